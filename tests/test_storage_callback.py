"""`OrbaxCheckpoint` saving into buckets (fake GCS and S3 servers): retention, layout, exact resume, SIGKILL.

The model, layout and data iterator are `_train_worker.py`'s (BatchNorm
statistics, a Dropout seed generator, Adam slots, metrics; a (2, 4) mesh with
kernels split over "model"), so every kind of state goes through the bucket.
"""

from __future__ import annotations

import os
import signal
import time

import keras
import numpy as np
import pytest

import shardckpt
from shardckpt import storage
from shardckpt.formats.orbax import ondisk
from tests import _train_worker as worker
from tests.buckets import download
from tests.test_resume_kill import Server, _compare, _load

STEPS, SAVE_FREQ = 6, 4
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fit(directory: str, epochs: int, *, resume: bool = False):
    """A run of the worker's model; returns (model, iterator, callback)."""
    keras.backend.clear_session()
    keras.utils.set_random_seed(1234)
    keras.distribution.set_distribution(worker.layout())
    model = worker.build_model()
    data = worker.ShuffledIterator()
    ckpt = shardckpt.OrbaxCheckpoint(directory, save_freq=SAVE_FREQ, max_to_keep=2, data_iterator=data,
                                      metadata={"run": "bucket"}, resume=resume)
    model.fit(ckpt.batches(), steps_per_epoch=STEPS, epochs=epochs, callbacks=[ckpt], verbose=0)
    ckpt.wait_until_finished()
    return model, data, ckpt


def _state(model: keras.Model) -> dict[str, tuple[np.ndarray, object]]:
    groups = {
        "trainable_variables": model.trainable_variables,
        "non_trainable_variables": model.non_trainable_variables,
        "optimizer_variables": model.optimizer.variables,
        "metrics_variables": model.metrics_variables,
    }
    return {f"{g}/{v.path}": (np.asarray(v.value), v.value.sharding) for g, vs in groups.items() for v in vs}


def _assert_same_state(got: keras.Model, want: keras.Model | dict) -> None:
    a, b = _state(got), want if isinstance(want, dict) else _state(want)
    assert a.keys() == b.keys()
    for key, (value, sharding) in b.items():
        np.testing.assert_array_equal(a[key][0], value, err_msg=key)
        assert a[key][0].dtype == value.dtype, key
        assert a[key][1].is_equivalent_to(sharding, value.ndim), (key, a[key][1], sharding)
    # The layout asked for, not replicated by accident.
    assert str(a["trainable_variables/up/kernel"][1].spec) == "P(None, 'model')"
    assert any("seed_generator" in k for k in a) and any("moving_mean" in k for k in a)


@pytest.fixture(scope="module")
def local_run(tmp_path_factory) -> dict:
    """The same run, 3 epochs unbroken, saving into a local folder (the reference for both stores)."""
    directory = str(tmp_path_factory.mktemp("local") / "ck")
    model, data, _ = _fit(directory, epochs=3)
    return {"state": _state(model), "iterator": data.get_state(), "step": ondisk.latest_step_dir(directory)}


def test_fit_into_bucket_keeps_two_steps_and_restores_and_resumes_exactly(tmp_path, bucket, local_run):
    url = f"{bucket}/run"
    trained, _, _ = _fit(url, epochs=2)  # 12 batches: steps 4, 8, 12
    root = storage.parse(url)
    keys = storage.list_keys(root)
    # max_to_keep=2: step 4 is deleted entirely once step 12 is committed.
    assert {k.split("/", 1)[0] for k in keys} == {"8", "12"}
    assert ondisk.committed_steps(url) == [8, 12] and ondisk.incomplete_steps(url) == []
    assert shardckpt.inspect(url).step == 12 and shardckpt.verify(url).ok

    # The items (and array keys) of the local callback's steps.
    local_step = local_run["step"]
    assert ondisk.items(f"{url}/12") == ondisk.items(local_step) == [
        "data_iterator", "metrics", "model_config", "pytree", "shardckpt_metadata"]
    remote_tree = ondisk.read_json(f"{url}/12/pytree/_METADATA")["tree_metadata"]
    local_tree = ondisk.read_json(f"{local_step}/pytree/_METADATA")["tree_metadata"]
    assert set(remote_tree) == {k for k, v in local_tree.items() if v["value_metadata"]["value_type"] != "Dict"}
    meta = ondisk.read_json_item(f"{url}/12", ondisk.METADATA_ITEM)
    assert (meta["step"], meta["total_batches"], meta["user"]) == (12, 12, {"run": "bucket"})

    # restore_latest from the bucket: every variable bit-equal, in its sharding.
    keras.backend.clear_session()
    keras.distribution.set_distribution(worker.layout())
    fresh, fresh_data = worker.build_model(), worker.ShuffledIterator()
    # One batch builds the metric and optimizer variables (different values).
    fresh.fit(fresh_data.x[:16], fresh_data.y[:16], batch_size=16, epochs=1, verbose=0)
    info = shardckpt.restore_latest(fresh, url, data_iterator=fresh_data)
    assert info.step == 12 and info.path == f"{url}/12"
    # After exactly the 12 batches of 16 trained on (96 examples a pass).
    assert fresh_data.get_state() == {"pass": 1, "index": 96}
    _assert_same_state(fresh, trained)

    # Keras' own loader reads the step (copied to a local folder).
    download(url, str(tmp_path / "copy"))
    loaded = keras.saving.load_model(str(tmp_path / "copy"))
    for got, want in zip(loaded.weights, trained.weights, strict=True):
        np.testing.assert_array_equal(np.asarray(got.value), np.asarray(want.value), err_msg=want.path)

    # resume=True in a fresh model: one more epoch equals the unbroken 3-epoch run.
    resumed, resumed_data, ckpt = _fit(url, epochs=3, resume=True)
    assert ckpt.resumed is not None and ckpt.resumed.step == 12
    _assert_same_state(resumed, local_run["state"])
    assert resumed_data.get_state() == local_run["iterator"]
    assert ondisk.committed_steps(url) == [12, 16]


