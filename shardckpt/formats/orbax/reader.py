"""Reading one step of an Orbax checkpoint (written by Keras' `OrbaxCheckpoint` or shardckpt).

The on-disk layout and its names are in `ondisk`. The arrays are the ones
the tree's `_METADATA` records; shapes and dtypes come from each array's zarr
metadata, and each box is read with tensorstore through the read spec Orbax
itself builds (`orbax.checkpoint.type_handlers.get_json_tspec_read`), its
OCDBT store's base being the tree's backend (`storage.kvstore`: a local
folder or a bucket), so only the chunks a device needs are fetched and decoded.

`read_pieces` lets tensorstore copy decoded chunks straight into the caller's
per-device buffers. A chunk shared by several pieces (one chunk per array is
what a single-device save writes) is decoded once: the pieces are read in one
`ts.Batch`, so their reads of it join; the reader's context also has a chunk
cache of `cache_bytes`.

Chunks written by shardckpt carry a zarr3 `crc32c` (see `writer`): tensorstore
checks it on every decode, and a mismatch is raised as `ChecksumMismatchError`
naming the array; any other tensorstore failure of a local step is
`CorruptCheckpointError` naming it.

Every file is read through the tree's backend, wherever it lives: metadata
JSON as single files or objects, array chunks as byte ranges of the OCDBT data
files (in a bucket through TensorStore's `gcs` / `s3` drivers; nothing is
downloaded whole).

What a read sees is pinned to one version of the step. OCDBT data files are
immutable once written (new data goes into new files); the only mutable file
is the manifest, which names the b-tree of every array. It is read once when
the reader opens, its version kept (a bucket's GCS generation or S3 ETag, a
local file's stamp), and tensorstore reads it from an in-memory copy, so every
array comes from that one version. `close` asks the backend whether the
manifest is still that version (in a bucket a conditional read): a step
replaced during the load raises `ObjectChangedError`, never passing for the
step that is there now.
"""

from __future__ import annotations

import math
import re
import threading
import uuid
from typing import Any

import numpy as np
import tensorstore as ts
from orbax.checkpoint import type_handlers

from shardckpt import storage
from shardckpt.budget import CHUNK_CACHE_BYTES
from shardckpt.errors import (
    CheckpointNotFoundError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    ObjectChangedError,
)
from shardckpt.formats.base import ArraySpec, Box, ChunkedReader
from shardckpt.formats.orbax import ondisk
from shardckpt.natsort import natural_sorted

# The root of an OCDBT store: the file that names its b-tree.
_MANIFEST = "manifest.ocdbt"

_DIGEST_MISMATCH = "Digest mismatch"
"""tensorstore's DATA_LOSS message when a `crc32c` codec's checksum fails."""


def _lost(error: BaseException, tree: storage.Location) -> str:
    """"; the object ... does not exist" when `error` is a 404 in the bucket of `tree`, else ""."""
    text = str(error)
    if not tree.is_remote or not re.search(r"NOT_FOUND|response code: 404|NoSuchKey", text):
        return ""
    # tensorstore names the object by URL (gcs) or by its key in the bucket (s3).
    found = re.search(r"Byte range \[[^)]*\) of \"?((?:gs|s3)://[^\s\"]+|[^\s\"]+)", text)
    if found is None:
        return "; an object it names does not exist (deleted, or not copied with the rest of the step)"
    url = found.group(1) if "://" in found.group(1) else f"{tree.scheme}://{tree.bucket}/{found.group(1)}"
    return f"; the object {url!r} does not exist (deleted, or not copied with the rest of the step)"


