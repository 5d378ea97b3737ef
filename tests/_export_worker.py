"""One process of the 2-process export test (run by tests/test_export_multiprocess.py)."""

import json
import os
import sys

from tests.mp import start_worker  # run_pair puts the checkout on PYTHONPATH

process_id, folder = start_worker()

import jax  # noqa: E402

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
