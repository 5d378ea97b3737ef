"""Writing an Orbax step one array piece at a time.

Orbax saves a pytree of arrays that are already in memory; a converter must
not hold the model, so this module writes the same on-disk layout itself, with
Orbax's own building blocks:

- every array is a zarr3 array inside the step's OCDBT key-value store, opened
  with the TensorStore spec Orbax builds for its own writes
  (`orbax.checkpoint.type_handlers.get_json_tspec_write`: same codecs, same
  `sharding_indexed` outer/inner chunks, same OCDBT configuration), plus a
  `crc32c` codec on every stored chunk (`_orbax.add_chunk_checksums`):
  tensorstore verifies it on each decode, so a restore that reads a damaged
  chunk fails (`ChecksumMismatchError`) without a separate verify pass.
  Orbax and Keras read such arrays as they read their own;
- pieces are written inside TensorStore transactions, so what TensorStore
  buffers is bounded by the caller's batches, and each commit appends one
  OCDBT version;
- `_METADATA` records each leaf as `np.ndarray`, which is what Orbax itself
  writes for host arrays: it carries no device names, so Keras'
  `model.load_weights(dir)` and Orbax restore it on any machine (with or
  without target shardings), and `shardckpt.load_sharded` reads it onto any
  mesh.

The JSON files (`_METADATA`, `_CHECKPOINT_METADATA`, the indicator files) have
no public Orbax writer; their fields are the ones Orbax 0.12 writes for the
same tree, which `tests/test_convert.py` checks against an `ocp.save` of the
same arrays.
"""

from __future__ import annotations

import base64
import concurrent.futures
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import tensorstore as ts
from orbax.checkpoint import type_handlers

from shardckpt import _orbax, storage, threads
from shardckpt.formats.base import Box
from shardckpt.formats.orbax import ondisk
from shardckpt.storage.direct import DirectWriter

"""Orbax's file of the saved shardings of a tree's `jax.Array` leaves (keys: base64 parameter names)."""
COMPRESSIONS = ("none", "zstd")
"""Array compressions shardckpt writes: none, or Orbax's zstd (level 3) per chunk."""
DEFAULT_COMPRESSION = "none"
"""Float weights barely compress, and zstd makes writing and reading slower
(see README, "Compression")."""


CHUNK_BYTES = {"none": 31 * 1024 * 1024, "zstd": 4 * 1024 * 1024}
"""Largest stored (read) chunk of the checkpoints shardckpt writes (`convert`,
`OrbaxCheckpoint`), per compression: Orbax's `chunk_byte_size` splits each
written block (a piece or a device's shard) into chunks of at most this size,
halving its largest dimensions first (Orbax 0.12 stores each as its own zarr
shard). Chosen with `tools/bench_chunks.py` (figures: CHANGELOG).

- zstd: a chunk decodes on one thread, so small chunks let a restore use
  every core.
- none: every chunk carries a `crc32c` (`_orbax.add_chunk_checksums`) and is
  decoded into a buffer tensorstore allocates; below 32 MiB (glibc's largest
  dynamic mmap threshold) malloc reuses the memory the previous chunk freed,
  above it every chunk is a fresh map whose every page faults.
"""


_OCDBT_DATA_DIR = "d"
"""Where an OCDBT store keeps its data files (immutable once committed)."""
_NODE_FILE_PREFIX = _OCDBT_DATA_DIR + "/n"
"""The names of the data files holding a store's B+tree and version nodes when it is encoded in
memory (`OrbaxStepWriter(direct=...)`): in the same folder as the value files, told apart by the
name (value files are named by hex digits alone), so each commit's value file can be written out
and dropped while the nodes, which the next commit reads, stay. Readers find every file through
the manifest and need no rule about names."""
_READ_PIECE = 1024 * 1024
"""Bytes of a memory-encoded file read at a time on their way to disk. Each read is a fresh
`bytes` object: small ones reuse the memory the previous one freed, large ones are fresh maps
whose every page faults (figures: CHANGELOG)."""


