"""Frozen or not, the same checkpoint: full-state Orbax steps match variables by path.

A state tree puts a variable under `trainable_variables/` or
`non_trainable_variables/` by its `trainable` flag, which users change between
runs: `enable_lora` freezes the base, a classifier is trained with
`backbone.trainable = False` and built again with the backbone trainable.
Values load by path on either side; optimizer slots follow trainability
(fresh for a variable that became trainable, skipped for one that became
frozen), said in one warning. `strict=False` that would fill (almost) nothing
raises instead of returning.
"""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest

import shardckpt
from shardckpt import errors

X = np.linspace(-1, 1, 8 * 8, dtype="float32").reshape(8, 8)
Y = np.linspace(1, -1, 8 * 4, dtype="float32").reshape(8, 4)


def _mlp(*, frozen=(), lora=(), compile=True):
    inputs = keras.Input((8,))
    x = keras.layers.Dense(16, name="base_a")(inputs)
    x = keras.layers.Dense(16, name="base_b")(x)
    model = keras.Model(inputs, keras.layers.Dense(4, name="head")(x))
    for name in frozen:
        model.get_layer(name).trainable = False
    for name in lora:
        layer = model.get_layer(name)
        layer.trainable = True
        layer.enable_lora(2)
    if compile:
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def _train(directory, writer, **flags):
    model = _mlp(**flags)
    if writer == "keras":
        callback = keras.callbacks.OrbaxCheckpoint(str(directory), save_freq="epoch")
    else:
        callback = shardckpt.OrbaxCheckpoint(str(directory), save_freq="epoch")
    model.fit(X, Y, epochs=2, batch_size=4, verbose=0, shuffle=False, callbacks=[callback])
    callback.wait_until_finished()
    weights = {v.path: np.asarray(v.value) for v in model.weights}
    slots = {v.path: np.asarray(v.value) for v in model.optimizer.variables}
    return weights, slots


def _values(variables):
    return {v.path: np.asarray(v.value) for v in variables}


def _trainability_warnings(record):
    return [w for w in record if "changed their trainable flag" in str(w.message)]


@pytest.mark.parametrize("writer", ["keras", "shardckpt"])
def test_frozen_base_resumes_into_trainable_model_slots_fresh(tmp_path, writer):
    """Saved with the base frozen, resumed (strict) with everything trainable."""
    weights, slots = _train(tmp_path / "ck", writer, frozen=("base_a", "base_b"))
    assert not any("base_" in k for k in slots)  # frozen: no slots saved
    keras.backend.clear_session()
    model = _mlp()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        info = shardckpt.restore_latest(model, tmp_path / "ck")
    for path, value in _values(model.weights).items():
        np.testing.assert_array_equal(value, weights[path], err_msg=path)
    restored = _values(model.optimizer.variables)
    fresh = sorted(p for p in restored if "base_" in p)
    assert len(fresh) == 8  # momentum and velocity of 2 kernels and 2 biases
    for path in fresh:
        np.testing.assert_array_equal(restored[path], 0.0, err_msg=path)
    for path, value in slots.items():
        np.testing.assert_array_equal(restored[path], value, err_msg=path)
    [said] = _trainability_warnings(record)
    assert "trainable now, frozen in the checkpoint" in str(said.message)
    assert "8 optimizer slot(s) are not in it and start fresh" in str(said.message)
    assert info.report.missing == [] and info.report.unexpected == []
    model.fit(X, Y, epochs=1, batch_size=4, verbose=0)  # trains on


@pytest.mark.parametrize("writer", ["keras", "shardckpt"])
def test_full_finetune_resumes_into_lora_model_slots_skipped(tmp_path, writer):
    """Saved fully trainable, loaded into a LoRA model (base frozen): values by path."""
    weights, slots = _train(tmp_path / "ck", writer)
    keras.backend.clear_session()
    with shardckpt.lazy_init():
        model = _mlp(frozen=("base_a", "base_b"), lora=("base_b",), compile=False)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.optimizer.build(model.trainable_variables)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        # Lazily built, 8 devices, no distribution: say where (replicated), as load_sharded requires.
        report = shardckpt.load_sharded(model, tmp_path / "ck", strict=False, layout=keras.distribution.DataParallel())
    for v in model.weights:
        if "lora" not in v.path:
            np.testing.assert_array_equal(np.asarray(v.value), weights[v.path], err_msg=v.path)
    assert sorted(v.path for v in model.trainable_variables if "lora" in v.path) == [
        "base_b/lora_kernel_a", "base_b/lora_kernel_b"]
    # The checkpoint holds base_b's kernel and no factors, as a merged-kernel one does
    # (Keras' save_weights): the factors are not looked for; lazily built, they get
    # enable_lora's initialisation (B zeros, so the model computes the checkpoint's
    # function). Their optimizer slots are new: missing.
    assert sorted(report.missing) == sorted(
        f"adam/base_b_lora_kernel_{f}_{s} (key 'optimizer_variables/adam/base_b_lora_kernel_{f}_{s}')"
        for f in "ab" for s in ("momentum", "velocity")
    ) and report.unexpected == []
    assert sorted(p for p in report.initialized if "lora" in p) == ["base_b/lora_kernel_a", "base_b/lora_kernel_b"]
    assert report.lora_zeroed == []
    np.testing.assert_array_equal(np.asarray(model.get_layer("base_b").lora_kernel_b.value), 0.0)
    assert [k for k in report.skipped if "base_" in k] == [
        f"optimizer_variables/adam/{name}_{slot}"
        for name in ("base_a_bias", "base_a_kernel", "base_b_kernel")  # base_b's bias trains on
        for slot in ("momentum", "velocity")
    ]
    [said] = _trainability_warnings(record)
    assert "frozen now, trainable in the checkpoint" in str(said.message)
    restored = _values(model.optimizer.variables)
    for path in ("adam/head_kernel_momentum", "adam/head_bias_velocity", "adam/iteration"):
        np.testing.assert_array_equal(restored[path], slots[path], err_msg=path)


