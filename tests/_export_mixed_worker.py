"""One process of the 2-process mixed-dtype export test (run by tests/test_export_multiprocess.py)."""

import json
import logging
import os

from tests.mp import start_worker  # run_pair puts the checkout on PYTHONPATH

process_id, folder = start_worker()

import jax  # noqa: E402
import keras  # noqa: E402
import keras_hub  # noqa: E402

import shardckpt  # noqa: E402


class _Said(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


said = _Said()
logging.getLogger("shardckpt").addHandler(said)
keras.utils.set_random_seed(0)
keras.distribution.set_distribution(keras.distribution.DataParallel())
policies = keras.dtype_policies.DTypePolicyMap(default_policy="float32")
policies["sequence_output_layernorm"] = "bfloat16"  # one bfloat16 norm in a float32 model
model = keras_hub.models.Llama3Backbone(vocabulary_size=64, num_layers=1, num_query_heads=8, num_key_value_heads=8,
                                        hidden_dim=32, intermediate_dim=64, dtype=policies)
shardckpt.export(model, os.path.join(folder, "mp_mixed"))
with open(os.path.join(folder, f"mixed{process_id}.json"), "w") as f:
    json.dump([m for m in said.messages if "config.json says" in m], f)
jax.distributed.shutdown()
