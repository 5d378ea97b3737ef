"""Orbax checkpoints on disk: every name and rule the reader, writer, inspect and training share.

A root folder holds one folder per step (`0/`, `100/`, ...). Orbax writes a
step into a `*.orbax-checkpoint-tmp*` folder and renames it when complete, so
only integer-named folders are committed steps. A step holds checkpointables
("items"): `pytree/` is the state tree of arrays (an OCDBT key-value store
with one zarr array per leaf, listed in its `_METADATA`), and shardckpt's
training callback adds two JSON items beside it. The step's own
`_CHECKPOINT_METADATA` records the items' handlers and `custom_metadata`.

In a bucket (`gs://`, `s3://`; see `shardckpt.storage`) there is no
rename (the backend's `renames` is False): a step is written under its final name and counts as committed only
once its `commit_success.txt` exists, the object Orbax itself writes last on
GCS and shardckpt's writer writes last everywhere. Each function below takes
a local path or a bucket URL.

A step leaves the committed set as atomically as it entered it
(`formats.orbax.removal`): a local step is renamed out of the integer
namespace (`<step>.shardckpt-deleting-*`) before any of its files is removed;
in a bucket its commit marker is deleted first. A local integer-named folder
that lacks `_CHECKPOINT_METADATA`, or an item that file records, or an array
item's `_METADATA` / OCDBT manifest, is what an in-place delete (Orbax's
`rmtree`, an older shardckpt, Keras' own callback) left when it was killed:
it is not committed, and `committed_steps` and `incomplete_steps` say so.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Sequence
from typing import Any

import jax
from etils import epath
from orbax.checkpoint import type_handlers

from shardckpt import storage
from shardckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, IncompleteCheckpointError
from shardckpt.storage import commit

_log = logging.getLogger("shardckpt")

TMP_MARK = ".orbax-checkpoint-tmp"
"""In the name of a step folder Orbax has not committed (yet, or ever)."""
STEP_METADATA = "_CHECKPOINT_METADATA"
"""The step's own metadata file (item handlers, `custom_metadata`)."""
TREE_METADATA = "_METADATA"
"""The array tree's metadata file inside the arrays item."""
COMMIT_MARKER = "commit_success.txt"
"""Orbax's commit marker for storage without atomic rename (in buckets: written last)."""
CHECKPOINT_INDICATOR = "orbax.checkpoint"
"""Orbax's (empty) file saying that a folder is a checkpoint step."""

ARRAYS_ITEM = "pytree"
"""The arrays item Keras' callback, `model.load_weights` and shardckpt use."""
TREE_ITEMS = (ARRAYS_ITEM, "default", "state")
"""Where a step's arrays may live: also Orbax v0 `CheckpointManager` defaults."""
ASSETS_ITEM = "assets"
"""Keras' asset files (vocabularies) of a full save: a tree of uint8 arrays, one per file."""
METADATA_ITEM = "shardckpt_metadata"
"""shardckpt's JSON item: step, epoch, logs, versions, layout, user metadata."""
ITERATOR_ITEM = "data_iterator"
"""shardckpt's JSON item: every process's data-iterator state."""
_HANDLERS = "orbax.checkpoint.experimental.v1._src.handlers."  # names recorded in _CHECKPOINT_METADATA
PYTREE_HANDLER = _HANDLERS + "pytree_handler.PyTreeHandler"
"""The handler Orbax records for an arrays item (Keras reads the item by name)."""
JSON_HANDLER = _HANDLERS + "json_handler.JsonHandler"
"""The handler Orbax records for a JSON item."""
METRICS_HANDLER = _HANDLERS + "json_handler.MetricsHandler"
"""The handler Orbax's training Checkpointer records for the metrics item."""
METRICS_ITEM = "metrics"
"""The item (and its one file's name) Orbax's training Checkpointer stores step metrics in."""
SHARDING_FILE = "_sharding"
"""Beside an item's `_METADATA`: each array's sharding, in Orbax's serialized form."""
STRINGS_FILE = "_strings.json"
"""The file of an item of string leaves (Orbax's StringHandler; Keras' `model_config`)."""
DICT_KEY = 2
"""Orbax's KeyType.DICT in `key_metadata`."""


