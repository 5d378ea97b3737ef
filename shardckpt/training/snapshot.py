"""A device-side copy of a model's state tree, safe to save in the background.

Keras' JAX train step donates its state buffers: the arrays a callback reads
from the model at batch end are freed by the next step. A background save must
therefore write a copy that nobody donates. The copy is one jitted program
(`jnp.copy` of every leaf, outputs in the inputs' shardings) dispatched
asynchronously: the training thread pays only the dispatch, and the device
makes the copy before it runs the next step, which reads the same buffers.
The copy costs one extra state's worth of device memory until it is written.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from shardckpt.state import collections


def _copy_leaves(values: list[jax.Array]) -> list[jax.Array]:
    return [jnp.copy(v) for v in values]


# One compiled program per distinct list of shapes/dtypes/shardings (jit's cache).
_copy = jax.jit(_copy_leaves)


def nest(paths: list[str], values: list[Any]) -> dict[str, Any]:
    """Nests `values` by their '/'-separated `paths`, as Keras' state tree does."""
    tree: dict[str, Any] = {}
    for path, value in zip(paths, values):
        node = tree
        parts = path.split("/")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        if parts[-1] in node:
            # Keras' get_state_tree refuses the same; two arrays cannot share a key.
            raise ValueError(
                f"Variable path {path!r} is found twice in the model; checkpoint keys "
                "must be unique. Fix: give unique names to your layers."
            )
        node[parts[-1]] = value
    return tree


def snapshot_state(model: Any, *, weights_only: bool = False) -> dict[str, Any]:
    """Returns a copy of `model.get_state_tree()` in fresh device buffers.

    The copy keeps every array's sharding. It is dispatched, not awaited: the
    call returns as soon as the copy is enqueued.

    Example:

    ```python
    tree = snapshot_state(model)        # cheap; training may go on
    checkpointer.save_checkpointables(step, {"pytree": tree})
    ```

    Args:
        model: A built Keras model (JAX backend) whose variables hold values.
        weights_only: Only trainable and non-trainable variables.

    Returns:
        `{collection: nested {path part: jax.Array}}`, the layout of
        `Model.get_state_tree()`.
    """
    groups = collections(model, weights_only=weights_only)
    variables = [v for group in groups.values() for v in group]
    copies = _copy([v.value for v in variables])
    tree: dict[str, Any] = {}
    start = 0
    for name, group in groups.items():
        part = copies[start : start + len(group)]
        start += len(group)
        tree[name] = nest([v.path for v in group], part)
    return tree
