"""Dimensions that do not divide: the next dimension splits; published sizes balance; a mesh chosen for the model."""

from __future__ import annotations

import json
import os

import jax
import keras
import numpy as np
import pytest

import shardckpt
from shardckpt.layout import auto_layout

keras_hub = pytest.importorskip("keras_hub")
M = "model"
PUBLISHED = os.environ.get("SHARDCKPT_PUBLISHED_CONFIGS", "/work/shared/published_configs.json")


def _tiny(name: str) -> keras.Model:
    if name == "gpt2 (12 heads, vocab 50257)":
        return keras_hub.models.GPT2Backbone(
            vocabulary_size=50257, num_layers=1, num_heads=12, hidden_dim=96, intermediate_dim=128,
            max_sequence_length=16, dropout=0.0,
        )
    return keras_hub.models.BertBackbone(  # 14 heads, vocab 30522
        vocabulary_size=30522, num_layers=1, num_heads=14, hidden_dim=112, intermediate_dim=128,
        max_sequence_length=16, dropout=0.0,
    )


def _inputs(model: keras.Model) -> dict:
    rng = np.random.default_rng(0)
    out = {}
    for key in model.input:
        if key == "padding_mask":
            out[key] = np.ones((2, 16), "int32")
        elif key == "segment_ids":
            out[key] = (np.arange(16)[None] >= 8).astype("int32").repeat(2, 0)
        else:
            out[key] = rng.integers(0, 30000, size=(2, 16)).astype("int32")
    return out


@pytest.mark.parametrize("name", ["gpt2 (12 heads, vocab 50257)", "bert (14 heads, vocab 30522)"])
def test_indivisible_dims_split_on_the_next_dimension_and_match_one_device(name):
    model = _tiny(name)
    rng = np.random.default_rng(1)
    for v in model.weights:
        if v.dtype.startswith("float"):
            v.assign(np.asarray(v.value) + 0.05 * rng.standard_normal(v.shape).astype("float32"))
    plan = auto_layout(model, (1, 8))
    table = next(p for p in plan.placements if p.path.startswith("token_embedding/"))
    assert table.axes == (None, M) and table.source == "fallback" and "vocabulary" in table.reason
    queries = [p for p in plan.placements if p.path.endswith("query/kernel")]
    assert queries and all(p.axes == (None, None, M) and p.source == "fallback" for p in queries)
    assert "one more all-reduce" in queries[0].reason
    assert plan.balance() <= 1.15, plan.balance()
    assert plan.sharded_fraction() > 0.98
    xs = _inputs(model)
    forward = jax.jit(lambda tv, ntv, x: model.stateless_call(tv, ntv, x)[0])
    want = forward([v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables], xs)
    tv = [jax.device_put(v.value, plan.sharding_for(v)) for v in model.trainable_variables]
    ntv = [jax.device_put(v.value, plan.sharding_for(v)) for v in model.non_trainable_variables]
    with plan.distribution().scope():  # as fit / predict run: its layout map relays the lookup's output
        got = forward(tv, ntv, xs)
    for a, b in zip(keras.tree.flatten(got), keras.tree.flatten(want)):
        a, b = np.asarray(a), np.asarray(b)
        assert np.max(np.abs(a - b)) <= 1e-5 * np.max(np.abs(b))
    hlo = forward.lower(tv, ntv, xs).compile().as_text()
    assert "collective-permute" not in hlo and "all-to-all" not in hlo


def _published(name: str) -> keras.Model:
    with open(PUBLISHED) as f:
        config = json.load(f)[name]
    with shardckpt.lazy_init():
        return getattr(keras_hub.models, config["class"])(**config["args"])


@pytest.mark.skipif(not os.path.exists(PUBLISHED), reason="published_configs.json not present")
def test_published_sizes_balance_and_auto_mesh():
    gpt2 = _published("gpt2-base")
    tp = auto_layout(gpt2, (1, 8))
    assert tp.balance() <= 1.15 and tp.sharded_fraction() > 0.99
    fsdp = auto_layout(gpt2, (2, 4), fsdp=True)
    assert fsdp.balance("adam") <= 1.05
    # Adam's two slots follow their variables (seed-generator states are not trainable: no slots).
    assert 2.99 < fsdp.bytes_per_device("adam") / fsdp.bytes_per_device() < 3
    # 12 heads on 8 devices: a model axis of 4, FSDP over the rest, said in explain().
    auto = auto_layout(gpt2, devices=8, fsdp=True)
    assert tuple(auto.mesh.shape) == (2, 4) and auto.fsdp
    assert auto.balance("adam") <= 1.05
    assert "mesh chosen for 8 devices with FSDP: (2, 4)" in str(auto.explain())
    # Without FSDP too: (1, 8) needs the head-dimension split (one more all-reduce per block).
    plain = auto_layout(gpt2, "auto", devices=8)
    assert tuple(plain.mesh.shape) == (2, 4) and plain.balance() <= 1.15 and not plain.fsdp
    four = auto_layout(gpt2, "auto", devices=4)
    assert tuple(four.mesh.shape) == (1, 4) and four.balance() <= 1.15
    qwen = _published("qwen2.5-0.5b")
    assert auto_layout(qwen, (2, 4), fsdp=True).balance("adam") <= 1.05


@pytest.mark.skipif(not os.path.exists(PUBLISHED), reason="published_configs.json not present")
def test_bench_layout_real_smoke(capsys):
    """tools/bench_layout.py --real --smoke: GPT-2 base at its real size, lazily, on (1, 8)."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
    import bench_layout

    assert bench_layout.main(["--real", "--smoke"]) == 0
    out = capsys.readouterr().out
    assert "gpt2-base" in out and "0.12B" in out and "3/0/0" in out  # 3 all-reduces per block: see README