JSON_ITEM_FILES = ("data.json", "metadata")
"""The file names Orbax's JsonHandler reads a JSON item from."""
OCDBT_MANIFEST = "manifest.ocdbt"
"""The OCDBT store's manifest, beside its `d/` data folder in an array item."""
DELETING_MARK = commit.WITHDRAW_MARK
"""In the name a step is renamed to before its files are removed (never a committed step)."""
CONVERT_TMP_MARK = commit.PRIVATE_MARK
"""In the name of `convert`'s hidden temporary folder beside its destination (`.<dst>.shardckpt-tmp-*`)."""


@dataclasses.dataclass
class _Listing:
    """One listing of a folder through its backend: what step rules look at.

    Attributes:
        location: The folder listed.
        renames: Whether its backend commits a step by renaming it (else:
            by the commit marker written last; `shardckpt.storage.commit`).
        keys: Every file or object key under it, relative, sorted.
        folders: The names of the folders directly under it.
    """

    location: storage.Location
    renames: bool
    keys: list[str]
    folders: set[str]

    def under(self, name: str) -> list[str]:
        """The keys inside folder `name`, relative to it."""
        prefix = name + "/"
        return [k[len(prefix):] for k in self.keys if k.startswith(prefix)]

    @property
    def heads(self) -> set[str]:
        """Every name directly under the folder (files, objects, folders)."""
        return {k.split("/", 1)[0] for k in self.keys} | self.folders


def _list(location: storage.Location) -> _Listing:
    """Lists `location` once (one listing request in a bucket); an absent folder lists as empty."""
    keys = storage.list_keys(location)
    folders = {k.split("/", 1)[0] for k in keys if "/" in k}
    if location.local_path is not None and storage.isdir(location):
        # A file system also has folders that hold no file yet (a save that had just begun).
        folders |= {n for n in storage.listdir(location) if n not in folders and storage.isdir(location.join(n))}
    return _Listing(location, commit.renames(location), keys, folders)


def _not_whole(step: storage.Location, keys: list[str], *, renames: bool) -> str:
    """What a step (its `keys`, relative) lacks to be committed; "" when it is whole.

    In a bucket a step is committed exactly when its `COMMIT_MARKER` exists
    (written last, deleted first). On a file system (commit by rename) a
    committed Orbax step holds `_CHECKPOINT_METADATA` (written at commit),
    every item that file records, and each array item's `_METADATA` and,
    when it stores data in OCDBT, its manifest: a kill during an in-place
    delete (`rmtree` goes in directory order) leaves a folder without some.
    """
    heads = {k.split("/", 1)[0] for k in keys}
    if not renames:
        return "" if COMMIT_MARKER in heads else f"its {COMMIT_MARKER}"
    if STEP_METADATA not in heads:
        return f"its {STEP_METADATA}"
    try:
        handlers = json.loads(storage.read_bytes(step.join(STEP_METADATA)) or b"").get("item_handlers")
    except (OSError, ValueError, AttributeError):
        return f"a readable {STEP_METADATA}"
    if not isinstance(handlers, dict):
        return ""  # a bare tree's metadata (no items recorded): the tree check is the reader's
    for item, handler in sorted(handlers.items()):
        inside = {k.split("/", 2)[1] for k in keys if k.startswith(item + "/")}
        if not inside:
            return f"its item {item!r}"
        if str(handler).endswith(_TREE_HANDLERS):
            if TREE_METADATA not in inside:
                return f"{item}/{TREE_METADATA}"
            stores = "d" in inside or any(n.startswith("ocdbt.process_") for n in inside)
            if stores and OCDBT_MANIFEST not in inside:
                return f"{item}/{OCDBT_MANIFEST}"
        elif handler in (JSON_HANDLER, METRICS_HANDLER) and not inside & {*JSON_ITEM_FILES, METRICS_ITEM}:
            return f"the data file of {item}/"
    return ""


