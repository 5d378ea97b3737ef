"""Reading one step of an Orbax checkpoint (written by Keras' `OrbaxCheckpoint` or shardckpt).

The on-disk layout and its names are in `ondisk`. Shapes and dtypes come from Orbax's public metadata API; each box is read with
tensorstore through the read spec Orbax itself builds
(`orbax.checkpoint.type_handlers.get_json_tspec_read`), so only the chunks a
device needs are fetched and decoded.

`read_pieces` lets tensorstore copy decoded chunks straight into the caller's
per-device buffers. A chunk shared by several pieces (one chunk per array is
what a single-device save writes) is decoded once: the pieces are read in one
`ts.Batch`, so their reads of it join; the reader's context also has a chunk
cache of `cache_bytes`.

Chunks written by shardckpt carry a zarr3 `crc32c` (see `writer`): tensorstore
checks it on every decode, and a mismatch is raised as `ChecksumMismatchError`
naming the array; any other tensorstore failure of a local step is
`CorruptCheckpointError` naming it.

In a bucket (`gs://`, `s3://`) metadata JSON is read as single objects and
array chunks as byte ranges of the OCDBT data files, through TensorStore's
`gcs` / `s3` drivers; nothing is downloaded whole.

What a bucket read sees is pinned to one version of the step. OCDBT data
files are immutable once written (new data goes into new files); the only
mutable object is the manifest, which names the b-tree of every array. It is
read once when the reader opens, its version (GCS generation, S3 ETag) kept,
and tensorstore reads it from an in-memory copy, so every array comes from
that one version. `close` asks the bucket whether the manifest is still that
version (a conditional read): a step replaced during the load raises
`ObjectChangedError`, never passing for the step that is there now.
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
import uuid
from typing import Any

import jax
import numpy as np
import orbax.checkpoint.experimental.v1 as ocp
import tensorstore as ts
from orbax.checkpoint import type_handlers

from shardckpt import storage
from shardckpt.budget import CHUNK_CACHE_BYTES
from shardckpt.errors import ChecksumMismatchError, CorruptCheckpointError, ObjectChangedError
from shardckpt.formats.base import ArraySpec, Box, ChunkedReader
from shardckpt.formats.orbax import ondisk
from shardckpt.natsort import natural_sorted

# The root of an OCDBT store: the file that names its b-tree.
_MANIFEST = "manifest.ocdbt"

_DIGEST_MISMATCH = "Digest mismatch"
"""tensorstore's DATA_LOSS message when a `crc32c` codec's checksum fails."""


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
        self, path: str | storage.Location, *, cache_bytes: int = CHUNK_CACHE_BYTES, memmap: bool = True
    ) -> None:
        self.location = storage.parse(path)
        self.path = ondisk.resolve_step(self.location if isinstance(path, storage.Location) else os.fspath(path))
        self.tree_dir = ondisk.tree_dir(self.path)
        self._specs: dict[str, ArraySpec] = {}
        self._names: dict[str, str] = {}
        context = ondisk.ts_context().spec.to_json()
        context["cache_pool"] = {"total_bytes_limit": cache_bytes}
        if memmap and storage.backend(self.location).mappable:
            # Read chunks straight out of the page cache instead of read()ing
            # them into fresh buffers: a restore is bound by page faults and
            # copies, and this drops one pass over the compressed bytes (about
            # 10% of a load; CHANGELOG). A setting of this reader's context only.
            context["file_io_mode"] = {"mode": "memmap"}
        self._context = ts.Context(ts.Context.Spec(context))
        self._stores: dict[str, ts.TensorStore] = {}
        self._lock = threading.Lock()
        self._manifest: dict | None = None  # the pinned copy's kvstore spec (bucket trees)
        self._manifest_version: bytes | None = None
        if self.location.local_path is None:  # Orbax reads metadata through epath: local paths only
            self._open_remote()
            return
        self._check_index()
        try:
            tree = ocp.metadata(self.path, checkpointable_name=os.path.basename(self.tree_dir))
            leaves = jax.tree_util.tree_flatten_with_path(tree.metadata)[0]
        except (ValueError, KeyError, json.JSONDecodeError, FileNotFoundError) as e:
            raise CorruptCheckpointError(
                f"Cannot read the array metadata of {self.tree_dir!r}: {e}. Fix: "
                "restore from another step."
            ) from e
        for key_path, leaf in leaves:
            if not hasattr(leaf, "shape"):
                continue  # a non-array leaf (string, None): not a variable
            parts = [_key_str(k) for k in key_path]
            key = "/".join(parts)
            self._names[key] = ondisk.param_name(parts)
            self._specs[key] = ArraySpec(shape=tuple(leaf.shape), dtype=np.dtype(leaf.dtype))
        self._check_all_listed()

    def _recorded_arrays(self) -> dict[str, str]:
        """`{key: Orbax parameter name}` of every array the tree's `_METADATA` lists."""
        path = ondisk.join(self.tree_dir, ondisk.TREE_METADATA)
        recorded = ondisk.read_json(path)
        arrays = {}
        try:
            for entry in (recorded.get("tree_metadata") or {}).values() if isinstance(recorded, dict) else ():
                value = entry.get("value_metadata", {})
                if (
                    not value.get("skip_deserialize", False) and "Array" in value.get("value_type", "")
                    or value.get("value_type") == "np.ndarray"
                ):
                    parts = [str(k["key"]) for k in entry["key_metadata"]]
                    arrays["/".join(parts)] = ondisk.param_name(parts)
        except (KeyError, TypeError, AttributeError) as e:
            raise CorruptCheckpointError(
                f"{path!r} is not the tree metadata Orbax writes ({type(e).__name__}: {e}). "
                "Fix: restore from another step."
            ) from e
        return arrays

    def _open_remote(self) -> None:
        # Orbax's metadata API reads through etils.epath, which has no s3://
        # and needs extra packages for gs://; the shapes and dtypes it
        # reports come from the arrays' zarr metadata, which opening each
        # store reads too (small ranged reads, all arrays concurrently).
        self._names = self._recorded_arrays()
        self._pin_manifest()
        futures = {key: self._open_store(key) for key in self._names}
        for key, future in futures.items():
            store = self._opened(key, future)
            self._specs[key] = ArraySpec(shape=tuple(store.shape), dtype=np.dtype(store.dtype.numpy_dtype))
            self._stores[key] = store

    def _manifest_location(self) -> storage.Location:
        return storage.parse(self.tree_dir).join(_MANIFEST)

    def _pin_manifest(self) -> None:
        """Reads the OCDBT manifest once and has tensorstore read that copy (see the module docstring)."""
        location = self._manifest_location()
        bucket: Any = storage.backend(location)  # an ObjectStore: bucket trees only come here
        data, version = bucket.read_version(location)
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
        backend: Any = storage.backend(location)  # an ObjectStore (a version was pinned)
        found = backend.changed(location, self._manifest_version)
        if found is not None:
            label, expected = backend.version_label, backend.version_text(self._manifest_version)
            raise ObjectChangedError(
                f"The OCDBT manifest {location.url!r} of step {self.path!r} was replaced during the load: "
                f"it began with {label} {expected}, the bucket now holds {label} {found}. Every array "
                "read came from the version the load began with, which is no longer the step in the "
                "bucket. Fix: load again once the step is written, and do not save into a step that "
                "is being read.",
                url=location.url, expected=expected, found=found,
            )

    def _check_index(self) -> None:
        # Reads the OCDBT manifest and b-tree (a key listing) before Orbax's
        # metadata call does: on a damaged index that call fails in
        # concurrent tasks whose errors surface as absl warnings and stray
        # asyncio tracebacks ("Task exception was never retrieved", "Event
        # loop is closed") after ours, and names one array. Here no array can
        # be located, so every one is named.
        if not os.path.exists(os.path.join(self.tree_dir, _MANIFEST)):
            return  # not OCDBT (one zarr folder per array): nothing shared to check
        try:
            spec = {"driver": "ocdbt", "base": f"file://{os.path.abspath(self.tree_dir)}"}
            ts.KvStore.open(spec, context=self._context).result().list().result()
        except ValueError as e:
            arrays = natural_sorted(self._recorded_arrays())
            raise CorruptCheckpointError(
                f"The index of {self.tree_dir!r} ({_MANIFEST} and its b-tree) is damaged, so none "
                f"of its {len(arrays)} array(s) can be located: {', '.join(repr(k) for k in arrays)} "
                f"({e}). Fix: restore from another step."
            ) from e

    def _check_all_listed(self) -> None:
        # Orbax's metadata call logs and drops arrays whose store it cannot
        # open (a damaged OCDBT node), returning a smaller tree; compare with
        # the tree Orbax recorded at save time so damage is not read as
        # "missing keys".
        expected = set(self._recorded_arrays())
        lost = natural_sorted(expected - set(self._specs))
        if lost:
            raise CorruptCheckpointError(
                f"{len(lost)} array(s) of {self.tree_dir!r} cannot be opened although "
                f"the checkpoint lists them: {', '.join(repr(k) for k in lost)}; its data "
                "files are damaged. Fix: restore from another step."
            )

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
        info = ondisk.param_info(
            name, self.tree_dir, context=self._context, use_zarr3=ondisk.is_zarr3(self.tree_dir, name)
        )
        spec = ondisk.tspec_for(type_handlers.get_json_tspec_read(info, use_ocdbt=True), self.tree_dir,
                                manifest=self._manifest)
        return ts.open(spec, read=True, context=self._context)

    def _opened(self, key: str, future: ts.Future) -> ts.TensorStore:
        try:
            return future.result()
        except ValueError as e:
            typed = storage.translate(e, self.location)
            if typed is not e:  # a bucket refused or lost the request: not damage
                raise typed from e
            raise CorruptCheckpointError(
                f"Array {key!r} of {self.tree_dir!r} cannot be opened: {e}. Fix: "
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
        typed = storage.translate(error, self.location)
        if typed is not error:  # a bucket refused or lost the request: not damage
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
            f"Reading array {key!r} of {self.tree_dir!r} failed: {error}. The chunk "
            "data is damaged. Fix: restore from another step."
        )

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


def _key_str(entry: object) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return re.sub(r"^[\[.'\"]+|[\]'\"]+$", "", str(entry))
