"""One of 2 processes (4 CPU devices each) saving with OrbaxCheckpoint into buckets.

Run by tests/test_bucket_multiprocess.py: argv = process id, port, folder,
mode, JSON list of bucket URLs (the fake servers' settings are in the
environment). Modes:

* "train": per URL, `fit` into `URL/run` and `restore_latest` from it into a
  fresh model (every shard of this process checked against the trained values,
  which process 0 also writes to `expected_<scheme>.npz`), and with Keras'
  `load_model` from a local copy; a bucket refusing
  process 1 alone (HTTP 403 from its second save on) in `URL/denied`; then,
  in the last URL, a SIGTERM to process 0 alone (`URL/preempt`).
* "kill": `fit` into `URL/run`; process 1 SIGKILLs itself in the middle of its
  second save (its pieces written, not yet reported).
* "resume": `fit(resume=True)` into `URL/run`, then the same run unbroken into
  `URL/ref`; each process compares its shards of the two.
* "two": `fit` with two callbacks, into `URL/run` every 2 batches and into
  `URL/epochs` every epoch; `restore_latest` from each root, every shard of
  this process checked against the trained values.

Each process writes what it saw to `<mode><id>.json`.
"""

import json
import os
import signal
import sys
import time

process_id, port, folder, mode, urls = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], json.loads(sys.argv[5])
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.mp import join  # noqa: E402

join(process_id, port)

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from shardckpt._jax import distributed_client  # noqa: E402
from shardckpt.formats.orbax import ondisk  # noqa: E402
from shardckpt.training import OrbaxCheckpoint, agreement, restore_latest  # noqa: E402
from tests._train_worker import ShuffledIterator, fresh_model, groups  # noqa: E402
from tests.buckets import download, start_denying  # noqa: E402


def fit(directory, *, callbacks=(), epochs=2, save_freq=2, **kwargs):
    """The run every mode trains: 3 batches an epoch, saves every `save_freq` batches."""
    model, distribution = fresh_model(1234)
    data = ShuffledIterator(seed=10 + process_id)  # each process its own data and position
    ckpt = OrbaxCheckpoint(directory, save_freq=save_freq, data_iterator=data, max_to_keep=2, **kwargs)
    model.fit(ckpt.batches(), steps_per_epoch=3, epochs=epochs, callbacks=[*callbacks, ckpt], verbose=0)
    ckpt.wait_until_finished()
    return model, distribution, ckpt, data


def values(model):
    """Every variable, all-gathered (the same full arrays on both processes)."""
    return {f"{g}/{v.path}": np.asarray(multihost_utils.process_allgather(v.value, tiled=True))
            for g, vs in groups(model).items() for v in vs}


def check_shards(model, distribution, want):
    """This process's shards of every variable equal `want`, in the layout's sharding; returns their count."""
    shards = 0
    for group, variables in groups(model).items():
        for v in variables:
            key = f"{group}/{v.path}"
            assert v.value.sharding.is_equivalent_to(distribution.get_variable_layout(v).backend_layout, v.ndim), key
            for shard in v.value.addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), want[key][shard.index], err_msg=key)
                shards += 1
    return shards


class At(keras.callbacks.Callback):
    """Calls `action()` at the end of batch `n` (from 1), then sleeps `slow` seconds per batch."""

    def __init__(self, n, action, slow=0.0):
        super().__init__()
        self.n, self.action, self.slow, self.seen = n, action, slow, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.n:
            self.action()
        if self.seen >= self.n:
            # Real steps take time: JAX's preemption notice reaches the other
            # process asynchronously, and these tiny steps would outrun it.
            time.sleep(self.slow)


