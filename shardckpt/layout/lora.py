"""LoRA factors (`layer.enable_lora(rank)`) placed with their base weight.

Keras' LoRA adds `x @ A @ B * scale` to `x @ kernel`: A has the kernel's
shape with its last dimension replaced by the rank, B is (rank, the
kernel's last dimension); an Embedding's factors are (vocabulary, rank) and
(rank, width). Each factor is split where it shares a dimension with the
base weight's split (`lora_axes`), so the sum needs no collective beyond
the base's own. The base is planned with LoRA off (`structure.lora_off`:
the trace sees the plain kernel), as if the factors were not there, and a
plan made before `enable_lora` carries the factors' layouts
(`lora_layout`) for when Keras creates them under its distribution.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from shardckpt.layout.placement import Axis, Placement
from shardckpt.structure import LORA_FACTORS

# Keras' LoRA (`layer.enable_lora(rank)`): a layer's base weight and its two
# factors, as attributes of the layer (Dense and EinsumDense, Embedding).
# `x @ A @ B` adds to `x @ kernel`: A has the kernel's shape with its last
# dimension replaced by the rank, B is (rank, kernel's last dimension).
_LORA_ATTRIBUTES = (("_kernel", "lora_kernel_a", "lora_kernel_b"), ("_embeddings", "lora_embeddings_a", "lora_embeddings_b"))
# The names Keras gives the factors' variables, for plans made before
# `enable_lora` creates them (`lora_layout`): base name -> factor names.
_LORA_NAMES = LORA_FACTORS


def lora_triples(model: Any) -> list[tuple[Any, Any, Any]]:
    """`(base weight, A, B)` of every LoRA-enabled layer of `model` (found by object, not by name)."""
    found = []
    for layer in getattr(model, "_flatten_layers", list)():
        if getattr(layer, "lora_enabled", False) is not True:
            continue
        for names in _LORA_ATTRIBUTES:
            weights = [getattr(layer, name, None) for name in names]
            if all(w is not None for w in weights):
                found.append((weights[0], weights[1], weights[2]))
    return found


def lora_axes(base: Sequence[Axis]) -> tuple[tuple[Axis, ...], tuple[Axis, ...]]:
    """The axes of A and B for a base weight placed on `base`: each split where it shares the base's dimension.

    A keeps the base's leading dimensions (its split over heads, features,
    rows or a vocabulary) and holds the rank last; B holds the base's last
    dimension (a column-parallel split). The rank is never split: `x @ A`
    then needs no collective beyond what the base's split already needs.
    """
    axes = tuple(base)
    return (*axes[:-1], None), (None, axes[-1])


def place_lora(placements: Sequence[Placement], triples: Sequence[tuple[int, int, int]]) -> list[Placement]:
    """`placements` with each LoRA factor (indices `(base, A, B)`) split with its base weight."""
    out = list(placements)
    for base_i, a_i, b_i in triples:
        base = out[base_i]
        owner = base.path.rsplit("/", 1)[-1]
        for i, axes, name in zip((a_i, b_i), lora_axes(base.axes), ("A", "B")):
            p = out[i]
            if p.source == "rule" or len(axes) != len(p.shape):
                continue
            if any(a is not None for a in axes):
                dims = [d for d, a in enumerate(axes) if a is not None]
                reason = f"LoRA factor {name} of its layer's {owner}: split with it on the dimension they share (dim {dims[0]})"
            elif any(a is not None for a in base.axes):
                reason = (f"LoRA factor {name} of its layer's {owner}: replicated: the {owner}'s split dimension is not one of "
                          "its own (it holds the rank there), and it is small")
            else:
                reason = f"LoRA factor {name} of its layer's {owner}, which is replicated: replicated"
            out[i] = dataclasses.replace(p, axes=axes, reason=reason, source="auto")
    return out


def lora_layout(placements: Sequence[Placement]) -> list[tuple[str, tuple[Axis, ...]]]:
    """`(variable path, axes)` of LoRA factors that `enable_lora` would create, for a plan made before it.

    Keras names them beside their base weight (`<layer>/lora_kernel_a`, ...);
    a distribution set from the plan places them as it is created, split
    with the base weight (`lora_axes`), instead of replicating them.
    """
    planned = {p.path for p in placements}
    out = []
    for p in placements:
        owner, _, name = p.path.rpartition("/")
        if name not in _LORA_NAMES or not p.shape:
            continue
        for path, axes in zip((f"{owner}/{n}" for n in _LORA_NAMES[name]), lora_axes(p.axes)):
            if path not in planned:
                out.append((path, axes))
    return out
