"""Restore paths checked against Keras' own loading where a user meets a silent difference."""

from __future__ import annotations

import logging

import keras
import numpy as np
import pytest

import shardckpt
from tests.zoo import model_parallel, save_as


def _bn_model(center: bool) -> keras.Model:
    """Input(8) -> Dense(16) -> BatchNormalization(center=center): `center=False` has no `beta`."""
    inputs = keras.Input((8,))
    x = keras.layers.Dense(16, name="d")(inputs)
    x = keras.layers.BatchNormalization(center=center, name="bn")(x)
    return keras.Model(inputs, x, name="m")


def _saved_with_beta(tmp_path, fmt: str) -> tuple[str, dict[str, np.ndarray]]:
    """A `center=True` model with distinct values in every variable, saved by Keras as `fmt`."""
    keras.backend.clear_session()
    src = _bn_model(center=True)
    rng = np.random.default_rng(7)
    for v in src.weights:
        v.assign(rng.standard_normal(v.shape).astype("float32"))
    src.get_layer("bn").moving_variance.assign(rng.uniform(1.0, 2.0, 16).astype("float32"))
    path = save_as(src, tmp_path, fmt)
    values = {v.path: np.asarray(v.value) for v in src.weights}
    keras.backend.clear_session()
    return path, values


@pytest.mark.parametrize("fmt", ["h5", "keras", "h5-sharded"])
def test_a_layer_saved_with_another_number_of_variables_is_not_loaded_by_position(tmp_path, fmt, caplog):
    """Keras saves a layer's variables by position (vars/0, vars/1, ...). A model whose
    BatchNormalization has no `beta` (center=False) against a checkpoint with one: position 1 is
    `beta` there and `moving_mean` here. strict=False loaded `beta` into `moving_mean` and
    `moving_mean` into `moving_variance`, saying only that vars/3 was not loaded; Keras'
    `load_weights(skip_mismatch=True)` skips the layer. Now no variable of that layer is loaded,
    the load says why, and the result equals Keras' bit for bit, in the layout's sharding."""
    path, saved = _saved_with_beta(tmp_path, fmt)

    reference = _bn_model(center=False)  # BatchNormalization's initializers are constants
    with pytest.warns(UserWarning, match="could not be loaded"):
        reference.load_weights(path, skip_mismatch=True)
    want = {v.path: np.asarray(v.value) for v in reference.weights}
    assert want["bn/moving_mean"].tolist() == [0.0] * 16  # Keras left the layer as built

    dist = model_parallel({"d/kernel": (None, "model"), "d/bias": ("model",)})
    with shardckpt.lazy_init():
        model = _bn_model(center=False)
    with pytest.raises(shardckpt.errors.CheckpointMismatchError, match="by position") as refused:
        shardckpt.load_sharded(model, path)
    assert "layers/batch_normalization/vars: 4 stored, 3 in the model" in str(refused.value)

    caplog.set_level(logging.WARNING, logger="shardckpt")
    report = shardckpt.load_sharded(model, path, strict=False)
    for v in model.weights:
        np.testing.assert_array_equal(np.asarray(v.value), want[v.path], err_msg=v.path)
        assert v.value.sharding.is_equivalent_to(dist.get_variable_layout(v).backend_layout, v.ndim), v.path
    np.testing.assert_array_equal(np.asarray(model.get_layer("d").kernel.value), saved["d/kernel"])
    assert report.miscounted == [
        "layers/batch_normalization/vars: 4 stored, 3 in the model (bn/gamma, bn/moving_mean, bn/moving_variance)"
    ]
    assert report.missing_paths == ["bn/gamma", "bn/moving_mean", "bn/moving_variance"]
    assert report.unexpected == [f"layers/batch_normalization/vars/{i}" for i in range(4)]
    assert sorted(report.initialized) == ["bn/gamma", "bn/moving_mean", "bn/moving_variance"]
    assert "stored by position in another number, not loaded: layers/batch_normalization/vars" in str(report)
    said = [r.getMessage() for r in caplog.records if r.name == "shardckpt" and r.levelno == logging.WARNING]
    assert len(said) == 1 and "layers/batch_normalization/vars: 4 stored, 3 in the model" in said[0]


