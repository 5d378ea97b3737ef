"""`mesh="auto"`: the `(data, model)` shape of the devices chosen for the model.

Every shape `(n / m, m)` with `m` dividing the device count is planned, then
chosen as a practitioner would (see `auto_layout`): what does not fit a
device is out; clean shapes (balanced, no extra all-reduce, no gathered
output; pure data parallelism always) come first; then the fewest bytes on
the most loaded device, the fewest extra all-reduces, the larger model axis.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
from keras import distribution as kd

from shardckpt import userwarn
from shardckpt.layout.plan import LayoutPlan

# The most loaded device within this of a perfect split counts as balanced.
BALANCED = 1.15
# Bytes per device within this factor of the fewest count as equal.
_EQUAL_BYTES = 1.05

_log = logging.getLogger("shardckpt")


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One planned mesh shape and its figures."""

    plan: LayoutPlan
    model: int  # the model axis size
    nbytes: int  # weights on the most loaded device
    state: int  # weights plus the optimizer's slots (what must fit)
    extra: int  # variables split on a second-choice dimension (an extra all-reduce each attention)
    gathers: int  # model-axis splits whose output is gathered (an all-gather outside the blocks)
    fits: bool | None  # None: no device memory known

    @property
    def clean(self) -> bool:
        """Balanced, no extra all-reduce, no gathered output; data parallelism always is."""
        if self.model == 1:
            return True
        return self.plan.balance() <= BALANCED and self.extra == 0 and self.gathers == 0


def extra_collectives(plan: LayoutPlan) -> int:
    """Variables split on a second-choice dimension that adds an all-reduce (head-dimension splits)."""
    return sum(1 for p in plan.placements if p.source == "fallback" and "one more all-reduce" in p.reason)


def device_limit(devices: Sequence[Any]) -> int | None:
    """One device's memory as its runtime reports it (`bytes_limit`), or None (CPU devices report none).

    Asked of a device of this process: in a multi-process run the runtime
    refuses `memory_stats()` of another process's device (`devices[0]` is
    process 0's), so each process asks its own (the same hardware).
    """
    import jax

    own = [d for d in devices if getattr(d, "process_index", 0) == jax.process_index()]
    if not own:
        return None
    stats = own[0].memory_stats() if hasattr(own[0], "memory_stats") else None
    limit = (stats or {}).get("bytes_limit")
    return int(limit) if limit else None


def _why(best: Candidate) -> str:
    """The chosen shape's own figures, as one clause."""
    figures = (
        f"balance {best.plan.balance():.2f}, {best.extra} extra all-reduces, {best.gathers} gathered lookups, "
        f"{best.nbytes:,} bytes on the most loaded device"
    )
    if best.model == 1:
        return f"data parallel, no collective in the forward pass ({figures})"
    if best.clean:
        return f"the fewest bytes per device among the clean shapes ({figures})"
    return f"no shape is clean; the fewest bytes per device ({figures})"


def announce(plan: LayoutPlan, caller: str) -> None:
    """Logs (INFO, logger "shardckpt") the mesh `mesh="auto"` chose and why, in one line.

    For callers that chose "auto" for the user (no mesh given); the other
    shapes' figures stay in `plan.explain()`.
    """
    first = plan.notes[0] if plan.notes else f"mesh {tuple(plan.mesh.shape)}"
    n = int(np.prod(plan.mesh.shape))
    _log.info(
        "%s: %s. Pass mesh=(1, %d) for every device on the model axis; plan.explain() lists every shape.",
        caller, first.split(" (shapes", 1)[0], n,
    )


def choose_mesh(
    plan_for: Callable[[kd.DeviceMesh, str], tuple[LayoutPlan, int]],
    devices: Sequence[Any],
    *,
    fsdp: bool,
    model_axis: str,
    unknown: str | None,
    device_memory: int | None,
    optimizer: str | keras.optimizers.Optimizer | None,
) -> LayoutPlan:
    """Plans every `(data, model)` shape of `devices` and returns the chosen plan.

    Args:
        plan_for: Plans the model on a mesh with the given batch axis; returns
            the plan and its count of model-axis splits with gathered outputs.
        devices: The devices.
        fsdp: Whether the plans shard parameters over the batch axis too.
        model_axis: The mesh axis weights are split over.
        unknown: The plan's policy for variables it does not know.
        device_memory: Bytes of one device, or None: the devices' own limit
            (`device_limit`), if they report one.
        optimizer: Whose slots count in the state that must fit (None:
            weights alone).

    Returns:
        The chosen plan; its notes say why, with every candidate's figures.
    """
    n = len(devices)
    batch_axis = "data" if model_axis != "data" else "batch"
    limit = device_memory if device_memory is not None else device_limit(devices)
    source = "given" if device_memory is not None else "reported by the device"
    candidates = []
    for m in (k for k in range(n, 0, -1) if n % k == 0):
        shape = (n // m, m)
        mesh = kd.DeviceMesh(shape, [batch_axis, model_axis], np.asarray(devices).reshape(shape))
        plan, gathers = plan_for(mesh, batch_axis)
        state = plan.bytes_per_device(optimizer)
        candidates.append(
            Candidate(
                plan, m, plan.bytes_per_device(), state, extra_collectives(plan), gathers,
                None if limit is None else state <= limit,
            )
        )
    fitting = [c for c in candidates if c.fits is not False]
    lines = []
    if not fitting:
        smallest = min(candidates, key=lambda c: c.state)
        message = (
            f"No mesh shape of {n} devices fits the device memory ({limit:,} bytes, {source}): the "
            f"smallest per-device state is {smallest.state:,} bytes. The shape with the fewest bytes is "
            "chosen; it will not fit. Fix: use more devices, fsdp=True, or a smaller model."
        )
        userwarn.warn(message)
        lines.append(message)
        fitting = [smallest]
    pool = [c for c in fitting if c.clean] or fitting
    fewest = min(c.nbytes for c in pool)
    best = min(pool, key=lambda c: (c.nbytes > _EQUAL_BYTES * fewest, c.extra, -c.model))
    memory = "" if limit is None else f" fitting {limit:,} bytes per device ({source}),"
    lines.insert(
        0,
        f"mesh chosen for {n} devices{' with FSDP' if fsdp else ''}: ({n // best.model}, {best.model}): "
        f"{_why(best)} "
        f"(shapes{memory} clean first: balanced within {BALANCED - 1:.0%}, no extra all-reduce and no "
        "gathered output, or pure data parallel; then the fewest bytes on the most loaded device within "
        f"{_EQUAL_BYTES - 1:.0%}, then the fewest extra all-reduces, then the largest model axis)",
    )
    for c in candidates:
        fit = "" if c.fits is None else f", {'fits' if c.fits else 'does not fit'} (state {c.state:,} bytes)"
        lines.append(
            f"  ({n // c.model}, {c.model}): {c.nbytes:,} bytes/device, balance {c.plan.balance():.2f}, "
            f"{c.extra} variables split on a second-choice dimension (extra all-reduce), "
            f"{c.gathers} lookups gathered{fit}{': clean' if c.clean else ''}"
        )
    chosen = best.plan
    return LayoutPlan(
        chosen.mesh, chosen.placements, model_axis=model_axis, batch_axis=batch_axis, unknown=unknown,
        notes=lines, fsdp=fsdp, gathered_outputs=chosen.gathered_outputs, problems=chosen.problems,
    )
