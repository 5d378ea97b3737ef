"""`OrbaxCheckpoint` steps written by shardckpt: into a bucket (`gs://`, `s3://`), or a local folder from one process.

Orbax v1's `ocp.training.Checkpointer` reaches `gs://` only through etils'
epath with gcsfs, and has no S3 support for arrays. In a bucket the callback
therefore writes each step itself, with the same layout its local saves have
(what `restore_latest`, `load_sharded`, `inspect`, `verify` and Keras' Orbax
loaders read):

- `pytree/`: the state tree, one zarr3 array per leaf in an OCDBT store,
  written through `OrbaxStepWriter` (Orbax's own TensorStore specs), each
  array chunked by its shards as Orbax chunks it;
- `shardckpt_metadata/data.json`, `data_iterator/data.json`: the JSON items
  (what Orbax's `JsonHandler` writes), `metrics/metrics` (its
  `MetricsHandler`);
- `model_config/` (the config string, as Orbax's `StringHandler` stores a
  string leaf) and `assets/` (Keras' asset tree) for full saves;
- `_CHECKPOINT_METADATA` and `orbax.checkpoint`, then `commit_success.txt`,
  the last object written (the commit protocol, `shardckpt.storage.commit`):
  a bucket has no rename, so a step counts as committed only once that
  marker exists, and a killed save never does.

`StepCheckpointer` offers the part of `ocp.training.Checkpointer` the
callback calls (`save_checkpointables`, `delete`, `wait`, `close`), so the
callback's background thread, snapshot and resume code are the same for both.
Retention uses the same Orbax preservation policy as local saves; old steps
are deleted only after the new step is committed, marker first, so a step
half-deleted by a kill is no longer taken as committed.

In a local folder (one process) the same files go into Orbax's temporary
folder for the step (`<step>.orbax-checkpoint-tmp-<ns>`, which every reader
and `removal.remove_leftovers` know as a save never committed), renamed to
the step when complete (`storage.commit`; `commit_success.txt` written just
before, as Orbax does): what Orbax's own `Checkpointer` writes there, except that the arrays' OCDBT store is encoded in memory and
its files are written past the page cache (`OrbaxStepWriter(direct=...)`),
each fsynced before the rename.

Several JAX processes (`jax.distributed`) save a step together, with the
layout of Orbax's multi-process OCDBT saves: process 0 begins the step's
stage (an earlier, never committed attempt at it removed); each process then writes only the pieces of its own devices
(replicated ones once, by the holder of replica 0) into its own OCDBT store,
`pytree/ocdbt.process_N`, within its host's in-flight budget; once every
process reports its writes durable, process 0 merges the stores into
`pytree/`'s own (`merge_process_stores`), writes the other items and the
commit marker last, and applies retention. The outcome of each phase goes
through JAX's coordination service (`agreement`): a failure on any process
fails the save on all, and nothing is committed.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import time
from typing import Any

import jax
import numpy as np

from shardckpt import _orbax, budget, storage
from shardckpt.errors import StepExistsError
from shardckpt.formats.orbax import ondisk, removal
from shardckpt.formats.orbax.writer import CHUNK_BYTES, OrbaxStepWriter, merge_process_stores
from shardckpt.storage import commit
from shardckpt.storage.direct import DirectWriter
from shardckpt.training.agreement import Agreement


@dataclasses.dataclass
class _StepInfo:
    """What Orbax's preservation policies look at (its `PolicyCheckpointInfo`)."""

    step: int
    metrics: dict[str, Any] | None
    time: datetime.datetime


