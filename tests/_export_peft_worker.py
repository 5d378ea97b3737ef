"""One process of the 2-process PEFT adapter export test (run by tests/test_export_peft.py)."""

import json
import os

from tests.mp import start_worker  # run_pair puts the checkout on PYTHONPATH

process_id, folder = start_worker()

import jax  # noqa: E402

import shardckpt  # noqa: E402
from tests.test_export_peft import lora_on_mesh  # noqa: E402

model = lora_on_mesh(os.path.join(folder, "src"))
report = shardckpt.export(model, os.path.join(folder, "mp_adapter"), format="peft")
with open(os.path.join(folder, f"result{process_id}.json"), "w") as f:
    json.dump({"written": report.bytes_written, "total": report.bytes_total}, f)
jax.distributed.shutdown()