class OrbaxReader(ChunkedReader):
    """Reader for one step of an Orbax checkpoint.

    Args:
        path: An Orbax root (the latest committed step is used) or a step folder.
        cache_bytes: Size of tensorstore's decoded-chunk cache.
        memmap: Map data files into memory rather than read() them (tensorstore's
            `file_io_mode`); False reads them as Orbax itself does.

    Raises:
        CheckpointNotFoundError, IncompleteCheckpointError: see `ondisk.resolve_step`.
        CorruptCheckpointError: the metadata cannot be parsed.
    """

    format = "orbax"

    def __init__(
        self, path: str | storage.Location, *, cache_bytes: int = CHUNK_CACHE_BYTES, memmap: bool = True,
        item: str | None = None,
    ) -> None:
        self.location = storage.parse(path)
        self.path = ondisk.resolve_step(self.location)
        # `item`: another array item of the step than its arrays (Keras' "assets").
        self.tree_dir = ondisk.tree_dir(self.path if item is None else storage.parse(self.path).join(item))
        self._tree = storage.parse(self.tree_dir)
        self._backend = storage.backend(self._tree)
        self._specs: dict[str, ArraySpec] = {}
        context = ondisk.ts_context().spec.to_json()
        context["cache_pool"] = {"total_bytes_limit": cache_bytes}
        if memmap and self._backend.mappable:
            # Read chunks straight out of the page cache instead of read()ing
            # them into fresh buffers: a restore is bound by page faults and
            # copies, and this drops one pass over the compressed bytes. A
            # setting of this reader's context only.
            context["file_io_mode"] = {"mode": "memmap"}
        self._context = ts.Context(ts.Context.Spec(context))
        self._stores: dict[str, ts.TensorStore] = {}
        self._lock = threading.Lock()
        self._manifest: dict | None = None  # the pinned copy's kvstore spec
        self._manifest_version: bytes | None = None
        # Shapes and dtypes come from the arrays' own zarr metadata, which
        # opening each store reads (every array concurrently; in a bucket,
        # small ranged reads). The tree to open is the one Orbax recorded at
        # save time (`_METADATA`), read through the backend like every other
        # file, so an array that cannot be opened is named as damaged, never
        # taken for a missing key. (Orbax's own metadata call reads through
        # etils.epath: local paths only.)
        self._names, self._zarr3 = self._recorded_arrays()
        self._pin_manifest()
        futures = {key: self._open_store(key) for key in self._names}
        failed: dict[str, ValueError] = {}
        for key, future in futures.items():
            try:
                store = future.result()
            except ValueError as e:
                typed = self._not_damage(e)
                if typed is not None:
                    raise typed from e
                failed[key] = e
                continue
            self._specs[key] = ArraySpec(shape=tuple(store.shape), dtype=np.dtype(store.dtype.numpy_dtype))
            self._stores[key] = store
        if failed:
            self._check_index()
            lost = natural_sorted(failed)
            raise CorruptCheckpointError(
                f"{len(lost)} array(s) of {self.tree_dir!r} cannot be opened although "
                f"the checkpoint lists them: {', '.join(repr(k) for k in lost)}; its data "
                f"files are damaged ({failed[lost[0]]}{_lost(failed[lost[0]], self._tree)}). Fix: restore from another step."
            ) from failed[lost[0]]

    def _recorded_arrays(self) -> tuple[dict[str, str], bool]:
        """`{key: Orbax parameter name}` of every array the tree's `_METADATA` lists, and
        whether they are zarr3 (Orbax >= 0.9; older trees are zarr v2 and say nothing)."""
        path = self._tree.join(ondisk.TREE_METADATA).url
        recorded = ondisk.read_json(path)
        arrays: dict[tuple[str, ...], str] = {}
        try:
            for entry in (recorded.get("tree_metadata") or {}).values() if isinstance(recorded, dict) else ():
                value = entry.get("value_metadata", {})
                if (
                    not value.get("skip_deserialize", False) and "Array" in value.get("value_type", "")
                    or value.get("value_type") == "np.ndarray"
                ):
                    parts = tuple(str(k["key"]) for k in entry["key_metadata"])
                    arrays[parts] = ondisk.param_name(parts)
        except (KeyError, TypeError, AttributeError) as e:
            raise CorruptCheckpointError(
                f"{path!r} is not the tree metadata Orbax writes ({type(e).__name__}: {e}). "
                "Fix: restore from another step."
            ) from e
        zarr3 = recorded.get("use_zarr3") if isinstance(recorded, dict) else None
        if zarr3 is None and arrays:  # written before Orbax recorded it: look for zarr v2's file
            zarr3 = not storage.exists(self._tree.join(next(iter(arrays.values())), ".zarray"))
        # In the order of a JAX tree of nested dicts (keys sorted level by level),
        # as Orbax's own metadata call lists them.
        return {"/".join(parts): arrays[parts] for parts in sorted(arrays)}, bool(zarr3)

    def _manifest_location(self) -> storage.Location:
        return self._tree.join(_MANIFEST)

    def _pin_manifest(self) -> None:
        """Reads the OCDBT manifest once and has tensorstore read that copy (see the module docstring)."""
        data, version = self._backend.read_version(self._manifest_location())
        if data is None:
            return  # not OCDBT: each array's own files
        memory = {"driver": "memory", "path": f"shardckpt-pinned-{uuid.uuid4().hex}/"}
        store = ts.KvStore.open(memory, context=self._context).result()
        store.write(_MANIFEST, data).result()
        self._manifest, self._manifest_version = memory, version

    def _check_pinned(self) -> None:
        """Raises `ObjectChangedError` when the manifest is no longer the version read at open."""
        if self._manifest_version is None:
            return
        location = self._manifest_location()
        found = self._backend.changed(location, self._manifest_version)
        if found is not None:
            label, expected = self._backend.version_label, self._backend.version_text(self._manifest_version)
            raise ObjectChangedError(
                f"The OCDBT manifest {location.url!r} of step {self.path!r} was replaced during the load: "
                f"it began with {label} {expected}, the store now holds {label} {found}. Every array "
                "read came from the version the load began with, which is no longer the step in the "
                "store. Fix: load again once the step is written, and do not save into a step that "
                "is being read.",
                url=location.url, expected=expected, found=found,
            )

    def _not_damage(self, error: ValueError) -> BaseException | None:
        """The typed error of a request a bucket refused or lost; None when `error` is damage.

        A 404 inside the tree (a data object its OCDBT index names, an array's
        `zarr.json`) is a lost part of the step, not a wrong URL: the tree's
        `_METADATA` and manifest were read already. It is damage (`_lost`).
        """
        typed = storage.translate(error, self._tree)
        if typed is error or isinstance(typed, CheckpointNotFoundError):
            return None
        return typed

    def _check_index(self) -> None:
        # Lists the OCDBT b-tree (from the pinned manifest): when no array can
        # be located because the index itself is damaged, every array is
        # named, rather than each one's open failing on its own.
        if self._manifest is None:
            return  # not OCDBT (one zarr folder per array): nothing shared to check
        try:
            spec = {"driver": "ocdbt", "base": storage.kvstore(self._tree), "manifest": self._manifest}
            ts.KvStore.open(spec, context=self._context).result().list().result()
        except ValueError as e:
            typed = self._not_damage(e)
            if typed is not None:
                raise typed from e
            arrays = natural_sorted(self._names)
            raise CorruptCheckpointError(
                f"The index of {self.tree_dir!r} ({_MANIFEST} and its b-tree) is damaged, so none "
                f"of its {len(arrays)} array(s) can be located: {', '.join(repr(k) for k in arrays)} "
                f"({e}{_lost(e, self._tree)}). Fix: restore from another step."
            ) from e

    def _store(self, key: str) -> ts.TensorStore:
        with self._lock:
            store = self._stores.get(key)
        if store is not None:
            return store
        store = self._opened(key, self._open_store(key))
        spec_shape = self._specs[key].shape
        if tuple(store.shape) != spec_shape:
            raise CorruptCheckpointError(
                f"Array {key!r} of {self.tree_dir!r} has shape {tuple(store.shape)} "
                f"on disk but {spec_shape} in its metadata. Fix: restore another step."
            )
        with self._lock:
            self._stores[key] = store
        return store

    def _open_store(self, key: str) -> ts.Future:
        name = self._names[key]
        info = ondisk.param_info(name, self._tree, context=self._context, use_zarr3=self._zarr3)
        # Orbax's own read spec, its OCDBT store's base pointed at the tree's
        # backend and its manifest at the pinned copy.
        spec = type_handlers.get_json_tspec_read(info, use_ocdbt=True)
        spec = dict(spec, kvstore=ondisk.ocdbt_kvstore(spec["kvstore"], self._tree, manifest=self._manifest))
        return ts.open(spec, read=True, context=self._context)

    def _opened(self, key: str, future: ts.Future) -> ts.TensorStore:
        try:
            return future.result()
        except ValueError as e:
            typed = self._not_damage(e)
            if typed is not None:
                raise typed from e
            raise CorruptCheckpointError(
                f"Array {key!r} of {self.tree_dir!r} cannot be opened: {e}{_lost(e, self._tree)}. Fix: "
                "restore from another step."
            ) from e

    def keys(self) -> list[str]:
        return list(self._specs)

    def spec(self, key: str) -> ArraySpec:
        return self._specs[key]

    def _read_chunk(self, key: str) -> tuple[int | None, ...]:
        """The stored (read) chunk shape of `key`; None or 0 where a dimension is whole."""
        return tuple(self._store(key).chunk_layout.read_chunk.shape or ())

    def chunk_rows(self, key: str) -> int | None:
        spec = self._specs[key]
        if not spec.shape:
            return None
        chunk = self._read_chunk(key)
        return int(chunk[0]) if chunk and chunk[0] else None

    def chunk_bytes(self, key: str) -> int:
        spec = self._specs[key]
        if not spec.shape:
            return spec.dtype.itemsize
        chunk = self._read_chunk(key)
        return math.prod(c or n for c, n in zip(chunk, spec.shape)) * spec.dtype.itemsize

    def chunk_checksums(self, key: str) -> int:
        """How many stored chunks of `key` carry a `crc32c` codec (0: none).

        tensorstore checks each one as it decodes the chunk, on every read;
        shardckpt's writers store one per chunk, Keras' callback does not.
        """
        spec = self._store(key).spec().to_json()
        metadata = spec.get("base", spec).get("metadata") or {}  # (a "cast" spec wraps the zarr3 one)
        shape = self._specs[key].shape
        for codec in metadata.get("codecs") or ():
            if codec.get("name") == "crc32c":  # on each chunk of the grid
                chunk = ((metadata.get("chunk_grid") or {}).get("configuration") or {}).get("chunk_shape")
                return _chunks(shape, chunk)
            inner = codec.get("configuration") or {}
            if codec.get("name") == "sharding_indexed" and any(
                    c.get("name") == "crc32c" for c in inner.get("codecs") or ()):
                return _chunks(shape, inner.get("chunk_shape"))
        return 0

    def is_chunk(self, key: str, box: Box) -> bool:
        # `read` of such a box hands back tensorstore's decoded chunk itself.
        spec = self._specs[key]
        if not spec.shape:
            return True
        chunk = self._read_chunk(key)
        for s, c, n in zip(box, chunk, spec.shape):
            c = c or n
            if s.start % c or s.stop != min(s.start + c, n):
                return False
        return True

    def read_pieces(self, key: str, boxes: list[Box], outs: list[np.ndarray]) -> None:
        store = self._store(key)
        # One batch: the pieces' reads of a shared chunk join one decode. Issued
        # one by one, late pieces often found the chunk already evicted from
        # the small cache and decoded it again.
        with ts.Batch() as batch:
            futures = [
                ts.array(out, copy=False).write(store[box] if box else store, batch=batch)
                for box, out in zip(boxes, outs)
            ]
        try:
            for future in futures:
                future.result()
        except ValueError as e:
            raise self._read_error(key, e) from e

    def read(self, key: str, box: Box) -> np.ndarray:
        store = self._store(key)
        try:
            data = store[box].read().result() if box else store.read().result()
        except ValueError as e:
            raise self._read_error(key, e) from e
        # np.asarray, not np.ascontiguousarray: the latter turns scalars into 1-D.
        return np.asarray(data, order="C")

    def _read_error(self, key: str, error: ValueError) -> BaseException:
        typed = self._not_damage(error)
        if typed is not None:
            return typed
        if _DIGEST_MISMATCH in str(error):
            # The chunk's stored crc32c (shardckpt's writers store one per
            # chunk; Orbax one per shard index) disagrees with its bytes.
            return ChecksumMismatchError(
                f"Array {key!r} of {self.tree_dir!r}: a stored chunk does not match its "
                f"crc32c checksum ({error}). Fix: restore from another step, or "
                "re-create the checkpoint from its source."
            )
        return CorruptCheckpointError(
            f"Reading array {key!r} of {self.tree_dir!r} failed: {error}{_lost(error, self._tree)}. The chunk "
            "data is damaged. Fix: restore from another step."
        )

    def assets(self) -> dict[str, Any] | None:
        """The step's Keras asset files as `{folder: {... file: uint8 array}}`, None when it has none.

        Keras' callback and shardckpt's `OrbaxCheckpoint` save them (full
        saves, `save_weights_only=False`) as the "assets" item: one uint8
        array per file, keyed by its folders (Keras' `_save_assets_to_dict`).
        """
        if ondisk.ASSETS_ITEM not in ondisk.items(self.path):
            return None
        files = OrbaxReader(self.path, item=ondisk.ASSETS_ITEM, memmap=False)
        try:
            tree: dict[str, Any] = {}
            for key in files.keys():
                *folders, name = key.split("/")
                node = tree
                for folder in folders:
                    node = node.setdefault(folder, {})
                spec = files.spec(key)
                node[name] = np.asarray(files.read(key, tuple(slice(0, n) for n in spec.shape)), np.uint8)
            return tree
        finally:
            files.close()

    def close(self) -> None:
        """Drops the open arrays; in a bucket, checks the step was not replaced meanwhile.

        Raises:
            ObjectChangedError: the manifest changed since the reader opened.
        """
        self._stores.clear()
        self._check_pinned()


def _chunks(shape: tuple[int, ...], chunk: list[int] | None) -> int:
    """Chunks of `chunk` shape that tile `shape` (one for a scalar)."""
    return math.prod(-(-n // max(c, 1)) for n, c in zip(shape, chunk or shape))