_TREE_HANDLERS = ("PyTreeHandler", "PyTreeCheckpointHandler", "StandardCheckpointHandler")
"""The ends of the handler names (Orbax v1 and v0) whose items are array trees."""


def _scan(root: str | storage.Location | _Listing) -> tuple[list[int], list[tuple[str, str]]]:
    """The committed steps of an Orbax root and its leftovers (name, why), from one listing.

    The one implementation of which steps count, for a local folder and a
    bucket alike: `committed_steps`, `incomplete_steps`, `leftovers`,
    `latest_step` and `resolve_step` all answer from it.
    """
    listing = root if isinstance(root, _Listing) else _list(storage.parse(root))
    committed, found = [], []
    for name in sorted(listing.folders):
        if TMP_MARK in name:
            found.append((name, "a step whose save was interrupted"))
        elif DELETING_MARK in name:
            found.append((name, "a step whose delete was interrupted"))
        elif name.isdigit():
            missing = _not_whole(listing.location.join(name), listing.under(name), renames=listing.renames)
            if missing:
                found.append((name, f"a step without {missing} (a save or delete of it was interrupted, or damage)"))
            else:
                committed.append(int(name))
    return sorted(committed), found


def committed_steps(root: str | storage.Location) -> list[int]:
    """Returns the committed step numbers under an Orbax root, ascending (see `_not_whole`)."""
    return _scan(root)[0]


def missing_part(step_dir: str | storage.Location) -> str:
    """What a step folder lacks to be a committed step; "" when it is whole (see `_not_whole`)."""
    location = storage.parse(step_dir)
    return _not_whole(location, storage.list_keys(location), renames=commit.renames(location))


def incomplete_steps(root: str | storage.Location) -> list[str]:
    """Names of the half-written or half-deleted step folders under an Orbax root.

    Orbax's temporary folders, folders being deleted (`DELETING_MARK`) and
    integer-named folders that are not committed (`_not_whole`).
    """
    return [name for name, _ in leftovers(root)]


def leftovers(root: str | storage.Location) -> list[tuple[str, str]]:
    """`incomplete_steps` with, for each, why it is not a committed step (for the log line)."""
    return _scan(root)[1]


def latest_step_dir(directory: str) -> str | None:
    """Returns the latest committed step folder under `directory`, or None.

    Half-written steps are never returned.
    """
    location = storage.parse(os.fspath(directory))
    steps = committed_steps(location)
    return location.join(str(steps[-1])).url if steps else None


def is_orbax_dir(path: str | storage.Location) -> bool:
    """True for an Orbax root or step folder (committed or not)."""
    location = storage.parse(path)
    if not commit.renames(location):
        keys = storage.list_keys(location)
        heads = {key.split("/", 1)[0] for key in keys}
        return (
            bool(heads & {STEP_METADATA, TREE_METADATA, *TREE_ITEMS})
            or any(n.isdigit() for n in heads)
            or any(key.count("/") == 1 and key.endswith("/" + TREE_METADATA) for key in keys)
        )
    path = location.path
    if not os.path.isdir(path):
        return False
    names = os.listdir(path)
    if STEP_METADATA in names or TREE_METADATA in names or TMP_MARK in path or DELETING_MARK in path:
        return True
    return any(n.isdigit() or TMP_MARK in n or DELETING_MARK in n for n in names) or any(
        os.path.isfile(os.path.join(path, n, TREE_METADATA)) for n in names
    )


