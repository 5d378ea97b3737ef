"""`Placement`: where one variable goes (path, structural key, shape, dtype, mesh axes, why)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp

# An entry of `Placement.axes`: a mesh axis, several (split over their product), or None.
Axis = str | tuple[str, ...] | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Placement:
    """The placement of one variable.

    Attributes:
        path: `variable.path` in the instance the plan was made or bound for.
        shape: The variable's shape.
        dtype: Its dtype name.
        axes: One mesh axis name (or None, replicated) per dimension.
        reason: Why, in words.
        source: "auto" (derived from the model), "rule" (a user rule), or
            "fallback" (a split was wanted but the axis does not divide the
            dimension; replicated).
        trainable: Whether an optimizer keeps slots for it.
        key: Its structural key (`shardckpt.structure.structural_paths`),
            the same in every instance of the architecture; "" in plans
            read from format /1 (matched by path then).
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    axes: tuple[Axis, ...]
    reason: str
    source: str = "auto"
    trainable: bool = True
    key: str = ""

    @property
    def nbytes(self) -> int:
        """Bytes of the whole variable."""
        return math.prod(self.shape) * jnp.dtype(self.dtype).itemsize


def flat_axes(axes: Sequence[Axis]) -> list[str]:
    """The mesh axis names used by `axes` (an entry may name several)."""
    out: list[str] = []
    for a in axes:
        if isinstance(a, tuple):
            out.extend(a)
        elif a is not None:
            out.append(a)
    return out


def axis_json(axis: Axis) -> Any:
    """An axes entry as JSON (several axes: a list)."""
    return list(axis) if isinstance(axis, tuple) else axis


def axis_from_json(axis: Any) -> Axis:
    """An axes entry read back from JSON."""
    return tuple(axis) if isinstance(axis, list) else axis
