"""`auto_layout(model, mesh)`: a tensor-parallel (optionally FSDP) `LayoutPlan` for any Keras model."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import keras

from shardckpt import userwarn
from shardckpt.errors import LayoutError
from shardckpt.layout.analyze import plan_splits
from shardckpt.layout.choose import choose_mesh
from shardckpt.layout.companions import place_companions
from shardckpt.layout.decision import Decision
from shardckpt.layout.fsdp import fsdp_axes
from shardckpt.layout.lora import lora_triples, place_lora
from shardckpt.layout.mesh import resolve_mesh
from shardckpt.layout.plan import Axis, LayoutPlan, Placement
from shardckpt.layout.rules import RulesLike, match_rule, normalize_rules, rule_problems
from shardckpt.layout.trace import trace_model
from shardckpt.structure import lora_off, structural_paths
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
    device_memory: int | None = None,
    optimizer: str | keras.optimizers.Optimizer | None = None,
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
    shape of the devices is planned, and chosen as a practitioner would:

    1. Shapes whose state does not fit one device are out: weights (plus
       `optimizer`'s slots, when given) against `device_memory`, or, when
       that is not given, the accelerator's own limit
       (`memory_stats()["bytes_limit"]`; CPU devices report none). So a
       large model is never put data-parallel into an out-of-memory error.
    2. Clean shapes come first: balanced (the most loaded device within
       15% of a perfect split), no extra all-reduce from a head-dimension
       split, and no model-axis split whose output must be gathered (an
       embedding split along its width because its vocabulary does not
       divide: one all-gather per lookup outside the blocks). Pure data
       parallelism (a model axis of 1) has no collective in the forward
       pass and is always clean.
    3. Among them, the fewest bytes on the most loaded device (within 5%
       count as equal), then the fewest extra all-reduces, then the larger
       model axis (less to gather).

    So GPT-2 base (124M parameters, vocabulary 50257) on 8 devices is run
    data-parallel, and Llama 3 8B tensor-parallel over 8. `explain()` lists
    every candidate with its figures.

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
        device_memory: For `mesh="auto"`: bytes one device holds (default:
            the accelerator's `bytes_limit`, none on CPU); shapes whose
            per-device state exceeds it are not chosen.
        optimizer: For `mesh="auto"` with a device memory: an optimizer
            name or instance whose slots count in the per-device state
            (e.g. "adam"); None: weights alone.

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
    ctx = Context(model, normalize_rules(rules))
    for line in ctx.rule_problems:
        userwarn.warn(line)
    if mesh is None or (isinstance(mesh, str) and mesh == "auto"):

        def plan_for(candidate: Any, batch: str) -> tuple[LayoutPlan, int]:
            plan = plan_on(ctx, candidate, model_axis=model_axis, batch_axis=batch, fsdp=fsdp, unknown=unknown)
            return plan, ctx.gathered(dict(zip(candidate.axis_names, candidate.shape))[model_axis])

        chosen = choose_mesh(
            plan_for, pool if pool is not None else jax.devices(), fsdp=fsdp, model_axis=model_axis,
            unknown=unknown, device_memory=device_memory, optimizer=optimizer,
        )
        _warn_if_paths_shared(chosen)
        return chosen
    device_mesh, batch_axis = resolve_mesh(mesh, model_axis=model_axis, batch_axis=batch_axis, devices=pool)
    plan = plan_on(ctx, device_mesh, model_axis=model_axis, batch_axis=batch_axis, fsdp=fsdp, unknown=unknown)
    _warn_if_paths_shared(plan)
    _warn_if_mostly_replicated(plan)
    return plan


# Above this share of parameter bytes left whole on every device, a mesh the
# user gave a model axis mostly buys collectives, not memory.
MOSTLY_REPLICATED = 0.5


def _warn_if_mostly_replicated(plan: LayoutPlan) -> None:
    """Warns once when most parameter bytes stay replicated on a mesh the user gave a model axis.

    Only for a mesh the user chose (`mesh="auto"` weighs this itself) whose
    model axis spans more than one device; names the largest replicated
    variables and why each stayed whole (no dimension divides, a rule).
    """
    n = plan.split_factor((plan.model_axis,))
    total = sum(p.nbytes for p in plan.placements)
    whole = sorted((p for p in plan.placements if plan.split_factor(p.axes) == 1), key=lambda p: -p.nbytes)
    share = sum(p.nbytes for p in whole) / total if total else 0.0
    if n <= 1 or share <= MOSTLY_REPLICATED:
        return
    largest = "; ".join(
        f"{p.path} {p.shape} ({p.nbytes:,} bytes): {p.reason if p.source == 'auto' else f'[{p.source}] {p.reason}'}"
        for p in whole[:3]
    )
    userwarn.warn(
        f"{share:.0%} of parameter bytes stay replicated on every device although the mesh splits "
        f"model axis {plan.model_axis!r} {n} ways. Largest: {largest}. Fix: a model axis that divides "
        "these dimensions (mesh='auto' picks one), rules= for them, or fsdp=True."
    )


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


class Context:
    """What every candidate mesh shares: the trace, structural keys, rules."""

    def __init__(self, model: Any, rules: list) -> None:
        self.variables = list(model.variables)
        # The base weights are planned as without LoRA; its factors follow them (layout.lora).
        with lora_off(model):
            self.graph = trace_model(model)
        index = {id(v): i for i, v in enumerate(self.variables)}
        self.lora = [(index[id(base)], index[id(a)], index[id(b)]) for base, a, b in lora_triples(model)
                     if {id(base), id(a), id(b)} <= index.keys()]
        self.keys = structural_paths(model)
        self.trainable = {id(v) for v in model.trainable_variables}
        self.rules = rules
        # The same for every candidate mesh: matching looks at paths only.
        self.rule_problems = rule_problems(rules, [v.path for v in self.variables])
        self._decisions: dict[int, dict[int, Decision]] = {}

    def gathered(self, n: int) -> int:
        """Variables a model axis of `n` splits with their lookup's output gathered (no rule overriding)."""
        return sum(
            1 for i, d in self.decisions(n).items()
            if d.gather_output and match_rule(self.rules, self.variables[i].path) is None
        )

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


