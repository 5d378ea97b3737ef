"""One process of the 2-process restore test (run by tests/test_multiprocess_restore.py)."""

import json
import os
import sys

process_id, port, folder = int(sys.argv[1]), sys.argv[2], sys.argv[3]
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["KERAS_BACKEND"] = "jax"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)

import keras  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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
with open(os.path.join(folder, f"result{process_id}.json"), "w") as f:
    json.dump(results, f)
jax.distributed.shutdown()
