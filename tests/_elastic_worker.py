"""One of 2 processes (4 CPU devices each) of the elastic-resume test
(tests/test_elastic_resume.py): argv = process id, port, folder.

`folder/ckpt` holds a step saved by 1 process with 8 devices on a (4, 2)
mesh. Here, on a (2, 4) mesh over both processes:
1. `restore_latest` with a data iterator refuses the 1-process iterator
   position (IteratorCountError, nothing restored), and with
   on_process_count_change="restart_iterators" restores every model,
   optimizer and metric shard bit-exact while the iterator keeps its place;
2. `fit(resume=True)` refuses the same way by default, and with
   "restart_iterators" resumes and trains the remaining epoch, saving a step
   of 2 processes into the same folder; process 0 writes its values
   (all-gathered) to expected2.npz for the 2 -> 1 half of the test.
Each process writes result<id>.json.
"""

import json
import os

from tests.mp import start_worker

process_id, folder = start_worker()

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from shardckpt.errors import IteratorCountError  # noqa: E402
from shardckpt.training import OrbaxCheckpoint, restore_latest  # noqa: E402
from tests._train_worker import ShuffledIterator, build_model, layout  # noqa: E402
from tests.test_elastic_resume import groups  # noqa: E402

ckpt_dir = os.path.join(folder, "ckpt")


def fresh(seed):
    keras.backend.clear_session()
    distribution = layout()
    distribution.auto_shard_dataset = False  # each process feeds its own numpy batches
    keras.distribution.set_distribution(distribution)
    keras.utils.set_random_seed(seed)
    return build_model(), distribution


def values(model):
    return {key: np.asarray(multihost_utils.process_allgather(v.value, tiled=True))
            for key, v in groups(model).items()}


result = {}
saved = dict(np.load(os.path.join(folder, "expected1.npz"), allow_pickle=False))

# 1. restore_latest: 1 -> 2 processes.
model, distribution = fresh(99)
model.fit(np.zeros((8, 12), "float32"), np.zeros((8, 1), "float32"), batch_size=8, verbose=0)  # builds optimizer
before = values(model)
data = ShuffledIterator(seed=10 + process_id)
try:
    restore_latest(model, ckpt_dir, data_iterator=data)
    result["error"] = None
except IteratorCountError as e:
    result["error"] = str(e)
result["untouched"] = all(np.array_equal(before[k], a) for k, a in values(model).items())
info = restore_latest(model, ckpt_dir, data_iterator=data, on_process_count_change="restart_iterators")
shards = 0
for key, v in groups(model).items():
    assert v.value.sharding.is_equivalent_to(distribution.get_variable_layout(v).backend_layout, v.ndim), key
    for shard in v.value.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), saved[key][shard.index], err_msg=key)
        shards += 1
result.update(step=info.step, shards=shards, iterator=data.get_state(), iterator_state=info.iterator_state)

# 2. fit(resume=True): refused by default, resumed with "restart_iterators".
model, distribution = fresh(99)
data = ShuffledIterator(seed=10 + process_id)
ckpt = OrbaxCheckpoint(ckpt_dir, data_iterator=data, resume=True, max_to_keep=3)
try:
    model.fit(ckpt.batches(), steps_per_epoch=2, epochs=2, callbacks=[ckpt], verbose=0)
    result["fit_error"] = None
except IteratorCountError as e:
    result["fit_error"] = str(e)
model, distribution = fresh(99)
data = ShuffledIterator(seed=10 + process_id)
ckpt = OrbaxCheckpoint(ckpt_dir, data_iterator=data, resume=True, max_to_keep=3,
                       on_process_count_change="restart_iterators")
model.fit(ckpt.batches(), steps_per_epoch=2, epochs=2, callbacks=[ckpt], verbose=0)
ckpt.wait_until_finished()
result.update(resumed_step=ckpt.resumed.step, epochs=model.history.epoch, saved_iterator=data.get_state())
trained = values(model)
if process_id == 0:
    np.savez(os.path.join(folder, "expected2.npz"), **trained)
with open(os.path.join(folder, f"result{process_id}.json"), "w") as f:
    json.dump(result, f)
jax.distributed.shutdown()
