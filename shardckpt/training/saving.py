"""Writing steps: one step writer behind local folders and buckets, in the
background, with one save queued behind the one being written.

`StepWriter` owns the checkpointer: `step_save.StepCheckpointer` for
`gs://` / `s3://` and for a local folder written by one process (there it
writes the arrays' files past the page cache, `O_DIRECT`), Orbax's own
`Checkpointer` for a local folder of several processes; both take the same
calls. It also owns the worker threads and the saves in flight. A save hands the snapshot to the workers and
returns: one thread moves each snapshot off the devices as soon as it is
handed over (`before_write`), another writes the steps one after the other,
in order. A save finding the writer busy queues behind it (`QUEUED_SAVES`):
the host then holds that snapshot too, and training goes on, so a save
blocks for its snapshot alone as long as the disk keeps up on average. A save
finding the queue full waits for the oldest. `wait` and `close` wait for all
of them; an error of a save is raised by the next save, `wait` or `close` as
`BackgroundSaveError`. A new snapshot is taken only once every earlier one
has left the devices: the devices never hold two. Multi-process runs into local folders keep
Orbax's own async save on the training thread instead of the worker: Orbax's
barriers may run device collectives, which must be issued in the same order on
every process. Bucket saves use the worker everywhere: their processes agree
through JAX's coordination service (`agreement`), which runs no collective.

Several `OrbaxCheckpoint`s in one process (a frequent local one beside a
per-epoch one) write one Orbax save at a time where Orbax writes (local
folders, several processes): see `ORBAX_CALLS`.

A wait for the save in flight is recorded (`waits_s`) and warned about once
per `fit`, only when it is a real share of the training time it held up
(`WAIT_SHARE` of the time since the previous save started): a few
milliseconds behind a long interval are no news.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import orbax.checkpoint
import orbax.checkpoint.experimental.v1 as ocp

from shardckpt import _orbax, storage
from shardckpt.errors import BackgroundSaveError
from shardckpt.formats.orbax import removal
from shardckpt.formats.orbax.writer import CHUNK_BYTES
from shardckpt.training import metadata as metadata_lib
from shardckpt.training import resume, step_save

_log = logging.getLogger("shardckpt")

QUEUED_SAVES = 1
"""Saves that may wait behind the one being written (worker path). Their
snapshots are in host memory meanwhile: one more copy of the state there, which
lets a save that comes before the previous write ended return at once instead of
blocking training for the rest of that write (disk speed, seconds) ."""

WAIT_SHARE = 0.1
"""A wait for the previous save is warned about above this share of the time
since that save started (the training it delayed)."""

ORBAX_CALLS = threading.RLock()
"""Held by every call into Orbax's local-folder saving (save, delete, wait,
close; several processes), by every `StepWriter` in the process; a save holds it until committed.

