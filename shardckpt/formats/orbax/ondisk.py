"""Orbax checkpoints on disk: every name and rule the reader, writer, inspect and training share.

A root folder holds one folder per step (`0/`, `100/`, ...). Orbax writes a
step into a `*.orbax-checkpoint-tmp*` folder and renames it when complete, so
only integer-named folders are committed steps. A step holds checkpointables
("items"): `pytree/` is the state tree of arrays (an OCDBT key-value store
with one zarr array per leaf, listed in its `_METADATA`), and shardckpt's
training callback adds two JSON items beside it. The step's own
`_CHECKPOINT_METADATA` records the items' handlers and `custom_metadata`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import orbax.checkpoint.experimental.v1 as ocp
from etils import epath
from orbax.checkpoint import type_handlers

from shardckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, IncompleteCheckpointError

TMP_MARK = ".orbax-checkpoint-tmp"
"""In the name of a step folder Orbax has not committed (yet, or ever)."""
STEP_METADATA = "_CHECKPOINT_METADATA"
"""The step's own metadata file (item handlers, `custom_metadata`)."""
TREE_METADATA = "_METADATA"
"""The array tree's metadata file inside the arrays item."""
COMMIT_MARKER = "commit_success.txt"
"""Orbax's commit marker for file systems without atomic rename."""
CHECKPOINT_INDICATOR = "orbax.checkpoint"
"""Orbax's (empty) file saying that a folder is a checkpoint step."""

ARRAYS_ITEM = "pytree"
"""The arrays item Keras' callback, `model.load_weights` and shardckpt use."""
TREE_ITEMS = (ARRAYS_ITEM, "default", "state")
"""Where a step's arrays may live: also Orbax v0 `CheckpointManager` defaults."""
METADATA_ITEM = "shardckpt_metadata"
"""shardckpt's JSON item: step, epoch, logs, versions, layout, user metadata."""
ITERATOR_ITEM = "data_iterator"
"""shardckpt's JSON item: every process's data-iterator state."""
PYTREE_HANDLER = "orbax.checkpoint.experimental.v1._src.handlers.pytree_handler.PyTreeHandler"
"""The handler Orbax records for an arrays item (Keras reads the item by name)."""


def committed_steps(root: str) -> list[int]:
    """Returns the committed step numbers under an Orbax root, ascending."""
    steps = []
    for name in os.listdir(root):
        full = os.path.join(root, name)
        if name.isdigit() and os.path.isdir(full):
            steps.append(int(name))
    return sorted(steps)


def incomplete_steps(root: str) -> list[str]:
    """Names of the half-written step folders under an Orbax root."""
    return sorted(n for n in os.listdir(root) if TMP_MARK in n)


def latest_step_dir(directory: str) -> str | None:
    """Returns the latest committed step folder under `directory`, or None.

    Half-written steps are never returned.
    """
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        return None
    steps = committed_steps(directory)
    return os.path.join(directory, str(steps[-1])) if steps else None


def is_orbax_dir(path: str) -> bool:
    """True for an Orbax root or step folder (committed or not)."""
    if not os.path.isdir(path):
        return False
    names = os.listdir(path)
    if STEP_METADATA in names or TREE_METADATA in names or TMP_MARK in path:
        return True
    return any(n.isdigit() or TMP_MARK in n for n in names) or any(
        os.path.isfile(os.path.join(path, n, TREE_METADATA)) for n in names
    )


def resolve_step(path: str) -> str:
    """Maps an Orbax root to its latest committed step; checks a step folder.

    Raises:
        CheckpointNotFoundError: no committed step under the root.
        IncompleteCheckpointError: the path is a half-written step, or the root
            holds only half-written steps.
    """
    path = os.path.abspath(os.fspath(path))
    if TMP_MARK in os.path.basename(path):
        raise IncompleteCheckpointError(
            f"{path!r} is a step Orbax never committed (its save was interrupted). "
            "Fix: load the checkpoint root or a committed step; shardckpt ignores "
            "and OrbaxCheckpoint cleans such folders."
        )
    names = os.listdir(path)
    if STEP_METADATA in names or any(n in names for n in TREE_ITEMS) or TREE_METADATA in names:
        return path
    steps = committed_steps(path)
    if steps:
        return os.path.join(path, str(steps[-1]))
    if any(TMP_MARK in n for n in names):
        raise IncompleteCheckpointError(
            f"{path!r} holds only half-written steps ({sorted(names)}); no save "
            "finished. Fix: let a save complete, or restore from another checkpoint."
        )
    raise CheckpointNotFoundError(f"No committed Orbax step under {path!r}.")


def tree_dir(step: str) -> str:
    """The folder of a step's array tree (the step itself for a bare tree).

    Raises:
        IncompleteCheckpointError: it has no `_METADATA` file.
    """
    for name in TREE_ITEMS:
        if os.path.isdir(os.path.join(step, name)):
            tree = os.path.join(step, name)
            break
    else:
        tree = step
    if not os.path.isfile(os.path.join(tree, TREE_METADATA)):
        raise IncompleteCheckpointError(
            f"{tree!r} has no {TREE_METADATA} file: the step is incomplete or not "
            "an Orbax pytree checkpoint. Fix: restore from another step."
        )
    return tree


def items(step_dir: str) -> list[str]:
    """The checkpointables of a step ("pytree", "model_config", ...), sorted."""
    return sorted(
        n for n in os.listdir(step_dir) if os.path.isdir(os.path.join(step_dir, n)) and not n.startswith((".", "_"))
    )


def read_json_item(step_dir: str, name: str) -> Any:
    """Returns JSON checkpointable `name` of a step, or None if it has none.

    Raises:
        CorruptCheckpointError: the item exists but cannot be read.
    """
    if not os.path.isdir(os.path.join(step_dir, name)):
        return None
    try:
        return ocp.load_checkpointables(step_dir, {name: None})[name]
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise CorruptCheckpointError(
            f"Cannot read item {name!r} of checkpoint step {step_dir!r}: {e}. Fix: "
            "delete this step folder to resume from the previous one."
        ) from e


def param_name(parts: Sequence[str]) -> str:
    """Orbax's parameter name (its OCDBT key prefix) for a nested-dict tree path."""
    return ".".join(parts)


def ts_context() -> Any:
    """The tensorstore context spec Orbax uses for OCDBT checkpoints."""
    return type_handlers.get_ts_context(use_ocdbt=True)


def param_info(
    name: str, tree: str, *, context: Any, use_zarr3: bool = True, use_compression: bool = True
) -> Any:
    """Orbax's `ParamInfo` for array `name` of the tree in folder `tree`.

    Reader and writer pass it to Orbax's own tensorstore spec builders
    (`get_json_tspec_read` / `get_json_tspec_write`), so both open arrays
    exactly as Orbax does.
    """
    return type_handlers.ParamInfo(
        name=name,
        parent_dir=epath.Path(tree),
        is_ocdbt_checkpoint=True,
        use_compression=use_compression,
        use_zarr3=use_zarr3,
        ts_context=context,
    )


def is_zarr3(tree: str, name: str) -> bool:
    """Orbax >= 0.9 writes zarr3; older checkpoints used zarr v2 (`.zarray`)."""
    return not os.path.exists(os.path.join(tree, name, ".zarray"))