class StepCheckpointer:
    """Writes, lists and deletes the callback's steps under a bucket prefix (or a local folder).

    Args:
        root: The checkpoint root (a bucket location, or a local folder
            written by one process).
        policy: An Orbax preservation policy (`retention.preservation_policy`),
            or None to keep every step.
        compression: zstd-compress array chunks (Orbax's zstd level 3).

    Only process 0 lists, deletes and commits steps (and keeps the list of
    steps retention looks at); every process writes its own pieces.
    """

    def __init__(self, root: storage.Location, *, policy: Any, compression: bool) -> None:
        self.root = root
        self.policy = policy
        self.compression = compression
        self.primary = jax.process_index() == 0
        self._steps: list[_StepInfo] = []
        self.local = commit.renames(root)
        if self.local and jax.process_count() > 1:
            raise ValueError(f"StepCheckpointer writes local folders from one process; {jax.process_count()} "
                             f"processes run. Received: root={root.url!r}")
        # Reused by every save: the aligned buffers the arrays' files go through (one per write-out at once).
        self._direct = DirectWriter() if self.local else None
        agreement = Agreement(root.url, -1, f"Opening checkpoint root {root.url!r}")
        agreement.settle("open", self._attempt(self._open_root), everyone=False)

    # ---- the Checkpointer methods the callback calls -------------------------

    def save_checkpointables(self, step: int, payload: dict[str, Any], *, metrics: dict[str, Any] | None = None,
                             force: bool = True) -> None:
        """Writes step `step` (committed last), then applies retention.

        Args:
            step: The step number (the folder name).
            payload: `{item: value}`: the array tree under "pytree", JSON
                dicts under the callback's JSON items, "model_config" and
                "assets" as Keras' callback gives them.
            metrics: Numeric logs, stored in the metrics item (the
                preservation policy ranks steps by them).
            force: Ignored (the callback decides when to save).

        Raises:
            StepExistsError: the step exists and is committed (a
                `ValueError`, as Orbax's `StepAlreadyExistsError`).
        """
        del force
        step_loc = self.root.join(str(step))
        agreement = Agreement(self.root.url, step, f"Saving checkpoint step {step} to {step_loc.url!r}")
        stages: list[commit.Stage] = []
        agreement.settle("clean", self._attempt(lambda: stages.extend(self._begin(step, step_loc))), everyone=False)
        try:
            multi = jax.process_count() > 1
            compression = "zstd" if self.compression else "none"
            # Where the files go: the step itself in a bucket, its temporary folder locally.
            where = stages[0].location if stages else step_loc
            # The chunks Orbax's local saves got (the callback's Orbax
            # context), so a step restores alike from either place.
            writer = OrbaxStepWriter(where.url, compression=compression, chunk_byte_size=CHUNK_BYTES[compression],
                                     process_index=jax.process_index() if multi else None, direct=self._direct)
            # Arrays first: any object of a save killed early is under pytree/,
            # which readers report as a step never committed.
            agreement.settle("write", self._attempt(lambda: _write_arrays(writer, payload[ondisk.ARRAYS_ITEM])),
                             everyone=True)
            agreement.settle("commit", self._attempt(lambda: self._commit(stages, step, writer, payload, metrics)),
                             everyone=False)
        except BaseException:
            if self.local:  # a local temporary folder is never a step: removed at once (a bucket's objects stay
                for stage in stages:  # markerless until the next start removes them)
                    stage.discard()
            raise

    @staticmethod
    def _attempt(action: Any) -> Exception | None:
        """Runs `action`; returns what it raised (shared with the other processes), or None."""
        try:
            action()
        except Exception as e:
            return e
        return None

    def _open_root(self) -> None:
        """Process 0: removes the half-written steps of a killed run, lists the committed ones."""
        if not self.primary:
            return
        if self.local:  # Orbax's Checkpointer creates a local root at once, saved into or not (Keras' callback too)
            os.makedirs(self.root.path, exist_ok=True)
        # Never restored; Orbax removes its local tmp folders at start
        # (cleanup_tmp_directories), so do we.
        removal.remove_leftovers(self.root)
        self._steps = [
            _StepInfo(step, self._read_metrics(step), datetime.datetime.fromtimestamp(0, datetime.UTC))
            for step in ondisk.committed_steps(self.root.url)
        ]

    def _begin(self, step: int, step_loc: storage.Location) -> list[commit.Stage]:
        """Process 0: refuses a committed step; starts its stage (`storage.commit`), which removes
        an earlier, never committed attempt at it. Every process writes under `step_loc` itself."""
        if not self.primary:
            return []
        if any(info.step == step for info in self._steps):
            raise StepExistsError(
                f"Step {step} already exists in {self.root.url!r} (committed). Fix: save under a new step "
                f"number, delete step {step} first, or use a new checkpoint directory. Received: step={step}"
            )
        if self.local:
            # Orbax's name for a step being written: every reader and `remove_leftovers` know it.
            # Its commit marker goes in before the rename, as Orbax writes it there too.
            return [commit.begin(step_loc, overwrite=True, marker=ondisk.COMMIT_MARKER, who="OrbaxCheckpoint",
                                 temporary=f"{step}{ondisk.TMP_MARK}-{time.time_ns()}")]
        return [commit.begin(step_loc, overwrite=True, marker=ondisk.COMMIT_MARKER, who="OrbaxCheckpoint")]

    def _commit(self, stages: list[commit.Stage], step: int, writer: OrbaxStepWriter, payload: dict[str, Any],
                metrics: dict[str, Any] | None) -> None:
        """Process 0, after every process wrote its pieces: the other items, the commit marker, retention."""
        if not self.primary:
            return
        [stage] = stages
        step_loc = storage.parse(writer.step_dir)  # the temporary folder, locally
        if writer.process_index is not None:
            merge_process_stores(writer.tree_dir, jax.process_count())
        handlers: dict[str, str] = {}
        compression = writer.compression
        for name, value in payload.items():
            if name == ondisk.ARRAYS_ITEM:
                continue
            if name == "model_config":
                OrbaxStepWriter(step_loc.url, compression=compression, chunk_byte_size=None, item=name).write_strings(value)
                handlers[name] = ondisk.PYTREE_HANDLER
            elif name == "assets":
                assets = OrbaxStepWriter(step_loc.url, compression=compression, chunk_byte_size=CHUNK_BYTES[compression],
                                         item=name, direct=self._direct)
                _write_arrays(assets, value)
                assets.flush_store()
                assets.write_tree_metadata()
                handlers[name] = ondisk.PYTREE_HANDLER
            else:
                ondisk.write_json(_item_file(step_loc, name, ondisk.JSON_ITEM_FILES[0]), value)
                handlers[name] = ondisk.JSON_HANDLER
        if metrics is not None:
            ondisk.write_json(_item_file(step_loc, ondisk.METRICS_ITEM, ondisk.METRICS_ITEM), metrics)
            handlers[ondisk.METRICS_ITEM] = ondisk.METRICS_HANDLER
        # Commit marker last (a bucket), or the rename (locally).
        stage.commit(writer.finish(custom_metadata={}, item_handlers=handlers, final_dir=stage.dst.url))
        self._steps.append(_StepInfo(step, metrics, datetime.datetime.now(datetime.UTC)))
        self._apply_retention()

    def delete(self, step: int) -> None:
        """Deletes a step: its commit marker first, so a half-deleted step never counts (process 0)."""
        if not self.primary:
            return
        removal.delete_step(self.root, step)
        self._steps = [info for info in self._steps if info.step != step]

    def wait(self) -> None:
        """Saves are synchronous here (the callback runs them on its worker thread)."""

    def close(self) -> None:
        """Nothing is held open between saves."""

    # ---- helpers ---------------------------------------------------------------

    def _apply_retention(self) -> None:
        if self.policy is None:
            return
        self._steps.sort(key=lambda info: info.step)
        keep = self.policy.should_preserve(self._steps, context=_orbax.preservation_policy.PreservationContext())
        for info, kept in list(zip(self._steps, keep)):
            if not kept:
                self.delete(info.step)

    def _read_metrics(self, step: int) -> dict[str, Any] | None:
        return storage.read_json(
            self.root.join(str(step), ondisk.METRICS_ITEM, ondisk.METRICS_ITEM),
            fix="delete this step to resume from the previous one.",
            missing_ok=True,
        )


