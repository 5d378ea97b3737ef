"""Quantized models trained sharded with `OrbaxCheckpoint`, restored lazily into their plan.

Embedding, Dense and EinsumDense layers too small for a float8 amax history
(1024 long) to be the smaller of a layer's variables, quantized with Keras'
`quantize()` and made tensor-parallel with `parallelize`, then trained with
`OrbaxCheckpoint`; Keras' `save_weights` and `save` are taken at the same
point. A model built lazily with the user's policy gets it all back through
`restore_latest` (optimizer included) and `load_sharded` (`.weights.h5`,
`.keras`): every variable bit-equal, in the sharding its plan gives, scales
split with their kernel's output dimension or replicated with it, amax
histories and 0-d scales replicated, and outputs bit-equal.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import shardckpt
from tests.support import assert_training_state_equal, training_state

M = "model"
MODES = {
    # quantize() mode: the policy a user builds the quantized layers with
    "int8": "int8_from_float32",
    "int4": "int4/128_from_float32",  # quantize("int4")'s sub-channel default
    "float8": "float8_from_float32",
}
X = np.random.default_rng(0).integers(0, 64, (32, 8)).astype("int32")
Y = np.random.default_rng(1).standard_normal((32, 8)).astype("float32")


def _build(policy: str | None = None) -> keras.Model:
    inputs = keras.Input((8,), dtype="int32")
    # Keras has no float8 Embedding: that layer stays float in a float8 model.
    x = keras.layers.Embedding(64, 32, name="emb", dtype=None if policy and "float8" in policy else policy)(inputs)
    x = keras.layers.Dense(64, name="up", dtype=policy)(x)
    x = keras.layers.EinsumDense("bsf,fh->bsh", output_shape=(8, 32), name="proj", dtype=policy)(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    x = keras.layers.Dense(8, name="head", dtype=policy)(x)
    return keras.Model(inputs, x, name="q")


def _kernel_of(layer: keras.layers.Layer):
    return layer._embeddings if isinstance(layer, keras.layers.Embedding) else layer._kernel


def _assert_placed(model: keras.Model, plan: shardckpt.LayoutPlan) -> None:
    """Each variable where the plan puts it; scales split with their kernel's output dimension
    (an embedding's with its rows) or replicated with it; statistics replicated."""
    for v in model.weights:
        assert v.value.sharding.is_equivalent_to(plan.sharding_for(v), v.ndim), (v.path, v.value.sharding)
    for layer in model.layers:
        if not getattr(layer, "quantization_mode", None):
            continue
        kernel = _kernel_of(layer)
        kernel_axes = tuple(kernel.value.sharding.spec) + (None,) * kernel.ndim
        out_dim = 0 if isinstance(layer, keras.layers.Embedding) else kernel.ndim - 1
        for v in layer.weights:
            axes = tuple(v.value.sharding.spec) + (None,) * v.ndim
            name = v.path.rsplit("/", 1)[-1]
            if v.ndim == 0 or "amax_history" in name:
                assert v.value.sharding.is_fully_replicated, (v.path, v.value.sharding)
            elif name.endswith(("_scale", "_zero")):
                scale_dim = 0 if out_dim == 0 else v.ndim - 1
                assert (axes[scale_dim] == M) == (kernel_axes[out_dim] == M), (v.path, axes, kernel.path, kernel_axes)
                assert M not in axes[:scale_dim] + axes[scale_dim + 1 : v.ndim], (v.path, axes)


@pytest.mark.parametrize("mesh", [(1, 8), (2, 4)])
@pytest.mark.parametrize("mode", list(MODES))
def test_quantized_fit_checkpoints_restore_lazily_into_the_plan(mode, mesh, tmp_path):
    keras.utils.set_random_seed(0)
    model = _build()
    model.quantize(mode)
    if mode == "float8":  # non-default scales (amax histories move in training)
        rng = np.random.default_rng(2)
        for v in model.weights:
            if v.path.endswith("_scale"):
                v.assign(rng.uniform(0.5, 2.0, v.shape).astype("float32"))
    shardckpt.parallelize(model, mesh)
    model.compile(optimizer="adam", loss="mse")
    ckpt = shardckpt.OrbaxCheckpoint(str(tmp_path / "ckpt"), save_on_background=False)
    model.fit(X, Y, epochs=2, batch_size=8, verbose=0, callbacks=[ckpt])
    state = training_state(model)
    values = {v.path: np.asarray(v.value) for v in model.weights}
    want = np.asarray(model.predict(X, verbose=0))
    model.save_weights(str(tmp_path / "q.weights.h5"))
    model.save(str(tmp_path / "q.keras"))
    if mode == "float8":
        assert any(v.path.endswith("amax_history") and np.any(values[v.path]) for v in model.weights)

    for source in ("orbax", "q.weights.h5", "q.keras"):
        keras.backend.clear_session()
        keras.distribution.set_distribution(None)
        with shardckpt.lazy_init():
            restored = _build(MODES[mode])
        plan = shardckpt.parallelize(restored, mesh)
        if source == "orbax":
            restored.compile(optimizer="adam", loss="mse")
            restored.optimizer.build(restored.trainable_variables)
            info = shardckpt.restore_latest(restored, str(tmp_path / "ckpt"))
            assert info.epoch == 1
            assert_training_state_equal(restored, state)
        else:
            report = shardckpt.load_sharded(restored, str(tmp_path / source), layout=plan)
            assert not report.missing and not report.unexpected, source
        assert sorted(v.path for v in restored.weights) == sorted(values), source
        for v in restored.weights:
            got = np.asarray(v.value)
            assert got.dtype == values[v.path].dtype, (source, v.path)
            np.testing.assert_array_equal(got, values[v.path], err_msg=f"{source}: {v.path}")
        _assert_placed(restored, plan)
        np.testing.assert_array_equal(np.asarray(restored.predict(X, verbose=0)), want, err_msg=source)
    keras.distribution.set_distribution(None)


@pytest.mark.parametrize("mesh", [(1, 8), (2, 4)])
def test_float8_amax_histories_of_small_layers_are_replicated(mesh):
    """A 1024-long amax history outgrows the kernel of a small layer (head: 32 x 8); the planner
    split it "along its largest dimension" (it is never read by the forward pass) and took it
    for the layer's main weight. Replicated, as in larger layers."""
    with shardckpt.lazy_init():
        model = _build(MODES["float8"])
    plan = shardckpt.auto_layout(model, mesh)
    histories = [v for v in model.weights if "amax_history" in v.path]
    assert len(histories) == 9 and model.get_layer("head")._kernel.shape == (32, 8)
    for v in histories:
        assert plan.axes_for(v) == (None,), (v.path, plan[v.path].axes, plan[v.path].reason)
    # The kernels keep their split (the largest variable the forward pass reads is the kernel).
    assert plan.axes_for(model.get_layer("up")._kernel) == (None, M)


@pytest.mark.parametrize("mode", list(MODES))
def test_quantize_after_parallelize_names_quantize_and_the_order(mode):
    """`quantize()` on a model already planned adds variables the plan does not know (scales,
    amax histories, int4's packed kernel): refused while Keras creates the first one, naming the
    layer and the order that works (quantize, then plan), not "another architecture"."""
    keras.distribution.set_distribution(None)
    model = _build()
    shardckpt.parallelize(model, (2, 4))
    first = {"int8": "emb/embeddings_scale", "int4": "emb/embeddings", "float8": "up/inputs_amax_history"}[mode]
    with pytest.raises(shardckpt.errors.UnplannedVariableError, match=(
        rf"Variable '{first}' .*layer '{first.split('/')[0]}' was already built, so it comes from "
        r"model.quantize\(\) after the plan was made.*Fix: rebuild the model, quantize it, then plan it"
    )):
        model.quantize(mode)
    keras.distribution.set_distribution(None)


@pytest.mark.parametrize("source", ["f.weights.h5", "f.keras", "f.safetensors"])
def test_a_float_checkpoint_into_an_int8_model_says_quantize_after_loading(source, tmp_path):
    """The float kernel meets the int8 one (same key, same shape): refused, naming the variable
    and the way a float checkpoint becomes a quantized model (load, then `quantize()`)."""
    keras.distribution.set_distribution(None)
    model = _build()
    rng = np.random.default_rng(3)
    for v in model.weights:
        v.assign(rng.standard_normal(v.shape).astype("float32"))
    model.save_weights(str(tmp_path / "f.weights.h5"))
    model.save(str(tmp_path / "f.keras"))
    shardckpt.export(model, tmp_path / "st", format="safetensors")
    (tmp_path / "st" / "model.safetensors").rename(tmp_path / "f.safetensors")
    keras.backend.clear_session()
    with shardckpt.lazy_init():
        quantized = _build(MODES["int8"])
    plan = shardckpt.auto_layout(quantized, (2, 4))
    for strict in (True, False):
        with pytest.raises(shardckpt.errors.DtypeMismatchError, match=(
            r"Variable 'emb/embeddings': .*holds float32.*variable's int8.*build the model with its "
            r"float policy, load the float checkpoint, then call model.quantize\(mode\)"
        )):
            shardckpt.load_sharded(quantized, str(tmp_path / source), layout=plan, strict=strict)


@pytest.mark.parametrize("fmt", ["safetensors", "hf"])
@pytest.mark.parametrize("mode", ["int8", "float8"])
def test_export_of_a_quantized_model_is_refused_before_writing(mode, fmt, tmp_path):
    """README: a quantized model raises `UnsupportedModelError` naming its layers; float8 too,
    whose kernels are floats but whose scales and amax histories no reader dequantizes with."""
    keras.distribution.set_distribution(None)
    model = _build()
    model.quantize(mode)
    with pytest.raises(shardckpt.errors.UnsupportedModelError, match=(
        rf"is quantized \(.*up \({mode}\).*Fix: export the float model \(before `quantize\(\)`\)"
    )):
        shardckpt.export(model, tmp_path / "out", format=fmt)
    assert list(tmp_path.iterdir()) == []
