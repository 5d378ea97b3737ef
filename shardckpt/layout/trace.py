"""Trace a Keras model's forward pass into a flat graph of array operations.

The planner follows tensors, not layer names: it traces
`model.stateless_call` with abstract values (`jax.ShapeDtypeStruct`, no
memory, works on models built under `shardckpt.lazy_init()`), inlines every
nested jaxpr (`jit`, `custom_jvp_call`, ...) and returns one list of
operations in execution order, where each operand is a `Value` shared by its
producer and all its consumers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore

# Sequence dimensions left unknown by `keras.Input((None, ...))` are traced at
# this length; the plan depends on parameter shapes only, never on it.
_TRACE_SEQ = 8
_TRACE_BATCH = 2


@dataclasses.dataclass(eq=False)
class Value:
    """One array in the traced graph.

    Attributes:
        shape: Its static shape.
        param: Index into the model's variables when it is a variable's
            value, else None.
        is_output: It is one of the model's outputs.
        consumers: `(op, operand position)` for every use.
    """

    shape: tuple[int, ...]
    param: int | None = None
    is_output: bool = False
    consumers: list[tuple[Op, int]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(eq=False)
class Op:
    """One primitive application: `outputs = name(*inputs, **params)`."""

    name: str
    inputs: list[Value]
    outputs: list[Value]
    params: dict[str, Any]


@dataclasses.dataclass
class Graph:
    """The flat forward graph of a model.

    Attributes:
        ops: Operations in execution order.
        params: One `Value` per model variable, in `model.variables` order.
    """

    ops: list[Op]
    params: list[Value]


def _abstract_inputs(model: Any) -> Any:
    """Abstract arrays for the model's inputs, from `model.inputs` or its build shapes."""
    specs = getattr(model, "inputs", None)
    if specs:
        shapes_dtypes = [(tuple(s.shape), s.dtype) for s in specs]
        structure = [
            jax.ShapeDtypeStruct(_concrete(shape), dtype) for shape, dtype in shapes_dtypes
        ]
        return structure[0] if len(structure) == 1 else structure
    build = getattr(model, "_build_shapes_dict", None)  # Keras records build() shapes here
    if build:
        shapes = list(build.values())
        structure = [jax.ShapeDtypeStruct(_concrete(tuple(s)), "float32") for s in shapes]
        return structure[0] if len(structure) == 1 else structure
    return None


def _concrete(shape: tuple) -> tuple[int, ...]:
    return tuple(
        (_TRACE_BATCH if i == 0 else _TRACE_SEQ) if d is None else int(d) for i, d in enumerate(shape)
    )


def trace_model(model: Any) -> Graph | None:
    """Traces `model`'s inference forward pass into a `Graph`.

    Args:
        model: A built Keras model (its variables may be unloaded).

    Returns:
        The graph, or None when the model's input shapes are unknown (a
        subclassed model that was never called); the planner then replicates
        every variable, with that reason, unless a user rule places it.
    """
    inputs = _abstract_inputs(model)
    if inputs is None:
        return None
    variables = list(model.variables)
    trainable = [jax.ShapeDtypeStruct(tuple(v.shape), v.dtype) for v in model.trainable_variables]
    frozen = [jax.ShapeDtypeStruct(tuple(v.shape), v.dtype) for v in model.non_trainable_variables]

    def forward(tv: Sequence, ntv: Sequence, x: Any) -> Any:
        # No `training=` argument: not every call() accepts one, and Keras
        # layers default to inference.
        return model.stateless_call(tv, ntv, x)[0]

    closed = jax.make_jaxpr(forward)(trainable, frozen, inputs)
    return _flatten(closed, model, variables)


def _flatten(closed: Any, model: Any, variables: list) -> Graph:
    jaxpr = closed.jaxpr
    order = {id(v): i for i, v in enumerate(variables)}
    var_ids = [id(v) for v in model.trainable_variables] + [id(v) for v in model.non_trainable_variables]
    n_params = len(var_ids)
    env: dict[Any, Value] = {}
    params = [Value(tuple(v.shape), param=i) for i, v in enumerate(variables)]
    for k, invar in enumerate(jaxpr.invars):
        if k < n_params:
            env[invar] = params[order[var_ids[k]]]
        else:
            env[invar] = Value(tuple(invar.aval.shape))
    for c in jaxpr.constvars:
        env[c] = Value(tuple(c.aval.shape))
    ops: list[Op] = []
    _inline(jaxpr, env, ops)
    for out in jaxpr.outvars:
        _read(env, out).is_output = True
    for op in ops:
        for pos, value in enumerate(op.inputs):
            value.consumers.append((op, pos))
    return Graph(ops, params)


def _read(env: dict, atom: Any) -> Value:
    if isinstance(atom, jcore.Literal):
        return Value(tuple(np.shape(atom.val)))
    return env[atom]


def _sub_jaxpr(eqn: Any) -> Any:
    """The inner jaxpr of a call-like equation whose operands map 1:1, else None."""
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        inner = eqn.params.get(key)
        if isinstance(inner, jcore.ClosedJaxpr):
            inner = inner.jaxpr
        if isinstance(inner, jcore.Jaxpr) and len(inner.invars) == len(eqn.invars) and len(
            inner.outvars
        ) == len(eqn.outvars):
            return inner
    return None


def _inline(jaxpr: Any, env: dict, ops: list[Op]) -> None:
    for eqn in jaxpr.eqns:
        inner = _sub_jaxpr(eqn)
        inputs = [_read(env, a) for a in eqn.invars]
        if inner is not None and eqn.primitive.name not in ("scan", "while", "cond"):
            sub_env: dict[Any, Value] = dict(zip(inner.invars, inputs))
            for c in inner.constvars:
                sub_env[c] = Value(tuple(c.aval.shape))
            _inline(inner, sub_env, ops)
            for outer, out in zip(eqn.outvars, inner.outvars):
                env[outer] = _read(sub_env, out)
            continue
        outputs = [Value(tuple(getattr(o.aval, "shape", ()))) for o in eqn.outvars]
        for outer, value in zip(eqn.outvars, outputs):
            env[outer] = value
        ops.append(Op(eqn.primitive.name, inputs, outputs, dict(eqn.params)))