def test_lora_run_loads_into_model_before_enable_lora(tmp_path):
    """A LoRA run (every layer frozen but the LoRA one), loaded into the model
    built again before `enable_lora`: every base weight by path, factors reported."""
    weights, _ = _train(tmp_path / "ck", "shardckpt", frozen=("base_a", "base_b", "head"), lora=("base_b",))
    keras.backend.clear_session()
    model = _mlp()
    with pytest.warns(UserWarning, match="changed their trainable flag"):
        report = shardckpt.load_sharded(model, tmp_path / "ck", strict=False)
    assert report.arrays >= 6
    for v in model.weights:
        np.testing.assert_array_equal(np.asarray(v.value), weights[v.path], err_msg=v.path)
    assert [k for k in report.unexpected if not k.startswith("optimizer_variables/")] == [
        "trainable_variables/base_b/lora_kernel_a", "trainable_variables/base_b/lora_kernel_b"]


def _bert_classifier(*, frozen):
    keras_hub = pytest.importorskip("keras_hub")
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=64, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32,
        max_sequence_length=16,
    )
    task = keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=3, preprocessor=None)
    backbone.trainable = not frozen
    task.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy")
    return task


def test_bert_classifier_trained_with_frozen_backbone_resumes_unfrozen(tmp_path):
    task = _bert_classifier(frozen=True)
    x = {
        "token_ids": np.arange(4 * 16, dtype="int32").reshape(4, 16) % 64,
        "segment_ids": np.zeros((4, 16), "int32"),
        "padding_mask": np.ones((4, 16), "int32"),
    }
    callback = shardckpt.OrbaxCheckpoint(str(tmp_path / "ck"), save_freq="epoch")
    task.fit(x, np.array([0, 1, 2, 1]), epochs=1, batch_size=2, verbose=0, callbacks=[callback])
    callback.wait_until_finished()
    weights = _values(task.weights)
    keras.backend.clear_session()
    again = _bert_classifier(frozen=False)
    # Compiled metrics (keras-hub's "auto": accuracy) have no variables before the first fit.
    with pytest.raises(errors.CheckpointMismatchError) as error:
        shardckpt.restore_latest(again, tmp_path / "ck")
    assert error.value.unexpected == [
        "metrics_variables/sparse_categorical_accuracy/count", "metrics_variables/sparse_categorical_accuracy/total"]
    fix = str(error.value).split("Fix: ", 1)[1]
    assert "no variables until the first fit/evaluate" in fix and "clear_session" not in fix
    with pytest.warns(UserWarning, match="start fresh"):
        info = shardckpt.restore_latest(again, tmp_path / "ck", strict=False)
    assert info.report.arrays >= len(weights)
    for v in again.weights:
        np.testing.assert_array_equal(np.asarray(v.value), weights[v.path], err_msg=v.path)


def test_strict_false_loading_nothing_raises(tmp_path):
    _train(tmp_path / "ck", "shardckpt")
    keras.backend.clear_session()
    inputs = keras.Input((8,))
    other = keras.Model(inputs, keras.layers.Dense(4, name="elsewhere")(inputs))
    before = _values(other.weights)
    with pytest.raises(errors.CheckpointMismatchError, match=r"would load 0 of the model's 2 weights") as info:
        shardckpt.load_sharded(other, tmp_path / "ck", strict=False)
    assert "strict=False is for a few differing variables" in str(info.value)
    assert "elsewhere/kernel (key 'trainable_variables/elsewhere/kernel')" in info.value.missing
    for path, value in _values(other.weights).items():
        np.testing.assert_array_equal(value, before[path])  # untouched


def test_strict_false_loading_under_half_raises(tmp_path):
    _train(tmp_path / "ck", "shardckpt")
    keras.backend.clear_session()
    inputs = keras.Input((8,))
    x = keras.layers.Dense(16, name="base_a")(inputs)  # 576 of 8,768 bytes match
    other = keras.Model(inputs, keras.layers.Dense(128, name="wide")(x))
    with pytest.raises(errors.CheckpointMismatchError, match=r"would load 2 of the model's 4 weights \(6% "):
        shardckpt.load_sharded(other, tmp_path / "ck", strict=False)


def test_unbuilt_optimizer_error_says_build_it(tmp_path):
    _train(tmp_path / "ck", "shardckpt")
    keras.backend.clear_session()
    model = _mlp()
    assert not model.optimizer.built
    with pytest.raises(errors.CheckpointMismatchError) as info:
        shardckpt.load_sharded(model, tmp_path / "ck")
    fix = str(info.value).split("Fix: ", 1)[1]
    assert "model.optimizer.build(model.trainable_variables)" in fix
    assert "restore_latest" in fix
    assert "clear_session" not in fix and "name the model" not in fix
    model.optimizer.build(model.trainable_variables)  # the fix, followed
    shardckpt.load_sharded(model, tmp_path / "ck", strict=False)