def resolve_step(path: str | storage.Location) -> str:
    """Maps an Orbax root to its latest committed step; checks a step folder.

    Raises:
        CheckpointNotFoundError: no committed step under the root, and
            nothing left by an interrupted save or delete either.
        IncompleteCheckpointError: the path is a half-written or half-deleted
            step, or the root holds only such steps (`leftovers`).
    """
    location = storage.parse(path)
    shown = location.url
    base = location.name
    if TMP_MARK in base or DELETING_MARK in base:
        what = "Orbax never committed (its save was interrupted)" if TMP_MARK in base else (
            "being deleted (its delete was interrupted)")
        raise IncompleteCheckpointError(
            f"{shown!r} is a step {what}. Fix: load the checkpoint root or a committed step; shardckpt "
            "ignores such folders and OrbaxCheckpoint removes them when it starts."
        )
    listing = _list(location)
    names = listing.heads
    if not names:
        raise storage.not_found(location, what="an Orbax checkpoint: a root of step folders, or one step")
    if listing.renames and TREE_METADATA in names:
        return shown  # a bare array tree
    if STEP_METADATA in names or names & set(TREE_ITEMS) or TREE_METADATA in names:
        missing = _not_whole(location, listing.keys, renames=listing.renames)
        if missing:
            raise IncompleteCheckpointError(
                f"{shown!r} is not a whole step, never committed or half-deleted: it lacks {missing} (a save "
                "or a delete of it was interrupted, or is still running). Fix: load the checkpoint root or "
                "another step, or let the save finish; OrbaxCheckpoint removes such folders when it starts."
            )
        return shown
    return _latest(listing)


def latest_step(root: str | storage.Location) -> str:
    """The latest committed step folder (or bucket URL) under an Orbax root.

    The one answer `load_sharded`, `inspect`, `restore_latest` and a resuming
    `OrbaxCheckpoint` give: the newest whole step.

    Raises:
        CheckpointNotFoundError: no committed step, and nothing left by an
            interrupted save or delete either (an empty or missing root).
        IncompleteCheckpointError: the root holds only what interrupted saves
            or deletes left (`leftovers`).
    """
    return _latest(_list(storage.parse(root)))


def _latest(listing: _Listing) -> str:
    location = listing.location
    steps, found = _scan(listing)
    if steps:
        _warn_newer(location.url, steps[-1], _newer(steps[-1], found))
        return location.join(str(steps[-1])).url
    if found:
        raise _only_leftovers(location.url, found)
    if not storage.isdir(location):
        raise CheckpointNotFoundError(f"No committed Orbax step under {location.url!r}: it does not exist.")
    raise CheckpointNotFoundError(f"No committed Orbax step under {location.url!r}.")


def newer_uncommitted(root: str | storage.Location) -> list[tuple[str, str]]:
    """The step folders newer than the latest committed step that are not committed (name, why).

    What a save killed before its commit left (or one still running): the
    latest committed step is older than the newest save. Folders being
    deleted are left out (their step was meant to go). [] when the root
    holds no committed step (`latest_step` raises then).
    """
    steps, found = _scan(root)
    return _newer(steps[-1], found) if steps else []