Orbax numbers its operations with one process-wide counter
(`OperationIdGenerator`) that a save's background threads read again later
to name their signals and barriers (`awaitable_signals_contract_<id>`). Two
saves in flight at once, from two callbacks, take each other's number: one
waits for the other's signals ("Timeout waiting for key ...") or creates the
other's temporary folder (`FileExistsError`). One Orbax save at a time per
process keeps the numbers apart. Bucket saves (`step_save`) do not go
through Orbax's saving and do not take it, nor do one-process local saves (the
same writer)."""

_async_in_flight: tuple[Any, int, str, Any] | None = None
"""(writer, step, directory, Orbax AsyncResponse) of the last async save
(several processes, local folders), whose commit outlives `ORBAX_CALLS`: the
next Orbax call of another writer waits for it first."""


@dataclasses.dataclass
class _InFlight:
    """A save handed to the workers (or to Orbax's own async save)."""

    done: Any  # a Future (worker) or an Orbax AsyncResponse
    step: int
    since: float  # when it was handed over
    staged: concurrent.futures.Future | None = None  # its snapshot's move off the devices
    off_devices: bool = False  # its snapshot is (or is being moved) in host memory


class StepWriter:
    """Writes checkpoint steps for `OrbaxCheckpoint` (one `fit` at a time).

    Args:
        location: The checkpoint root.
        policy: The Orbax preservation policy (`retention.preservation_policy`).
        compression: zstd-compress array chunks.
        background: Write on a worker thread (single process, buckets) or
            through Orbax's async save (several processes, local folders);
            False: write before returning.
        context: The Orbax context of the saves (`json_context`).
        waits_s: The list each wait for a save in flight is appended to.
        writes_s: The list the duration of each write (snapshot handed over
            -> step committed; on the worker or, for saves that are not in
            the background, the training thread) is appended to. Orbax's own
            async saves (several processes) are not timed.
    """

    def __init__(self, location: storage.Location, *, policy: Any, compression: bool, background: bool,
                 context: Any, waits_s: list[float], writes_s: list[float] | None = None) -> None:
        self.location = location
        self.background = background
        self.context = context
        self.waits_s = waits_s
        self.writes_s = [] if writes_s is None else writes_s
        # Our own step writer for buckets and for a local folder of one process (it removes the
        # leftovers of killed runs itself); Orbax's Checkpointer for local folders of several processes.
        self.orbax = not location.is_remote and jax.process_count() > 1
        if not self.orbax:
            self.checkpointer: Any = step_save.StepCheckpointer(location, policy=policy, compression=compression)
        else:
            if jax.process_index() == 0:  # before Orbax lists the steps: no leftover is taken for one
                removal.remove_leftovers(location)
            sync("shardckpt-leftovers-removed")
            _orbax.checksum_saves_under(location.url)  # per-chunk crc32c, as shardckpt's own writer stores
            self.checkpointer = ocp.training.Checkpointer(
                location.url,
                preservation_policy=policy,
                # Every call is a decision the callback already made.
                save_decision_policy=ocp.training.save_decision_policies.FixedIntervalPolicy(1),
                # Half-written steps of a killed run: never restored, removed here.
                cleanup_tmp_directories=True,
            )
            # A step leaves the committed set in one rename before its files go.
            _orbax.replace_step_deleter(self.checkpointer, functools.partial(removal.delete_step, location))
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._stager: concurrent.futures.ThreadPoolExecutor | None = None
        if background and (jax.process_count() == 1 or location.is_remote):
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="shardckpt-save")
            self._stager = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="shardckpt-stage")
            # Start the workers now: started by the first save's submit, their
            # start-up was part of the time that save blocked training.
            self._executor.submit(lambda: None).result()
            self._stager.submit(lambda: None).result()
        # Orbax's own async save (several processes) keeps one save in flight:
        # its barriers must come in the same order on every process.
        self.queue_depth = QUEUED_SAVES if self._executor is not None else 0
        self._in_flight: collections.deque[_InFlight] = collections.deque()
        self._warned_wait = False

    def save(self, step: int, payload: dict[str, Any], meta: dict[str, Any], logs: dict[str, Any],
             user: Any, best: Any, *, before_write: Callable[[], None] | None = None,
             off_devices: bool = False) -> None:
        """Starts writing `step` (after `finish_pending(waiting_for=step)` made room for it).

        `before_write` runs on a worker when there is one, at once (the
        snapshot's move off the devices), while an earlier save may still be
        written; the write itself follows the earlier ones. `off_devices`:
        the snapshot is in host memory, or `before_write` moves it there (a
        later save may then queue behind this one; a snapshot left on the
        devices is freed by its write alone, which a later save waits for).
        """
        if not self.background:
            self._timed_write(step, payload, meta, logs, user, best, before_write)
            return
        since = time.perf_counter()
        if self._executor is not None:
            assert self._stager is not None
            staged = self._stager.submit(before_write) if before_write is not None else None
            ready = staged.result if staged is not None else None
            done = self._executor.submit(self._timed_write, step, payload, meta, logs, user, best, ready)
            self._in_flight.append(_InFlight(done, step, since, staged, off_devices))
            return
        global _async_in_flight
        if before_write is not None:
            before_write()
        metrics = metadata_lib.complete(payload, meta, logs, user, best)
        with self._one_orbax_call(), self.context:
            response = self.checkpointer.save_checkpointables_async(step, payload, metrics=metrics, force=True)
            _async_in_flight = (self, step, self.location.url, response)
        self._in_flight.append(_InFlight(response, step, since))

    def _timed_write(self, step: int, payload: dict[str, Any], meta: dict[str, Any], logs: dict[str, Any],
                     user: Any, best: Any, ready: Callable[[], Any] | None) -> None:
        # On the save worker (background) or the training thread (sync). The
        # training thread never touches the Checkpointer while a save is in
        # flight (`delete` and `wait` wait for them first), so Orbax sees one
        # caller at a time. `ready`: the snapshot's move off the devices (sync)
        # or the wait for it (worker: the stager runs it). Timed from the
        # moment the write can start: a queued save's time in the queue is not
        # its write's.
        start = time.perf_counter()
        if ready is not None:
            ready()
        metrics = metadata_lib.complete(payload, meta, logs, user, best)
        with self._one_orbax_call(), self.context:
            self.checkpointer.save_checkpointables(step, payload, metrics=metrics, force=True)
        self.writes_s.append(time.perf_counter() - start)

    def busy(self) -> bool:
        """True while a background save is still being written (or queued)."""
        return any(not _finished(f.done) for f in self._in_flight)

    @contextlib.contextmanager
    def _one_orbax_call(self) -> Iterator[None]:
        """Holds `ORBAX_CALLS` (Orbax's Checkpointer), after another writer's async save in flight is committed."""
        if not self.orbax:
            yield
            return
        with ORBAX_CALLS:
            global _async_in_flight
            if _async_in_flight is not None and _async_in_flight[0] is not self:
                _, step, directory, response = _async_in_flight
                _async_in_flight = None
                try:
                    response.result()
                except Exception as e:
                    raise background_error(e, step, directory) from e
            yield

    def finish_pending(self, waiting_for: int | None = None) -> None:
        """Waits for saves in flight and raises the first error among them, if any.

        Args:
            waiting_for: The step about to be saved: then only room is made for
                it (the snapshots of earlier saves off the devices, at most
                `queue_depth` saves left in flight), and a wait for a save
                being written is recorded (and warned about if it is long).
                None: waits for every save.

        Raises:
            BackgroundSaveError: a save in flight failed.
        """
        while self._in_flight and (waiting_for is None or _finished(self._in_flight[0].done)):
            self._settle(self._in_flight.popleft())
        if waiting_for is None:
            return
        # A snapshot left on the devices is freed by its write alone: the next
        # one waits for it, so the devices never hold two.
        room = self.queue_depth if all(s.off_devices for s in self._in_flight) else 0
        while len(self._in_flight) > room:
            saving = self._in_flight.popleft()
            start = time.perf_counter()
            still_running = not _finished(saving.done)
            self._settle(saving)
            if still_running:
                self._record_wait(waiting_for, saving, start, time.perf_counter() - start, room)
        # Those queued are off the devices before the next snapshot is taken
        # (a failed move is raised by its write, when settled).
        concurrent.futures.wait([s.staged for s in self._in_flight if s.staged is not None])

    def _settle(self, saving: _InFlight) -> None:
        global _async_in_flight
        if _async_in_flight is not None and _async_in_flight[3] is saving.done:
            _async_in_flight = None  # its error, if any, is raised here
        try:
            saving.done.result()
        except Exception as e:
            raise background_error(e, saving.step, self.location.url) from e

    def _record_wait(self, waiting_for: int, saving: _InFlight, start: float, waited: float, room: int) -> None:
        self.waits_s.append(waited)
        share = waited / max(start + waited - saving.since, 1e-9)
        if room:
            queued = f"{room} save queued behind the one being written, at most"
        elif self.queue_depth:
            queued = "its snapshot stays on the devices until written, so the next one waits for it"
        else:
            queued = "one save in flight at a time"
        message = (f"checkpoint step {waiting_for} waited {waited:.3f} s for the background save of step "
                   f"{saving.step} ({share:.0%} of the training time since that save started; {queued}).")
        if share < WAIT_SHARE or self._warned_wait:
            _log.debug("OrbaxCheckpoint: %s", message)
            return
        self._warned_wait = True
        _log.warning("OrbaxCheckpoint: %s Fix: save less often (save_freq), or check the write speed "
                     "of the directory. Said once per fit; all waits are in save_waits_s.", message)

    def wait(self) -> None:
        """Blocks until every started save is committed."""
        self.finish_pending()
        with self._one_orbax_call():
            self.checkpointer.wait()

    def end(self) -> None:
        """Finishes the save in flight and closes the checkpointer (end of `fit`).

        Raises:
            BackgroundSaveError: the save in flight failed.
        """
        try:
            self.finish_pending()
        except BackgroundSaveError as failure:
            self.close(failure)
            raise
        self.close(None)

    def delete(self, step: int) -> None:
        self.finish_pending()  # the Checkpointer has one caller at a time
        with self._one_orbax_call():
            self.checkpointer.delete(step)

    def close(self, failure: BackgroundSaveError | None) -> None:
        """Closes the checkpointer (after `finish_pending`); `failure` is being raised already."""
        for pool in (self._stager, self._executor):
            if pool is not None:
                pool.shutdown(wait=True)
        self._executor = self._stager = None
        try:
            with self._one_orbax_call():
                self.checkpointer.close()
        except Exception as e:
            # Orbax keeps a failed save's error and raises it again on close;
            # that one is already being reported, anything else is new.
            cause = getattr(failure, "original", None)
            if cause is None or not (e is cause or (type(e) is type(cause) and str(e) == str(cause))):
                raise


