"""LoRA models exported to every format store one function: merged kernels, no factors.

Keras' own `save_weights` is the reference: it stores each LoRA layer's
merged kernel (base + A @ B * alpha / rank) and no factors, and its
`load_weights` zeroes the factors of the model it loads into. Exports of a
sharded LoRA model to safetensors and Orbax read back, into the same LoRA
architecture (lazily built, or built with trained factors) and into a
plain one, give outputs bit-equal to that reference.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

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


def _build(lora: bool) -> keras.Model:
    tokens = keras.Input((8,), dtype="int32")
    x = keras.layers.Embedding(32, 16, name="embed")(tokens)
    x = keras.layers.Dense(32, name="up")(x)
    x = keras.layers.EinsumDense("btd,dh->bth", (None, 16), bias_axes="h", name="mix")(x)
    x = keras.layers.Dense(32, name="head")(x)
    model = keras.Model(tokens, x)
    if lora:
        for name in LORA:
            model.get_layer(name).enable_lora(2, lora_alpha=3)
    return model


def _randomize(model: keras.Model, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for v in model.weights:
        v.assign(rng.standard_normal(v.shape).astype("float32") * 0.1)


@pytest.fixture
def trained(tmp_path):
    """A sharded LoRA model with trained factors, exported; Keras' references."""
    model_parallel(RULES)
    model = _build(lora=True)
    _randomize(model, 3)
    reference_h5 = str(tmp_path / "keras.weights.h5")
    model.save_weights(reference_h5)
    out = {"model": model, "output": np.asarray(model(TOKENS)), "h5": reference_h5}
    for fmt in ("safetensors", "orbax"):
        report = shardckpt.export(model, tmp_path / fmt, format=fmt)
        assert report.arrays == 7  # embeddings, 3 kernels, 3 biases: no factor
        out[fmt] = str(tmp_path / fmt / "model.safetensors") if fmt == "safetensors" else str(tmp_path / fmt)
    # Keras' own round trip: the merged .weights.h5 into a LoRA model and into a plain one.
    for lora in (True, False):
        model_parallel(RULES)
        ref = _build(lora)
        _randomize(ref, 5)
        ref.load_weights(reference_h5)
        out[f"keras_lora={lora}"] = np.asarray(ref(TOKENS))
    return out


@pytest.mark.parametrize("fmt", ["safetensors", "orbax"])
def test_lora_export_stores_merged_kernels_without_factors(trained, fmt):
    info = shardckpt.inspect(trained[fmt])
    names = [a.key for a in info.arrays]
    assert len(names) == 7
    assert not [n for n in names if "lora" in n], names
    model = trained["model"]
    plain_dist = model_parallel(RULES)
    plain = _build(lora=False)
    _randomize(plain, 7)
    shardckpt.load_sharded(plain, trained[fmt])
    for layer in LORA:
        src = model.get_layer(layer)
        merged = src.kernel if hasattr(src, "_kernel") else src.embeddings
        dst = plain.get_layer(layer)
        got = dst.kernel if hasattr(dst, "_kernel") else dst.embeddings
        np.testing.assert_array_equal(np.asarray(got), np.asarray(merged), err_msg=layer)
    np.testing.assert_array_equal(np.asarray(plain(TOKENS)), trained["keras_lora=False"])
    for v in plain.weights:
        assert v.value.sharding.is_equivalent_to(plain_dist.get_variable_layout(v).backend_layout, v.ndim), v.path


@pytest.mark.parametrize("fmt", ["safetensors", "orbax"])
def test_lora_export_reads_back_into_a_lazy_lora_model_exactly(trained, fmt):
    model_parallel(RULES)
    with shardckpt.lazy_init():
        model = _build(lora=True)
    report = shardckpt.load_sharded(model, trained[fmt])
    assert report.missing == [] and report.unexpected == []
    assert len(report.initialized) == 2 * len(LORA)  # factors: enable_lora's A, B zeros
    for layer in LORA:
        b = model.get_layer(layer)
        b = b.lora_kernel_b if hasattr(b, "lora_kernel_b") else b.lora_embeddings_b
        np.testing.assert_array_equal(np.asarray(b.value), np.zeros(b.shape, "float32"))
    np.testing.assert_array_equal(np.asarray(model(TOKENS)), trained["keras_lora=True"])
    np.testing.assert_allclose(np.asarray(model(TOKENS)), trained["output"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["safetensors", "orbax", "h5"])
def test_lora_export_into_a_trained_lora_model_zeroes_its_factors_as_keras(trained, fmt):
    """A built LoRA model with factors of its own: LoRA must not be applied on top of merged kernels."""
    model_parallel(RULES)
    model = _build(lora=True)
    _randomize(model, 11)
    report = shardckpt.load_sharded(model, trained[fmt])
    assert sorted(report.lora_zeroed) == sorted(
        v.path for v in model.weights if "lora" in v.path
    )
    np.testing.assert_array_equal(np.asarray(model(TOKENS)), trained["keras_lora=True"])


def _llama(lora: bool) -> keras.Model:
    import keras_hub

    backbone = keras_hub.models.Llama3Backbone(
        vocabulary_size=64, num_layers=2, num_query_heads=4, num_key_value_heads=2, hidden_dim=32,
        intermediate_dim=64)
    if lora:
        backbone.enable_lora(2)
    return backbone


LLAMA_INPUTS = {"token_ids": TOKENS, "padding_mask": np.ones_like(TOKENS)}


@pytest.fixture(scope="module")
def llama_exports(tmp_path_factory):
    """A keras-hub Llama 3 backbone with trained LoRA factors, exported to every format; Keras' references."""
    pytest.importorskip("keras_hub")
    tmp = tmp_path_factory.mktemp("llama_lora")
    keras.distribution.set_distribution(None)
    keras.backend.clear_session()
    model = _llama(lora=True)
    _randomize(model, 3)
    h5 = str(tmp / "keras.weights.h5")
    model.save_weights(h5)
    paths = {}
    for fmt in ("hf", "keras-hub", "safetensors", "orbax"):
        shardckpt.export(model, tmp / fmt, format=fmt)
        paths[fmt] = str(tmp / fmt / "model.safetensors") if fmt == "safetensors" else str(tmp / fmt)
    refs = {}
    for lora in (True, False):
        ref = _llama(lora)
        ref.load_weights(h5)
        refs[lora] = np.asarray(ref(LLAMA_INPUTS))
    return paths, refs


@pytest.mark.parametrize("lora", [True, False], ids=["into_lora", "into_plain"])
@pytest.mark.parametrize("fmt", ["hf", "keras-hub", "safetensors", "orbax"])
def test_keras_hub_lora_export_round_trips_equal_keras_h5(llama_exports, fmt, lora):
    """Every format, into the same LoRA architecture (lazily built) and a plain one: Keras' h5 round trip's output.

    keras-hub's enable_lora freezes the whole backbone, so its Orbax keys sit under
    non_trainable_variables/ while a plain model's sit under trainable_variables/: load_sharded
    matches them by path whichever collection.
    """
    paths, refs = llama_exports
    with shardckpt.lazy_init():
        model = _llama(lora)
    # Lazily built, 8 devices, no distribution: say where (replicated), as load_sharded requires.
    report = shardckpt.load_sharded(model, paths[fmt], layout=keras.distribution.DataParallel())
    assert report.missing == [] and report.unexpected == [], report
    assert len([p for p in report.initialized if "lora" in p]) == (2 * 2 * 2 if lora else 0)
    np.testing.assert_array_equal(np.asarray(model(LLAMA_INPUTS)), refs[lora])
