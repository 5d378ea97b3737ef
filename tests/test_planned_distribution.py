"""`plan.distribution()` places a rebuilt instance of the planned architecture by structure.

Keras names an unnamed layer by a process-wide counter: a keras-hub MoE
backbone built a second time has `mixtral_sparse_moe_block_2/...` where the
planned one had `mixtral_sparse_moe_block/...`. A `ModelParallel` over the
plan's exact paths misses those and Keras replicates the experts without a
word; the plan's own distribution places them as planned, and refuses a
variable of another architecture.
"""

from __future__ import annotations

import os
import sys

import keras
import numpy as np
import pytest
from jax.sharding import PartitionSpec

import shardckpt
from shardckpt.errors import UnplannedVariableError
from shardckpt.layout import auto_layout

pytest.importorskip("keras_hub")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
import bench_layout as B  # noqa: E402  (tools/ is put on the path just above)

MOE = ["Mixtral (MoE)", "QwenMoe"]


def _split_share(model) -> float:
    """Share of parameter bytes whose value is split over at least one device axis."""
    total = split = 0
    for v in model.weights:
        nbytes = int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
        total += nbytes
        if not v.value.sharding.is_fully_replicated:
            split += nbytes
    return split / total


@pytest.mark.parametrize("name", MOE)
def test_second_instance_built_under_the_plans_distribution_is_placed_by_structure(name):
    build = B.HUB_BACKBONES[name]
    with shardckpt.lazy_init():
        first = build(2)
    plan = auto_layout(first, (2, 4))
    assert plan.sharded_fraction() > 0.9
    keras.distribution.set_distribution(plan.distribution())
    second = build(2)  # built normally: Keras asks the distribution for every variable
    renamed = [v.path for v, w in zip(second.weights, first.weights) if v.path != w.path]
    assert renamed, "the rebuild has other generated names"
    assert _split_share(second) == pytest.approx(plan.sharded_fraction(), abs=1e-12)
    bound = plan.bind(second)
    for v in second.weights:
        assert v.value.sharding.spec == PartitionSpec(*bound.placement(v.path).axes), v.path
    # Its optimizer's slots follow their variables.
    second.compile(optimizer="adam", loss="mse")
    second.optimizer.build(second.trainable_variables)
    slots = {v.path: v for v in second.optimizer.variables}
    for v in second.trainable_variables:
        slot = slots[f"adam/{v.path.replace('/', '_')}_momentum"]
        assert slot.value.sharding.spec == v.value.sharding.spec, slot.path


@pytest.mark.parametrize("name", MOE)
def test_lazy_second_instance_loads_in_the_planned_sharding(name, tmp_path):
    build = B.HUB_BACKBONES[name]
    first = build(1)
    rng = np.random.default_rng(0)
    for v in first.weights:
        v.assign(rng.standard_normal(v.shape).astype(v.dtype))
    first.save_weights(tmp_path / "m.weights.h5")
    plan = auto_layout(first, (1, 8))
    keras.distribution.set_distribution(plan.distribution())
    with shardckpt.lazy_init():
        second = build(1)
    shardckpt.load_sharded(second, tmp_path / "m.weights.h5")
    assert _split_share(second) == pytest.approx(plan.sharded_fraction(), abs=1e-12)
    for v, w in zip(second.weights, first.weights):
        np.testing.assert_array_equal(np.asarray(v.value), np.asarray(w.value), err_msg=v.path)


def test_a_variable_of_another_architecture_is_refused():
    build = B.HUB_BACKBONES["Mixtral (MoE)"]
    with shardckpt.lazy_init():
        first = build(1)
    plan = auto_layout(first, (1, 8))
    keras.distribution.set_distribution(plan.distribution())
    with pytest.raises(UnplannedVariableError, match=r"token_embedding/embeddings.*shape \(128, 32\).*plan has it with shape \(128, 64\)"):
        build(1, hidden=32)  # same layers, another width
    with pytest.raises(UnplannedVariableError, match="dense.*kernel.*no variable there"):
        keras.layers.Dense(8).build((None, 4))  # another model altogether
    # Opted in: what the plan does not know is replicated.
    keras.distribution.set_distribution(plan.bind(first, unknown="replicate").distribution())
    layer = keras.layers.Dense(8)
    layer.build((None, 4))
    assert layer.kernel.value.sharding.is_fully_replicated


def test_a_seed_generator_made_after_planning_is_replicated_a_weight_of_its_shape_is_refused():
    """RNG state (a sampler's, made by `compile()` after the load) is replicated; the plan still
    refuses a layer's variable it does not know, even one of the seed state's shape."""
    inputs = keras.Input((16,))
    model = keras.Model(inputs, keras.layers.Dense(8)(keras.layers.Dense(32)(inputs)))
    plan = auto_layout(model, (1, 8))
    keras.distribution.set_distribution(plan.distribution())
    seed = keras.random.SeedGenerator(7)
    assert seed.state.value.sharding.is_fully_replicated and len(seed.state.value.sharding.device_set) == 8
    np.testing.assert_array_equal(np.asarray(seed.state.value), [7, 0])
    with pytest.raises(UnplannedVariableError, match=r"'norm/gamma' \(shape \(2,\)\).*no variable there"):
        keras.layers.LayerNormalization(name="norm").build((None, 2))
