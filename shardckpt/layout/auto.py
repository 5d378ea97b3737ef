"""`auto_layout(model, mesh)`: a tensor-parallel `LayoutPlan` for any Keras model."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from shardckpt.errors import LayoutError
from shardckpt.layout.analyze import Decision, plan_splits
from shardckpt.layout.mesh import resolve_mesh
from shardckpt.layout.plan import LayoutPlan, Placement
from shardckpt.layout.rules import RulesLike, match_rule, normalize_rules
from shardckpt.layout.trace import trace_model
from shardckpt.structure import structural_paths


def auto_layout(
    model: Any,
    mesh: Any,
    *,
    model_axis: str = "model",
    batch_axis: str | None = None,
    rules: RulesLike = None,
    unknown: str | None = None,
) -> LayoutPlan:
    """Plans where every variable of `model` goes on `mesh` (tensor parallel).

    The forward pass is traced with abstract arrays (no weight memory, so a
    model built under `shardckpt.lazy_init()` works) and each variable's split
    is derived from how its value flows: attention query/key/value and MLP
    up/gate weights column-parallel over heads/features, attention output and
    MLP down row-parallel, embeddings over the vocabulary (a tied head
    follows), biases and normalization weights following the tensor they are
    applied to, convolutions over channels, expert weights over the expert
    dimension. A split the model axis does not divide is replicated, with the
    reason recorded. Layer and variable names are never consulted; only
    `rules` (user data) look at paths, and they override the automatic plan.

    Example:

    ```python
    mesh = keras.distribution.DeviceMesh((1, 8), ["data", "model"])
    with shardckpt.lazy_init():
        model = build_model()
    plan = shardckpt.auto_layout(model, mesh)
    keras.distribution.set_distribution(plan.distribution())
    shardckpt.load_sharded(model, "model.weights.h5", layout=plan)
    ```

    Args:
        model: A built Keras model (functional, sequential, or subclassed and
            called once). Its variables may be unloaded.
        mesh: A `keras.distribution.DeviceMesh`, a shape such as `(1, 8)`, or
            `(shape, axis_names)`.
        model_axis: The mesh axis to split weights over.
        batch_axis: The mesh axis batches are split over (default: the other
            axis; a 1-D mesh gets a size-1 "data" axis).
        rules: Regex on variable path -> mesh axes per dimension (a mapping,
            pairs, or a `keras.distribution.LayoutMap`); first match wins and
            overrides the automatic placement.
        unknown: None: asking the plan for a variable it has no placement
            for raises `UnplannedVariableError`; "replicate": replicates it.

    Returns:
        The `LayoutPlan`.

    Raises:
        LayoutError: The model has no variables (not built), the mesh lacks
            the axes, or a rule names an unknown axis or has the wrong rank.
    """
    device_mesh, batch_axis = resolve_mesh(mesh, model_axis=model_axis, batch_axis=batch_axis)
    variables = list(model.variables)
    if not variables:
        raise LayoutError(
            f"Model {getattr(model, 'name', model)!r} has no variables. Fix: build it first "
            "(keras.Input / model.build(shape) / call it once), under shardckpt.lazy_init() "
            "to skip initialisation."
        )
    axis_size = dict(zip(device_mesh.axis_names, device_mesh.shape))
    n = axis_size[model_axis]
    graph = trace_model(model)
    if graph is None:
        decisions = {
            i: Decision(None, "model inputs unknown (subclassed model never called): replicated; call it once to plan")
            for i in range(len(variables))
        }
    else:
        decisions = plan_splits(graph, n)
    compiled = normalize_rules(rules)
    keys = structural_paths(model)
    trainable = {id(v) for v in model.trainable_variables}
    placements = []
    for i, v in enumerate(variables):
        shape = tuple(int(d) for d in v.shape)
        dtype = jnp.dtype(v.dtype).name
        rule = match_rule(compiled, v.path)
        if rule is not None:
            axes, reason, source = _rule_axes(v.path, shape, rule, axis_size)
        else:
            d = decisions[i]
            axes = tuple(model_axis if k == d.dim else None for k in range(len(shape)))
            reason, source = d.reason, ("fallback" if d.fallback else "auto")
        placements.append(
            Placement(
                path=v.path,
                shape=shape,
                dtype=dtype,
                axes=axes,
                reason=reason,
                source=source,
                trainable=id(v) in trainable,
                key=keys[id(v)],
            )
        )
    return LayoutPlan(device_mesh, placements, model_axis=model_axis, batch_axis=batch_axis, unknown=unknown)


def _rule_axes(
    path: str, shape: tuple[int, ...], rule: tuple[str, tuple], axis_size: dict[str, int]
) -> tuple[tuple[str | None, ...], str, str]:
    pattern, axes = rule
    if len(axes) != len(shape):
        raise LayoutError(
            f"Layout rule {pattern!r} gives {len(axes)} axes {axes} to variable {path!r} of "
            f"shape {shape} (rank {len(shape)}). Fix: give one axis (or None) per dimension, "
            "or narrow the pattern. Received: " f"rule={pattern!r}"
        )
    for axis in axes:
        if axis is not None and axis not in axis_size:
            raise LayoutError(
                f"Layout rule {pattern!r} names mesh axis {axis!r} for {path!r}, but the mesh "
                f"axes are {tuple(axis_size)}. Fix: use one of them. Received: axes={axes}"
            )
    kept: list[str | None] = []
    dropped: list[str] = []
    for dim, (size, axis) in enumerate(zip(shape, axes)):
        if axis is not None and size % axis_size[axis]:
            dropped.append(f"dim {dim} ({size}) over {axis!r} ({axis_size[axis]})")
            kept.append(None)
        else:
            kept.append(axis)
    if dropped:
        return tuple(kept), f"rule {pattern!r}: {', '.join(dropped)} not divisible: replicated", "fallback"
    return tuple(kept), f"rule {pattern!r}", "rule"
