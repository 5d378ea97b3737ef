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
PUBLISHED = os.environ.get("SHARDCKPT_PUBLISHED_CONFIGS", os.path.join(os.path.dirname(__file__), "published_configs.json"))


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
    # Its vocabulary (50257) divides by no model axis: every tensor-parallel shape gathers the
    # embedding's lookups, so "auto" shards it over the data axis alone (ZeRO-3), said in explain().
    auto = auto_layout(gpt2, devices=8, fsdp=True)
    assert tuple(auto.mesh.shape) == (8, 1) and auto.fsdp
    # 0.7% of the bytes stay whole on every device: the position table and the biases and
    # normalization scales, applied element-wise (FSDP keeps those; see layout/fsdp.py).
    assert auto.balance("adam") <= 1.06
    assert "mesh chosen for 8 devices with FSDP: (8, 1)" in str(auto.explain())
    qwen = _published("qwen2.5-0.5b")
    assert auto_layout(qwen, (2, 4), fsdp=True).balance("adam") <= 1.05


@pytest.mark.skipif(not os.path.exists(PUBLISHED), reason="published_configs.json not present")
@pytest.mark.parametrize(("name", "shape"), [("gpt2-base", (8, 1)), ("bert-base", (4, 2))])
def test_auto_mesh_of_an_indivisible_vocabulary_gathers_nothing_in_the_forward(name, shape):
    """GPT-2 / BERT base: a model axis that does not divide the vocabulary (50257; 30522 =
    2 x 15261) splits the embedding along its width and gathers each lookup outside the blocks.
    "auto" takes no such shape: GPT-2 runs data parallel (no collective in the forward at all),
    BERT on a model axis of 2 (all-reduces only: a vocabulary split and two per block)."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
    import layout_real

    with open(PUBLISHED) as f:
        config = json.load(f)[name]
    model = layout_real.build(config)
    plan = auto_layout(model, devices=8)
    assert tuple(plan.mesh.shape) == shape and not plan.gathered_outputs and plan.balance() <= 1.15
    lines = str(plan.explain())
    assert f"mesh chosen for 8 devices: {shape}" in lines and "1 lookups gathered" in lines
    # The forward of a one-block build (the same embedding; layout_real counts per block),
    # compiled from abstract sharded inputs: no weight memory.
    small = layout_real.build(config, blocks=1)
    small_plan = auto_layout(small, devices=8)
    assert tuple(small_plan.mesh.shape) == shape
    counts = layout_real.forward_collectives(small, small_plan)
    assert {k: v for k, v in counts.items() if k != "all-reduce"} == dict.fromkeys(counts.keys() - {"all-reduce"}, 0)
    assert counts["all-reduce"] == (0 if shape[1] == 1 else 3), counts  # the lookup's and one block's two
    if name != "gpt2-base":
        return
    # Where one device cannot hold that much, the shape is out (the one-block build: a cheaper trace).
    limit = small_plan.bytes_per_device() // 2
    tight = auto_layout(small, devices=8, device_memory=limit)
    assert tuple(tight.mesh.shape) != shape and tight.bytes_per_device() <= limit
    assert "does not fit" in str(tight.explain())
    with pytest.warns(UserWarning, match="No mesh shape of 8 devices fits"):
        none = auto_layout(small, devices=8, device_memory=1 << 20)
    assert tuple(none.mesh.shape) == (1, 8)  # the fewest bytes, said not to fit


@pytest.mark.skipif(not os.path.exists(PUBLISHED), reason="published_configs.json not present")
def test_bench_layout_real_smoke(capsys):
    """tools/bench_layout.py --real --smoke: GPT-2 base at its real size, lazily, on (1, 8)."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
    import bench_layout

    assert bench_layout.main(["--real", "--smoke"]) == 0
    out = capsys.readouterr().out
    assert "gpt2-base" in out and "0.12B" in out and "3/0/0" in out  # 3 all-reduces per block: see README
