"""Keras' state tree: which variables a model's checkpoint holds, grouped as Keras groups them.

`Model.get_state_tree()` (what Keras' `OrbaxCheckpoint` saves and
`load_weights` of an Orbax folder reads) groups variables in these
collections, keyed by `variable.path`. Restore's key matching, the converter,
the training snapshots and `parallelize` all take their variables from here.
"""

from __future__ import annotations

from typing import Any

from shardckpt.errors import DuplicateStateKeyError

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


def check_unique_paths(groups: dict[str, list[Any]], optimizer: Any = None, *, loading: bool = False) -> None:
    """Refuses state a state-tree checkpoint cannot hold: two variables of one collection at one path.

    The tree keys each variable by `variable.path`, so the second of two
    variables at one path would overwrite the first (Keras'
    `Model.get_state_tree()` refuses them too). In the optimizer's
    collection it is the optimizer's doing, not the model's: Keras'
    `Adafactor` names each factored slot after its variable's short name
    (`adafactor/kernel` for the row and the column factor of every kernel,
    `bias` for the placeholders of every 1-D variable).

    Args:
        groups: `{collection: [variables]}` (`collections`).
        optimizer: The model's optimizer, named in the message.
        loading: The check is a restore's (the checkpoint holds these
            collections): the fix says how to load instead of how to save.
            A restore keyed by path would fill one of the variables and
            leave the others as they are.

    Raises:
        DuplicateStateKeyError: naming the path, the shapes found there, and the fix.
    """
    for name, variables in groups.items():
        seen: dict[str, list[Any]] = {}
        for variable in variables:
            seen.setdefault(variable.path, []).append(variable)
        twice = {path: found for path, found in seen.items() if len(found) > 1}
        if not twice:
            continue
        path, found = next(iter(twice.items()))
        shapes = ", ".join(str(tuple(v.shape)) for v in found)
        where = f"{len(found)} variables of collection {name!r} share the path {path!r} (shapes {shapes})"
        more = f"; {len(twice) - 1} other path(s) are shared as well" if len(twice) > 1 else ""
        if name == "optimizer_variables":
            who = (
                f"Optimizer {getattr(optimizer, 'name', optimizer)!r} ({type(optimizer).__name__}) names "
                "these slots after the variable's short name, not its path (Keras' Adafactor does so for "
                "its factored slots)."
            )
            if loading:
                raise DuplicateStateKeyError(
                    f"{where}{more}: the checkpoint keys every variable by its path, so it holds one array "
                    f"there for all of them, and loading would fill one and leave the others. {who} Fix: "
                    "load the weights alone (load_sharded into the model before compile(); the optimizer "
                    "then starts afresh), or restore the whole state from a .keras file saved with "
                    "model.save('model.keras') (it keys optimizer variables by position; "
                    f"shardckpt.load_sharded reads it). Received: path={path!r}"
                )
            raise DuplicateStateKeyError(
                f"{where}{more}: a state-tree checkpoint keys every variable by its path, as Keras' "
                f"model.get_state_tree() does, and cannot hold them. {who} Fix: save_weights_only=True "
                "(the optimizer starts afresh on resume), save the whole state with "
                "model.save('model.keras') (it keys optimizer variables by position; shardckpt.load_sharded "
                "reads it), or use an optimizer that names its slots by variable path (Adam, Lion, Lamb, "
                f"...). Received: path={path!r}"
            )
        if loading:
            raise DuplicateStateKeyError(
                f"{where}{more}: the checkpoint keys every variable by its path, so it holds one array "
                "there for all of them, and loading would fill one and leave the others. Fix: load from a "
                ".weights.h5 or .keras file (Keras keys variables by their position in the model), or give "
                f"the variables unique names and save the checkpoint again. Received: path={path!r}"
            )
        raise DuplicateStateKeyError(
            f"{where}{more}: a state-tree checkpoint keys every variable by its path and cannot hold "
            f"them. Fix: give unique names to your layers (and other objects). Received: path={path!r}"
        )