class OrbaxStepWriter:
    """Writes one Orbax step folder holding a `pytree` item of arrays.

    Example:

    ```python
    writer = OrbaxStepWriter("out/0", compression="none", chunk_byte_size=1 << 20)
    [store] = writer.open_arrays([("trainable_variables/dense/kernel", (4, 3), np.float32, (4, 3))])
    with writer.transaction() as txn:
        writer.write(store, txn, (slice(0, 4), slice(0, 3)), values)
    marker = writer.finish(custom_metadata={"note": "converted"})
    ```

    Args:
        step_dir: The step folder to create (must not exist), or a bucket URL
            (`gs://`, `s3://`) under which nothing exists yet. A bucket has
            no rename: the commit protocol (`storage.commit`) writes the
            marker `finish` returns after everything else, and readers take a
            step without it for an interrupted save.
        compression: "none" or "zstd" (Orbax's zstd level 3 per chunk).
        chunk_byte_size: Target bytes of one stored (read) chunk; Orbax's
            subchunking splits each written block down to it. None: one
            chunk per written block, as Orbax's own saves without `SaveArgs`.
        item: The step's checkpointable the arrays go to ("pytree"; the
            training callback also writes Keras' "assets" tree).
        process_index: Write the arrays into this process's own OCDBT store
            (`ocdbt.process_N` in the item), as each process of an Orbax
            multi-process save does; `merge_process_stores` then joins them
            into the item's store. None: straight into the item's store.
        direct: Local folders, one process: TensorStore encodes the OCDBT
            store into memory (its `memory` kvstore, the same specs, so the
            same files) and this writer writes the files out itself through
            `direct` (`O_DIRECT`, each file fsynced): the value file of each
            transaction as soon as it is committed (`flush_values`, on
            threads, while the caller encodes the next ones; then dropped
            from memory), the nodes and the manifest at `finish`
            (or `flush_store`). None: TensorStore writes the files itself,
            through the page cache.
    """

    def __init__(
        self, step_dir: str, *, compression: str, chunk_byte_size: int | None, item: str = ondisk.ARRAYS_ITEM,
        process_index: int | None = None, direct: DirectWriter | None = None,
    ) -> None:
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {COMPRESSIONS}. Received: compression={compression!r}")
        location = storage.parse(step_dir)
        if direct is not None and (location.local_path is None or process_index is not None):
            raise ValueError(f"Encoding in memory writes local folders of one process. Received: step_dir="
                             f"{step_dir!r}, process_index={process_index!r}")
        self.step_dir = location.url
        self.item = item
        self.tree_dir = ondisk.join(self.step_dir, item)
        self.compression = compression
        self.chunk_byte_size = chunk_byte_size
        self.process_index = process_index
        self.store_dir = self.tree_dir if process_index is None else process_store(self.tree_dir, process_index)
        if location.local_path is not None:  # object stores have no folders
            os.makedirs(self.tree_dir)
        self._context = ondisk.ts_context()
        self._keys: list[tuple[str, ...]] = []
        self._shardings: dict[tuple[str, ...], tuple[Any, tuple[int, ...]]] = {}
        self._init_ns = time.time_ns()
        self._released: set[str] = set()  # data files dropped from the page cache
        self._direct = direct
        self._memory: ts.KvStore | None = None  # the memory kvstore the store is encoded into (direct)
        self._writing: list[concurrent.futures.Future] = []  # value files being written out, oldest first
        self._handed: set[str] = set()  # value files handed to `_write_values`

    def open_arrays(
        self, arrays: list[tuple[str, tuple[int, ...], np.dtype, tuple[int, ...]]]
    ) -> list[ts.TensorStore]:
        """Creates arrays and returns their stores, one per `(key, shape, dtype, write_shape)`.

        `key` is the '/'-separated state-tree path ("trainable_variables/dense/kernel");
        `write_shape` is the outer chunk (one stored shard file region): every
        write should cover whole outer chunks so none is rewritten.

        Creating an array writes its zarr metadata into the OCDBT store, and
        each such write waits for the store's pending commit, so created one
        by one between data commits they took most of a conversion's time.
        Opened together, TensorStore batches them.
        """
        futures = [self._open(*array) for array in arrays]
        return [future.result() for future in futures]

    def _open(
        self, key: str, shape: tuple[int, ...], dtype: np.dtype, write_shape: tuple[int, ...]
    ) -> ts.Future:
        parts = tuple(key.split("/"))
        self._keys.append(parts)
        info = ondisk.param_info(
            ondisk.param_name(parts), self.tree_dir, context=self._context,
            use_compression=self.compression == "zstd",
        )
        spec = type_handlers.get_json_tspec_write(
            info,
            use_ocdbt=True,
            global_shape=tuple(shape),
            local_shape=tuple(max(1, n) for n in write_shape),
            dtype=np.dtype(dtype),
            arg=type_handlers.SaveArgs(chunk_byte_size=self.chunk_byte_size),
            process_index=self.process_index,
        )
        spec = ondisk.tspec_for(_orbax.add_chunk_checksums(spec), self.store_dir)
        if self._direct is not None:
            spec = dict(spec, kvstore=_in_memory(spec["kvstore"], self.store_dir))
        return ts.open(spec, create=True, open=True, context=self._context)

    def record_sharding(self, key: str, sharding: Any, write_shape: tuple[int, ...]) -> None:
        """Records array `key` as a `jax.Array` saved from `sharding`, as Orbax records one.

        Its `_METADATA` entry then says "jax.Array" with its write shape, and
        the tree's `_sharding` file holds the sharding: what Orbax writes
        for a `jax.Array` leaf, and what Keras' loader falls back on for a
        variable it has no target sharding for.
        """
        self._shardings[tuple(key.split("/"))] = (sharding, tuple(write_shape))

    @property
    def encodes_in_memory(self) -> bool:
        """Whether the store is encoded in memory and written out by this writer (`direct`)."""
        return self._direct is not None

    @property
    def direct(self) -> DirectWriter | None:
        """The writer the files of a memory-encoded store go through, or None."""
        return self._direct

    def transaction(self) -> ts.Transaction:
        """A TensorStore transaction: its writes become one OCDBT commit (memory-encoded: one value file)."""
        return ts.Transaction(atomic=self._direct is not None)

    def flush_values(self) -> None:
        """Memory-encoded stores: starts writing the committed value files out (`direct`) on a thread of
        their own, each dropped from memory once written.

        Call it after each commit (OCDBT never changes a data file once its
        commit is done). The caller encodes the next transaction while the
        committed ones' files go to disk, so the disk and the encoding
        (checksums, copies) overlap. At most `direct.streams` calls' files
        are written at once: a further call first waits for the oldest, so
        at most `direct.streams + 1` transactions' value files are in memory
        (the ones written and the one encoded). `wait_values` waits for them
        all (`flush_store` and `finish` call it). No-op for stores
        TensorStore writes itself.

        Raises:
            OSError: writing an earlier call's files failed.
        """
        if self._direct is None:
            return
        memory = self._memory_store()
        names = [name for name in (key.decode() for key in memory.list().result())
                 if name.startswith(_OCDBT_DATA_DIR + "/") and not name.startswith(_NODE_FILE_PREFIX)
                 and name not in self._handed]
        while len(self._writing) >= self._direct.streams:
            self._writing.pop(0).result()
        if names:
            self._handed.update(names)
            self._writing.append(threads.start(self._write_values, memory, names, name="shardckpt-write-out"))

    def wait_values(self) -> None:
        """Waits for every value file `flush_values` is writing; raises what writing them raised."""
        while self._writing:
            self._writing.pop(0).result()

    def abandon(self) -> BaseException | None:
        """For a save that failed: waits for any value files still being written (never leaving a thread
        writing into a folder about to be removed); returns the first error writing them raised, or None."""
        writing, self._writing = self._writing, []
        concurrent.futures.wait(writing)
        return next((e for e in (future.exception() for future in writing) if e is not None), None)

    def _write_values(self, memory: ts.KvStore, names: list[str]) -> None:
        for name in names:
            self._write_out(memory, name)
            del memory[name.encode()]

    def flush_store(self) -> None:
        """Memory-encoded stores: writes every file left in memory out (nodes, the manifest last).

        Call it once the last transaction is committed (`finish` does).
        No-op for stores TensorStore writes itself.
        """
        if self._direct is None:
            return
        self.wait_values()
        memory = self._memory_store()
        names = sorted((key.decode() for key in memory.list().result()), key=lambda n: (n == ondisk.OCDBT_MANIFEST, n))
        for name in names:
            self._write_out(memory, name)
        memory.delete_range(ts.KvStore.KeyRange()).result()

    def _memory_store(self) -> ts.KvStore:
        if self._memory is None:
            self._memory = ts.KvStore.open({"driver": "memory", "path": self.store_dir + "/"},
                                           context=self._context).result()
        return self._memory

    def _write_out(self, memory: ts.KvStore, name: str) -> None:
        assert self._direct is not None
        path = os.path.join(self.store_dir, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self._direct.write(path, _pieces(memory, name))

    @staticmethod
    def write(
        store: ts.TensorStore, txn: ts.Transaction, box: Box, data: np.ndarray, *, reference: bool = False
    ) -> ts.WriteFutures:
        """Stages `data` at `box` of `store` in `txn`.

        By default TensorStore copies `data` into a buffer of its own and
        keeps `data` referenced until `futures.copy` is done; the caller waits
        for it before counting the bytes as released.

        With `reference=True` TensorStore keeps `data` itself instead, until
        the commit has written it, and encodes (checksums, writes) straight
        from it: the caller must not change `data` until then. For a view of
        a memory-mapped source this writes from the page cache with no copy
        at all: converting a 0.8 GB `.weights.h5`, the copy into fresh buffers
        cost 198,000 page faults and about half of the CPU time (README,
        "Convert speed").
        """
        target = store.with_transaction(txn)[box] if box else store.with_transaction(txn)
        return target.write(data, can_reference_source_data_indefinitely=reference)

    def committed_files(self) -> list[str]:
        """The data files of a local store not yet released (`release`); call it between commits.

        OCDBT never rewrites a data file once its commit is done, so every
        file listed while no commit is in flight is complete for good.
        """
        data = storage.parse(self.store_dir).local_path
        if data is None:  # object stores have no page cache here
            return []
        data = os.path.join(data, _OCDBT_DATA_DIR)
        try:
            names = os.listdir(data)
        except FileNotFoundError:  # nothing committed yet
            return []
        return [path for path in (os.path.join(data, name) for name in names) if path not in self._released]

    def release(self, files: list[str]) -> None:
        """Syncs `files` (from `committed_files`) and drops them from the page cache (`storage.sync_and_drop`).

        Dirty pages left to the kernel's writeback stall later writes and
        evict other caches (figures: CHANGELOG). A later read of the
        checkpoint comes from disk instead of memory.
        """
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                storage.sync_and_drop(fd)
            finally:
                os.close(fd)
            self._released.add(path)

    def write_tree_metadata(self) -> None:
        """Writes the item's `_METADATA` (the tree of every array opened)."""
        leaves = {}
        shardings = {}
        for parts in sorted(self._keys):
            value: dict[str, Any] = {"value_type": "np.ndarray", "skip_deserialize": False}
            if parts in self._shardings:
                sharding, write_shape = self._shardings[parts]
                value = {"value_type": "jax.Array", "skip_deserialize": False, "write_shape": list(write_shape)}
                name = base64.urlsafe_b64encode(ondisk.param_name(parts).encode()).decode()
                shardings[name] = _orbax.sharding_metadata.from_jax_sharding(sharding).to_serialized_string()
            leaves[parts] = value
        if shardings:
            ondisk.write_json(ondisk.join(self.tree_dir, ondisk.SHARDING_FILE), shardings)
        ondisk.write_json(ondisk.join(self.tree_dir, ondisk.TREE_METADATA), ondisk.tree_metadata(leaves))

    def write_strings(self, value: dict[str, str]) -> None:
        """Writes this writer's item as a tree of string leaves, as Orbax's StringHandler does."""
        string = {"value_type": "string", "skip_deserialize": False}
        ondisk.write_json(
            ondisk.join(self.tree_dir, ondisk.TREE_METADATA), ondisk.tree_metadata({(k,): string for k in sorted(value)})
        )
        storage.write_bytes(
            storage.parse(self.tree_dir).join(ondisk.STRINGS_FILE), json.dumps(value, separators=(",", ":")).encode()
        )

    def finish(
        self, *, custom_metadata: dict[str, Any], final_dir: str | None = None,
        item_handlers: dict[str, str] | None = None,
    ) -> bytes:
        """Writes the metadata files of the step; returns its commit marker's contents.

        The marker (`ondisk.COMMIT_MARKER`) itself is written by the commit
        protocol (`shardckpt.storage.commit.Stage.commit`): last in a bucket.

        Args:
            custom_metadata: JSON stored as the step's `custom_metadata`.
            final_dir: Where the step will be renamed to (recorded in the
                commit marker, as Orbax records its final path).
            item_handlers: The handlers of other items the caller wrote into
                the step before (recorded beside this writer's item).

        Returns:
            The commit marker's contents (Orbax's text, naming the final folder).
        """
        self.flush_store()
        self.write_tree_metadata()
        step_meta = {
            "item_handlers": dict(sorted({**(item_handlers or {}), self.item: ondisk.PYTREE_HANDLER}.items())),
            "metrics": {},
            "performance_metrics": {},
            "init_timestamp_nsecs": self._init_ns,
            "commit_timestamp_nsecs": time.time_ns(),
            "custom_metadata": custom_metadata,
        }
        ondisk.write_json(ondisk.join(self.step_dir, ondisk.STEP_METADATA), step_meta)
        step = storage.parse(self.step_dir)
        storage.write_bytes(step.join(ondisk.CHECKPOINT_INDICATOR), b"")
        return f"Checkpoint commit was successful to {final_dir or self.step_dir}".encode()


def _in_memory(kvstore: dict[str, Any], store_dir: str) -> dict[str, Any]:
    """An OCDBT kvstore spec Orbax built for a local folder, encoding into memory instead.

    The store's files get the keys they would have as files under
    `store_dir` (data files, nodes under `_NODE_FILE_PREFIX`, the manifest
    beside `d/`); everything else (config, file size target, cache) is Orbax's.
    """
    spec = dict(kvstore)
    spec["base"] = {"driver": "memory", "path": store_dir + "/"}
    spec.pop("manifest", None)  # Orbax's local spec keeps the manifest in a file kvstore of its own
    spec["btree_node_data_prefix"] = spec["version_tree_node_data_prefix"] = _NODE_FILE_PREFIX
    return spec


def _pieces(memory: ts.KvStore, name: str) -> Iterator[bytes]:
    """The bytes of `name` in a memory kvstore, `_READ_PIECE` at a time (no copy of a whole data file)."""
    start = 0
    while True:
        try:
            piece = memory.read(name, byte_range=slice(start, start + _READ_PIECE)).result().value
        except ValueError as e:  # OUT_OF_RANGE: fewer bytes are left than a piece
            if "OUT_OF_RANGE" not in str(e):
                raise
            yield memory.read(name, byte_range=slice(start, None)).result().value
            return
        yield piece
        start += len(piece)


def process_store(tree_dir: str, process_index: int) -> str:
    """The OCDBT store process `process_index` writes an item's arrays into (Orbax's `ocdbt.process_N`)."""
    return ondisk.join(tree_dir, f"{_orbax.PROCESS_STORE_PREFIX}{process_index}")


def merge_process_stores(tree_dir: str, process_count: int) -> None:
    """Joins the per-process OCDBT stores of an item into the item's own store, as Orbax does at commit.

    The item's store then lists every array key of every process (the
    process stores' data files stay where they are and are referenced), so
    readers open the item as they open a single-process one. One atomic
    OCDBT commit.

    Args:
        tree_dir: The item's folder or bucket URL (holding `ocdbt.process_N`).
        process_count: The number of processes that wrote into it.
    """
    context = ondisk.ts_context()

    def spec(directory: str, *, merge: bool) -> dict[str, Any]:
        local = storage.parse(directory).local_path
        built = _orbax.merge_kvstore_spec(local or ondisk.PLACEHOLDER_DIR)
        if not merge:
            built = {k: v for k, v in built.items() if k not in ("config", "assume_config", "target_data_file_size")}
        return built if local is not None else ondisk.ocdbt_kvstore(built, storage.parse(directory))

    opened = [ts.KvStore.open(spec(process_store(tree_dir, i), merge=False), context=context)
              for i in range(process_count)]
    parent = ts.KvStore.open(spec(tree_dir, merge=True), context=context)
    children = [future.result() for future in opened]
    target = parent.result()
    txn = ts.Transaction(atomic=True)
    copies = [child.experimental_copy_range_to(target.with_transaction(txn)) for child in children]
    for copy in copies:
        copy.result()
    txn.commit_async().result()


def write_assets(step_dir: str, tree: dict[str, Any], *, compression: str) -> dict[str, str]:
    """Writes Keras' asset files as the step's "assets" item, as Keras' `OrbaxCheckpoint` saves them.

    `tree` is `{folder: {... file: uint8 array}}` (Keras' `_save_assets_to_dict`,
    a `.keras` archive's `assets/`), so `load_sharded`, `restore_latest` and
    `keras.saving.load_model` give each layer's `load_assets` its files (an
    adapted lookup layer's vocabulary). Returns the item's handler, for
    `finish(item_handlers=...)` of the step's arrays writer.
    """
    leaves: list[tuple[str, np.ndarray]] = []

    def walk(node: dict[str, Any], prefix: str) -> None:
        for name, value in sorted(node.items()):
            if isinstance(value, dict):
                walk(value, f"{prefix}{name}/")
            else:
                leaves.append((f"{prefix}{name}", np.ascontiguousarray(value, np.uint8).reshape(-1)))

    walk(tree, "")
    writer = OrbaxStepWriter(step_dir, compression=compression, chunk_byte_size=CHUNK_BYTES[compression],
                             item=ondisk.ASSETS_ITEM)
    stores = writer.open_arrays([(key, data.shape, data.dtype, data.shape) for key, data in leaves])
    txn = writer.transaction()
    for store, (_, data) in zip(stores, leaves, strict=True):
        OrbaxStepWriter.write(store, txn, (slice(0, data.size),), data).copy.result()
    txn.commit_async().result()
    writer.flush_store()
    writer.write_tree_metadata()
    return {ondisk.ASSETS_ITEM: ondisk.PYTREE_HANDLER}
