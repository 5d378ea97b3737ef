"""Every use of Orbax internals, in one place: the upgrade surface behind the Orbax pin.

shardckpt uses Orbax's public API (`orbax.checkpoint.experimental.v1`,
`type_handlers`) wherever one exists. What is here has none; each entry says
why it is needed and who uses it:

- `sharding` metadata (formats.orbax.writer): the `_sharding` file Orbax
  writes beside an array tree, in Orbax's own serialized form, so that
  Orbax and Keras restore our steps with the shardings they were saved with.
- `preservation_policy.PreservationContext` (training.step_save): the
  argument of a `PreservationPolicy.should_preserve` call; the bucket
  checkpointer applies Keras' / Orbax's retention policies itself, as
  Orbax's `Checkpointer` does for local folders.
- `tensorstore_utils.build_array_write_spec` (training.saving, through
  `checksum_saves_under`): every array Orbax writes gets its zarr3 metadata
  from this function, and no Orbax option adds a codec. shardckpt's local
  `OrbaxCheckpoint` saves through Orbax's own `Checkpointer`; to give its
  chunks the `crc32c` checksum its own writer stores (`add_chunk_checksums`),
  the function is wrapped once, and the wrapper changes only the specs of
  arrays under a folder registered here, so Orbax saves elsewhere (Keras'
  own callback included) are written exactly as Orbax writes them.
- `tensorstore_utils.build_kvstore_tspec` (formats.orbax.writer,
  `merge_kvstore_spec`): the OCDBT kvstore spec of Orbax's merge of
  per-process stores (`ocdbt.process_N`) into the item's own store at a
  multi-process commit (`ocdbt_utils.merge_ocdbt_per_process_files` does the
  same, but finds the stores through etils' epath, which has no `s3://`).
- `Checkpointer._manager._checkpoint_deleter` (training.saving, through
  `replace_step_deleter`): every step Orbax's `Checkpointer` deletes (by its
  preservation policy, or by `delete`) goes through this object, and Orbax's
  own removes a step in place (`rmtree`, directory order), so a kill leaves
  an integer-named folder that looks committed. Its `todelete_subdir` option
  renames first but is not reachable from the v1 `Checkpointer` and never
  removes the files. shardckpt's deleter (`formats.orbax.removal`) renames
  the step out of the committed set first, then removes it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
from orbax.checkpoint._src.checkpoint_managers import preservation_policy
from orbax.checkpoint._src.metadata import sharding as sharding_metadata
from orbax.checkpoint._src.serialization import tensorstore_utils as _ts_utils

__all__ = [
    "PROCESS_STORE_PREFIX", "add_chunk_checksums", "checksum_saves_under", "merge_kvstore_spec",
    "preservation_policy", "replace_step_deleter", "sharding_metadata",
]

PROCESS_STORE_PREFIX = _ts_utils.PROCESS_SUBDIR_PREFIX
"""The name of a process's own OCDBT store in a multi-process save, before its index ("ocdbt.process_")."""

CHECKSUM_CODEC = {"name": "crc32c"}
"""zarr3's bytes -> bytes codec appending a CRC-32C to each stored chunk;
tensorstore checks it on every decode ("DATA_LOSS ... Digest mismatch")."""

_roots: set[str] = set()
_lock = threading.Lock()
_installed = False


def add_chunk_checksums(spec: dict[str, Any]) -> dict[str, Any]:
    """Adds a `crc32c` codec to every chunk of a zarr3 write spec Orbax built.

    The checksum goes last in the inner chunks' codec chain of Orbax's
    `sharding_indexed` codec, so it covers each chunk's stored bytes (after
    zstd, when compressed). Orbax already checksums each shard's index
    (`index_codecs`). Specs of other drivers (zarr v2) are returned unchanged.

    Args:
        spec: A tensorstore spec from Orbax's `get_json_tspec_write` /
            `build_array_write_spec(...).json` (possibly wrapped in `cast`).

    Returns:
        `spec`, changed in place.
    """
    base = spec.get("base", spec) if spec.get("driver") == "cast" else spec
    for codec in (base.get("metadata") or {}).get("codecs") or ():
        if codec.get("name") == "sharding_indexed":
            inner = codec.setdefault("configuration", {}).setdefault("codecs", [])
            if CHECKSUM_CODEC not in inner:
                inner.append(dict(CHECKSUM_CODEC))
    return spec


def checksum_saves_under(directory: str | os.PathLike) -> None:
    """Makes every array Orbax writes under `directory` carry per-chunk checksums.

    Args:
        directory: A local checkpoint root (`OrbaxCheckpoint`'s directory).
    """
    global _installed
    with _lock:
        _roots.add(os.path.join(os.path.abspath(os.fspath(directory)), ""))
        if _installed:
            return
        original = _ts_utils.build_array_write_spec

        def build_array_write_spec(info: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(info, *args, **kwargs)
            parent = os.path.join(os.path.abspath(os.fspath(info.parent_dir)), "")
            if any(parent.startswith(root) for root in tuple(_roots)):
                add_chunk_checksums(result.json)
            return result

        _ts_utils.build_array_write_spec = build_array_write_spec
        _installed = True


def merge_kvstore_spec(directory: str) -> dict[str, Any]:
    """The OCDBT kvstore spec Orbax opens an item's store with to merge the per-process stores into it.

    Args:
        directory: The item's local folder (callers swap in a bucket's base).
    """
    options = _ts_utils.OcdbtKvStoreWriteOptions(mode=_ts_utils.OcdbtWriteMode.MERGE)
    return _ts_utils.build_kvstore_tspec(directory, use_ocdbt=True, ocdbt_write_options=options)


class _StepDeleter:
    """Orbax's `CheckpointDeleter` protocol over `delete(step)`, run by the primary process only (as Orbax's)."""

    def __init__(self, delete: Callable[[int], None]) -> None:
        self._delete = delete

    def delete(self, step: int) -> None:
        if jax.process_index() == 0:
            self._delete(step)

    def delete_steps(self, steps: Sequence[int]) -> None:
        for step in steps:
            self.delete(step)

    def close(self) -> None:
        """Nothing runs in the background."""


def replace_step_deleter(checkpointer: Any, delete: Callable[[int], None]) -> None:
    """Makes an Orbax v1 `training.Checkpointer` delete every step with `delete(step)`.

    Args:
        checkpointer: The `ocp.training.Checkpointer`.
        delete: Removes one step (called on process 0 only, after the
            Checkpointer dropped the step from its list).

    Raises:
        RuntimeError: this Orbax version keeps its deleter elsewhere.
    """
    manager = getattr(checkpointer, "_manager", None)
    if manager is None or not hasattr(manager, "_checkpoint_deleter"):
        raise RuntimeError(
            f"orbax-checkpoint's Checkpointer has no step deleter where shardckpt expects it "
            f"(_manager._checkpoint_deleter). Fix: install the orbax-checkpoint version shardckpt pins. "
            f"Received: {type(checkpointer).__name__}")
    manager._checkpoint_deleter.close()
    manager._checkpoint_deleter = _StepDeleter(delete)