def test_an_optimizer_saved_with_other_variables_is_skipped_whole_as_keras_does(tmp_path):
    """A `.weights.h5` of a trained model holds its optimizer's 6 variables by position; a model
    compiled with another learning rate and not yet trained has 2 (iteration, learning_rate).
    strict=False loaded the checkpoint's iteration count (6) and learning rate (0.01) over the
    compiled 0.5 and dropped the slots: half an optimizer. Keras' `load_weights` skips the whole
    optimizer with a warning; so does the load now, listing its variables in `report.kept`."""
    keras.backend.clear_session()
    src = _bn_model(center=True)
    src.compile(keras.optimizers.Adam(0.01), "mse")
    src.fit(np.ones((8, 8)), np.ones((8, 16)), batch_size=4, epochs=3, verbose=0)
    path = str(tmp_path / "trained.weights.h5")
    src.save_weights(path)
    keras.backend.clear_session()

    reference = _bn_model(center=True)
    reference.compile(keras.optimizers.Adam(0.5), "mse")
    with pytest.warns(UserWarning, match="Skipping variable loading for optimizer"):
        reference.load_weights(path)

    model = _bn_model(center=True)
    model.compile(keras.optimizers.Adam(0.5), "mse")
    with pytest.raises(shardckpt.errors.CheckpointMismatchError, match="optimizer is not built yet"):
        shardckpt.load_sharded(model, path)  # the advice to build it first is kept
    report = shardckpt.load_sharded(model, path, strict=False)
    for ours, theirs in zip(model.weights + model.optimizer.variables, reference.weights + reference.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(ours.value), np.asarray(theirs.value), err_msg=ours.path)
    assert int(np.asarray(model.optimizer.iterations.value)) == 0
    assert float(np.asarray(model.optimizer.learning_rate)) == 0.5
    assert report.kept == [v.path for v in model.optimizer.variables]
    assert report.miscounted == [f"optimizer/vars: 10 stored, 2 in the model ({', '.join(report.kept)})"]


def test_a_path_matching_several_layout_map_keys_is_a_typed_error_naming_it_and_the_fix_works(tmp_path):
    """Keras' `LayoutMap` lookup raised a bare `ValueError` for the first path two patterns
    match, from inside the load. Now every such path is named in one `LayoutError` before
    anything is read, and its fix (add the path itself as a key) loads in that key's sharding."""
    keras.backend.clear_session()
    src = _bn_model(center=True)
    path = save_as(src, tmp_path, "h5")
    kernel = np.asarray(src.get_layer("d").kernel.value)
    keras.backend.clear_session()
    with shardckpt.lazy_init():
        model = _bn_model(center=True)
    mesh = keras.distribution.DeviceMesh((2, 4), ["data", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*/kernel"] = (None, "model")
    layout_map["d/ker.*"] = ("model", None)
    with pytest.raises(shardckpt.errors.LayoutError, match="several LayoutMap keys") as refused:
        shardckpt.load_sharded(model, path, layout=layout_map)
    assert "'d/kernel' matches ['.*/kernel', 'd/ker.*']" in str(refused.value)
    assert str(refused.value).startswith("1 variable path(s)")
    assert all(shardckpt.lazy.is_unloaded(v) for v in model.weights)  # nothing was read

    layout_map["d/kernel"] = ("data", "model")  # the fix: the path itself as a key
    shardckpt.load_sharded(model, path, layout=layout_map)
    np.testing.assert_array_equal(np.asarray(model.get_layer("d").kernel.value), kernel)
    want = layout_map["d/kernel"].backend_layout
    assert model.get_layer("d").kernel.value.sharding.is_equivalent_to(want, 2)


def test_the_printed_report_names_the_optimizer_variables_a_weights_file_leaves_as_they_are(tmp_path):
    """A `.weights.h5` saved without an optimizer, loaded into a model trained a few steps: the
    optimizer keeps its 10 variables (iteration count 2, slots of other weights), as in Keras,
    whose `load_weights` warns "Skipping variable loading for optimizer". The printed report said
    only "Loaded 6 arrays"; it now lists them (`report.kept`), as it lists every other list."""
    keras.backend.clear_session()
    path = save_as(_bn_model(center=True), tmp_path, "h5")  # no optimizer: weights only
    keras.backend.clear_session()
    model = _bn_model(center=True)
    model.compile(keras.optimizers.Adam(0.01), "mse")
    model.fit(np.ones((8, 8)), np.ones((8, 16)), batch_size=4, epochs=1, verbose=0)
    before = {v.path: np.asarray(v.value) for v in model.optimizer.variables}
    keras_twin = _bn_model(center=True)
    keras_twin.compile(keras.optimizers.Adam(0.01), "mse")
    keras_twin.fit(np.ones((8, 8)), np.ones((8, 16)), batch_size=4, epochs=1, verbose=0)
    with pytest.warns(UserWarning, match="Skipping variable loading for optimizer"):
        keras_twin.load_weights(path)
    assert int(np.asarray(keras_twin.optimizer.iterations.value)) == 2  # Keras keeps them too
    report = shardckpt.load_sharded(model, path)
    for v in model.optimizer.variables:
        np.testing.assert_array_equal(np.asarray(v.value), before[v.path], err_msg=v.path)
    assert int(before[model.optimizer.iterations.path]) == 2
    assert report.kept == list(before)
    kept_line = "\n  optimizer/metric variables kept at their current values: " + ", ".join(list(before)[:8])
    assert kept_line + ", ... (10 total)" in str(report)
