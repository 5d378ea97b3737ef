"""One of 2 processes (4 CPU devices each) of the restore-traffic test
(tests/test_restore_traffic.py): argv = process id, port, folder.

`folder/config.json` names, per store and format, the checkpoint URL and the
endpoint (a port of the test's counting proxy) this process reads it through.
Each load fills a lazily built model on a (1, 8) mesh over both processes;
every shard is checked bit-exact against `folder/expected.npz`.
"""

import json
import os

from tests.mp import start_worker

process_id, folder = start_worker()

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import shardckpt  # noqa: E402
from tests.test_restore_traffic import build, layout_map  # noqa: E402

config = json.load(open(os.path.join(folder, "config.json")))
expected = dict(np.load(os.path.join(folder, "expected.npz"), allow_pickle=False))
results = {}
for load in config["loads"]:
    keras.backend.clear_session()
    mesh = keras.distribution.DeviceMesh((1, 8), ["data", "model"], jax.devices())
    distribution = keras.distribution.ModelParallel(layout_map=layout_map(mesh))
    keras.distribution.set_distribution(distribution)
    with shardckpt.lazy_init():
        model = build()
    os.environ[load["endpoint_variable"]] = load["endpoints"][process_id]
    if load["how"] == "restore_latest":
        report = shardckpt.restore_latest(model, load["url"]).report
    else:
        report = shardckpt.load_sharded(model, load["url"], progress=False)
    shards = 0
    for v in model.weights:
        assert v.value.sharding.is_equivalent_to(distribution.get_variable_layout(v).backend_layout, v.ndim), v.path
        for shard in v.value.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), expected[v.path][shard.index], err_msg=v.path)
            shards += 1
    results[load["label"]] = {"shards": shards, "bytes_read": report.bytes_read}
with open(os.path.join(folder, f"result{process_id}.json"), "w") as f:
    json.dump(results, f)
jax.distributed.shutdown()
