"""Child process of tests/test_layout_rebuild.py: applies a plan read from JSON to a fresh build."""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["KERAS_BACKEND"] = "jax"
os.environ["JAX_PLATFORMS"] = "cpu"

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import shardckpt  # noqa: E402
from shardckpt.layout import LayoutPlan  # noqa: E402
from shardckpt.structure import structural_paths  # noqa: E402
from tests.test_layout_rebuild import build_moe  # noqa: E402

folder = sys.argv[1]
build_moe()  # a first instance: the names Keras generates for the next one differ from the parent's
with shardckpt.lazy_init():
    model = build_moe()
with open(os.path.join(folder, "plan.json")) as f:
    plan = LayoutPlan.from_json(f.read())
shardckpt.load_sharded(model, os.path.join(folder, "a.weights.h5"), layout=plan)
expected = dict(np.load(os.path.join(folder, "values.npz"), allow_pickle=False))
keys = structural_paths(model)
out = {}
for v in model.variables:
    value = v.value
    out[keys[id(v)]] = {
        "path": v.path,
        "spec": [list(a) if isinstance(a, tuple) else a for a in value.sharding.spec],
        "equal": bool(np.array_equal(np.asarray(value), expected[keys[id(v)].replace("/", "|")])),
    }
print("RESULT " + json.dumps(out))
