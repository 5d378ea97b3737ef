"""The shapes of a backbone's Hugging Face tensors, solved from its Keras layers.

A converter names the stored tensor each variable reads, not its shape. A
variable ported without a hook is stored as it is (keras-hub assigns the
tensor unchanged: position tables of any length, norms, biases). Otherwise
the shape is solved from the Keras layer that owns the variable, in PyTorch's
layout: a Linear weight is `(out_features, in_features)`, where an
`EinsumDense` kernel's input axes (those in the equation's input) are `in`
and the rest `out`; a weight several variables read (fused projections) is
their outputs joined along dim 0; a value the converter combines itself
(stacked experts) gets the shape that undoing its transposes and stacks
gives. GPT-2 style `Conv1D` layers store `(in, out)`: when the converter's
hooks reject the Linear layout, the Conv1D one (fused along the last dim)
is tried. The result is checked by the caller (`export.hf.plan`): the
recorded remaps must cover each stored tensor exactly once.
"""

from __future__ import annotations

import math
from typing import Any

import keras
import numpy as np


def _owners(model: Any) -> dict[int, Any]:
    out: dict[int, Any] = {}
    for layer in model._flatten_layers(include_self=False):
        for v in layer._trainable_variables + layer._non_trainable_variables:
            out.setdefault(id(v), layer)
    return out


def _linear_shape(variable: Any, layer: Any) -> tuple[int, ...]:
    shape = tuple(variable.shape)
    if isinstance(layer, keras.layers.EinsumDense):
        if variable is layer.kernel or variable is getattr(layer, "_kernel", None):
            inputs, rest = layer.equation.split(",")
            kernel = rest.split("->")[0]
            ins = [d for c, d in zip(kernel, shape, strict=False) if c in inputs]
            outs = [d for c, d in zip(kernel, shape, strict=False) if c not in inputs]
            return (math.prod(outs), math.prod(ins))
        return (math.prod(shape),)
    if isinstance(layer, keras.layers.Dense) and variable is getattr(layer, "_kernel", None):
        return shape[::-1]
    # A matrix a hook reshapes (a separate output projection of an untied
    # embedding) is a Linear weight; an embedding table is stored as is.
    if len(shape) == 2 and variable is not getattr(layer, "embeddings", None):
        return shape[::-1]
    return shape


class _Pending:
    """A stored tensor whose shape is found from what it is assigned to."""

    def __init__(self, key: str, perm: tuple[int, ...] | None = None) -> None:
        self.key, self.perm = key, perm

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        if func is np.transpose:
            return _Pending(self.key, tuple(kwargs.get("axes", args[1] if len(args) > 1 else (1, 0))))
        if func in (np.stack, np.concatenate):
            return _PendingJoin(list(args[0]), kwargs.get("axis", args[1] if len(args) > 1 else 0), func is np.stack)
        raise NotImplementedError(f"solving a stored shape through numpy.{func.__name__}")

    def solve(self, shape: tuple[int, ...], out: dict[str, tuple[int, ...]]) -> None:
        if self.perm is None:
            out[self.key] = shape
        else:
            src = [0] * len(shape)
            for i, p in enumerate(self.perm):
                src[p] = shape[i]
            out[self.key] = tuple(src)


class _PendingJoin:
    def __init__(self, parts: list[Any], axis: int, stacked: bool) -> None:
        self.parts, self.axis, self.stacked = parts, axis, stacked

    __array_function__ = _Pending.__array_function__

    def solve(self, shape: tuple[int, ...], out: dict[str, tuple[int, ...]]) -> None:
        axis = self.axis % len(shape)
        part = list(shape)
        if self.stacked:
            del part[axis]
        else:
            part[axis] //= len(self.parts)
        for p in self.parts:
            p.solve(tuple(part), out)


class _ShapeFinder:
    """A converter loader recording the stored shapes the variables imply."""

    def __init__(self, model: Any, conv1d: bool) -> None:
        self.prefix = None
        self.preset = None
        self.owners = _owners(model)
        self.conv1d = conv1d
        self.shapes: dict[str, tuple[int, ...]] = {}

    def get_prefixed_key(self, key: str, dict_like: Any) -> str:
        return key

    def get_tensor(self, key: str) -> _Pending:
        return _Pending(key)

    def port_weight(self, keras_variable: Any, hf_weight_key: str, hook_fn: Any = None) -> None:
        if hook_fn is None:
            # No hook: keras-hub assigns the stored tensor as it is, so it
            # has the variable's shape whatever the layer (a position table
            # of any length, a norm, a bias).
            shape = tuple(keras_variable.shape)
        else:
            shape = _linear_shape(keras_variable, self.owners.get(id(keras_variable)))
        if self.conv1d and len(shape) == 2 and hook_fn is not None:
            shape = shape[::-1]
        known = self.shapes.get(hf_weight_key)
        if known is not None:
            # A fused weight (Phi-3 qkv_proj, GPT-2 c_attn): outputs joined.
            axis = len(shape) - 1 if self.conv1d else 0
            shape = tuple(k + s if i == axis else k for i, (k, s) in enumerate(zip(known, shape, strict=True)))
        self.shapes[hf_weight_key] = shape

    def assign(self, variable: Any, value: Any) -> None:
        value.solve(tuple(variable.shape), self.shapes)

    def __enter__(self) -> _ShapeFinder:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def _solve(model: Any, converter: Any, config: dict, conv1d: bool) -> dict[str, tuple[int, ...]]:
    finder = _ShapeFinder(model, conv1d)
    variables = list(model.weights)
    for v in variables:
        v.assign = lambda value, _v=v: finder.assign(_v, value)
    try:
        converter.convert_weights(model, finder, config)
    finally:
        for v in variables:
            del v.assign
    return finder.shapes


def stored_shapes(model: Any, converter: Any, config: dict) -> dict[str, tuple[int, ...]]:
    """`{Hugging Face key: shape}` for `model` (Linear layout, else Conv1D)."""
    from shardckpt.formats.base import ArraySpec
    from shardckpt.formats.hf_record import record

    first: Exception | None = None
    for conv1d in (False, True):
        shapes = _solve(model, converter, config, conv1d)
        specs = {k: ArraySpec(shape=s, dtype=np.dtype("float32")) for k, s in shapes.items()}
        try:
            recorded = record(model, converter, "<export>", config, specs)
            for variable, remap in recorded.assigned.values():
                if tuple(remap.shape) != tuple(variable.shape):
                    raise ValueError(f"{variable.path}: a hook gives {remap.shape}, the variable is {variable.shape}")
        except (ValueError, KeyError) as e:  # a hook's reshape or slice disagrees: try the other layout
            first = first or e
            continue
        return shapes
    assert first is not None
    raise first