def plan_on(
    ctx: Context, device_mesh: Any, *, model_axis: str, batch_axis: str, fsdp: bool, unknown: str | None,
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
    placements = place_lora(placements, ctx.lora)
    if fsdp:
        for i, (p, use) in enumerate(zip(placements, uses)):
            if use is not None:
                axes, why = fsdp_axes(p.shape, p.axes, model_axis=model_axis, batch_axis=batch_axis, sizes=axis_size, use=use)
                placements[i] = dataclasses.replace(p, axes=axes, reason=f"{p.reason}; {why}" if why else p.reason)
                if use == "lookup" and batch_axis in axes and p.key not in gathered:
                    gathered.append(p.key)
    placements = _one_placement_per_path(placements)
    return LayoutPlan(
        device_mesh, placements, model_axis=model_axis, batch_axis=batch_axis, unknown=unknown, notes=notes, fsdp=fsdp,
        gathered_outputs=gathered, problems=ctx.rule_problems,
    )


# The reason given to variables replicated because another variable shares their path.
SHARED_PATH = "shares its path with a variable placed otherwise"


def _one_placement_per_path(placements: list[Placement]) -> list[Placement]:
    """Replicates variables that share their path with one the plan places otherwise.

    Two variables have one path when two sub-models' layers have the same
    given names (a functional block built twice with `name="up"` inside).
    Keras places a variable by its path (`LayoutMap`), and so do a plan's
    lookups (`sharding_for`, `load_sharded`): both would get one of the two
    placements whatever the plan says for each. Replicated, both are placed
    as planned (`auto_layout` warns, naming them).
    """
    by_path: dict[str, list[int]] = {}
    for i, p in enumerate(placements):
        by_path.setdefault(p.path, []).append(i)
    out = list(placements)
    for found in by_path.values():
        if len(found) < 2 or len({placements[i].axes for i in found}) == 1:
            continue
        for i in found:
            p = placements[i]
            out[i] = dataclasses.replace(
                p, axes=(None,) * len(p.shape), source="fallback",
                reason=f"{SHARED_PATH} ({p.reason}); Keras places variables by path: replicated",
            )
    return out


def _warn_if_paths_shared(plan: LayoutPlan) -> None:
    """Warns once naming the variables replicated because they share a path (`_one_placement_per_path`)."""
    shared = sorted({p.path for p in plan.placements if p.reason.startswith(SHARED_PATH)})
    if shared:
        userwarn.warn(
            f"{len(shared)} variable path(s) are held by two or more variables that the plan would "
            f"split differently, so they stay replicated: {', '.join(shared[:5])}. Keras places a "
            "variable by its path, and layers of two sub-models with the same given names (one "
            "block built twice) share theirs. Fix: give each sub-model's layers their own names "
            "(e.g. prefix them with the block's), or leave naming to Keras."
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