def _item_file(step: storage.Location, item: str, name: str) -> str:
    """The URL of file `name` of a step's item; a local item's folder is created (a bucket has none)."""
    if step.local_path is not None:
        os.makedirs(os.path.join(step.local_path, item), exist_ok=True)
    return step.join(item, name).url


def _leaves(tree: dict[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    out = []
    for key in sorted(tree):
        value = tree[key]
        if isinstance(value, dict):
            out += _leaves(value, (*prefix, key))
        else:
            out.append(((*prefix, key), value))
    return out


def _write_arrays(writer: OrbaxStepWriter, tree: dict[str, Any], *, limit: int | None = None) -> None:
    """Writes this process's pieces of every leaf of `tree`; bucket failures typed.

    `limit`: the bytes of one transaction (None: the host's in-flight budget).

    Raises:
        StorageAccessDeniedError, BucketNotFoundError, StorageTimeoutError, ...:
            a request failed (the error names the OCDBT store written).
    """
    try:
        _write_pieces(writer, tree, limit=limit)
    except ValueError as e:
        typed = storage.translate(e, storage.parse(writer.store_dir), action="writing")
        if typed is e:
            raise
        raise typed from e


def _write_pieces(writer: OrbaxStepWriter, tree: dict[str, Any], *, limit: int | None = None) -> None:
    """Writes every leaf of `tree`, one stored block per distinct shard.

    Each array's write blocks are its shards, as Orbax writes a `jax.Array`
    (stored in chunks of at most `writer.chunk_byte_size`); replicated shards
    are written once (`replica_id == 0`), each by the process whose device
    holds it; host (numpy) leaves by process 0. TensorStore holds what a transaction
    has staged until it commits, so the writes go in transactions of at most
    the host's `max_inflight_bytes` each (one OCDBT commit apiece, as
    `convert` writes): host memory beyond the state stays within that budget
    rather than a second copy of the state. A store encoded in memory has
    its transactions' value files written out on threads while the next
    transaction is encoded, so the budget is shared by the transactions in
    memory at once (`OrbaxStepWriter.flush_values`).
    """
    leaves = _leaves(tree)
    specs = []
    for parts, value in leaves:
        shape = tuple(value.shape)
        if isinstance(value, jax.Array):
            write_shape = tuple(value.sharding.shard_shape(value.shape))
        else:
            write_shape = shape
        specs.append(("/".join(parts), shape, np.dtype(value.dtype), write_shape))
    stores = writer.open_arrays(specs)
    for (key, _, _, write_shape), (_, value) in zip(specs, leaves):
        if isinstance(value, jax.Array):
            writer.record_sharding(key, value.sharding, write_shape)
    limit = budget.default_max_inflight_bytes() if limit is None else limit
    if writer.direct is not None:
        # Value files are written out while the next transaction is encoded (`flush_values`).
        limit = max(1, limit // (writer.direct.streams + 1))
    try:
        _write_transactions(writer, leaves, stores, limit)
    except BaseException as e:
        failed = writer.abandon()
        if failed is not None and failed is not e:
            e.add_note(f"Writing the committed value files of {writer.store_dir!r} out failed too: {failed!r}")
        raise


def _write_transactions(writer: OrbaxStepWriter, leaves: list[tuple[tuple[str, ...], Any]], stores: list[Any],
                        limit: int) -> None:
    """Stages the pieces of `leaves` into `stores` in transactions of at most `limit` bytes; commits each."""
    txn = writer.transaction()
    copies: list[Any] = []  # futures: TensorStore has copied the staged data
    staged = 0

    def commit(txn: Any, copies: list[Any]) -> None:
        for copy in copies:
            copy.result()
        txn.commit_async().result()
        writer.flush_values()  # a memory-encoded store: its committed value file to disk, on a thread

    for (_, value), store in zip(leaves, stores, strict=True):
        if isinstance(value, jax.Array):
            pieces = [(tuple(s.index), s.data) for s in value.addressable_shards if s.replica_id == 0]
        else:
            pieces = [((), value)] if writer.process_index in (None, 0) else []
        for box, data in pieces:
            nbytes = int(np.prod(data.shape)) * np.dtype(data.dtype).itemsize
            if copies and staged + nbytes > limit:
                commit(txn, copies)
                txn, copies, staged = writer.transaction(), [], 0
            # A memory-encoded store is committed and written out before this save returns, and
            # the snapshot is not changed meanwhile: TensorStore encodes from it with no copy.
            copies.append(writer.write(store, txn, box, np.asarray(data), reference=writer.encodes_in_memory).copy)
            staged += nbytes
    commit(txn, copies)
    writer.wait_values()
