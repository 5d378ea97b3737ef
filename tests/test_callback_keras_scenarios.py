"""Keras' own test scenarios for `keras.callbacks.OrbaxCheckpoint`, run on ours.

Ported from `keras/src/callbacks/orbax_checkpoint_test.py` at tag v3.15.1 with
the import swapped to `shardckpt.training.OrbaxCheckpoint`. Each test keeps
Keras' scenario (arguments, data sizes, what it checks) and, where Keras
compares with a tolerance, compares bit for bit. Left out: Keras'
`test_checkpoint_with_assets` (both parametrisations), which calls the private
`OrbaxCheckpoint._save_checkpoint` of Keras' class instead of training (and
whose `StringLookup` needs TensorFlow, which this project does not install).
"""

from __future__ import annotations

import os

import jax
import keras
import numpy as np
import pytest

from shardckpt.training import OrbaxCheckpoint

DENSE, OUT, SAMPLES, PREDICT = 32, 16, 64, 8  # Keras' distributed-test sizes


def _two_dense_regressor(steps_per_execution: int = 1) -> keras.Model:
    inputs = keras.layers.Input(shape=(10,), name="input_layer")
    x = keras.layers.Dense(6, name="dense_layer")(inputs)
    outputs = keras.layers.Dense(2, name="output_layer")(x)
    model = keras.Model(inputs, outputs, name="test_model")
    model.compile(optimizer="adam", loss="mse", steps_per_execution=steps_per_execution)
    return model


def _data(n: int = 100, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 10)), rng.standard_normal((n, 2))


def _steps(directory) -> list[int]:
    return sorted(int(n) for n in os.listdir(directory) if n.isdigit())


def _assert_equal_lists(a, b) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f"array {i}")


@pytest.mark.parametrize("save_freq, epochs, batch_size, expected", [
    (10, 1, 5, [10]),            # 10 batches of 5: one save at batch 10
    ("epoch", 3, None, [2]),     # max_to_keep=1 (Keras' default) keeps the last epoch
])
def test_checkpoint_saving_basic(tmp_path, save_freq, epochs, batch_size, expected):
    model = _two_dense_regressor()
    x, y = _data(50)
    callback = OrbaxCheckpoint(directory=str(tmp_path / "c"), save_freq=save_freq)
    kwargs = {"batch_size": batch_size} if batch_size else {}
    model.fit(x, y, epochs=epochs, callbacks=[callback], verbose=0, **kwargs)
    assert os.listdir(tmp_path / "c") and _steps(tmp_path / "c") == expected


@pytest.mark.parametrize("mode", ["min", "max"])
def test_save_best_only(tmp_path, mode):
    model = _two_dense_regressor()
    x, y = _data(100)
    callback = OrbaxCheckpoint(directory=str(tmp_path / "c"), monitor="loss", save_best_only=True, mode=mode,
                               save_freq="epoch")
    model.fit(x, y, epochs=5, callbacks=[callback], verbose=0)
    losses = model.history.history["loss"]
    best = int(np.argmin(losses) if mode == "min" else np.argmax(losses))
    # Only improving epochs save, and max_to_keep=1 keeps the last of them: the best.
    assert _steps(tmp_path / "c") == [best]


@pytest.mark.parametrize("save_on_background", [False, True])
def test_async_vs_sync_saving(tmp_path, save_on_background):
    model = _two_dense_regressor()
    x, y = _data()
    callback = OrbaxCheckpoint(directory=str(tmp_path / "c"), save_freq="epoch",
                               save_on_background=save_on_background)
    model.fit(x, y, epochs=2, callbacks=[callback], verbose=0)
    assert _steps(tmp_path / "c") == [1]
    assert len(callback.save_blocking_s) == 2


def test_max_to_keep(tmp_path):
    model = _two_dense_regressor()
    x, y = _data()
    callback = OrbaxCheckpoint(directory=str(tmp_path / "c"), save_freq="epoch", max_to_keep=2)
    model.fit(x, y, epochs=5, callbacks=[callback], verbose=0)
    assert _steps(tmp_path / "c") == [3, 4]


def test_default_max_to_keep_is_keras_one():
    assert OrbaxCheckpoint("unused").max_to_keep == 1
    assert keras.callbacks.OrbaxCheckpoint("unused").max_to_keep == 1
    assert OrbaxCheckpoint("unused").resume is False


def test_load_weights_from_orbax_checkpoint(tmp_path):
    model = _two_dense_regressor()
    x, y = _data()
    callback = OrbaxCheckpoint(directory=str(tmp_path / "c"), save_freq="epoch", save_weights_only=True)
    model.fit(x, y, epochs=1, callbacks=[callback], verbose=0)
    original = model.get_weights()
    new_model = _two_dense_regressor()
    new_model.set_weights([w * 2 for w in original])
    for o, n in zip(original, new_model.get_weights()):
        assert not np.array_equal(o, n)
    new_model.load_weights(str(tmp_path / "c"))
    _assert_equal_lists(new_model.get_weights(), original)


