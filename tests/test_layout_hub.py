"""auto_layout / parallelize / `shardckpt plan` on real keras-hub backbones, 8 CPU devices.

Every keras-hub transformer backbone of `tools/bench_layout.HUB_BACKBONES`
(tiny configs) is built under `lazy_init()` and planned on a (1, 8) mesh; the
plan is then checked against what the devices do with it: parameter bytes
split, all-reduces per block and all-gathers counted in the compiled forward
pass, output against one device, bytes per device against the placed shards.
"""

from __future__ import annotations

import os
import sys

import jax
import keras
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import shardckpt
from shardckpt.layout import auto_layout
from shardckpt.restore.lazy import is_unloaded
from shardckpt.layout.parallel import parallelize

pytest.importorskip("keras_hub")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
import bench_layout as B  # noqa: E402

M = "model"
# Backbones whose key/value heads (2, or 1) the 8-way axis does not divide.
FEW_KV_HEADS = {"Llama (GQA, 2 kv heads)", "Mistral (GQA, 2 kv heads)", "Gemma (MQA, 1 kv head)"}
MOE = {"Mixtral (MoE)", "QwenMoe", "Qwen3Moe"}
# `fit` compiles a train step twice per backbone; these cover the distinct
# structures (grouped-query + rotary + untied head, multi-query + tied
# embedding, mixture of experts, shared expert, learned positions +
# LayerNorm + biases, token types).
FIT = ["Llama (GQA, 2 kv heads)", "Gemma (MQA, 1 kv head)", "Mixtral (MoE)", "QwenMoe", "GPT-2", "BERT"]


def _perturb(model, seed: int) -> None:
    """Moves every weight off its initial value (zero biases, unit scales would hide mistakes)."""
    rng = np.random.default_rng(seed)
    for v in model.weights:
        v.assign(np.asarray(v.value) + 0.05 * rng.standard_normal(v.shape).astype("float32"))


def _placed(model, plan):
    tv = [jax.device_put(v.value, plan.sharding_for(v)) for v in model.trainable_variables]
    ntv = [jax.device_put(v.value, plan.sharding_for(v)) for v in model.non_trainable_variables]
    return tv, ntv


def _max_device_bytes(arrays) -> int:
    per_device: dict = {}
    for arr in arrays:
        for shard in arr.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return max(per_device.values())


def _build_lazy(name: str, blocks: int):
    keras.backend.clear_session()
    with shardckpt.lazy_init():
        return B.HUB_BACKBONES[name](blocks)


@pytest.mark.parametrize("name", list(B.HUB_BACKBONES))
def test_backbone_plan_split_cheap_and_exact(name):
    """>= 90% split, <= 2 all-reduces per block, no all-gather, output and bytes true to the devices."""
    counts = []
    for blocks in (1, 2):
        lazy = _build_lazy(name, blocks)
        assert all(is_unloaded(v) for v in lazy.variables)
        plan = auto_layout(lazy, (1, 8))
        assert plan.validate(lazy) == []
        assert [p.path for p in plan.placements] == [v.path for v in lazy.variables]
        keras.backend.clear_session()
        model = B.HUB_BACKBONES[name](blocks)
        _perturb(model, blocks)
        assert auto_layout(model, (1, 8)).placements == plan.placements  # lazy or built: one plan
        xs = B.hub_inputs(model)
        tv, ntv = _placed(model, plan)
        for v, arr in zip(model.trainable_variables + model.non_trainable_variables, tv + ntv):
            assert arr.sharding == NamedSharding(plan.mesh.backend_mesh, PartitionSpec(*plan[v.path].axes)), v.path
        assert _max_device_bytes(tv + ntv) == plan.bytes_per_device()
        forward = jax.jit(lambda a, b, x: model.stateless_call(a, b, x)[0])
        counts.append(B.count_collectives(forward.lower(tv, ntv, xs).compile().as_text()))
        got = np.asarray(forward(tv, ntv, xs))
        want = np.asarray(model(xs))
        assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))
    assert plan.sharded_fraction() >= 0.90, plan.sharded_fraction()
    text = str(plan.explain())
    for p in plan.placements:
        assert p.path in text and p.reason in text, p.path
    per_block = {k: counts[1][k] - counts[0][k] for k in counts[0]}
    assert per_block["all-reduce"] <= 2, counts
    assert all(c["all-gather"] == 0 and c["all-to-all"] == 0 and c["collective-permute"] == 0 for c in counts), counts
    if name in FEW_KV_HEADS:
        for p in plan.placements:
            if p.path.endswith(("key/kernel", "value/kernel")):
                assert p.axes == (None,) * 3 and p.source == "fallback" and "does not divide" in p.reason, p
            elif p.path.endswith(("query/kernel", "attention_output/kernel")):
                assert M in p.axes, p
    if name in MOE:
        experts = [p for p in plan.placements if "/experts/" in p.path]
        assert len(experts) >= 2
        for p in experts:  # each device holds 1/8 of every expert tensor
            assert M in p.axes, p
            assert plan.bytes_per_device() and p.nbytes // 8 == p.nbytes / 8


@pytest.mark.parametrize("name", FIT)
def test_parallelize_then_fit_equals_one_device(name):
    xs = B.hub_inputs(B.HUB_BACKBONES[name](1), batch=8, seed=1)
    ys = np.random.default_rng(2).standard_normal((8, B.HUB_SEQ, 64)).astype("float32")

    def fit(model):
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        history = model.fit(xs, ys, batch_size=8, epochs=3, shuffle=False, verbose=0)
        return history.history["loss"], [np.asarray(v.value) for v in model.variables]

    keras.backend.clear_session()
    single = B.HUB_BACKBONES[name](1)
    _perturb(single, 0)
    weights = single.get_weights()
    losses_one, after_one = fit(single)
    keras.backend.clear_session()
    model = B.HUB_BACKBONES[name](1)
    model.set_weights(weights)
    plan = parallelize(model)
    assert plan.sharded_fraction() >= 0.9
    losses_tp, after_tp = fit(model)
    np.testing.assert_allclose(losses_tp, losses_one, rtol=1e-5)
    for v, a, b in zip(model.variables, after_tp, after_one):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=v.path)
        assert v.value.sharding == plan.sharding_for(v), v.path
