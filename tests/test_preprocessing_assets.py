"""Layers whose state is not in variables: a vocabulary kept as a Keras asset file, boundaries in the config.

An adapted `StringLookup` / `IntegerLookup` / `TextVectorization` keeps its
vocabulary in `vocabulary.txt` (its `save_assets`); a fresh instance of the
model has an empty one and maps every id to the out-of-vocabulary index.
Those Keras layers need TensorFlow, which this environment (JAX only) lacks,
so `VocabLookup` below is IntegerLookup's contract on JAX: the same
`save_assets` / `load_assets` (vocabulary in the config when given to the
constructor, in an asset file when adapted). `Discretization` (boundaries in
its config), `CategoryEncoding` and an adapted `Normalization` (variables,
`finalize_state`) sit beside it, on the 8-device `ModelParallel` mesh.
Outputs are compared bit for bit with the source model's and Keras' loaders'.
"""

from __future__ import annotations

import logging
import os

import jax.numpy as jnp
import keras
import numpy as np
import pytest
from jax.sharding import PartitionSpec
from keras import layers

import shardckpt

IDS = np.random.default_rng(0).integers(0, 40, (64, 5)).astype("int32")
NUM = np.random.default_rng(1).normal(3.0, 2.0, (64, 3)).astype("float32")
X = [IDS[:16], NUM[:16]]
Y = np.random.default_rng(2).normal(size=(16, 2)).astype("float32")


@keras.saving.register_keras_serializable("shardckpt_tests")
class VocabLookup(layers.Layer):
    """IntegerLookup on JAX: id -> 1 + its index in the vocabulary, 0 (OOV) otherwise.

    As Keras' lookup layers: a `vocabulary=` given to the constructor is in
    the config; one set by `adapt` (most frequent first) is an asset file.
    """

    def __init__(self, vocabulary: list[int] | None = None, **kwargs):
        super().__init__(**kwargs)
        self.input_vocabulary = vocabulary
        self.vocabulary = np.asarray(vocabulary if vocabulary is not None else [], "int32")

    def adapt(self, data: np.ndarray) -> None:
        values, counts = np.unique(np.asarray(data), return_counts=True)
        self.vocabulary = values[np.argsort(-counts, kind="stable")].astype("int32")

    def call(self, ids):
        if self.vocabulary.size == 0:
            return jnp.zeros_like(ids)
        hit = ids[..., None] == jnp.asarray(self.vocabulary)
        return jnp.where(hit.any(-1), jnp.argmax(hit, -1) + 1, 0).astype("int32")

    def compute_output_spec(self, ids):
        return keras.KerasTensor(ids.shape, "int32")

    def get_config(self):
        return {**super().get_config(), "vocabulary": self.input_vocabulary}

    def save_assets(self, dir_path):
        if self.input_vocabulary is None:
            with open(os.path.join(dir_path, "vocabulary.txt"), "w") as f:
                f.write("\n".join(str(int(v)) for v in self.vocabulary))

    def load_assets(self, dir_path):
        if self.input_vocabulary is None:
            with open(os.path.join(dir_path, "vocabulary.txt")) as f:
                self.vocabulary = np.asarray([int(line) for line in f.read().splitlines() if line], "int32")


def _model(*, adapt: bool, extra: bool = False) -> keras.Model:
    """ids (5) -> "look" (adapted vocabulary) -> Embedding "emb"; ids -> "fixed" (constructor
    vocabulary) -> Embedding "emb2"; num (3) -> Normalization "norm" (adapted) and Discretization
    "disc" (constructor boundaries) -> CategoryEncoding "cat"; -> Dense "hidden" (16) -> Dense "head" (2).
    `extra`: one more adaptable lookup "look3" (no variables) added to "look"'s ids times 0."""
    keras.utils.set_random_seed(3)
    ids = keras.Input((5,), dtype="int32", name="ids")
    num = keras.Input((3,), name="num")
    look = VocabLookup(name="look")
    norm = layers.Normalization(name="norm")
    looked = look(ids)
    if extra:
        looked = looked + VocabLookup(name="look3")(ids) * 0
    emb = layers.Embedding(41, 8, name="emb")(looked) + layers.Embedding(4, 8, name="emb2")(
        VocabLookup(vocabulary=[7, 3, 11], name="fixed")(ids)
    )
    counts = layers.CategoryEncoding(num_tokens=4, output_mode="count", name="cat")(
        layers.Discretization(bin_boundaries=[1.0, 3.0, 5.0], name="disc")(num)
    )
    h = layers.Concatenate()([layers.GlobalAveragePooling1D()(emb), norm(num), counts])
    h = layers.Dense(16, activation="relu", name="hidden")(h)
    model = keras.Model([ids, num], layers.Dense(2, name="head")(h), name="lookups")
    if adapt:
        look.adapt(IDS)
        norm.adapt(NUM)
    return model


