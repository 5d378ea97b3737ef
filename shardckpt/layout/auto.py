"""`auto_layout(model, mesh)`: a tensor-parallel (optionally FSDP) `LayoutPlan` for any Keras model."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from keras import distribution as kd

from shardckpt.errors import LayoutError
from shardckpt.layout.analyze import Decision, plan_splits
from shardckpt.layout.companions import place_companions
from shardckpt.layout.fsdp import fsdp_axes
from shardckpt.layout.mesh import resolve_mesh
from shardckpt.layout.plan import Axis, LayoutPlan, Placement
from shardckpt.layout.rules import RulesLike, match_rule, normalize_rules
from shardckpt.layout.trace import trace_model
from shardckpt.structure import structural_paths
from shardckpt.types import Mesh, Model


def auto_layout(
    model: Model,
    mesh: Mesh | Literal["auto"] | None = None,
    *,
    devices: int | Sequence[Any] | None = None,
    fsdp: bool = False,
    model_axis: str = "model",
    batch_axis: str | None = None,
    rules: RulesLike = None,
    unknown: str | None = None,
) -> LayoutPlan:
    """Plans where every variable of `model` goes on `mesh` (tensor parallel, optionally FSDP).

    The forward pass is traced with abstract arrays (no weight memory, so a
    model built under `shardckpt.lazy_init()` works) and each variable's split
    is derived from how its value flows: attention query/key/value and MLP
    up/gate weights column-parallel over heads/features, attention output and
    MLP down row-parallel, embeddings over the vocabulary (a tied head
    follows), biases and normalization weights following the tensor they are
    applied to, convolutions over channels, expert weights over the expert
    dimension. Where the model axis does not divide the preferred dimension,
    the next one that works is taken (a head dimension where heads do not
    divide; an embedding's width where the vocabulary does not), and only
    where none does is the variable replicated; `explain()` says which and
    why. Layer and variable names are never consulted; only `rules` (user
    data) look at paths, and they override the automatic plan.

    With `mesh="auto"` (or `devices=N` and no mesh) every `(data, model)`
    shape of the devices is planned. Shapes whose plan is balanced (within
    15% of a perfect split) with no extra all-reduce from a head-dimension
    split come first; among them the one whose most loaded device holds the
    fewest bytes wins (within 5% count as equal; then the larger model
    axis); `explain()` lists the candidates.

    Example:

    ```python
    mesh = keras.distribution.DeviceMesh((1, 8), ["data", "model"])
    with shardckpt.lazy_init():
        model = build_model()
    plan = shardckpt.auto_layout(model, mesh)
    keras.distribution.set_distribution(plan.distribution())
    shardckpt.load_sharded(model, "model.weights.h5", layout=plan)
    plan = shardckpt.auto_layout(model, devices=8, fsdp=True)     # mesh chosen for the model
    ```

    Args:
        model: A built Keras model (functional, sequential, or subclassed and
            called once). Its variables may be unloaded.
        mesh: A `keras.distribution.DeviceMesh`, a shape such as `(1, 8)`,
            `(shape, axis_names)`, or "auto" (see above). None: "auto" when
            `devices` is given.
        devices: For a mesh given by shape or "auto": a device count (the
            first N of `jax.devices()`) or the devices themselves.
        fsdp: Also split every parameter over the batch axis, on a
            dimension the model axis left free (FSDP / ZeRO-3); optimizer
            slots follow their variable.
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
    pool = _device_pool(devices)
    variables = list(model.variables)
    if not variables:
        raise LayoutError(
            f"Model {getattr(model, 'name', model)!r} has no variables. Fix: build it first "
            "(keras.Input / model.build(shape) / call it once), under shardckpt.lazy_init() "
            "to skip initialisation."
        )
    if mesh is None and devices is None:
        raise LayoutError(
            "auto_layout needs a mesh or a device count. Fix: pass mesh=(1, 8), mesh='auto' or "
            "devices=8. Received: mesh=None, devices=None"
        )
    ctx = _Context(model, normalize_rules(rules))
    if mesh is None or (isinstance(mesh, str) and mesh == "auto"):
        return _choose(ctx, pool, fsdp=fsdp, model_axis=model_axis, unknown=unknown)
    device_mesh, batch_axis = resolve_mesh(mesh, model_axis=model_axis, batch_axis=batch_axis, devices=pool)
    return _plan_on(ctx, device_mesh, model_axis=model_axis, batch_axis=batch_axis, fsdp=fsdp, unknown=unknown)


def _device_pool(devices: int | Sequence[Any] | None) -> list[Any] | None:
    if devices is None:
        return None
    if isinstance(devices, int):
        available = jax.devices()
        if not 1 <= devices <= len(available):
            raise LayoutError(
                f"devices={devices} but {len(available)} devices are available. Fix: pass a count "
                f"from 1 to {len(available)}. Received: devices={devices}"
            )
        return available[:devices]
    return list(devices)


class _Context:
    """What every candidate mesh shares: the trace, structural keys, rules."""

    def __init__(self, model: Any, rules: list) -> None:
        self.variables = list(model.variables)
        self.graph = trace_model(model)
        self.keys = structural_paths(model)
        self.trainable = {id(v) for v in model.trainable_variables}
        self.rules = rules
        self._decisions: dict[int, dict[int, Decision]] = {}

    def decisions(self, n: int) -> dict[int, Decision]:
        if n not in self._decisions:
            if self.graph is None:
                self._decisions[n] = {
                    i: Decision(None, "model inputs unknown (subclassed model never called): replicated; call it once to plan")
                    for i in range(len(self.variables))
                }
            else:
                self._decisions[n] = plan_splits(self.graph, n)
        return self._decisions[n]


def _plan_on(
    ctx: _Context, device_mesh: Any, *, model_axis: str, batch_axis: str, fsdp: bool, unknown: str | None,
    notes: Sequence[str] = (),
) -> LayoutPlan:
    axis_size = dict(zip(device_mesh.axis_names, device_mesh.shape))
    decisions = ctx.decisions(axis_size[model_axis])
    placements = []
    gathered = []
    uses: list[str | None] = []  # how the forward pass uses each variable (None: placed by a rule)
    for i, v in enumerate(ctx.variables):
        shape = tuple(int(d) for d in v.shape)
        dtype = jnp.dtype(v.dtype).name
        rule = match_rule(ctx.rules, v.path)
        axes: tuple[Axis, ...]
        if rule is not None:
            axes, reason, source = _rule_axes(v.path, shape, rule, axis_size)
            uses.append(None)
        else:
            d = decisions[i]
            axes = tuple(model_axis if k == d.dim else None for k in range(len(shape)))
            reason, source = d.reason, ("fallback" if d.fallback else "auto")
            uses.append(d.use)
            if d.gather_output:
                gathered.append(ctx.keys[id(v)])
        placements.append(
            Placement(
                path=v.path,
                shape=shape,
                dtype=dtype,
                axes=axes,
                reason=reason,
                source=source,
                trainable=id(v) in ctx.trainable,
                key=ctx.keys[id(v)],
            )
        )
    placements = place_companions(placements, model_axis=model_axis, axis_size=axis_size[model_axis])
    if fsdp:
        for i, (p, use) in enumerate(zip(placements, uses)):
            if use is not None:
                axes, why = fsdp_axes(p.shape, p.axes, model_axis=model_axis, batch_axis=batch_axis, sizes=axis_size, use=use)
                placements[i] = dataclasses.replace(p, axes=axes, reason=f"{p.reason}; {why}" if why else p.reason)
                if use == "lookup" and batch_axis in axes and p.key not in gathered:
                    gathered.append(p.key)
    return LayoutPlan(
        device_mesh, placements, model_axis=model_axis, batch_axis=batch_axis, unknown=unknown, notes=notes, fsdp=fsdp,
        gathered_outputs=gathered,
    )


def _extra_collectives(plan: LayoutPlan) -> int:
    """Variables split on a second-choice dimension that adds an all-reduce (head-dimension splits)."""
    return sum(1 for p in plan.placements if p.source == "fallback" and "one more all-reduce" in p.reason)


def _choose(ctx: _Context, pool: list[Any] | None, *, fsdp: bool, model_axis: str, unknown: str | None) -> LayoutPlan:
    devices = pool if pool is not None else jax.devices()
    n = len(devices)
    batch_axis = "data" if model_axis != "data" else "batch"
    scored = []
    for m in (k for k in range(n, 0, -1) if n % k == 0):
        shape = (n // m, m)
        mesh = kd.DeviceMesh(shape, [batch_axis, model_axis], np.asarray(devices).reshape(shape))
        plan = _plan_on(ctx, mesh, model_axis=model_axis, batch_axis=batch_axis, fsdp=fsdp, unknown=unknown)
        scored.append((plan.bytes_per_device(), _extra_collectives(plan), m, plan))
    # A shape is clean when its plan is balanced (most loaded device within
    # 15% of a perfect split over the devices it shards over) and splits no
    # variable on a second-choice dimension (no extra all-reduce). Clean
    # shapes come first; among them (or among all, if none is clean) the
    # fewest bytes on the most loaded device, within 5%, then the fewest
    # extra all-reduces, then the larger model axis (less to gather).
    clean = [s for s in scored if s[3].balance() <= 1.15 and s[1] == 0]
    pool = clean or scored
    fewest = min(s[0] for s in pool)
    best = min(pool, key=lambda s: (s[0] > 1.05 * fewest, s[1], -s[2]))
    lines = [
        f"mesh chosen for {n} devices{' with FSDP' if fsdp else ''}: ({n // best[2]}, {best[2]}) "
        "(balanced within 15% with no extra all-reduce first, then the fewest bytes on the most loaded "
        "device within 5%, then the fewest extra all-reduces, then the largest model axis)"
    ]
    for nbytes, extra, m, plan in scored:
        lines.append(
            f"  ({n // m}, {m}): {nbytes:,} bytes/device, balance {plan.balance():.2f}, "
            f"{extra} variables split on a second-choice dimension (extra all-reduce)"
        )
    chosen = best[3]
    return LayoutPlan(
        chosen.mesh, chosen.placements, model_axis=model_axis, batch_axis=batch_axis, unknown=unknown,
        notes=lines, fsdp=fsdp, gathered_outputs=chosen.gathered_outputs,
    )


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
