"""A layout on another mesh than the model computes on is refused unless asked for.

A `LayoutMap` built for another mesh (or a 4-device sub-mesh naming a single
key) moved every variable onto that mesh, with no word; the next train step
then ran on devices the distribution does not know.
"""

from __future__ import annotations

import jax
import keras
import numpy as np
import pytest

import shardckpt
from shardckpt import errors
from tests.zoo import build_zoo, randomize


@pytest.fixture
def saved(tmp_path):
    keras.backend.clear_session()
    model = build_zoo(rnn=False)
    randomize(model, seed=3)
    path = str(tmp_path / "m.weights.h5")
    model.save_weights(path)
    values = {v.path: np.asarray(v.value) for v in model.weights}
    keras.backend.clear_session()
    return path, values


def _lazy_zoo():
    with shardckpt.lazy_init():
        return build_zoo(rnn=False)


def _layout_map(mesh):
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["head/kernel"] = (None, "model")
    return layout_map


def _devices(variable):
    return {d.id for d in variable.value.sharding.device_set}


def test_layout_map_on_another_mesh_than_the_distribution_is_refused(saved):
    path, values = saved
    active = keras.distribution.DeviceMesh((2, 4), ["data", "model"])
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=_layout_map(active)))
    other = keras.distribution.DeviceMesh((4, 2), ["data", "model"])  # same devices, another shape
    model = _lazy_zoo()
    with pytest.raises(errors.MeshMismatchError) as e:
        shardckpt.load_sharded(model, path, layout=_layout_map(other))
    assert isinstance(e.value, errors.LayoutError) and isinstance(e.value, ValueError)
    message = str(e.value)
    assert "{'data': 4, 'model': 2}" in message and "{'data': 2, 'model': 4}" in message
    assert "allow_other_mesh=True" in message
    assert all(shardckpt.lazy.is_unloaded(v) for v in model.weights)  # untouched

    # The fix: the opt-in loads onto the layout's mesh.
    shardckpt.load_sharded(model, path, layout=_layout_map(other), allow_other_mesh=True)
    head = next(v for v in model.weights if v.path == "head/kernel")
    assert head.value.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    assert dict(head.value.sharding.mesh.shape) == {"data": 4, "model": 2}
    for v in model.weights:
        np.testing.assert_array_equal(np.asarray(v.value), values[v.path], err_msg=v.path)

    # The other fix: a layout on the distribution's own mesh is accepted.
    model = _lazy_zoo()
    shardckpt.load_sharded(model, path, layout=_layout_map(active))
    assert dict(next(v for v in model.weights if v.path == "head/kernel").value.sharding.mesh.shape) == {
        "data": 2,
        "model": 4,
    }


def test_sub_mesh_layout_without_a_distribution_is_refused(saved):
    path, values = saved
    sub = keras.distribution.DeviceMesh((1, 4), ["data", "model"], devices=jax.devices()[:4])
    model = _lazy_zoo()
    with pytest.raises(errors.MeshMismatchError) as e:
        shardckpt.load_sharded(model, path, layout=_layout_map(sub))
    assert "4 of the 8 devices" in str(e.value) and "devices [0, 1, 2, 3]" in str(e.value)
    assert all(shardckpt.lazy.is_unloaded(v) for v in model.weights)

    # The hint's first fix: a mesh over every device.
    full = keras.distribution.DeviceMesh((2, 4), ["data", "model"])
    shardckpt.load_sharded(model, path, layout=_layout_map(full))
    assert all(_devices(v) == set(range(8)) for v in model.weights)

    # The opt-in: only the sub-mesh's devices hold the model.
    model = _lazy_zoo()
    shardckpt.load_sharded(model, path, layout=_layout_map(sub), allow_other_mesh=True)
    for v in model.weights:
        assert _devices(v) == {0, 1, 2, 3}, v.path
        np.testing.assert_array_equal(np.asarray(v.value), values[v.path], err_msg=v.path)


def test_a_plan_whose_distribution_is_active_is_accepted(saved):
    path, values = saved
    model = _lazy_zoo()
    plan = shardckpt.auto_layout(model, keras.distribution.DeviceMesh((2, 4), ["data", "model"]))
    keras.distribution.set_distribution(plan.distribution())
    shardckpt.load_sharded(model, path, layout=plan)
    for v in model.weights:
        assert v.value.sharding.is_equivalent_to(plan.sharding_for(v), v.ndim), v.path
        np.testing.assert_array_equal(np.asarray(v.value), values[v.path], err_msg=v.path)