@pytest.fixture(scope="module")
def fork_server(tmp_path_factory, gcs_server, s3_server):
    """`_train_worker.py`'s fork server, started with both fake servers' settings in its environment."""
    srv = Server(str(tmp_path_factory.mktemp("server") / "server.log"))
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def unbroken(fork_server, tmp_path_factory):
    """The reference: the same run in a local folder, never interrupted."""
    tmp = tmp_path_factory.mktemp("unbroken")
    args = _args(str(tmp / "ck"), tmp, "ref")
    pid = fork_server.start(args)
    assert fork_server.wait(pid) == 0, "the uninterrupted run failed; see the server log"
    return _load(args["out"])


def _args(directory: str, tmp, name: str) -> dict:
    return {"dir": directory, "out": str(tmp / f"{name}_out"), "progress": str(tmp / f"{name}.progress"),
            "save_freq": 2, "epochs": 3, "steps": STEPS, "max_to_keep": 2, "cache": str(tmp / "jax_cache")}


def _new_step_in_flight(url: str) -> bool:
    """Whether objects of a step newer than the last committed one are in the bucket without its marker."""
    committed = ondisk.committed_steps(url)
    return bool(committed) and any(int(n) > committed[-1] for n in ondisk.incomplete_steps(url))


def _alive(pid: int) -> bool:
    """Whether the fork server's child still runs (it stays a zombie, unreaped, once it exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _kill_during_a_save(fork_server, args: dict) -> bool:
    """Runs `args`, SIGKILLs it once a save (not the first) is seen in flight; True if it was still in flight."""
    pid = fork_server.start(args)
    deadline = time.monotonic() + 120
    while _alive(pid) and not _new_step_in_flight(args["dir"]):
        assert time.monotonic() < deadline, "the run neither ended nor was seen saving"
        time.sleep(0.001)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)
    code = fork_server.wait(pid)
    return code == -signal.SIGKILL and _new_step_in_flight(args["dir"])


def test_sigkill_during_a_save_into_a_bucket_resumes_from_the_last_committed_step(
        fork_server, unbroken, tmp_path, bucket):
    ref_arrays, ref_info = unbroken
    # A save of this model takes tens of ms: the kill may land just after its
    # commit. Then the run is tried again in a fresh prefix.
    for attempt in range(5):
        url = f"{bucket}/run{attempt}"
        args = _args(url, tmp_path, f"killed{attempt}")
        if _kill_during_a_save(fork_server, args):
            break
    else:
        pytest.fail("in 5 runs no SIGKILL landed while a save was writing")
    committed = ondisk.committed_steps(url)
    interrupted = [n for n in ondisk.incomplete_steps(url) if int(n) > committed[-1]]
    assert len(interrupted) == 1 and storage.list_keys(storage.parse(f"{url}/{interrupted[0]}"))
    assert shardckpt.inspect(url).step == committed[-1]  # the interrupted step is not taken
    with pytest.raises(shardckpt.errors.IncompleteCheckpointError, match="commit_success.txt"):
        shardckpt.inspect(f"{url}/{interrupted[0]}")

    resume = dict(args, out=str(tmp_path / "resumed_out"))
    pid = fork_server.start(resume)
    assert fork_server.wait(pid) == 0, "the resumed run failed; see the server log"
    arrays, info = _load(resume["out"])
    assert info["resumed_step"] == committed[-1]
    _compare(arrays, info, ref_arrays, ref_info, f"killed during step {interrupted[0]}")
    # The resumed run removed the interrupted objects and kept its last two steps.
    assert ondisk.incomplete_steps(url) == []
    assert ondisk.committed_steps(url) == [16, 18]


def test_a_bucket_save_larger_than_the_budget_commits_in_pieces_and_restores_exactly(gcs_server, monkeypatch):
    """With a 256-byte budget every save stages its arrays in many transactions
    (one OCDBT commit each; a shard above the budget alone), as a state
    larger than the host's budget would; the last step still restores
    bit-equal, in its shardings."""
    from shardckpt import budget

    commits = []
    real = budget.default_max_inflight_bytes
    monkeypatch.setattr(budget, "default_max_inflight_bytes", lambda: commits.append(1) or 256)
    url = f"{gcs_server.new_bucket()}/ck"
    model, _, _ = _fit(url, epochs=2)  # 12 batches: the last save (step 12) holds the final state
    monkeypatch.setattr(budget, "default_max_inflight_bytes", real)
    assert commits, "the bucket save must ask for the budget"
    sizes = [int(np.prod(v.shape)) * 4 for v in model.weights]
    assert sum(sizes) > 8 * 256 and max(sizes) > 256, "the weights alone must need many 256-byte transactions"
    keras.backend.clear_session()
    keras.distribution.set_distribution(worker.layout())
    restored, data = worker.build_model(), worker.ShuffledIterator()
    restored.fit(data.x[:16], data.y[:16], batch_size=16, epochs=1, verbose=0)  # builds the slots
    assert shardckpt.restore_latest(restored, url).step == 12
    _assert_same_state(restored, model)
