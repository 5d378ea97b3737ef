"""FSDP (`fsdp=True`): parameters and Adam slots split over the data axis too; training equals one device."""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import shardckpt
from shardckpt.layout import auto_layout, parallelize
from tests.reference_fit import fit_twice_started

pytest.importorskip("keras_hub")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
import bench_layout as B  # noqa: E402  (tools/ is put on the path just above)

NAMES = ["Llama3", "GPT-2"]


@pytest.mark.parametrize("name", ["GPT-2"])  # biases, norms, positions: the harder case (Llama 3 passes too)
def test_fsdp_training_equals_one_device(name):
    xs = B.hub_inputs(B.HUB_BACKBONES[name](1), batch=8, seed=1)
    ys = np.random.default_rng(2).standard_normal((8, B.HUB_SEQ, 64)).astype("float32")

    def fit(model):
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
        history = model.fit(xs, ys, batch_size=8, epochs=2, shuffle=False, verbose=0)
        return history.history["loss"], [np.asarray(v.value) for v in model.variables]

    model, (loss_one, after_one) = fit_twice_started(lambda: B.HUB_BACKBONES[name](1), fit)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    plan = parallelize(model, (2, 4), fsdp=True)
    assert plan.fsdp and plan.balance("adam") < 1.3  # tiny: biases and norms (kept whole) weigh more than at real sizes
    assert sum("data" in str(p.axes) for p in plan.placements) >= 6  # kernels split over the data axis too
    loss, after = fit(model)
    np.testing.assert_allclose(loss, loss_one, rtol=1e-5)
    for v, a, b in zip(model.variables, after, after_one):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=v.path)
        assert v.value.sharding.is_equivalent_to(plan.sharding_for(v), len(v.shape)), v.path
    # Adam's slots follow their variable, data axis included.
    by_stem = {v.path.replace("/", "_"): v for v in model.trainable_variables}
    slots = [s for s in model.optimizer.variables if s.path.split("/", 1)[-1].rsplit("_", 1)[0] in by_stem]
    assert len(slots) == 2 * len(model.trainable_variables)
    for s in slots:
        owner = by_stem[s.path.split("/", 1)[-1].rsplit("_", 1)[0]]
        assert s.value.sharding.is_equivalent_to(owner.value.sharding, len(s.shape)), s.path


def _step_collectives(model, plan) -> dict[str, int]:
    """Collectives of one compiled SGD step (forward, backward, update), from abstract sharded values."""
    spec = lambda v: jax.ShapeDtypeStruct(tuple(v.shape), v.dtype, sharding=plan.sharding_for(v))  # noqa: E731
    tv = [spec(v) for v in model.trainable_variables]
    ntv = [spec(v) for v in model.non_trainable_variables]
    rows = NamedSharding(plan.mesh.backend_mesh, PartitionSpec(plan.batch_axis))
    xs = {k: jax.ShapeDtypeStruct((4, B.HUB_SEQ), "int32", sharding=rows) for k in model.input}

    def step(tv, ntv, xs):
        def loss(tv):
            out = model.stateless_call(tv, ntv, xs)[0]
            return jnp.mean(jnp.square(out))

        value, grads = jax.value_and_grad(loss)(tv)
        return value, [w - 0.1 * g for w, g in zip(tv, grads)]

    out = (None, [plan.sharding_for(v) for v in model.trainable_variables])
    with plan.distribution().scope():
        lowered = jax.jit(step, out_shardings=out).lower(tv, ntv, xs)
    return B.count_collectives(lowered.compile().as_text())


@pytest.mark.parametrize("name", NAMES)
def test_fsdp_step_adds_only_gathers_and_scatters(name):
    """Against tensor parallelism on the same (2, 4) mesh, FSDP adds all-gathers (and reduce-scatters) only."""
    with shardckpt.lazy_init():
        model = B.HUB_BACKBONES[name](2)
    tp = _step_collectives(model, auto_layout(model, (2, 4)))
    fsdp = _step_collectives(model, auto_layout(model, (2, 4), fsdp=True))
    assert fsdp["all-reduce"] <= tp["all-reduce"], (tp, fsdp)
    assert fsdp["all-to-all"] == tp["all-to-all"] == 0 and fsdp["collective-permute"] == tp["collective-permute"] == 0
    assert fsdp["all-gather"] + fsdp["reduce-scatter"] > tp["all-gather"] + tp["reduce-scatter"], (tp, fsdp)