def _finished(done: Any) -> bool:
    """Whether a Future (or an Orbax AsyncResponse, which cannot tell: False) is done."""
    return bool(done.done()) if hasattr(done, "done") else False


def payload(tree: dict[str, Any], *, model_config: Any, assets: Any, iterator_states: list[Any] | None) -> dict:
    """The items of one step: arrays, Keras' model config and assets (full saves), iterator states."""
    items: dict[str, Any] = {resume.ARRAYS_ITEM: tree}
    if model_config is not None:
        items["model_config"] = {"config": model_config}
    if assets is not None:
        items["assets"] = assets
    if iterator_states is not None:
        items[resume.ITERATOR_ITEM] = {"process_states": iterator_states}
    return items


def json_context(*, compression: bool) -> Any:
    """The Orbax context of every save: JSON items, array compression and chunking.

    Our metadata items go to Orbax's JsonHandler; without the registry a dict
    would go to the PyTree handler (registered last), which cannot hold None or
    lists of mixed types.

    Arrays are stored in chunks of at most 31 MiB, or 4 MiB with zstd
    (Orbax's `chunk_byte_size` splits each device's shard), as `convert`
    writes them. Orbax's default is one chunk per shard: a whole array when
    it was on one device, which a restore decodes on one thread. Measured with
    `tools/bench_chunks.py` (see `shardckpt.formats.orbax.writer.CHUNK_BYTES`).
    """
    registry = ocp.handlers.local_registry()
    registry.add(ocp.handlers.JsonHandler, checkpointable_name=resume.METADATA_ITEM)
    registry.add(ocp.handlers.JsonHandler, checkpointable_name=resume.ITERATOR_ITEM)
    context = ocp.Context()
    context.checkpointables.registry = registry
    context.array.saving.use_compression = compression
    context.array.saving.storage_options.chunk_byte_size = CHUNK_BYTES["zstd" if compression else "none"]
    # Replica-parallel saving slices every replicated shard on its device
    # (one jitted slice per shard, a device copy of it) so that replicas
    # could share the writing; with one process writing everything that
    # buys nothing and costs device memory above the snapshot and, on CPU,
    # a third of a background save's time (the first save compiles each slice).
    context.array.saving.use_replica_parallel = False
    return context


def background_error(error: Exception, step: int | None, directory: str) -> BackgroundSaveError:
    """Wraps a save thread's exception; keeps it as `.original` and `.step`.

    `__cause__` is set too, but Keras' traceback filtering re-raises errors
    from `fit` with `from None`, so the attributes are what survives.
    """
    return BackgroundSaveError(
        f"Saving checkpoint step {step} to {directory!r} failed in the background: "
        f"{type(error).__name__}: {error}. The step was not committed; earlier steps "
        "are intact. Fix: check disk space and permissions of the directory, then "
        "rerun (training resumes from the last committed step).",
        original=error,
        step=step,
    )


def sync(key: str) -> None:
    """A barrier of every process (nothing with one process)."""
    if jax.process_count() > 1:
        # The v0 public barrier (the v1 one wants an Orbax operation id).
        orbax.checkpoint.multihost.sync_global_processes(key)
