"""LoRA factors placed with their kernels: after `from_preset` + `enable_lora`, `lora_kernel_a` /
`lora_kernel_b` are split along the dimension they share with the base kernel's split, for plans
made before `enable_lora` (the distribution places them as Keras creates them) and after it."""

from __future__ import annotations

import warnings

import jax
import keras
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import shardckpt
from shardckpt.layout.lora import lora_axes, lora_triples

keras_hub = pytest.importorskip("keras_hub")
M = "model"
LLAMA = dict(vocabulary_size=64, num_layers=2, num_query_heads=8, num_key_value_heads=8, hidden_dim=32,
             intermediate_dim=64)


@pytest.fixture(scope="module")
def preset(tmp_path_factory):
    keras.backend.clear_session()
    backbone = keras_hub.models.Llama3Backbone(**LLAMA)
    rng = np.random.default_rng(0)
    for v in backbone.weights:
        v.assign(rng.standard_normal(v.shape).astype(np.float32) * 0.2)
    folder = tmp_path_factory.mktemp("lora_layout") / "preset"
    backbone.save_to_preset(str(folder))
    keras.backend.clear_session()
    return str(folder)


def _inputs():
    tokens = (np.arange(8 * 16).reshape(8, 16) * 7 % 64).astype("int32")
    return {"token_ids": tokens, "padding_mask": np.ones_like(tokens)}


def _fill_factors(model):
    """Random A and B (enable_lora leaves B zero, which would hide a wrong placement)."""
    rng = np.random.default_rng(1)
    for _, a, b in lora_triples(model):
        for v in (a, b):
            v.assign(rng.standard_normal(v.shape).astype(np.float32) * 0.2)


def _assert_factors_follow_kernels(model) -> int:
    triples = lora_triples(model)
    assert len(triples) == 2 * LLAMA["num_layers"]  # keras-hub's enable_lora: query and value of each block
    split = 0
    for base, a, b in triples:
        base_axes = tuple(base.value.sharding.spec) + (None,) * (len(base.shape) - len(base.value.sharding.spec))
        assert M in base_axes, base.path
        want_a, want_b = lora_axes(base_axes)
        mesh = base.value.sharding.mesh
        assert a.value.sharding.is_equivalent_to(NamedSharding(mesh, PartitionSpec(*want_a)), len(a.shape)), a.path
        assert b.value.sharding.is_equivalent_to(NamedSharding(mesh, PartitionSpec(*want_b)), len(b.shape)), b.path
        split += M in want_a or M in want_b
    return split


def _forward(model, x, *, replicate_factors: bool):
    """The compiled forward; with `replicate_factors` every LoRA factor replicated instead (the reference)."""
    factors = {id(w) for _, a, b in lora_triples(model) for w in (a, b)} if replicate_factors else set()
    mesh = keras.distribution.distribution().device_mesh.backend_mesh
    whole = NamedSharding(mesh, PartitionSpec())

    def values(variables):
        return [jax.device_put(v.value, whole) if id(v) in factors else v.value for v in variables]

    forward = jax.jit(lambda tv, ntv, inputs: model.stateless_call(tv, ntv, inputs)[0])
    out = forward(values(model.trainable_variables), values(model.non_trainable_variables), x)
    return np.asarray(out)


def _assert_same_as_replicated_factors(model, x):
    split = _forward(model, x, replicate_factors=False)
    np.testing.assert_array_equal(split, _forward(model, x, replicate_factors=True))
    assert np.abs(split).max() > 0


def test_plan_made_before_enable_lora_places_the_factors_as_keras_creates_them(preset):
    keras.backend.clear_session()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = shardckpt.from_preset(preset, mesh=(1, 8))
    # The plan's keys for factors not created yet are no user mistake: no "match no variable" warning.
    assert not [w for w in caught if "LayoutMap key" in str(w.message)]
    x = _inputs()
    before = np.asarray(model(x))
    model.enable_lora(2)
    # B starts at zero: the merged kernel is the base kernel, bit for bit.
    np.testing.assert_array_equal(np.asarray(model(x)), before)
    _fill_factors(model)
    assert _assert_factors_follow_kernels(model) == 2 * LLAMA["num_layers"]
    _assert_same_as_replicated_factors(model, x)
    keras.distribution.set_distribution(None)


def test_plan_made_after_enable_lora_splits_the_factors_and_says_why(preset):
    keras.backend.clear_session()
    model = shardckpt.from_preset(preset, mesh=(1, 8))
    values = {v.path: np.asarray(v.value) for v in model.weights}
    model.enable_lora(2)
    _fill_factors(model)
    factors = {v.path: np.asarray(v.value) for _, a, b in lora_triples(model) for v in (a, b)}
    plan = shardckpt.parallelize(model, (1, 8))
    assert _assert_factors_follow_kernels(model) == 2 * LLAMA["num_layers"]
    for v in model.weights:  # moved, never changed
        want = factors.get(v.path, values.get(v.path))
        np.testing.assert_array_equal(np.asarray(v.value), want, err_msg=v.path)
        assert v.value.sharding == plan.sharding_for(v), v.path
    x = _inputs()
    _assert_same_as_replicated_factors(model, x)
    text = str(plan.explain())
    assert "LoRA factor A of its layer's kernel: split with it" in text
    assert "LoRA factor B of its layer's kernel: replicated:" in text  # (rank, head_dim): no split dimension
    # The base kernels keep the plan made without LoRA.
    keras.distribution.set_distribution(None)
    keras.backend.clear_session()
    plain = shardckpt.from_preset(preset, mesh=(1, 8))
    bases = {p.path: p.axes for p in shardckpt.auto_layout(plain, (1, 8)).placements}
    for p in plan.placements:
        if p.path in bases:
            assert p.axes == bases[p.path], p.path
    keras.distribution.set_distribution(None)
