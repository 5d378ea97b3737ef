"""Keras' state tree: which variables a model's checkpoint holds, grouped as Keras groups them.

`Model.get_state_tree()` (what Keras' `OrbaxCheckpoint` saves and
`load_weights` of an Orbax folder reads) groups variables in these
collections, keyed by `variable.path`. Restore's key matching, the converter,
the training snapshots and `parallelize` all take their variables from here.
"""

from __future__ import annotations

from typing import Any

FULL_COLLECTIONS = (
    "trainable_variables",
    "non_trainable_variables",
    "optimizer_variables",
    "metrics_variables",
)
"""Keras' state-tree collections, in Keras' order."""

WEIGHT_COLLECTIONS = FULL_COLLECTIONS[:2]
"""The collections of a weights-only checkpoint."""

OPTIONAL_COLLECTIONS = FULL_COLLECTIONS[2:]
"""Collections a weights-only checkpoint, or a model without an optimizer, lacks."""


def collections(model: Any, *, weights_only: bool = False) -> dict[str, list[Any]]:
    """Returns `{collection name: [variables]}` as `get_state_tree` groups them.

    Every collection of `FULL_COLLECTIONS` (or `WEIGHT_COLLECTIONS`) is
    present; a model without an optimizer has an empty "optimizer_variables".
    """
    out = {
        "trainable_variables": list(model.trainable_variables),
        "non_trainable_variables": list(model.non_trainable_variables),
    }
    if not weights_only:
        optimizer = getattr(model, "optimizer", None)
        out["optimizer_variables"] = list(optimizer.variables) if optimizer is not None else []
        out["metrics_variables"] = list(getattr(model, "metrics_variables", []) or [])
    return out
