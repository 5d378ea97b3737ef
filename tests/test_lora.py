"""LoRA-enabled models built under lazy_init(): Keras' merged kernel goes into `kernel`.

Keras saves a LoRA layer's kernel merged (base + A @ B * alpha / rank) and not
the factors. shardckpt loads the merged kernel into the base kernel and gives
the factors `enable_lora`'s initialisation (A random, B zeros): the model
computes exactly what Keras' own `load_weights` gives, and LoRA can be trained
on (Keras zeroes A too, which leaves both factors with zero gradients).
"""

from __future__ import annotations

import jax
import keras
import numpy as np

import shardckpt
from tests.zoo import model_parallel

RULES = {
    "embed/embeddings": ("model", None),
    "up/kernel": (None, "model"),
    "mix/kernel": ("model", None),
    "head/kernel": (None, "model"),
}
LORA = ("embed", "up", "mix")
TOKENS = np.arange(16, dtype="int32").reshape(2, 8) % 32


def _build():
    tokens = keras.Input((8,), dtype="int32")
    x = keras.layers.Embedding(32, 16, name="embed")(tokens)
    x = keras.layers.Dense(32, name="up")(x)
    x = keras.layers.EinsumDense("btd,dh->bth", (None, 16), bias_axes="h", name="mix")(x)
    x = keras.layers.Dense(32, name="head")(x)
    model = keras.Model(tokens, x)
    for name in LORA:
        model.get_layer(name).enable_lora(2)
    return model


def _saved(tmp_path):
    """A LoRA model with random base and factors, saved by Keras (merged kernels)."""
    keras.backend.clear_session()
    model = _build()
    rng = np.random.default_rng(3)
    for v in model.weights:
        v.assign(rng.standard_normal(v.shape).astype("float32") * 0.1)
    path = str(tmp_path / "lora.weights.h5")
    model.save_weights(path)
    return path, np.asarray(model(TOKENS))


def test_lazy_lora_model_loads_merged_kernels_exactly(tmp_path):
    path, saved_output = _saved(tmp_path)
    # Keras' own loading into a normally built LoRA model, same distribution.
    dist = model_parallel(RULES)
    reference = _build()
    reference.load_weights(path)
    want = {v.path: np.asarray(v.value) for v in reference.weights}
    want_output = np.asarray(reference(TOKENS))

    dist = model_parallel(RULES)
    with shardckpt.lazy_init():
        model = _build()
    report = shardckpt.load_sharded(model, path)
    factors = [v.path for v in model.weights if "lora" in v.path]
    assert len(factors) == 2 * len(LORA) and sorted(report.initialized) == sorted(factors)
    assert report.missing == [] and report.unexpected == []
    for v in model.weights:
        assert v.value.sharding.is_equivalent_to(dist.get_variable_layout(v).backend_layout, v.ndim), v.path
        got = np.asarray(v.value)
        if "lora_kernel_b" in v.path or "lora_embeddings_b" in v.path:
            np.testing.assert_array_equal(got, np.zeros_like(got), err_msg=v.path)
        elif "lora" in v.path:  # A: enable_lora's he_uniform, not zeros
            assert got.std() > 0 and np.abs(got).max() <= np.sqrt(6 / got.shape[0]), v.path
        else:  # base kernels hold Keras' merged kernels, bit for bit
            np.testing.assert_array_equal(got, want[v.path], err_msg=v.path)
    up = model.get_layer("up")
    assert up._kernel.value.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    # The model computes exactly what Keras' loaded model computes, and the saved function.
    np.testing.assert_array_equal(np.asarray(model(TOKENS)), want_output)
    np.testing.assert_allclose(np.asarray(model(TOKENS)), saved_output, rtol=1e-5, atol=1e-5)

    # LoRA training goes on: B gets a gradient because A is not zero.
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(TOKENS, np.ones((2, 8, 32), "float32"), epochs=1, verbose=0)
    assert np.abs(np.asarray(up.lora_kernel_b.value)).max() > 0