def _on_mesh() -> None:
    mesh = keras.distribution.DeviceMesh((1, 8), ["data", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["emb/embeddings"] = (None, "model")
    layout_map["hidden/kernel"] = (None, "model")
    layout_map["head/kernel"] = ("model", None)
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="data"))


def _fresh(lazy: bool) -> keras.Model:
    if not lazy:
        return _model(adapt=False)
    with shardckpt.lazy_init():
        return _model(adapt=False)


def _out(model: keras.Model) -> np.ndarray:
    return np.asarray(model(X))


def _trained(tmp_path, fmt: str) -> tuple[keras.Model, str]:
    """The adapted model, trained one epoch when saved by a callback; the path its save wrote."""
    src = _model(adapt=True)
    if fmt == "keras":
        path = str(tmp_path / "m.keras")
        src.save(path)
        return src, path
    path = str(tmp_path / "ckpt")
    callback = (
        keras.callbacks.OrbaxCheckpoint(path, save_weights_only=False)
        if fmt == "orbax-keras"
        else shardckpt.OrbaxCheckpoint(path, save_weights_only=False)
    )
    src.compile(optimizer="adam", loss="mse")
    src.fit(X, Y, epochs=1, batch_size=16, verbose=0, callbacks=[callback])
    return src, path


@pytest.mark.parametrize("lazy", [True, False], ids=["lazy", "built"])
@pytest.mark.parametrize("fmt", ["keras", "orbax-keras", "orbax-shardckpt"])
def test_adapted_vocabulary_loads_as_load_model(tmp_path, fmt, lazy):
    """A `.keras` archive and full Orbax saves (Keras' and shardckpt's callbacks) carry the adapted
    vocabulary as an asset file: `load_sharded` into a fresh model (its vocabulary empty) on the
    8-device mesh computes bit-equal to the saved model and, for `.keras`, to Keras' `load_model`.
    Before, the vocabulary stayed empty and every id was out of vocabulary, without a word."""
    _on_mesh()
    src, path = _trained(tmp_path, fmt)
    want = _out(src)
    if fmt == "keras":
        np.testing.assert_array_equal(_out(keras.saving.load_model(path)), want)
    model = _fresh(lazy)
    assert model.get_layer("look").vocabulary.size == 0
    report = shardckpt.load_sharded(model, path)
    assert report.assets == ["layers/vocab_lookup/vocabulary.txt"]
    assert "\n  assets loaded: layers/vocab_lookup/vocabulary.txt" in str(report)  # the printed report says it
    np.testing.assert_array_equal(model.get_layer("look").vocabulary, src.get_layer("look").vocabulary)
    np.testing.assert_array_equal(_out(model), want)
    assert model.get_layer("hidden").kernel.value.sharding.spec == PartitionSpec(None, "model")


def test_restore_latest_and_resumed_fit_carry_the_vocabulary(tmp_path):
    """`restore_latest` of a full shardckpt step into a fresh compiled model loads the vocabulary, and
    one more epoch from there equals the source model's next epoch bit for bit."""
    _on_mesh()
    src, path = _trained(tmp_path, "orbax-shardckpt")
    model = _model(adapt=False)
    model.compile(optimizer="adam", loss="mse")
    shardckpt.restore_latest(model, path)
    np.testing.assert_array_equal(_out(model), _out(src))
    src.fit(X, Y, epochs=1, batch_size=16, verbose=0)
    model.fit(X, Y, epochs=1, batch_size=16, verbose=0)
    np.testing.assert_array_equal(_out(model), _out(src))