def train(url, scheme):
    out = {}
    model, _, _, data = fit(f"{url}/run")
    trained = values(model)
    # Coordination keys of this root left behind by the 3 saves and the root's opening.
    out["agreement_keys"] = sorted(k for k, _ in distributed_client().key_value_dir_get(
        f"{agreement.root_keys(f'{url}/run')}/"))
    if process_id == 0:
        np.savez(os.path.join(folder, f"expected_{scheme}.npz"), **trained)
    # Restore on the same 2 processes into a model with other values.
    model, distribution = fresh_model(99)
    model.fit(np.zeros((8, 12), "float32"), np.zeros((8, 1), "float32"), batch_size=8, verbose=0)
    other = ShuffledIterator(seed=10 + process_id)
    info = restore_latest(model, f"{url}/run", data_iterator=other)
    out["restored"] = {"step": info.step, "shards": check_shards(model, distribution, trained),
                       "iterator": [data.get_state(), other.get_state()]}
    # Keras' own loader reads the step, copied to a local folder, under the same layout.
    local = os.path.join(folder, f"keras_{scheme}_{process_id}")
    download(f"{url}/run", local)
    restored = model
    model, distribution = fresh_model(99)
    loaded = keras.saving.load_model(local)  # (variable paths of a second model differ: compare in order)
    shards = 0
    for got, want in zip(loaded.weights, restored.weights, strict=True):
        assert got.value.sharding.is_equivalent_to(want.value.sharding, got.ndim), got.path
        for a, b in zip(got.value.addressable_shards, want.value.addressable_shards, strict=True):
            np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data), err_msg=got.path)
            shards += 1
    out["keras"] = {"shards": shards}

    # The bucket refuses process 1 alone from its second save (step 4) on.
    denying = []
    root = f"{url}/denied"

    def deny():
        if process_id == 1:
            # Step 2 is written in the background and may still be in flight at
            # batch 3; its requests read the endpoint when made, so the refusal
            # starts only once step 2 is committed (process 0 commits after every
            # process's writes; training waits here, nothing else does).
            deadline = time.monotonic() + 120
            while 2 not in ondisk.committed_steps(root):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"step 2 of {root} was not committed within 120 s")
                time.sleep(0.05)
            url, stop = start_denying()
            denying.append((os.environ.get("TENSORSTORE_GCS_HTTP_URL"), os.environ.get("AWS_ENDPOINT_URL"), stop))
            os.environ["TENSORSTORE_GCS_HTTP_URL" if scheme == "gs" else "AWS_ENDPOINT_URL"] = url

    start = time.perf_counter()
    try:
        fit(root, callbacks=[At(3, deny)])
        out["denied"] = {"raised": None}
    except Exception as e:
        original = getattr(e, "original", None)
        out["denied"] = {"raised": type(e).__name__, "original": type(original).__name__, "message": str(original),
                         "step": getattr(e, "step", None), "processes": getattr(original, "processes", None)}
    out["denied"]["seconds"] = time.perf_counter() - start
    for gcs, s3, stop in denying:
        os.environ["TENSORSTORE_GCS_HTTP_URL" if scheme == "gs" else "AWS_ENDPOINT_URL"] = gcs if scheme == "gs" else s3
        stop()
    multihost_utils.sync_global_devices("denied done")

    return out


def preempt(url):
    """Only process 0 gets a SIGTERM (after its 3rd batch); JAX's preemption service tells process 1.

    Then a second `fit` in the same processes: JAX's preemption service never
    forgets the notice, so that fit must not stop at the same step count.
    """
    calls = [At(3, lambda: os.kill(os.getpid(), signal.SIGTERM), slow=0.5)] if process_id == 0 else [
        At(3, lambda: None, slow=0.5)]
    model, _, ckpt, _ = fit(f"{url}/preempt", callbacks=calls, epochs=6, save_freq=5)
    out = {"step": ckpt.preempted_step, "mode": ckpt.preemption_mode, "epochs": model.history.epoch}
    model, _, ckpt, _ = fit(f"{url}/after_preempt", epochs=4, save_freq=5)
    out["after"] = {"step": ckpt.preempted_step, "epochs": model.history.epoch}
    return out


def kill(url, scheme):
    if process_id == 1:
        settle = agreement.Agreement.settle

        def settle_or_die(self, phase, error, *, everyone):
            if phase == "write" and self.step == 4:
                os.kill(os.getpid(), signal.SIGKILL)
            return settle(self, phase, error, everyone=everyone)

        agreement.Agreement.settle = settle_or_die
    fit(f"{url}/run")
    return {}


def two(url, scheme):
    """Two callbacks, each into its own root: every 2 batches into `URL/run`, every epoch into
    `URL/epochs` (both save at once after the last batch); each root restores the trained state."""
    epochs = OrbaxCheckpoint(f"{url}/epochs", save_freq="epoch", max_to_keep=2)
    model, _, _, _ = fit(f"{url}/run", callbacks=[epochs])
    epochs.wait_until_finished()
    trained = values(model)
    out = {}
    for root in ("run", "epochs"):
        model, distribution = fresh_model(99)
        model.fit(np.zeros((8, 12), "float32"), np.zeros((8, 1), "float32"), batch_size=8, verbose=0)
        info = restore_latest(model, f"{url}/{root}")
        keys = distributed_client().key_value_dir_get(f"{agreement.root_keys(f'{url}/{root}')}/")
        out[root] = {"step": info.step, "shards": check_shards(model, distribution, trained),
                     "saves_left": sorted({k.split("/")[3] for k, _ in keys})}
    return out


def resume(url, scheme):
    model, _, ckpt, data = fit(f"{url}/run", resume=True)
    resumed = values(model)
    ref, distribution, _, ref_data = fit(f"{url}/ref")
    return {"resumed_from": ckpt.resumed.step, "shards": check_shards(model, distribution, values(ref)),
            "iterator": [data.get_state(), ref_data.get_state()], "keys": len(resumed)}


result = {}
for url in urls:
    scheme = url.split(":", 1)[0]
    result[scheme] = {"train": train, "kill": kill, "resume": resume, "two": two}[mode](url, scheme)
if mode == "train":
    result["preempt"] = preempt(urls[-1])
with open(os.path.join(folder, f"{mode}{process_id}.json"), "w") as f:
    json.dump(result, f)
jax.distributed.shutdown()
