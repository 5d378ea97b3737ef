"""A LayoutMap key that places nothing is said, once (Keras replicates those variables silently)."""

import warnings

import jax
import keras
import numpy as np
import pytest

import shardckpt
from shardckpt.restore import targets


def _sequential() -> keras.Model:
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32), keras.layers.Dense(8)])
    return model


def _columns_over_model(*keys: str) -> keras.distribution.ModelParallel:
    mesh = keras.distribution.DeviceMesh((1, 8), ["data", "model"], jax.devices())
    layout_map = keras.distribution.LayoutMap(mesh)
    for key in keys:
        layout_map[key] = (None, "model")
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="data")


@pytest.fixture
def saved(tmp_path):
    model = _sequential()
    for i, v in enumerate(model.weights):
        v.assign(np.arange(np.prod(v.shape), dtype="float32").reshape(v.shape) + i)
    path = str(tmp_path / "m.weights.h5")
    model.save_weights(path)
    keras.backend.clear_session()
    return path, [np.asarray(v.value) for v in model.weights]


def _load(path: str, *keys: str) -> tuple[keras.Model, list[warnings.WarningMessage]]:
    targets._warned_unmatched.clear()
    keras.distribution.set_distribution(_columns_over_model(*keys))
    with shardckpt.lazy_init():
        model = _sequential()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shardckpt.load_sharded(model, path, progress=False)
    return model, [w for w in caught if "LayoutMap key" in str(w.message)]


def test_a_key_short_of_the_whole_path_is_warned_about_and_the_kernel_is_replicated(saved):
    path, values = saved
    model, caught = _load(path, "dense/kernel")
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "'dense/kernel'" in message and "'sequential/dense/kernel'" in message and "'.*dense/kernel'" in message
    kernel = model.weights[0]
    assert kernel.path == "sequential/dense/kernel"
    assert kernel.value.sharding.is_fully_replicated  # what Keras does with it: the warning says so
    for variable, value in zip(model.weights, values):
        np.testing.assert_array_equal(np.asarray(variable.value), value)


def test_a_pattern_that_places_the_kernel_gives_no_warning(saved):
    path, values = saved
    model, caught = _load(path, ".*dense/kernel")
    assert caught == []
    kernel = model.weights[0]
    assert kernel.value.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    np.testing.assert_array_equal(np.asarray(kernel.value), values[0])


def test_the_same_unmatched_keys_are_warned_about_once(saved):
    path, _ = saved
    _, first = _load(path, "dense/kernel")
    keras.backend.clear_session()
    with shardckpt.lazy_init():
        model = _sequential()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shardckpt.load_sharded(model, path, progress=False, layout=keras.distribution.DataParallel())
    assert len(first) == 1 and [w for w in caught if "LayoutMap key" in str(w.message)] == []


def test_a_layer_output_key_is_no_mistake_and_one_of_no_layer_is(saved):
    """Keras places a layer's output by "<layer path>/output" (as shardckpt's own plans do for an
    embedding whose vocabulary the mesh does not divide): such a key matches a layer, not a
    variable. One that names no layer is still said."""
    path, _ = saved
    _, caught = _load(path, ".*dense/kernel", "sequential/dense/output", "sequential/dense_1/output")
    assert caught == []
    keras.backend.clear_session()
    _, caught = _load(path, ".*dense/kernel", "sequential/nothing/output")
    assert len(caught) == 1 and "'sequential/nothing/output'" in str(caught[0].message)
