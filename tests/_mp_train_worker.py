"""One of 2 processes (4 CPU devices each) training with OrbaxCheckpoint on a
(2, 4) mesh, then restoring the checkpoint with `restore_latest` into a fresh
model. Run by tests/test_callback_multiprocess.py: argv = process id, port,
folder. Process 0 writes the trained values (all-gathered) to expected.npz;
each process checks its own shards of the restored model against them.
"""

import json
import os
import time

from tests.mp import start_worker  # run_pair puts the checkout on PYTHONPATH

process_id, folder = start_worker()

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from shardckpt.training import OrbaxCheckpoint, restore_latest  # noqa: E402
from tests._train_worker import ShuffledIterator, fresh_model, groups, sigterm_at  # noqa: E402

model, distribution = fresh_model(1234)
data = ShuffledIterator(seed=10 + process_id)  # each process its own data and position
ckpt = OrbaxCheckpoint(os.path.join(folder, "ckpt"), save_freq=2, data_iterator=data, max_to_keep=2)
model.fit(ckpt.batches(), steps_per_epoch=3, epochs=2, callbacks=[ckpt], verbose=0)
ckpt.wait_until_finished()
trained = {}
for group, variables in groups(model).items():
    for v in variables:
        trained[f"{group}/{v.path}"] = np.asarray(multihost_utils.process_allgather(v.value, tiled=True))
if process_id == 0:
    np.savez(os.path.join(folder, "expected.npz"), **trained)
saved_state = data.get_state()

# Restore into a model with other initial values, on the same 2-process mesh.
model, distribution = fresh_model(99)
model.fit(np.zeros((8, 12), "float32"), np.zeros((8, 1), "float32"), batch_size=8, verbose=0)  # builds optimizer/metrics
other = ShuffledIterator(seed=10 + process_id)
info = restore_latest(model, os.path.join(folder, "ckpt"), data_iterator=other)
shards = 0
for group, variables in groups(model).items():
    for v in variables:
        key = f"{group}/{v.path}"
        want = distribution.get_variable_layout(v).backend_layout
        assert v.value.sharding.is_equivalent_to(want, v.ndim), key
        for shard in v.value.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), trained[key][shard.index], err_msg=key)
            shards += 1
result = {
    "step": info.step,
    "shards": shards,
    "iterator_saved": saved_state,
    "iterator_restored": other.get_state(),
    "kernel_spec": str(model.get_layer("up").kernel.value.sharding.spec),
}


class SlowAfter(keras.callbacks.Callback):
    """Steps of `seconds` after batch `n`, as real training steps take: JAX's
    preemption notice reaches the other process asynchronously, and these tiny
    steps would otherwise finish the run before it arrives on a loaded machine."""

    def __init__(self, n, seconds):
        super().__init__()
        self.n, self.seconds, self.seen = n, seconds, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen >= self.n:
            time.sleep(self.seconds)


class CountBatches(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seen = 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1


# Preemption: only process 0 gets a SIGTERM (after its 3rd batch). JAX's
# preemption service tells process 1; both save the same step and stop.
model, distribution = fresh_model(1234)
data = ShuffledIterator(seed=10 + process_id)
pre = OrbaxCheckpoint(os.path.join(folder, "preempt"), save_freq=5, data_iterator=data, max_to_keep=2)
count = CountBatches()
extra = [sigterm_at(3)] if process_id == 0 else []
model.fit(pre.batches(), steps_per_epoch=3, epochs=6, callbacks=[*extra, SlowAfter(3, 0.5), pre, count], verbose=0)
result["preempt"] = {"step": pre.preempted_step, "batches": count.seen, "mode": pre.preemption_mode,
                     "epochs": model.history.epoch}
with open(os.path.join(folder, f"result{process_id}.json"), "w") as f:
    json.dump(result, f)
jax.distributed.shutdown()
