"""One process of the 2-process export test (run by tests/test_export_multiprocess.py)."""

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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import shardckpt  # noqa: E402

model = shardckpt.from_preset(os.path.join(folder, "src"), mesh=(2, 4))
results = {}
for fmt, name, shard in (("hf", "mp_hf", "20KB"), ("keras-hub", "mp_kh", 20e3 / 1024**3)):
    report = shardckpt.export(model, os.path.join(folder, name), format=fmt, max_shard_size=shard)
    results[fmt] = {"written": report.bytes_written, "total": report.bytes_total}
# Several processes into one bucket folder: refused, before anything is written.
try:
    shardckpt.export(model, f"{sys.argv[4]}/mp")
except shardckpt.errors.UnsupportedURLError as e:
    results["bucket_refusal"] = str(e)
with open(os.path.join(folder, f"result{process_id}.json"), "w") as f:
    json.dump(results, f)
jax.distributed.shutdown()
