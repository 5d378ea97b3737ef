"""Small real Keras models covering the layer types the restore engine must handle."""

from __future__ import annotations

import os

import keras
import numpy as np
import safetensors.numpy as stnp
from keras import layers


@keras.saving.register_keras_serializable("shardckpt_tests")
class Int8Table(layers.Layer):
    """A layer with an int8 and a float variable (like a quantized lookup)."""

    def build(self, input_shape):
        self.table = self.add_weight(
            shape=(16, 8), initializer="zeros", dtype="int8", trainable=False, name="table"
        )
        self.scale = self.add_weight(shape=(8,), initializer="ones", name="scale")

    def call(self, x):
        return x * self.scale


@keras.saving.register_keras_serializable("shardckpt_tests")
class Block(keras.Model):
    """A subclassed model nested inside a functional one."""

    def __init__(self, dim, **kwargs):
        super().__init__(**kwargs)
        self.dim = dim
        self.up = layers.Dense(dim * 2, name="up")
        self.down = layers.EinsumDense("btd,dh->bth", output_shape=(None, dim), bias_axes="h", name="down")
        self.norm = layers.LayerNormalization(name="norm")

    def call(self, x):
        return self.norm(x + self.down(keras.activations.gelu(self.up(x))))

    def get_config(self):
        return {**super().get_config(), "dim": self.dim}


def build_zoo(
    dtype: str = "float32", dim: int = 16, vocab: int = 32, seq: int = 8, rnn: bool | None = None
) -> keras.Model:
    """Dense, EinsumDense, Embedding, Conv1D, LayerNorm, BatchNorm, GRU, a nested
    subclassed model and an int8 variable, all dimensions divisible by 8.

    The GRU is left out for bfloat16 by default: Keras' orthogonal initializer
    needs a QR decomposition that JAX's CPU LAPACK has no bfloat16 kernel for.
    """
    rnn = dtype != "bfloat16" if rnn is None else rnn
    tokens = keras.Input((seq,), dtype="int32", name="tokens")
    x = layers.Embedding(vocab, dim, dtype=dtype, name="embed")(tokens)
    x = Block(dim, dtype=dtype, name="block")(x)
    x = layers.Conv1D(dim, 3, padding="same", dtype=dtype, name="conv")(x)
    x = layers.BatchNormalization(dtype=dtype, name="bn")(x)
    if rnn:
        x = layers.GRU(dim, return_sequences=True, dtype=dtype, name="gru")(x)
    x = Int8Table(dtype=dtype, name="int8_table")(x[..., :8])
    x = layers.Dense(vocab, dtype=dtype, name="head")(x)
    return keras.Model(tokens, x, name="zoo")


def randomize(model: keras.Model, seed: int = 0) -> None:
    """Gives every variable distinct random values (initializers give zeros/ones)."""
    rng = np.random.default_rng(seed)
    for v in model.weights:
        dtype = np.dtype(v.dtype)
        if dtype.kind in "iu":
            value = rng.integers(-100, 100, size=v.shape).astype(dtype)
        else:
            value = rng.standard_normal(v.shape).astype(np.float32).astype(dtype)
        v.assign(value)


def saved_zoo_h5(path: str, seed: int) -> tuple[str, dict[str, np.ndarray]]:
    """Builds the zoo with `randomize(seed)` values and saves it with Keras' `save_weights`.

    Returns:
        `path` and the saved values by variable path. The Keras session is
        cleared afterwards, so the next build gets the same names.
    """
    keras.backend.clear_session()
    model = build_zoo()
    randomize(model, seed)
    model.save_weights(path)
    values = {v.path: np.asarray(v.value) for v in model.weights}
    keras.backend.clear_session()
    return path, values


