"""Transformer stacks and a CNN for the layout tests, built from Keras layers.

Shapes cover multi-head, grouped-query (2 key/value heads), multi-query (1,
tied head), a top-2 mixture of experts and an encoder with position and
token-type embeddings: the structures `auto_layout` must place. The same
stacks are measured by `tools/bench_layout.py`.
"""

from __future__ import annotations

import dataclasses

import keras
from keras import layers, ops


@dataclasses.dataclass(kw_only=True)
class Shape:
    """One transformer stack.

    Attributes:
        vocab: Token vocabulary.
        seq: Sequence length.
        dim: Hidden size.
        heads: Query heads.
        kv_heads: Key/value heads (None: equal to `heads`, MultiHeadAttention).
        ff: MLP inner size.
        blocks: Transformer blocks.
        gated: SwiGLU MLP (gate * up -> down) instead of up -> gelu -> down.
        experts: Mixture-of-experts MLP with this many experts (0: dense MLP).
        token_types: Token-type vocabulary of an encoder (0: decoder, no types).
        tied: Output head reuses the token embedding matrix.
    """

    vocab: int = 256
    seq: int = 16
    dim: int = 64
    heads: int = 8
    kv_heads: int | None = None
    ff: int = 256
    blocks: int = 2
    gated: bool = False
    experts: int = 0
    token_types: int = 0
    tied: bool = False


SHAPES: dict[str, Shape] = {
    "multi-head": Shape(),
    "grouped-query": Shape(kv_heads=2, gated=True),
    "multi-query": Shape(kv_heads=1, gated=True, tied=True),
    "mixture-of-experts": Shape(kv_heads=2, experts=8, ff=128),
    "encoder": Shape(token_types=2, heads=16, dim=128, ff=512),
}


class DenseMoE(layers.Layer):
    """Top-k mixture of experts, computed densely: every expert sees every token.

    A router scores experts; the top `k` scores per token are softmaxed into
    combine weights (zero for the other experts). Expert weights carry the
    expert dimension first, `(experts, dim, ff)` and `(experts, ff, dim)`.
    """

    def __init__(self, experts: int, ff: int, k: int = 2, **kwargs):
        super().__init__(**kwargs)
        self.experts = experts
        self.ff = ff
        self.k = k

    def build(self, input_shape):
        dim = input_shape[-1]
        self.router = layers.Dense(self.experts, use_bias=False)
        self.router.build(input_shape)
        self.w_in = self.add_weight(shape=(self.experts, dim, self.ff), initializer="glorot_uniform")
        self.w_out = self.add_weight(shape=(self.experts, self.ff, dim), initializer="glorot_uniform")

    def call(self, x):
        scores, index = ops.top_k(self.router(x), self.k)
        weights = ops.softmax(scores, axis=-1)
        combine = ops.sum(ops.one_hot(index, self.experts) * weights[..., None], axis=-2)
        h = keras.activations.gelu(ops.einsum("btd,edf->betf", x, self.w_in))
        y = ops.einsum("betf,efd->betd", h, self.w_out)
        return ops.einsum("betd,bte->btd", y, combine)


class Positions(layers.Layer):
    """Adds a learned position table (seq, dim) to its input."""

    def build(self, input_shape):
        self.table = self.add_weight(shape=tuple(input_shape[1:]), initializer="random_normal")

    def call(self, x):
        return x + self.table


class TiedLogits(layers.Layer):
    """Output logits through the transposed token embedding matrix."""

    def __init__(self, embedding: layers.Embedding, **kwargs):
        super().__init__(**kwargs)
        self.embedding = embedding

    def call(self, x):
        return ops.matmul(x, ops.transpose(self.embedding.embeddings))


def _block(x, s: Shape):
    h = layers.LayerNormalization()(x)
    if s.kv_heads is None:
        h = layers.MultiHeadAttention(s.heads, s.dim // s.heads)(h, h, use_causal_mask=not s.token_types)
    else:
        h = layers.GroupQueryAttention(s.dim // s.heads, s.heads, s.kv_heads)(
            h, h, use_causal_mask=not s.token_types
        )
    x = layers.Add()([x, h])
    h = layers.LayerNormalization()(x)
    if s.experts:
        h = DenseMoE(s.experts, s.ff)(h)
    elif s.gated:
        gate = layers.Dense(s.ff, activation="silu", use_bias=False)(h)
        up = layers.Dense(s.ff, use_bias=False)(h)
        h = layers.Dense(s.dim, use_bias=False)(layers.Multiply()([gate, up]))
    else:
        h = layers.Dense(s.ff, activation="gelu")(h)
        h = layers.Dense(s.dim)(h)
    return layers.Add()([x, h])


def build_transformer(s: Shape, *, blocks: int | None = None) -> keras.Model:
    """Builds the functional transformer `s` (with `blocks` overriding `s.blocks`)."""
    tokens = keras.Input((s.seq,), dtype="int32")
    inputs = [tokens]
    embedding = layers.Embedding(s.vocab, s.dim)
    x = embedding(tokens)
    if s.token_types:
        types = keras.Input((s.seq,), dtype="int32")
        inputs.append(types)
        x = layers.Add()([x, layers.Embedding(s.token_types, s.dim)(types)])
        x = Positions()(x)
        x = layers.LayerNormalization()(x)
    for _ in range(s.blocks if blocks is None else blocks):
        x = _block(x, s)
    x = layers.LayerNormalization()(x)
    logits = TiedLogits(embedding)(x) if s.tied else layers.Dense(s.vocab, use_bias=False)(x)
    return keras.Model(inputs, logits)


def build_cnn(*, channels: int = 16, classes: int = 10, size: int = 16) -> keras.Model:
    """A small CNN: conv -> batch norm -> relu pairs, pooling, a dense head."""
    x = inputs = keras.Input((size, size, 3))
    for _ in range(2):
        x = layers.Conv2D(channels, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)
        x = layers.ReLU()(x)
        x = layers.Conv2D(channels * 2, 3, padding="same")(x)
        x = layers.ReLU()(x)
        x = layers.Conv2D(channels, 1)(x)
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, layers.Dense(classes)(x))


def sample_inputs(model: keras.Model, vocab: int, *, batch: int = 4, seed: int = 0) -> list:
    """Deterministic numpy inputs: token ids below `vocab`, token types below 2, floats."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for i, spec in enumerate(model.inputs):
        shape = (batch, *spec.shape[1:])
        if "int" in str(spec.dtype):
            out.append(rng.integers(0, vocab if i == 0 else 2, size=shape).astype("int32"))
        else:
            out.append(rng.standard_normal(shape).astype("float32"))
    return out


def build_default() -> keras.Model:
    """The multi-head stack (for `shardckpt plan tests.stacks:build_default`)."""
    return build_transformer(SHAPES["multi-head"])
