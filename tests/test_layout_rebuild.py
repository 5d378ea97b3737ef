"""Plans survive a rebuild: matched by structure, never by the names Keras generates."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import shardckpt
from shardckpt.errors import UnplannedVariableError
from shardckpt.layout import LayoutPlan, auto_layout
from shardckpt.structure import structural_paths, variables_by_key

keras_hub = pytest.importorskip("keras_hub")


def build_moe() -> keras.Model:
    """A tiny Mixtral: its sparse-MoE block is an unnamed layer, numbered per process."""
    return keras_hub.models.MixtralBackbone(
        vocabulary_size=128, num_layers=1, num_query_heads=8, num_key_value_heads=8,
        hidden_dim=32, intermediate_dim=64, num_experts=8, top_k=2,
    )


def _expected_sharding(plan: LayoutPlan, key: str) -> NamedSharding:
    placement = next(p for p in plan.placements if p.key == key)
    return NamedSharding(plan.mesh.backend_mesh, PartitionSpec(*placement.axes))


def _saved(tmp_path):
    model = build_moe()
    rng = np.random.default_rng(0)
    for v in model.variables:
        if v.dtype.startswith("float"):
            v.assign(rng.standard_normal(v.shape).astype(v.dtype))
    model.save_weights(tmp_path / "a.weights.h5")
    keys = structural_paths(model)
    values = {keys[id(v)]: np.asarray(v.value) for v in model.variables}
    return model, values


def test_plan_applies_to_a_second_instance_in_the_same_process(tmp_path):
    first, values = _saved(tmp_path)
    plan = auto_layout(first, (2, 4))
    experts = [p for p in plan.placements if len(p.shape) == 3 and p.shape[0] == 8 and "model" in p.axes]
    assert experts, "the expert kernels are split over the model axis"
    with shardckpt.lazy_init():
        second = build_moe()
    renamed = [v for v, w in zip(second.variables, first.variables) if v.path != w.path]
    assert renamed, "the rebuild has different generated names"
    # The unbound plan refuses a variable it does not know, never replicates it.
    with pytest.raises(UnplannedVariableError, match=renamed[0].path):
        plan.sharding_for(renamed[0])
    shardckpt.load_sharded(second, tmp_path / "a.weights.h5", layout=plan)
    keys = structural_paths(second)
    for v in second.variables:
        key = keys[id(v)]
        assert v.value.sharding.is_equivalent_to(_expected_sharding(plan, key), len(v.shape)), v.path
        np.testing.assert_array_equal(np.asarray(v.value), values[key])
    bound = plan.bind(second)
    assert {p.path for p in bound.placements} == {v.path for v in second.variables}
    assert [p.axes for p in bound.placements] == [p.axes for p in plan.placements]
    assert bound.validate(second) == []


def test_plan_from_json_applies_in_a_new_process(tmp_path):
    first, values = _saved(tmp_path)
    plan = auto_layout(first, (1, 8))
    (tmp_path / "plan.json").write_text(plan.to_json())
    np.savez(tmp_path / "values.npz", **{k.replace("/", "|"): a for k, a in values.items()})
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    env.pop("XLA_FLAGS", None)
    worker = os.path.join(os.path.dirname(__file__), "_plan_worker.py")
    done = subprocess.run([sys.executable, worker, str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    got = json.loads(line[len("RESULT "):])
    assert set(got) == {p.key for p in plan.placements}
    assert any(got[p.key]["path"] != p.path for p in plan.placements), "the child's names differ"
    for p in plan.placements:
        want = [list(a) if isinstance(a, tuple) else a for a in p.axes]
        spec = got[p.key]["spec"] + [None] * (len(want) - len(got[p.key]["spec"]))
        assert spec == want, p.key
        assert got[p.key]["equal"], p.key


def test_unknown_variables_raise_unless_opted_in():
    keras.backend.clear_session()
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32), keras.layers.Dense(16)])
    other = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32), keras.layers.Dense(8), keras.layers.Dense(8)])
    plan = auto_layout(model, (1, 8))
    stranger = other.layers[2].kernel
    with pytest.raises(UnplannedVariableError, match=rf"{stranger.path}.*Fix"):
        plan.axes_for(stranger)
    with pytest.raises(UnplannedVariableError, match=r"model shape \(32, 8\), plan shape \(32, 16\)"):
        plan.bind(other)
    lenient = auto_layout(model, (1, 8), unknown="replicate")
    assert lenient.axes_for(stranger) == (None, None)
    # Opting in replicates unknown variables, but a shape that differs is still refused.
    with pytest.raises(UnplannedVariableError, match="model shape"):
        lenient.bind(other)
    # Scalars (step counters, learning rates) are the one thing replicated without a placement.
    assert plan.axes_for(keras.Variable(0.0, name="step")) == ()
    assert set(variables_by_key(model)) == {"layers/dense/vars/0", "layers/dense/vars/1",
                                            "layers/dense_1/vars/0", "layers/dense_1/vars/1"}


def test_from_preset_with_a_plan_of_another_instance_and_fsdp(tmp_path):
    first, values = _saved(tmp_path)
    first.save_to_preset(str(tmp_path / "preset"))
    plan = auto_layout(first, (2, 4), fsdp=True)
    assert plan.fsdp and any("data" in str(p.axes) for p in plan.placements)
    model = shardckpt.from_preset(tmp_path / "preset", layout=plan)  # built again: other generated names
    assert any(v.path != p.path for v, p in zip(model.variables, plan.placements))
    keys = structural_paths(model)
    for v in model.variables:
        key = keys[id(v)]
        assert v.value.sharding.is_equivalent_to(_expected_sharding(plan, key), len(v.shape)), v.path
        np.testing.assert_array_equal(np.asarray(v.value), values[key])
    again = shardckpt.from_preset(tmp_path / "preset", mesh="auto", fsdp=True)
    assert keras.distribution.distribution() is not None
    assert {tuple(v.value.sharding.mesh.devices.shape) for v in again.variables} == {(1, 8)}  # all heads divide 8