def _newer(step: int, found: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The leftovers in `found` whose step number is above `step`, oldest first."""
    newer = []
    for name, why in found:
        number = name.split(".", 1)[0]
        if DELETING_MARK not in name and number.isdigit() and int(number) > step:
            newer.append((int(number), name, why))
    return [(name, why) for _, name, why in sorted(newer)]


_warned_newer: set[tuple[str, tuple[str, ...]]] = set()
"""(root, folder names) already warned about: a load opens its reader more than once, one line is enough."""


def _warn_newer(root: str, step: int, newer: list[tuple[str, str]]) -> None:
    """Says once per root and set of folders that the newer, uncommitted steps were passed over.

    Process 0 alone says it: under `jax.distributed` every process lists the
    same root and would print the same line.
    """
    key = (root, tuple(name for name, _ in newer))
    if not newer or key in _warned_newer or jax.process_index() != 0:
        return
    _warned_newer.add(key)
    _log.warning(
        "%r: using step %d, the latest committed one; passed over %d newer step folder(s) that are not "
        "committed: %s. A save of them was interrupted (or is still running): what they hold is not restored. "
        "Fix: if a save is running, let it finish and load again; else the run resumes from step %d "
        "(OrbaxCheckpoint removes such folders when it starts).",
        root, step, len(newer), "; ".join(f"{name} ({why})" for name, why in newer), step)


def _only_leftovers(root: str, found: list[tuple[str, str]]) -> IncompleteCheckpointError:
    listed = "; ".join(f"{name}: {why}" for name, why in found[:8])
    more = f" and {len(found) - 8} more" if len(found) > 8 else ""
    return IncompleteCheckpointError(
        f"{root!r} holds no committed step, only {len(found)} half-written or half-deleted step folder(s) "
        f"({listed}{more}): an interrupted save or delete left them. Fix: let a save complete, or restore "
        "from another checkpoint; OrbaxCheckpoint removes them when it starts."
    )


def tree_dir(step: str | storage.Location) -> str:
    """The folder of a step's array tree (the step itself for a bare tree), local or in a bucket.

    Raises:
        IncompleteCheckpointError: it has no `_METADATA` file.
    """
    location = storage.parse(step)
    names = storage.listdir(location) if storage.isdir(location) else []
    item = next((n for n in TREE_ITEMS if n in names and storage.isdir(location.join(n))), None)
    tree = location.join(item) if item else location
    if not storage.exists(tree.join(TREE_METADATA)):
        raise IncompleteCheckpointError(
            f"{tree.url!r} has no {TREE_METADATA} file: the step is incomplete or not "
            "an Orbax pytree checkpoint. Fix: restore from another step."
        )
    return tree.url


def items(step_dir: str | storage.Location) -> list[str]:
    """The checkpointables of a step ("pytree", "model_config", ...), sorted: its folders that hold a file."""
    keys = storage.list_keys(storage.parse(step_dir))
    return sorted({k.split("/", 1)[0] for k in keys if "/" in k and not k.startswith((".", "_"))})


def read_json_item(step_dir: str | storage.Location, name: str) -> Any:
    """Returns JSON checkpointable `name` of a step, or None if it has none.

    The item's one file is read whole, from the names Orbax's JsonHandler
    reads (`JSON_ITEM_FILES`), alike on a disk and in a bucket (where Orbax's
    epath has no `s3://`).

    Raises:
        CorruptCheckpointError: the item exists but is not valid JSON, or has no such file.
    """
    location = storage.parse(step_dir)
    for filename in JSON_ITEM_FILES:
        value = storage.read_json(
            location.join(name, filename), fix="delete this step to resume from the previous one.", missing_ok=True
        )
        if value is not None:
            return value
    if storage.isdir(location.join(name)):
        raise CorruptCheckpointError(
            f"Item {name!r} of checkpoint step {location.url!r} has none of the files Orbax's JsonHandler "
            f"writes ({', '.join(JSON_ITEM_FILES)}): the item is damaged. Fix: delete this step folder to "
            "resume from the previous one."
        )
    return None


def short(error: BaseException, limit: int = 200) -> str:
    """The first line of an error's text, cut at `limit` characters.

    Orbax's errors append its whole handler registry (about a kilobyte) to
    their first line; the cause stays chained for whoever needs it.
    """
    text = (str(error).strip().splitlines() or [""])[0]
    at = text.lower().find("registry")
    if at >= 0:
        text = text[:at].rsplit(" found in", 1)[0].rstrip(" :,(")
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return text + (" (Orbax's handler registry left out)" if at >= 0 else "")


def read_json(path: str) -> Any:
    """Reads a small JSON file of a checkpoint (`_METADATA`, ...), local or in a bucket.

    Raises:
        CorruptCheckpointError: missing or not valid JSON.
    """
    try:
        return storage.read_json(storage.parse(path), fix="restore from another step.")
    except CheckpointNotFoundError as e:
        raise CorruptCheckpointError(f"Cannot read {path!r}: {e}") from e


def write_json(path: str, value: Any) -> None:
    """Writes a small JSON file of a checkpoint, local or in a bucket (one object write)."""
    storage.write_bytes(storage.parse(path), json.dumps(value).encode())


def join(path: str, *names: str) -> str:
    """`os.path.join` for local paths and bucket URLs alike."""
    return storage.parse(path).join(*names).url


def tree_metadata(leaves: dict[tuple[str, ...], dict[str, Any]]) -> dict[str, Any]:
    """An item's `_METADATA` document: `leaves` maps each tree path to its `value_metadata`."""
    tree = {
        str(parts): {"key_metadata": [{"key": p, "key_type": DICT_KEY} for p in parts], "value_metadata": value}
        for parts, value in leaves.items()
    }
    return {
        "tree_metadata": tree,
        "use_ocdbt": True,
        "use_zarr3": True,
        "store_array_data_equal_to_fill_value": True,
        "custom_metadata": None,
    }


def param_name(parts: Sequence[str]) -> str:
    """Orbax's parameter name (its OCDBT key prefix) for a nested-dict tree path."""
    return ".".join(parts)


def ts_context() -> Any:
    """The tensorstore context spec Orbax uses for OCDBT checkpoints."""
    return type_handlers.get_ts_context(use_ocdbt=True)


def param_info(
    name: str, tree: str | storage.Location, *, context: Any, use_zarr3: bool = True, use_compression: bool = True
) -> Any:
    """Orbax's `ParamInfo` for array `name` of the tree in folder `tree`.

    Reader and writer pass it to Orbax's own tensorstore spec builders
    (`get_json_tspec_read` / `get_json_tspec_write`), so both open arrays
    exactly as Orbax does. For a tree in a bucket the spec is built for a
    placeholder folder; `tspec_for` then points it at the bucket.
    """
    location = storage.parse(tree)
    return type_handlers.ParamInfo(
        name=name,
        parent_dir=epath.Path(location.local_path or PLACEHOLDER_DIR),
        is_ocdbt_checkpoint=True,
        use_compression=use_compression,
        use_zarr3=use_zarr3,
        ts_context=context,
    )


def tspec_for(spec: dict[str, Any], tree: str, *, manifest: dict[str, Any] | None = None) -> dict[str, Any]:
    """A tensorstore spec Orbax built (from `param_info`) for the tree in `tree`.

    Local trees: unchanged. Bucket trees: the OCDBT store's base is the bucket
    (see `ocdbt_kvstore`); `manifest`, when given, is the kvstore the OCDBT
    manifest is read from instead (a reader's pinned copy).
    """
    location = storage.parse(tree)
    if location.local_path is None:
        spec = dict(spec, kvstore=ocdbt_kvstore(spec["kvstore"], location, manifest=manifest))
    return spec


PLACEHOLDER_DIR = "/shardckpt-bucket-placeholder"
"""The local folder Orbax builds a bucket's specs for (never touched: see `ocdbt_kvstore`)."""


def ocdbt_kvstore(
    kvstore: dict[str, Any], tree: storage.Location, *, manifest: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Points an OCDBT kvstore spec built by Orbax for a local folder at `tree`.

    Orbax builds its TensorStore specs (`type_handlers.get_json_tspec_read` /
    `_write`) for local paths and `gs://` only; shardckpt builds them for a
    placeholder folder and swaps in the store here, so codecs, chunking and
    OCDBT settings stay Orbax's own for every backend.
    """
    spec = dict(kvstore)
    spec["base"] = storage.kvstore(tree)
    spec.pop("manifest", None)  # the local spec's manifest override is a file path
    if manifest is not None:
        spec["manifest"] = manifest
    return spec

