"""2 real `jax.distributed` processes save with OrbaxCheckpoint into fake GCS and S3 buckets.

One launch of the pair (`_mp_bucket_worker.py` "train") does, for each bucket:
fit and restore on both processes, a bucket refusing process 1 alone, and a
SIGTERM to process 0 alone; the steps are then read here in 1 process
(resharded, Keras' `load_model`, `inspect`, `verify`). One launch ("two"):
two callbacks into two roots, each restored. Two more launches: a SIGKILL of
process 1 in the middle of a save, then the resume.
"""

from __future__ import annotations

import json
import signal

import keras
import numpy as np
import pytest

import shardckpt
from shardckpt import storage
from shardckpt.formats.orbax import ondisk
from tests._train_worker import build_model
from tests.mp import run_pair, start_pair

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def buckets(gcs_server, s3_server) -> dict[str, str]:
    return {"gs": gcs_server.new_bucket(), "s3": s3_server.new_bucket()}


def _results(folder, mode: str) -> list[dict]:
    return [json.loads((folder / f"{mode}{i}.json").read_text()) for i in range(2)]


def test_two_processes_save_into_buckets_and_restore_on_two_and_on_one(tmp_path, buckets):
    run_pair("_mp_bucket_worker.py", str(tmp_path), "train", json.dumps(list(buckets.values())), timeout=600)
    results = _results(tmp_path, "train")
    for scheme, url in buckets.items():
        run = f"{url}/run"
        got = [r[scheme] for r in results]
        # Restored on both processes: every shard of each bit-equal, in its sharding.
        for i, r in enumerate(got):
            assert r["restored"]["step"] == 6 and r["restored"]["shards"] > 0, r
            assert r["restored"]["iterator"][0] == r["restored"]["iterator"][1], (i, r)
            assert r["keras"]["shards"] > 0, r
        # Process 0 deleted the coordination keys of every earlier save into the root: the last one's are left.
        for r in got:
            saves = {k.split("/")[3] for k in r["agreement_keys"]}
            assert len(saves) == 1 and any(k.endswith("/commit/verdict") for k in r["agreement_keys"]), r
        # One step layout: each process's own OCDBT store, merged into pytree/'s.
        keys = storage.list_keys(storage.parse(f"{run}/6/pytree"))
        assert any(k.startswith("ocdbt.process_0/") for k in keys) and any(k.startswith("ocdbt.process_1/") for k in keys)
        assert "manifest.ocdbt" in keys
        # Retention (max_to_keep=2) ran once: step 2 is gone entirely.
        assert {k.split("/", 1)[0] for k in storage.list_keys(storage.parse(run))} == {"4", "6"}
        info = shardckpt.inspect(run)
        assert info.steps == [4, 6] and info.incomplete == []
        assert info.iterator_state == [r["restored"]["iterator"][0] for r in got]
        assert info.metadata["layout"]["process_count"] == 2
        assert shardckpt.verify(run).ok

        # One process, 8 devices, another mesh: every variable resharded, bit-exact.
        expected = dict(np.load(tmp_path / f"expected_{scheme}.npz", allow_pickle=False))
        mesh = keras.distribution.DeviceMesh((4, 2), ["data", "model"])
        layout_map = keras.distribution.LayoutMap(mesh)
        layout_map["up/kernel"] = (None, "model")
        layout_map["down/kernel"] = ("model", None)
        keras.backend.clear_session()
        keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="data"))
        model = build_model()
        model.fit(np.zeros((8, 12), "float32"), np.zeros((8, 1), "float32"), epochs=1, verbose=0)
        shardckpt.load_sharded(model, run, progress=False)
        for group in ("trainable_variables", "non_trainable_variables", "metrics_variables"):
            for v in getattr(model, group):
                np.testing.assert_array_equal(np.asarray(v.value), expected[f"{group}/{v.path}"], err_msg=v.path)
        for v in model.optimizer.variables:
            np.testing.assert_array_equal(np.asarray(v.value), expected[f"optimizer_variables/{v.path}"],
                                          err_msg=v.path)
        kernel = model.get_layer("up").kernel.value.sharding
        assert str(kernel.spec) == "P(None, 'model')" and kernel.mesh.devices.shape == (4, 2)
        # The bucket refused process 1's second save (step 4): both processes'
        # fits failed at the next save, nothing was committed after step 2.
        denied = [r["denied"] for r in got]
        assert [d["raised"] for d in denied] == ["BackgroundSaveError"] * 2, denied
        assert [d["step"] for d in denied] == [4, 4], denied
        assert denied[1]["original"] == "StorageAccessDeniedError", denied
        assert f"{url}/denied/4/pytree/ocdbt.process_1" in denied[1]["message"], denied
        assert denied[0]["original"] == "ProcessSaveError" and denied[0]["processes"] == [1], denied
        assert "process 1: StorageAccessDeniedError" in denied[0]["message"], denied
        assert ondisk.committed_steps(f"{url}/denied") == [2]

    # SIGTERM to process 0 alone: both saved the same step into the (S3) bucket and stopped.
    pre = [r["preempt"] for r in results]
    assert [p["mode"] for p in pre] == ["jax", "jax"], pre
    assert pre[0]["step"] is not None and pre[0]["step"] == pre[1]["step"] < 18, pre
    assert pre[0]["epochs"] == pre[1]["epochs"], pre
    preempt = shardckpt.inspect(f"{buckets['s3']}/preempt")
    assert preempt.step == pre[0]["step"] and preempt.incomplete == []
    # A later fit in the same processes runs to its end: the old notice stops nothing.
    assert [p["after"] for p in pre] == [{"step": None, "epochs": [0, 1, 2, 3]}] * 2, pre