def test_save_freq_epoch(tmp_path):
    model = _two_dense_regressor()
    x, y = _data()
    callback = OrbaxCheckpoint(directory=str(tmp_path / "c"), save_freq="epoch")
    model.fit(x, y, epochs=3, callbacks=[callback], verbose=0)
    # Exactly one checkpoint, named by its epoch, as Keras' default keeps.
    assert os.listdir(tmp_path / "c") == ["2"]


def test_invalid_save_freq(tmp_path):
    with pytest.raises(ValueError, match="save_freq"):
        OrbaxCheckpoint(directory=str(tmp_path / "c"), save_freq="invalid")


def test_initial_value_threshold(tmp_path):
    model = _two_dense_regressor()
    x, y = _data()
    callback = OrbaxCheckpoint(directory=str(tmp_path / "c"), monitor="loss", save_best_only=True, mode="min",
                               initial_value_threshold=1.0, save_freq="epoch")
    model.fit(x, y, epochs=3, callbacks=[callback], verbose=0)
    assert os.path.exists(tmp_path / "c")
    losses = model.history.history["loss"]
    improving = [e for e, loss in enumerate(losses) if loss < min([1.0] + losses[:e])]
    assert _steps(tmp_path / "c") == improving[-1:]


@pytest.mark.parametrize("save_on_background", [False, True])
def test_checkpoint_loading_comprehensive(tmp_path, save_on_background):
    model = _two_dense_regressor()
    x, y = _data(200)
    callback = OrbaxCheckpoint(directory=str(tmp_path / "c"), save_freq="epoch",
                               save_on_background=save_on_background, save_weights_only=True)
    model.fit(x, y, epochs=1, callbacks=[callback], verbose=0)
    original = model.get_weights()
    new_model = _two_dense_regressor()
    nx, ny = _data(10, seed=1)
    new_model.fit(nx, ny, epochs=1, batch_size=5, verbose=0)
    new_model.set_weights([w * 2 for w in original])
    new_model.load_weights(str(tmp_path / "c"))
    _assert_equal_lists(new_model.get_weights(), original)


def _layout_map(mesh, *names) -> keras.distribution.LayoutMap:
    layout_map = keras.distribution.LayoutMap(mesh)
    for name in names:
        layout_map[f"{name}/kernel"] = keras.distribution.TensorLayout(axes=(None, "data"))
        layout_map[f"{name}/bias"] = keras.distribution.TensorLayout(axes=("data",))
    return layout_map


def _distributed_model() -> keras.Model:
    inputs = keras.layers.Input(shape=(10,), name="input_layer")
    h = keras.layers.Dense(DENSE, name="dense_layer")(inputs)
    outputs = keras.layers.Dense(OUT, name="output_layer")(h)
    model = keras.Model(inputs, outputs, name="test_model")
    model.compile(optimizer="adam", loss="mse")
    return model


def _fit_sharded(tmp_path, seed: int):
    """Both kernels sharded over all devices; 2 epochs of fit with a checkpoint after each into tmp_path/c."""
    mesh = keras.distribution.DeviceMesh((len(jax.devices()),), axis_names=["data"])
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=_layout_map(mesh, "dense_layer", "output_layer")))
    model = _distributed_model()
    rng = np.random.default_rng(seed)
    x, y = rng.standard_normal((SAMPLES, 10)), rng.standard_normal((SAMPLES, OUT))
    callback = OrbaxCheckpoint(directory=str(tmp_path / "c"), save_freq="epoch")
    model.fit(x, y, epochs=2, callbacks=[callback], verbose=0)
    return mesh, model, x


def test_distributed_checkpoint_functionality(tmp_path):
    _, model, x = _fit_sharded(tmp_path, seed=3)
    predictions = model.predict(x[:PREDICT], verbose=0)
    loaded = keras.saving.load_model(str(tmp_path / "c"))
    _assert_equal_lists(loaded.get_weights(), model.get_weights())
    _assert_equal_lists([v.value for v in loaded.optimizer.variables], [v.value for v in model.optimizer.variables])
    np.testing.assert_array_equal(loaded.predict(x[:PREDICT], verbose=0), predictions)
    assert loaded.name == model.name and len(loaded.layers) == len(model.layers) and loaded.compiled
    assert type(keras.distribution.distribution()) is keras.distribution.ModelParallel
    loaded_shardings = {v.path: v.value.sharding for v in loaded.variables}
    for v in model.variables:
        assert loaded_shardings[v.path] == v.value.sharding, v.path
    assert model.get_layer("dense_layer").kernel.value.sharding.spec == jax.sharding.PartitionSpec(None, "data")