def zoo_layout_map(mesh: keras.distribution.DeviceMesh) -> keras.distribution.LayoutMap:
    """Shards kernels and embeddings over the "model" axis, columns and rows."""
    lm = keras.distribution.LayoutMap(mesh)
    lm["embed/embeddings"] = ("model", None)
    lm["block/up/kernel"] = (None, "model")
    lm["block/up/bias"] = ("model",)
    lm["block/down/kernel"] = ("model", None)
    lm["conv/kernel"] = (None, None, "model")
    lm["gru/.*/kernel"] = (None, "model")
    lm["int8_table/table"] = ("model", None)
    lm["head/kernel"] = ("data", "model")
    return lm


def model_parallel(
    rules: dict[str, tuple], mesh_shape: tuple[int, int] = (1, 8)
) -> keras.distribution.ModelParallel:
    """Clears the Keras session and sets `ModelParallel` with `rules` (LayoutMap
    key -> axes) on a ("data", "model") mesh; returns the distribution."""
    keras.backend.clear_session()
    mesh = keras.distribution.DeviceMesh(mesh_shape, ["data", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    for key, axes in rules.items():
        layout_map[key] = axes
    dist = keras.distribution.ModelParallel(layout_map=layout_map)
    keras.distribution.set_distribution(dist)
    return dist


class CountingIterator:
    """Endless deterministic batches of 8 from `rows` fixed rows; its state
    (`get_state`/`set_state`, as grain's iterators) is the number of batches given."""

    def __init__(self, rows: int = 64) -> None:
        rng = np.random.default_rng(0)
        self.rows = rows
        self.x = rng.standard_normal((rows, 6)).astype("float32")
        self.y = rng.standard_normal((rows, 1)).astype("float32")
        self.n = 0

    def __iter__(self):
        return self

    def __next__(self):
        i = (self.n * 8) % self.rows
        self.n += 1
        return self.x[i : i + 8], self.y[i : i + 8]

    def get_state(self):
        return {"n": self.n}

    def set_state(self, state):
        self.n = int(state["n"])


def lazy_zoo(dtype: str = "float32", mesh_shape: tuple[int, ...] | None = None, **kw):
    """`build_zoo` under `shardckpt.lazy_init()` in a fresh Keras session.

    With `mesh_shape`, a (data, model) `ModelParallel` over `zoo_layout_map` is
    set first. Returns (model, that distribution or None).
    """
    import shardckpt

    keras.backend.clear_session()
    dist = None
    if mesh_shape is not None:
        mesh = keras.distribution.DeviceMesh(mesh_shape, ["data", "model"])
        dist = keras.distribution.ModelParallel(layout_map=zoo_layout_map(mesh))
        keras.distribution.set_distribution(dist)
    with shardckpt.lazy_init():
        model = build_zoo(dtype=dtype, **kw)
    return model, dist


SAVED_NAMES = {"h5": "m.weights.h5", "keras": "m.keras", "h5-sharded": "m.weights.json", "safetensors": "m.safetensors"}


def save_as(model: keras.Model, folder, fmt: str) -> str:
    """Writes `model` into `folder` as users write `fmt` (a key of `SAVED_NAMES`); returns the path.

    Keras' own `save_weights` / `save` (h5-sharded: a file per variable
    group), or safetensors' `save_file` keyed by variable path (weights only).
    """
    path = os.path.join(str(folder), SAVED_NAMES[fmt])
    if fmt == "keras":
        model.save(path)
    elif fmt == "safetensors":
        stnp.save_file({v.path: np.asarray(v.value) for v in model.weights}, path)
    elif fmt == "h5-sharded":
        model.save_weights(path, max_shard_size=1e-6)
    else:
        model.save_weights(path)
    return path


def small_regressor(seed: int, width: int, optimizer: str | keras.optimizers.Optimizer = "adam") -> keras.Model:
    """x (6) -> hidden (Dense `width`, relu) -> head (Dense 1), named "small", compiled (mse, mae), seeded."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,), name="x")
    h = layers.Dense(width, activation="relu", name="hidden")(inputs)
    outputs = layers.Dense(1, name="head")(h)
    model = keras.Model(inputs, outputs, name="small")
    model.compile(optimizer=optimizer, loss="mse", metrics=["mae"])
    return model