def test_two_callbacks_into_two_roots_each_restore_the_trained_state_on_two_processes(tmp_path, gcs_server):
    # Their saves run on two worker threads per process, both at once after batch 6:
    # the agreements of each root pair up across processes however they interleave.
    url = gcs_server.new_bucket()
    run_pair("_mp_bucket_worker.py", str(tmp_path), "two", json.dumps([url]), timeout=600,
             env={"SHARDCKPT_PROCESS_WAIT_S": "60"})
    for r in _results(tmp_path, "two"):
        got = r["gs"]
        assert got["run"]["step"] == 6 and got["run"]["shards"] > 0, got
        assert got["epochs"]["step"] == 1 and got["epochs"]["shards"] == got["run"]["shards"], got  # (epoch 1)
        # One save's keys left per root: the last one (the root's opening is number 0).
        assert got["run"]["saves_left"] == ["3"] and got["epochs"]["saves_left"] == ["2"], got
    assert ondisk.committed_steps(f"{url}/run") == [4, 6] and ondisk.committed_steps(f"{url}/epochs") == [0, 1]


def test_sigkill_of_one_process_mid_save_into_a_bucket_resumes_bit_exact(tmp_path, gcs_server):
    url = gcs_server.new_bucket()
    args = (str(tmp_path), "kill", json.dumps([url]))
    procs = start_pair("_mp_bucket_worker.py", *args, env={"SHARDCKPT_PROCESS_WAIT_S": "30"})
    try:
        # Process 1 kills itself in its second save (step 4), its pieces written, unreported.
        code = procs[1].wait(timeout=300)
    finally:
        procs[0].kill()  # what a scheduler does with the job's other process
        outputs = [p.communicate()[0] for p in procs]
    assert code == -signal.SIGKILL, outputs[1][-3000:]
    run = f"{url}/run"
    assert ondisk.committed_steps(run) == [2] and ondisk.incomplete_steps(run) == ["4"]
    assert any("ocdbt.process_1/" in k for k in storage.list_keys(storage.parse(f"{run}/4")))
    assert shardckpt.inspect(run).step == 2  # the partial step is never taken

    run_pair("_mp_bucket_worker.py", str(tmp_path), "resume", json.dumps([url]), timeout=400)
    for r in _results(tmp_path, "resume"):
        got = r["gs"]
        assert got["resumed_from"] == 2 and got["shards"] > 0, got
        assert got["iterator"][0] == got["iterator"][1], got
    assert ondisk.committed_steps(run) == [4, 6] and ondisk.incomplete_steps(run) == []
