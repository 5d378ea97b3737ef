"""lazy_init(): no initializer runs, no value exists, and nothing fills values later."""

from __future__ import annotations

import logging

import jax
import keras
import numpy as np
import pytest
import safetensors.numpy as stnp

import shardckpt
from shardckpt import errors
from shardckpt.lazy import is_unloaded
from tests.zoo import build_zoo


def test_lazy_build_has_no_values_and_stays_so():
    with shardckpt.lazy_init():
        model = build_zoo()
    assert model.weights and all(v._value is None for v in model.weights)
    # A later plain StatelessScope exit initialises Keras' pending variables;
    # lazy_init took its own off that list.
    with keras.StatelessScope():
        pass
    assert all(v._value is None for v in model.weights)
    assert sum(int(np.prod(v.shape)) for v in model.weights) == model.count_params()


def test_using_an_unloaded_variable_names_it():
    with shardckpt.lazy_init():
        model = build_zoo()
    with pytest.raises(errors.UnloadedVariableError, match="embed/embeddings.*load_sharded"):
        model(np.zeros((1, 8), "int32"))


def test_models_built_outside_are_normal():
    with shardckpt.lazy_init():
        build_zoo()
    model = build_zoo()
    # Every variable has its initializer's value (readable, not the lazy sentinel) and the
    # model runs: nothing of the lazy build leaked into the next one.
    for v in model.weights:
        assert not is_unloaded(v), v.path
        value = v.numpy()
        assert value.shape == tuple(v.shape) and np.isfinite(value).all(), v.path
    kernels = [v.numpy() for v in model.weights if v.path.endswith("kernel") and v.dtype.startswith("float")]
    assert kernels and all(np.any(k != 0) for k in kernels)  # initializers ran (glorot is never all zero)
    out = model(np.zeros((2, 8), "int32"))
    assert np.isfinite(keras.ops.convert_to_numpy(out)).all()


class _FilledInBuild(keras.layers.Layer):
    """`w` from its initializer; `table` and `count` filled by `assign` in `build()`, after `add_weight`."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1], 8), initializer="ones", name="w")
        self.table = self.add_weight(shape=(8,), initializer="zeros", trainable=False, name="table")
        self.table.assign(np.arange(8, dtype="float32") + 1.5)
        self.count = self.add_weight(shape=(), initializer="zeros", trainable=False, name="count")
        self.count.assign_add(3.0)  # reads the variable inside the scope: its pending value

    def call(self, x):
        return x @ self.w * self.table + self.count


def _filled_in_build():
    inputs = keras.Input((4,))
    return keras.Model(inputs, _FilledInBuild(name="filled")(inputs))


def test_values_assigned_in_build_are_kept_for_variables_the_checkpoint_lacks(tmp_path, caplog):
    """A lazily built layer's own `assign`s in `build()` give its variables the values a normal
    build gives them, in their sharding, where the checkpoint has no array (strict=False); arrays
    the checkpoint holds still win."""
    built = _filled_in_build()
    layer = built.get_layer("filled")
    layer.w.assign(np.full((4, 8), 2.0, "float32"))
    path = str(tmp_path / "w_only.safetensors")
    stnp.save_file({"filled/w": np.asarray(layer.w.value)}, path)  # no table, no count
    mesh = keras.distribution.DeviceMesh((8,), ["model"], jax.devices())
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["filled/table"] = ("model",)
    x = np.arange(8, dtype="float32").reshape(2, 4)

    with shardckpt.lazy_init():
        model = _filled_in_build()
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        report = shardckpt.load_sharded(model, path, strict=False, layout=layout_map, allow_other_mesh=True)
    assert sorted(report.initialized) == ["filled/count", "filled/table"]
    assert "2 variable(s) the checkpoint lacks got the values a build gives (filled/table, filled/count)" in caplog.text
    lazy = model.get_layer("filled")
    for name in ("w", "table", "count"):
        np.testing.assert_array_equal(np.asarray(getattr(lazy, name).value), np.asarray(getattr(layer, name).value))
    np.testing.assert_array_equal(np.asarray(lazy.w.value), np.full((4, 8), 2.0, "float32"))
    sharding = lazy.table.value.sharding
    assert sharding.spec == jax.sharding.PartitionSpec("model") and len(sharding.device_set) == 8
    np.testing.assert_array_equal(np.asarray(model(x)), np.asarray(built(x)))
