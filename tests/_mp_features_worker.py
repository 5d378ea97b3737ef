"""One of 2 processes (4 CPU devices each) checking restore features on a mesh over both.

Run by tests/test_multiprocess_features.py: argv = process id, port, folder.
The folder holds `m.weights.h5` (an adapted Normalization -> "up" -> "down",
written by the test in one process) and `expected.npz` (its values and its
outputs on `x`). Each process writes `result<i>.json`:

* "slots": a `.weights.h5` loaded by `load_sharded` into a lazily built model
  whose Adam was built by hand: `report.slots_moved`, and per-shard checks of
  every variable (bit-equal to the file) and slot (on its variable's sharding,
  values kept).
* "normalization": the loaded model's outputs, all-gathered ("normalization_by_keras":
  those of the file loaded by Keras' `load_weights`).
* "early_stopping": EarlyStopping's counters after a resumed fit, the epochs
  it ran, and whether its variables are bit-equal to an unbroken fit's.
* "log": every line the "shardckpt" logger and Python's warnings gave this
  process (the test asks which of them both processes say).
"""

import json
import logging
import os

from tests.mp import start_worker  # run_pair puts the checkout on PYTHONPATH

process_id, folder = start_worker()

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import shardckpt  # noqa: E402
from shardckpt.training import OrbaxCheckpoint, restore_latest  # noqa: E402
from tests._train_worker import ShuffledIterator, fresh_model, groups  # noqa: E402

LOG: list[str] = []


class _Collect(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        LOG.append(f"{record.levelname} {record.getMessage()}")


logging.captureWarnings(True)
for name in ("shardckpt", "py.warnings"):
    logging.getLogger(name).addHandler(_Collect(level=logging.INFO))
    logging.getLogger(name).setLevel(logging.INFO)

expected = dict(np.load(os.path.join(folder, "expected.npz"), allow_pickle=False))
result: dict = {}


def build_normalized() -> keras.Model:
    """x (8) -> Normalization "norm" -> Dense "up" (16) -> Dense "down" (8), as the test built it."""
    inputs = keras.Input((8,), name="x")
    x = keras.layers.Normalization(name="norm")(inputs)
    x = keras.layers.Dense(16, name="up")(x)
    return keras.Model(inputs, keras.layers.Dense(8, name="down")(x), name="m")


def gathered(value) -> np.ndarray:
    return np.asarray(multihost_utils.process_allgather(value, tiled=True))


# 1 + 2: a weights-only file into a lazily built model with a hand-built Adam, ModelParallel over 8 devices.
keras.backend.clear_session()
mesh = keras.distribution.DeviceMesh((1, 8), ["batch", "model"], jax.devices())
layout_map = keras.distribution.LayoutMap(mesh)
layout_map["up/kernel"] = (None, "model")
layout_map["down/kernel"] = ("model", None)
keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch"))
with shardckpt.lazy_init():
    model = build_normalized()
model.compile(optimizer="adam", loss="mse")
model.optimizer.build(model.trainable_variables)
slot_of = {v.path: v for v in model.optimizer.variables}
pairs = [(slot_of[f"{model.optimizer.name}/{v.path.replace('/', '_')}_{kind}"], v)
         for v in model.trainable_variables for kind in ("momentum", "velocity")]
before = {slot.path: gathered(slot.value) for slot, _ in pairs}
report = shardckpt.load_sharded(model, os.path.join(folder, "m.weights.h5"), progress=False)
checked, wrong = 0, []
for v in model.weights:
    for shard in v.value.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), expected[v.path][shard.index], err_msg=v.path)
        checked += 1
for slot, variable in pairs:
    if slot.value.sharding != variable.value.sharding:
        wrong.append(f"{slot.path}: {slot.value.sharding.spec} vs {variable.path}: {variable.value.sharding.spec}")
    for shard in slot.value.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), before[slot.path][shard.index], err_msg=slot.path)
result["slots"] = {"moved": sorted(report.slots_moved), "wrong": wrong, "shards": checked,
                   "split": sorted(v.path for v in model.trainable_variables
                                   if "model" in tuple(v.value.sharding.spec))}
result["normalization"] = gathered(model(expected["x"])).tolist()
# The same file through Keras' own load_weights (which finalizes the Normalization), in these processes.
keras.utils.set_random_seed(0)  # (initial values the same on both processes, as a multi-process build needs)
by_keras = build_normalized()
by_keras.load_weights(os.path.join(folder, "m.weights.h5"))
result["normalization_by_keras"] = gathered(by_keras(expected["x"])).tolist()

# 3: OrbaxCheckpoint resumed with EarlyStopping (never improving after epoch 0: patience 2 stops after epoch 2).


def stopper() -> keras.callbacks.EarlyStopping:
    return keras.callbacks.EarlyStopping(monitor="loss", patience=2, min_delta=1e9)


def fit(directory: str, epochs: int, *, resume: bool = False):
    model, _ = fresh_model(1234)
    data = ShuffledIterator(seed=10 + process_id)
    ckpt = OrbaxCheckpoint(os.path.join(folder, directory), save_freq="epoch", data_iterator=data, resume=resume)
    early = stopper()
    history = model.fit(ckpt.batches(), steps_per_epoch=3, epochs=epochs, callbacks=[ckpt, early], verbose=0)
    ckpt.wait_until_finished()
    return model, early, history.epoch


model, _, unbroken_epochs = fit("unbroken", 5)
unbroken = {f"{g}/{v.path}": gathered(v.value) for g, vs in groups(model).items() for v in vs}
fit("resumed", 2)
model, early, resumed_epochs = fit("resumed", 5, resume=True)
differ = [f"{g}/{v.path}" for g, vs in groups(model).items() for v in vs
          if not np.array_equal(gathered(v.value), unbroken[f"{g}/{v.path}"])]
result["early_stopping"] = {
    "unbroken_epochs": unbroken_epochs, "resumed_epochs": resumed_epochs, "differ": differ,
    "counters": {k: getattr(early, k) for k in ("wait", "best", "stopped_epoch", "best_epoch")},
}

# 4: a newer step folder whose save never committed, beside the committed ones: restore_latest passes it over.
if process_id == 0:
    os.makedirs(os.path.join(folder, "resumed", "99.orbax-checkpoint-tmp-1"))
multihost_utils.sync_global_devices("leftover made")
LOG.append("--- restore_latest with a newer uncommitted folder")
model, _ = fresh_model(99)
restore_latest(model, os.path.join(folder, "resumed"), strict=False)  # (metrics unbuilt)

result["log"] = LOG
with open(os.path.join(folder, f"result{process_id}.json"), "w") as f:
    json.dump(result, f, default=str)
jax.distributed.shutdown()