def test_distributed_checkpoint_resharding(tmp_path):
    mesh, model, x = _fit_sharded(tmp_path, seed=4)
    weights = model.get_weights()
    predictions = model.predict(x[:PREDICT], verbose=0)
    # Layout B: only output_layer sharded.
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=_layout_map(mesh, "output_layer")))
    loaded = keras.saving.load_model(str(tmp_path / "c"))
    _assert_equal_lists(loaded.get_weights(), weights)
    np.testing.assert_allclose(loaded.predict(x[:PREDICT], verbose=0), predictions, rtol=1e-5, atol=1e-6)
    assert loaded.name == model.name and loaded.compiled
    assert loaded.get_layer("dense_layer").kernel.value.sharding.is_fully_replicated
    assert loaded.get_layer("output_layer").kernel.value.sharding.spec == jax.sharding.PartitionSpec(None, "data")


def test_checkpoint_loading_via_saving_api(tmp_path):
    model = _two_dense_regressor()
    x, y = _data()
    callback = OrbaxCheckpoint(directory=str(tmp_path / "full"), save_freq="epoch")
    model.fit(x, y, epochs=1, callbacks=[callback], verbose=0)
    weights = model.get_weights()
    loaded = keras.saving.load_model(str(tmp_path / "full"))
    _assert_equal_lists(loaded.get_weights(), weights)
    assert loaded.compiled
    weights_callback = OrbaxCheckpoint(directory=str(tmp_path / "weights"), save_freq="epoch", save_weights_only=True)
    model.fit(x, y, epochs=1, callbacks=[weights_callback], verbose=0)
    with pytest.raises(ValueError):
        keras.saving.load_model(str(tmp_path / "weights"))


@keras.saving.register_keras_serializable(package="shardckpt_test")
class CustomLayer(keras.layers.Layer):
    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units = units

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], self.units), name="kernel")
        self.moving_mean = self.add_weight(shape=(self.units,), trainable=False, name="moving_mean")
        super().build(input_shape)

    def call(self, inputs):
        return inputs @ self.kernel

    def get_config(self):
        return {**super().get_config(), "units": self.units}


@pytest.mark.parametrize("save_on_background", [False, True])
def test_comprehensive_model_state_restoration(tmp_path, save_on_background):
    keras.utils.set_random_seed(42)
    inputs = keras.layers.Input(shape=(10,), name="input_layer")
    h = keras.layers.Dense(8, name="dense_layer")(inputs)
    outputs = CustomLayer(2, name="custom_layer")(h)
    model = keras.Model(inputs, outputs, name="comprehensive_test_model")
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    x, y = _data(100)
    callback = OrbaxCheckpoint(directory=str(tmp_path / "c"), save_freq="epoch",
                               save_on_background=save_on_background)
    model.fit(x, y, epochs=2, verbose=0, callbacks=[callback])
    loaded = keras.saving.load_model(str(tmp_path / "c"))
    assert loaded.name == model.name and len(loaded.layers) == len(model.layers) and loaded.compiled
    _assert_equal_lists(loaded.get_weights(), model.get_weights())
    _assert_equal_lists([v.value for v in loaded.optimizer.variables], [v.value for v in model.optimizer.variables])


@pytest.mark.parametrize("steps_per_execution", [1, 2])
def test_training_resumption(tmp_path, steps_per_execution):
    """A second fit on a reloaded model trains and saves new steps (no auto-resume)."""
    model = _two_dense_regressor(steps_per_execution)
    x, y = _data(50)
    directory = str(tmp_path / "c")
    oc1 = OrbaxCheckpoint(directory, save_freq=1, max_to_keep=10)
    model.fit(x, y, epochs=2, batch_size=25, callbacks=[oc1], verbose=0)
    first = _steps(directory)
    assert first == ([1, 2, 3, 4] if steps_per_execution == 1 else [2, 4])
    reloaded = keras.saving.load_model(directory)
    _assert_equal_lists(reloaded.get_weights(), model.get_weights())
    oc2 = OrbaxCheckpoint(directory, save_freq=1, max_to_keep=10)
    reloaded.fit(x, y, epochs=1, batch_size=25, callbacks=[oc2], verbose=0)
    assert oc2.resumed is None and reloaded.history.epoch == [0]
    second = _steps(directory)
    assert len(second) > len(first)
    # Steps count on from the optimizer's iterations, as Keras names them.
    assert second == first + ([5, 6] if steps_per_execution == 1 else [6])
