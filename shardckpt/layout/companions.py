"""Variables that belong with another of their layer: quantization scales, float8 statistics.

The planner decides each variable from the first operation that reads it.
A quantized layer reads its scale before its kernel's output exists
(`inputs_scale * kernel_scale` first, then the division of the matmul's
output by that product), so the scale would be replicated even when the
kernel is split over its output features. Tied to its kernel by the
layer they share (their structural key, `layers/dense/vars/<i>`: never a
generated name), the scale instead follows the kernel:

- where the layer's largest weight (its kernel or table) is split over its
  output features (column-parallel, a vocabulary, experts), a smaller
  variable of the layer that the planner left replicated and that has a
  dimension of the same size (`kernel_scale` (units,), int4's sub-channel
  (groups, units), EinsumDense's (1, 1, units)) is split on it;
- where that weight is replicated, its scales and zero points are
  replicated with it;
- int4 layers need none of this: the planner follows a packed kernel
  through its unpacking and the scales, zero points and group indices
  through their dequantization (`take(scale, g_idx)`), so it splits the
  packed output dimension and the scales with it, and keeps the group
  indices (lookup indices) whole;
- a variable of the layer that the forward pass never reads (float8's amax
  histories, updated through their gradient) is replicated when it is a
  vector (at any length: a history of 1024 outgrows a small layer's kernel)
  or smaller than the kernel; the kernel is the largest variable read.

LoRA factors, companions of another kind, are placed by `layout.lora`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from shardckpt.layout.decision import INDICES_ONLY
from shardckpt.layout.plan import Placement

_OUTPUT_SPLITS = ("column-parallel", "vocabulary split", "batch-dimension split", "split along the batch")
_UNREAD = "not used by the traced forward pass"
# Replicated on purpose by the planner, which saw them meet the kernel's split.
_DELIBERATE = (INDICES_ONLY, "broadcast along the split dimension")


def _layer(key: str) -> str:
    return key.rsplit("/vars/", 1)[0] if "/vars/" in key else ""


def place_companions(placements: Sequence[Placement], *, model_axis: str, axis_size: int) -> list[Placement]:
    """`placements` with scales following their kernel and unread state replicated (see the module docstring)."""
    out = list(placements)
    groups: dict[str, list[int]] = {}
    for i, p in enumerate(out):
        if p.key and p.source in ("auto", "fallback"):
            groups.setdefault(_layer(p.key), []).append(i)
    for layer, members in groups.items():
        if not layer or len(members) < 2:
            continue
        # The kernel is the largest variable the forward pass reads: a float8 amax history
        # (1024 long by default) outgrows the kernel of a small layer and is never read.
        read = [i for i in members if not out[i].reason.startswith(_UNREAD)] or members
        main = max(read, key=lambda i: math.prod(out[i].shape))
        kernel = out[main]
        size = math.prod(kernel.shape)
        for i in members:
            p = out[i]
            if i == main or not p.shape:
                continue
            if p.reason.startswith(_UNREAD):
                # A vector of statistics is the layer's state at any size; a larger unread
                # matrix may be a weight of its own (kept as the planner split it).
                if model_axis in p.axes and (len(p.shape) == 1 or math.prod(p.shape) * 4 <= size):
                    out[i] = dataclasses.replace(
                        p, axes=(None,) * len(p.shape),
                        reason="state of its layer the forward pass does not read (e.g. a float8 amax history): replicated",
                    )
                continue
            if math.prod(p.shape) * 4 > size:
                continue  # another weight of the layer (an expert's second kernel), not a companion
            if model_axis in kernel.axes and kernel.reason.startswith(_OUTPUT_SPLITS):
                if model_axis in p.axes or p.reason.startswith(_DELIBERATE):
                    continue
                dim = _matching_dim(kernel, p, model_axis, axis_size)
                if dim is not None:
                    width = p.shape[dim]
                    axes = tuple(model_axis if d == dim else None for d in range(len(p.shape)))
                    out[i] = dataclasses.replace(
                        p, axes=axes, reason=f"follows its layer's {kernel.path.rsplit('/', 1)[-1]} (split over {width} outputs)",
                    )
            elif model_axis not in kernel.axes and model_axis in p.axes:
                out[i] = dataclasses.replace(
                    p, axes=(None,) * len(p.shape),
                    reason=f"follows its layer's {kernel.path.rsplit('/', 1)[-1]}, which is replicated",
                )
    return out


def _matching_dim(kernel: Placement, companion: Placement, model_axis: str, axis_size: int) -> int | None:
    """The companion's dimension that corresponds to the kernel's split one, or None.

    A scale is shaped like the layer's output (`(units,)`, `(groups, units)`,
    `(1, 1, heads, head_dim)`), whose dimensions are the kernel's trailing
    ones: aligned from the end first; otherwise the one dimension of the same
    size (an embedding's per-row scale), if there is exactly one.
    """
    k = kernel.axes.index(model_axis)
    width = kernel.shape[k]
    if width % axis_size:
        return None
    aligned = len(companion.shape) - (len(kernel.shape) - k)
    if 0 <= aligned < len(companion.shape) and companion.shape[aligned] == width:
        return aligned
    same = [d for d, size in enumerate(companion.shape) if size == width]
    return same[0] if len(same) == 1 else None

