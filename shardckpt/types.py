"""The types of shardckpt's public signatures: layouts, meshes, models, dtypes.

A bottom-level module (no shardckpt imports) so that every layer can name
them: `restore` accepts a `LayoutPlan` from `layout`, its sibling, through
the `PlanLike` protocol it satisfies, not by importing it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, TypeAlias, runtime_checkable

import jax
import keras
import numpy.typing as npt
from keras import distribution as kd


@runtime_checkable
class PlanLike(Protocol):
    """A layout plan: `shardckpt.LayoutPlan`, or anything that places variables alike."""

    def sharding_for(self, variable: Any) -> jax.sharding.Sharding:
        """The sharding `variable` is placed in."""
        ...

    def layout_map(self) -> kd.LayoutMap:
        """The plan as a Keras `LayoutMap`."""
        ...

    def bind(self, model: Any) -> PlanLike:
        """The plan applied to `model` (an instance of the planned architecture), matched by structure."""
        ...


@runtime_checkable
class StatefulIterator(Protocol):
    """A data iterator whose position can be saved: grain's, or anything with `get_state` / `set_state`."""

    def get_state(self) -> Any:
        """The iterator's position (bytes, a dict, ...; stored exactly)."""
        ...

    def set_state(self, state: Any) -> None:
        """Moves the iterator to a position `get_state` returned."""
        ...


Layout: TypeAlias = PlanLike | kd.LayoutMap | kd.ModelParallel | kd.DataParallel | None
"""What `layout=` takes: a `LayoutPlan`, a Keras `LayoutMap`, a Keras
distribution (`ModelParallel`, `DataParallel`: keras.distribution exports no
common base class), or None (the active distribution, else each variable's
current sharding)."""

Mesh: TypeAlias = kd.DeviceMesh | Sequence[int] | tuple[Sequence[int], Sequence[str]]
"""What `mesh=` takes: a Keras `DeviceMesh`, a shape such as `(1, 8)` (axes
"data", "model"; `(8,)`: "model" only), or `(shape, axis_names)`."""

Model: TypeAlias = keras.Model
"""A Keras 3 model on the JAX backend (functional, sequential or subclassed)."""

DType: TypeAlias = npt.DTypeLike | None
"""A dtype: a name ("bfloat16"), a numpy / ml_dtypes type, or None (keep)."""

__all__ = ["DType", "Layout", "Mesh", "Model", "PlanLike", "StatefulIterator"]