@pytest.mark.parametrize("lazy", [True, False], ids=["lazy", "built"])
def test_weights_file_without_vocabulary_warns_once(tmp_path, lazy, caplog):
    """A `.weights.h5` holds no asset file (Keras' `load_weights` is equally blind): the fresh model's
    outputs equal Keras' load_weights' (not worse), and one WARNING names the layer left with an empty
    vocabulary and the fix. Given its vocabulary (`adapt`) first, no warning and the saved outputs."""
    _on_mesh()
    src = _model(adapt=True)
    path = str(tmp_path / "m.weights.h5")
    src.save_weights(path)
    by_keras = _model(adapt=False)
    by_keras.load_weights(path)
    model = _fresh(lazy)
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        report = shardckpt.load_sharded(model, path)
    assert report.assets == []
    np.testing.assert_array_equal(_out(model), _out(by_keras))
    said = [r.getMessage() for r in caplog.records if "asset" in r.getMessage()]
    assert len(said) == 1 and "'look'" in said[0] and "'fixed'" not in said[0] and ".keras" in said[0], said

    caplog.clear()
    model = _fresh(lazy)
    model.get_layer("look").adapt(IDS)
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        shardckpt.load_sharded(model, path)
    assert not [r for r in caplog.records if "asset" in r.getMessage()]
    np.testing.assert_array_equal(_out(model), _out(src))


@pytest.mark.parametrize("how", ["convert", "export"])
def test_convert_and_export_to_orbax_carry_the_vocabulary(tmp_path, how):
    """`shardckpt.convert` of a `.keras` archive and `shardckpt.export(format="orbax")` write the asset
    files as the step's "assets" item (as Keras' full saves): a lazily built fresh model loads from the
    step bit-equal to the saved model. Before, the step held the arrays only (a warning, empty vocabulary)."""
    _on_mesh()
    src = _model(adapt=True)
    step = str(tmp_path / "step")
    if how == "convert":
        archive = str(tmp_path / "m.keras")
        src.save(archive)
        shardckpt.convert(archive, step)
    else:
        shardckpt.export(src, step, format="orbax")
    with shardckpt.lazy_init():
        model = _model(adapt=False)
    report = shardckpt.load_sharded(model, step)
    assert report.assets == ["layers/vocab_lookup/vocabulary.txt"]
    np.testing.assert_array_equal(_out(model), _out(src))


def test_stored_assets_a_layer_cannot_load_are_refused(tmp_path, caplog):
    """A model with one more adaptable lookup than the `.keras` archive (no variables: the weights
    match): Keras' walk gives the lookups the archive's folders by position, and the last finds
    none. strict=True raises `CheckpointMismatchError` naming it and the absent folder before any
    variable is loaded; strict=False loads the rest and warns once naming it."""
    src = _model(adapt=True)
    path = str(tmp_path / "m.keras")
    src.save(path)
    model = _model(adapt=False, extra=True)
    before = np.asarray(model.get_layer("hidden").kernel.value)
    with pytest.raises(shardckpt.errors.CheckpointMismatchError, match="load_assets failed") as raised:
        shardckpt.load_sharded(model, path)
    assert "the checkpoint's assets have not: layers/vocab_lookup_" in str(raised.value)
    np.testing.assert_array_equal(np.asarray(model.get_layer("hidden").kernel.value), before)
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        report = shardckpt.load_sharded(model, path, strict=False)
    said = [r.getMessage() for r in caplog.records if "load_assets failed" in r.getMessage()]
    assert len(said) == 1, said
    assert report.assets == ["layers/vocab_lookup/vocabulary.txt"]
    np.testing.assert_array_equal(np.asarray(model.get_layer("hidden").kernel.value), np.asarray(src.get_layer("hidden").kernel.value))
