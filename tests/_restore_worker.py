"""One process of the 2-process restore test (run by tests/test_multiprocess_restore.py)."""

import json
import os

from tests.mp import start_worker  # run_pair puts the checkout on PYTHONPATH

process_id, folder = start_worker()

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import shardckpt  # noqa: E402
from tests.zoo import build_zoo, zoo_layout_map  # noqa: E402

expected = dict(np.load(os.path.join(folder, "expected.npz"), allow_pickle=False))
results = {}
for name, path, mesh_shape in [
    ("h5", "m.weights.h5", (1, 8)),
    ("sharded", "m.weights.json", (1, 8)),
    ("orbax", "orbax", (2, 4)),
]:
    keras.backend.clear_session()
    mesh = keras.distribution.DeviceMesh(mesh_shape, ["data", "model"], jax.devices())
    dist = keras.distribution.ModelParallel(layout_map=zoo_layout_map(mesh))
    keras.distribution.set_distribution(dist)
    with shardckpt.lazy_init():
        model = build_zoo(rnn=False)
    report = shardckpt.load_sharded(model, os.path.join(folder, path))
    checked = 0
    for v in model.weights:
        want_sharding = dist.get_variable_layout(v).backend_layout
        assert v.value.sharding.is_equivalent_to(want_sharding, v.ndim), v.path
        assert v.value.shape == expected[v.path].shape, v.path
        for shard in v.value.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), expected[v.path][shard.index])
            checked += 1
    total = sum(int(a.nbytes) for a in expected.values())
    results[name] = {"bytes_read": report.bytes_read, "total": total, "shards": checked}
# mesh="auto" over both processes' devices: each process plans it (asking its own devices' memory).
results["auto_mesh"] = list(shardckpt.auto_layout(model, mesh="auto").mesh.shape)
with open(os.path.join(folder, f"result{process_id}.json"), "w") as f:
    json.dump(results, f)
jax.distributed.shutdown()
