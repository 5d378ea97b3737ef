"""0-d variables (Keras' iteration counter, scalar weights) and shapes with a 0
dimension load from every format, with full optimizer state, into a compiled
model whose optimizer is built, lazily and normally built.

The iteration counter `optimizer/vars/0` is the 0-d array every Keras
checkpoint with optimizer state holds: numpy indexes a 0-d array with `()`
into a scalar, not a view, so a copy "into" it went nowhere (a TypeError).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import shardckpt
from tests.zoo import save_as

X = np.linspace(-1, 1, 8 * 4, dtype="float32").reshape(8, 4)
Y = np.linspace(1, -1, 8 * 16, dtype="float32").reshape(8, 16)


@keras.saving.register_keras_serializable("shardckpt_tests")
class Scaled(keras.layers.Layer):
    """`x * temperature`, with a 0-d weight and (`empty=True`) one of shape (0, 16)."""

    def __init__(self, empty=True, **kwargs):
        super().__init__(**kwargs)
        self.with_empty = empty

    def build(self, input_shape):
        self.temperature = self.add_weight(shape=(), initializer="ones", name="temperature")
        if self.with_empty:
            self.empty = self.add_weight(shape=(0, 16), initializer="zeros", name="empty")

    def call(self, x):
        x = x * self.temperature
        return x + keras.ops.sum(self.empty, axis=0) if self.with_empty else x

    def get_config(self):
        return {**super().get_config(), "empty": self.with_empty}


def _dense_then_scaled(empty=True):
    """Orbax cannot save arrays of size 0 ("Cannot save arrays with zero size"):
    `empty=False` leaves that weight out."""
    return keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(16, name="dense"), Scaled(empty, name="scaled")], name="seq"
    )


def _build(empty=True, lazy=False):
    """The model, compiled with Adam (Keras creates no optimizer under a StatelessScope)."""
    if lazy:
        with shardckpt.lazy_init():
            model = _dense_then_scaled(empty)
    else:
        model = _dense_then_scaled(empty)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def _dense_over_model():
    mesh = keras.distribution.DeviceMesh((2, 4), ["data", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["dense/kernel"] = (None, "model")
    layout_map["dense/bias"] = ("model",)
    return keras.distribution.ModelParallel(layout_map=layout_map)


def _state(model):
    return {v.path: np.asarray(v.value) for v in [*model.weights, *model.optimizer.variables]}


def _trained(tmp_path, fmt):
    """Trains 2 steps, writes `fmt` with Keras (full state where it holds one)."""
    keras.backend.clear_session()
    model = _build()
    model.fit(X, Y, batch_size=4, epochs=1, verbose=0, shuffle=False)
    want = _state(model)
    assert int(model.optimizer.iterations) == 2 and np.asarray(model.optimizer.iterations.value).shape == ()
    if fmt == "orbax":
        callback = keras.callbacks.OrbaxCheckpoint(str(tmp_path / "ckpt"), save_freq="epoch", save_weights_only=False)
        keras.backend.clear_session()
        model = _build(empty=False)
        model.fit(X, Y, batch_size=4, epochs=1, verbose=0, shuffle=False, callbacks=[callback])
        callback.wait_until_finished()
        want = _state(model)
        path = str(tmp_path / "ckpt")
    else:
        path = save_as(model, tmp_path, fmt)  # h5-sharded: a file per variable group
        if fmt == "safetensors":  # weights only: the format holds no optimizer state
            want = {v.path: want[v.path] for v in model.weights}
    keras.backend.clear_session()
    return path, want


@pytest.mark.parametrize("lazy", [True, False], ids=["lazy", "built"])
@pytest.mark.parametrize("fmt", ["h5", "keras", "h5-sharded", "orbax", "safetensors"])
def test_full_state_with_scalars_and_empty_arrays_loads_bit_exact(tmp_path, fmt, lazy):
    path, want = _trained(tmp_path, fmt)
    distribution = _dense_over_model()
    keras.distribution.set_distribution(distribution)
    model = _build(empty=fmt != "orbax", lazy=lazy)
    model.optimizer.build(model.trainable_variables)
    report = shardckpt.load_sharded(model, path)
    assert report.missing == [] and report.unexpected == []
    got = _state(model)
    if fmt == "safetensors":
        got = {k: got[k] for k in want}
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key].shape == value.shape and got[key].dtype == value.dtype, key
        np.testing.assert_array_equal(got[key], value, err_msg=key)
    for v in model.weights:
        expected = distribution.get_variable_layout(v).backend_layout
        assert v.value.sharding.is_equivalent_to(expected, v.ndim), v.path
    if fmt != "safetensors":
        assert int(model.optimizer.iterations) == 2
    # Training goes on from the loaded state.
    model.fit(X, Y, batch_size=4, epochs=1, verbose=0, shuffle=False)
    if fmt != "safetensors":
        assert int(model.optimizer.iterations) == 4
