"""`OrbaxCheckpoint`: Keras' Orbax callback with little blocking and exact resume.

A drop-in for `keras.callbacks.OrbaxCheckpoint` (same arguments, same meaning,
same on-disk layout: an `ocp.training.Checkpointer` root whose steps hold the
"pytree" state tree, plus "model_config"/"assets" for full saves), with:

* Background saves that block training only for a snapshot of the state
  (`snapshot.py`: an on-device copy, or a copy to pinned host memory in pieces
  of bounded size when the devices have no room for one); Orbax writes it on
  one worker thread. At most one save is in
  flight: when the next is due while one is still writing, the training thread
  waits for it, and the wait is logged (`logging` WARNING, and
  `save_waits_s`). Errors of a background save are raised as
  `BackgroundSaveError` at the next save or at the end of training.
* Two JSON items beside the arrays: "shardckpt_metadata" (the user's metadata,
  step, epoch, logs, versions, mesh and layout) and "data_iterator" (the
  position of every process's iterator after the batches trained on).
* Retention by latest N, best N by `monitor`, and every `keep_period` steps.
* Preemption: on SIGTERM (or JAX's preemption notice with several
  processes), a save at the next step boundary, committed before `fit` stops
  cleanly (`preemption.py`).
* Resume: `fit` restores the latest committed step (all model, optimizer,
  metric and seed-generator variables, iterator position, epoch and position in
  the epoch) and continues bit-identically to an uninterrupted run.

Multi-process runs (`jax.process_count() > 1`) keep Orbax's own async save on
the training thread instead of the worker: Orbax's barriers may run device
collectives, which must be issued in the same order on every process.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
import orbax.checkpoint
import orbax.checkpoint.experimental.v1 as ocp

from shardckpt import _keras, storage
from shardckpt._keras import MonitorCallback
from shardckpt.errors import BackgroundSaveError
from shardckpt.formats.orbax.writer import CHUNK_BYTES
from shardckpt.training import bucket_save, iterators, preemption, resume, retention
from shardckpt.training import metadata as metadata_lib
from shardckpt.training import snapshot as snapshot_lib
from shardckpt.training.resume import ResumeInfo

_log = logging.getLogger("shardckpt")


class OrbaxCheckpoint(MonitorCallback):
    """Saves and resumes training state with Orbax, asynchronously and exactly.

    Arguments up to `save_weights_only` are those of
    `keras.callbacks.OrbaxCheckpoint`, in its order and with its meaning, so
    swapping the import is enough. The rest are keyword-only additions.

    Steps are named as Keras names them: the epoch index for
    `save_freq="epoch"`, the number of batches trained for an integer
    `save_freq`. `keep_period` counts in the same unit.

    Resume (`resume=True`, opt-in as Keras' callback never resumes): at the start of `fit`, if `directory` holds a
    committed step, it is restored and `fit` continues after it. A step saved
    in the middle of an epoch resumes in that epoch: only its remaining
    batches run (the callback stops the shortened epoch with
    `model.stop_training` and clears the flag in `on_epoch_end`), so epoch
    boundaries match the uninterrupted run. Exact mid-epoch resume needs the
    data to continue where it stopped: feed `fit` from `self.batches()` over
    `data_iterator`. With array inputs an epoch restarts from its first
    batch, as with `keras.callbacks.BackupAndRestore`.

    Preemption (`save_on_preemption=True`, the default): while `fit` runs, a
    SIGTERM (the notice of spot VMs and cluster schedulers) or, with several
    processes, JAX's preemption notice makes the callback save at the next
    step boundary (all processes agree on it), wait until that step is
    committed, and stop `fit` cleanly; `preempted_step` then names the step.
    The save happens whatever `save_best_only` says: it is the state to resume
    from. With `save_freq="epoch"` a step saved in the middle of epoch `e` is
    named `e`; a resumed run replaces it with the full epoch's step `e`. The
    previous SIGTERM handler is back when `fit` ends; a second SIGTERM goes to
    it (by default: the process ends at once).

    Example:

    ```python
    ckpt = shardckpt.OrbaxCheckpoint(
        "ckpts/", save_freq=100, max_to_keep=3, keep_best=1,
        metadata={"run": "exp-7"}, data_iterator=it, resume=True)
    model.fit(ckpt.batches(), steps_per_epoch=500, epochs=10, callbacks=[ckpt])
    ```

    Args:
        directory: Root folder of the checkpoints, or a `gs://bucket/...` /
            `s3://bucket/...` URL (single-process runs; see `bucket_save`).
        monitor: Metric for `save_best_only` and `keep_best`.
        verbose: 1 prints a line per save and per wait.
        save_best_only: Save only when `monitor` improves.
        mode: "auto", "min" or "max": the direction of `monitor`.
        save_freq: "epoch", or save every this many batches.
        initial_value_threshold: Initial "best" value for `save_best_only`.
        max_to_keep: Keep the latest N steps (None: keep every step). 1 by
            default, as in Keras' callback.
        save_on_background: Write in the background (training waits only for a
            snapshot). False: each save is written before training goes on.
        save_weights_only: Save trainable and non-trainable variables only
            (no optimizer/metrics/model config; such a step cannot resume
            exactly).
        keep_best: Also keep the N best steps by `monitor` (with `max_to_keep`).
        keep_period: Also keep every step that is a multiple of this.
        metadata: A JSON dict, or a callable `(epoch, logs) -> dict`, saved under
            "user" in each step's metadata.
        data_iterator: An object with `get_state()` / `set_state(state)`.
        resume: Restore the latest committed step when `fit` starts. Off by
            default: Keras' callback never restores, and a second `fit` in
            the same directory trains and saves new steps as it does there.
        compression: zstd-compress array chunks as Keras' callback does. Off by
            default: float training state shrinks ~10% while compression took
            about a third of a background save's CPU time (tools/bench_save.py);
            readers (Keras, Orbax, shardckpt) handle both.
        save_on_preemption: Save and stop at the next step boundary on a
            preemption notice (see above).
        snapshot: How a background save copies the state before training
            goes on: "device" (an on-device copy, the least blocking, one
            extra state of device memory until written), "host" (off the
            devices piece by piece into pinned host memory, device memory
            above the state within `snapshot_budget_bytes`, training waits for
            the transfer), or "auto": "device" only when `memory_stats()` of
            every device shows room for it. `snapshot_modes` lists the mode of
            each save, and each step's metadata has it under "snapshot".
        snapshot_budget_bytes: Host mode's piece size, and the room "auto"
            keeps free beside an on-device copy (256 MiB).

    Raises:
        ValueError: an argument is out of range.
        TypeError: `data_iterator` lacks `get_state`/`set_state`, or `metadata`
            is neither a dict nor callable.
    """

    def __init__(
        self,
        directory: str,
        monitor: str = "val_loss",
        verbose: int = 0,
        save_best_only: bool = False,
        mode: str = "auto",
        save_freq: str | int = "epoch",
        initial_value_threshold: float | None = None,
        max_to_keep: int | None = 1,
        save_on_background: bool = True,
        save_weights_only: bool = False,
        *,
        keep_best: int | None = None,
        keep_period: int | None = None,
        metadata: dict[str, Any] | Callable[[int, dict], dict] | None = None,
        data_iterator: Any = None,
        resume: bool = False,
        compression: bool = False,
        save_on_preemption: bool = True,
        snapshot: str = "auto",
        snapshot_budget_bytes: int = snapshot_lib.DEFAULT_BUDGET_BYTES,
    ) -> None:
        super().__init__(monitor, mode, initial_value_threshold)
        self.best: float | None  # set by MonitorCallback.__init__ (initial_value_threshold)
        if save_freq != "epoch" and (not isinstance(save_freq, int) or isinstance(save_freq, bool) or save_freq < 1):
            raise ValueError(f"Unrecognized save_freq: {save_freq}. Expected save_freq are 'epoch' or integer values")
        if snapshot not in snapshot_lib.MODES:
            raise ValueError(f"snapshot must be one of {snapshot_lib.MODES}. Received: snapshot={snapshot!r}")
        if not isinstance(snapshot_budget_bytes, int) or isinstance(snapshot_budget_bytes, bool) or snapshot_budget_bytes < 1:
            raise ValueError(
                f"snapshot_budget_bytes must be a positive integer. Received: {snapshot_budget_bytes!r}")
        if metadata is not None and not (isinstance(metadata, dict) or callable(metadata)):
            raise TypeError(
                "metadata must be a JSON dict or a callable (epoch, logs) -> dict. "
                f"Received: metadata={metadata!r}"
            )
        # Validate the counts now rather than at the first fit.
        retention.preservation_policy(
            max_to_keep=max_to_keep, keep_best=keep_best, monitor=monitor,
            higher_is_better=False, keep_period=keep_period,
        )
        # A gs:// or s3:// URL saves through bucket_save (single process).
        self._location = storage.parse(directory, what="directory")
        self.directory = self._location.url
        self.verbose = verbose
        self.save_best_only = save_best_only
        self.save_freq = save_freq
        self.max_to_keep = max_to_keep
        self.save_on_background = save_on_background
        self.save_weights_only = save_weights_only
        self.keep_best = keep_best
        self.keep_period = keep_period
        self.metadata = metadata
        self.data_iterator = data_iterator
        self.resume = resume
        self._tracker = (
            iterators.IteratorTracker(data_iterator, on_first_pull=self._restore_iterator_early)
            if data_iterator is not None
            else None
        )
        self.checkpointer: Any = None
        # ResumeInfo by name: in this method `resume` is the argument, not the module.
        self.resumed: ResumeInfo | None = None
        self.save_blocking_s: list[float] = []
        self.save_waits_s: list[float] = []
        self.compression = compression
        self.save_on_preemption = save_on_preemption
        self.snapshot = snapshot
        self.snapshot_budget_bytes = snapshot_budget_bytes
        self.snapshot_mode_used: str | None = None
        self.snapshot_modes: list[str] = []
        self.preempted_step: int | None = None
        self.preemption_mode = "off"
        self._watch = preemption.PreemptionWatch()
        self._context = _json_context(compression=compression)
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: Any = None  # Future (worker) or Orbax AsyncResponse
        self._pending_step: int | None = None
        self._iterator_restored_from: str | None = None
        # Per-fit state, set by `_reset_counters` (here and at each fit's start).
        self._epoch: int
        self._batch_in_epoch: int
        self._last_batch_seen: int | None
        self._batches_since_save: int
        self._fit_batches: int
        self._resume_epoch: int | None
        self._resume_offset: int
        self._resume_metrics: list[np.ndarray] | None
        self._stopped_epoch_early: bool
        self._batch_ends: int
        self._last_saved_step: int | None
        self._replace_step: int | None
        self._steps_per_epoch: int | None
        self._total_batches_seen: int
        self._reset_counters()

    # ---- public API ---------------------------------------------------------

    def batches(self) -> Iterator[Any]:
        """The batches of `data_iterator`, to pass to `fit` (call once per fit).

        The iterator is set to the resumed position before its first batch is
        pulled, and its state is recorded before every pull, so each save holds
        the position after exactly the batches trained on (Keras pulls ahead).

        Raises:
            ValueError: the callback has no `data_iterator`.
        """
        if self._tracker is None:
            raise ValueError("OrbaxCheckpoint.batches() needs data_iterator=... in the constructor.")
        self._tracker = iterators.IteratorTracker(self.data_iterator, on_first_pull=self._restore_iterator_early)
        return self._tracker.batches()

    def wait_until_finished(self) -> None:
        """Blocks until every started save is written (on every process).

        Raises:
            BackgroundSaveError: a background save failed.
        """
        self._finish_pending()
        if self.checkpointer is not None:
            self.checkpointer.wait()
        _sync("shardckpt_wait_until_finished")

    def is_multihost_enabled(self) -> bool:
        """True when JAX runs more than one process (as Keras' callback)."""
        return jax.process_count() > 1

    def is_primary_host(self) -> bool:
        """True on process 0 (as Keras' callback)."""
        return jax.process_index() == 0

    # ---- Keras callback hooks -----------------------------------------------

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._reset_counters()
        # Keras' trainer reads the initial epoch right after this hook (see _keras).
        self._previous_initial_epoch = _keras.initial_epoch(self._model)
        if self.monitor_op is None and (self.keep_best is not None or self.save_best_only):
            self._set_monitor_op()
        self.checkpointer = self._make_checkpointer()
        if self._executor is None and self.save_on_background and jax.process_count() == 1:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="shardckpt-save")
        # Config and assets (vocabularies...) do not change during fit; Keras'
        # callback rebuilds both at every save (tens of ms on the training thread).
        # Private Keras helpers, the ones its callback and load_model use.
        self._model_config = None if self.save_weights_only else _keras.serialize_model_config(self.model)
        self._assets = None if self.save_weights_only else _keras.save_assets(self.model)
        self._layout = metadata_lib.layout_of(self.model)
        step_dir = resume.latest_step_dir(self.directory) if self.resume else None
        if step_dir is not None:
            self._resume_from(step_dir)
        self.preempted_step = None
        if self.save_on_preemption:
            self._watch.start()
        # How a notice is seen in this fit: "signal", "jax" (JAX's preemption
        # service, several processes), "signal+allgather", or "off".
        self.preemption_mode = self._watch.mode

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = epoch
        self._batch_in_epoch = 0
        self._last_batch_seen = None
        if self._resume_epoch == epoch:
            self._batch_in_epoch = self._resume_offset
            if self._resume_metrics is not None:
                # fit reset the metrics before this hook; give back the partial
                # epoch's accumulators so epoch-end logs match the unbroken run.
                for variable, value in zip(self.model.metrics_variables, self._resume_metrics):
                    variable.assign(value)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._scheduled_batch_end(batch, logs)
        self._batch_ends += 1
        if self.save_on_preemption and self._watch.reached(self._batch_ends):
            self._save_for_preemption(logs)

    def _scheduled_batch_end(self, batch: int, logs: dict | None) -> None:
        if self._last_batch_seen is None or batch <= self._last_batch_seen:
            add = batch + 1
        else:
            add = batch - self._last_batch_seen
        self._last_batch_seen = batch
        self._batch_in_epoch += add
        self._fit_batches += add
        self._total_batches_seen += add
        if self._resume_epoch == self._epoch and self._batch_in_epoch >= (self._steps_per_epoch or 0) > 0:
            # The resumed epoch has run its remaining batches: end it here.
            # `_model`, not `model`: the property would sync the JAX state every batch.
            self._model.stop_training = True
            self._stopped_epoch_early = True
        if isinstance(self.save_freq, str):  # "epoch": saved in on_epoch_end
            return
        self._batches_since_save += add
        if self._batches_since_save < self.save_freq:
            return
        self._batches_since_save = 0
        if self.save_best_only and not self._improved(logs, f"batch {batch}"):
            return
        # A save after an epoch's last batch resumes at the next epoch.
        complete = bool(self._steps_per_epoch and self._batch_in_epoch >= self._steps_per_epoch)
        self._save(self._total_batches_seen, logs, epoch_complete=complete)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self.preempted_step is not None:
            # Saved and committed already; fit must stop after this epoch.
            self._model.stop_training = True
            return
        if self._stopped_epoch_early:
            self._model.stop_training = False
            self._stopped_epoch_early = False
        self._resume_epoch = None
        if self.save_freq != "epoch":
            return
        if self.save_best_only and not self._improved(logs, f"epoch {epoch}"):
            return
        self._save(epoch, logs, epoch_complete=True)

    def on_train_end(self, logs: dict | None = None) -> None:
        self._watch.stop()
        _keras.set_initial_epoch(self._model, self._previous_initial_epoch)
        try:
            self._finish_pending()
        except BackgroundSaveError as failure:
            self._close(failure)
            raise
        self._close(None)
        _sync("shardckpt_checkpoint_cleanup")

    def _close(self, failure: BackgroundSaveError | None) -> None:
        if self.checkpointer is None:
            return
        try:
            self.checkpointer.close()
        except Exception as e:
            # Orbax keeps a failed save's error and raises it again on close;
            # that one is already being reported, anything else is new.
            cause = getattr(failure, "original", None)
            if cause is None or not (e is cause or (type(e) is type(cause) and str(e) == str(cause))):
                raise

    # ---- saving ------------------------------------------------------------

    def _save_for_preemption(self, logs: dict | None) -> None:
        """Saves the state after this batch, waits for the commit, stops fit."""
        complete = bool(self._steps_per_epoch and self._batch_in_epoch >= self._steps_per_epoch)
        step = self._epoch if self.save_freq == "epoch" else self._total_batches_seen
        if step != self._last_saved_step or step == self._replace_step:
            # (A scheduled save of this very batch already holds the state.)
            self._save(step, logs, epoch_complete=complete)
        self._finish_pending()
        self.checkpointer.wait()
        _sync("shardckpt_preemption_save")
        self.preempted_step = step
        self._model.stop_training = True
        message = f"preemption notice: step {step} committed to {self.directory}; fit stops."
        _log.warning("OrbaxCheckpoint: %s", message)
        if self.verbose > 0:
            print(f"OrbaxCheckpoint: {message}")

    def _save(self, step: int, logs: dict | None, *, epoch_complete: bool) -> None:
        start = time.perf_counter()
        self._finish_pending(waiting_for=step)
        if step == self._replace_step:
            # The mid-epoch step this run resumed from (save_freq="epoch" names
            # it by its epoch): Orbax never overwrites a step, so it goes first.
            self.checkpointer.delete(step)
            self._replace_step = None
        self._last_saved_step = step
        model = self.model  # Callback.model syncs the JAX state into the variables
        tree, self.snapshot_mode_used = snapshot_lib.snapshot_state(
            model, weights_only=self.save_weights_only, mode=self.snapshot, budget_bytes=self.snapshot_budget_bytes)
        self.snapshot_modes.append(self.snapshot_mode_used)
        payload: dict[str, Any] = {resume.ARRAYS_ITEM: tree}
        if not self.save_weights_only:
            payload["model_config"] = {"config": self._model_config}
            if self._assets is not None:
                payload["assets"] = self._assets
        logs = dict(logs or {})
        user = self.metadata(self._epoch, logs) if callable(self.metadata) else self.metadata
        # Counters are read now: training moves them on while the save runs.
        meta = self._metadata(step, epoch_complete)
        if self._tracker is not None:
            state = self._tracker.state_after(self._fit_batches)
            payload[resume.ITERATOR_ITEM] = {"process_states": iterators.gather_json(iterators.encode_state(state))}
        if not self.save_on_background:
            self._write(step, payload, meta, logs, user, self.best)
        elif self._executor is not None:
            self._pending = self._executor.submit(self._write, step, payload, meta, logs, user, self.best)
        else:
            metrics = _complete(payload, meta, logs, user, self.best)
            with self._context:
                self._pending = self.checkpointer.save_checkpointables_async(
                    step, payload, metrics=metrics, force=True
                )
        self._pending_step = step if self.save_on_background else None
        self.save_blocking_s.append(time.perf_counter() - start)
        if self.verbose > 0:
            print(f"OrbaxCheckpoint: step {step} saved to {self.directory} "
                  f"({'background' if self.save_on_background else 'written'}, "
                  f"training blocked {self.save_blocking_s[-1] * 1e3:.1f} ms)")

    def _write(self, step: int, payload: dict[str, Any], meta: dict[str, Any], logs: dict[str, Any],
               user: Any, best: Any) -> None:
        # On the worker thread (background) or the training thread (sync). The
        # training thread never touches the Checkpointer while a save is
        # pending, so Orbax sees one caller at a time.
        metrics = _complete(payload, meta, logs, user, best)
        with self._context:
            self.checkpointer.save_checkpointables(step, payload, metrics=metrics, force=True)

    def _finish_pending(self, waiting_for: int | None = None) -> None:
        """Waits for the save in flight and raises its error, if any."""
        if self._pending is None:
            return
        pending, step = self._pending, self._pending_step
        self._pending = self._pending_step = None
        start = time.perf_counter()
        still_running = not pending.done() if hasattr(pending, "done") else True
        try:
            pending.result()
        except Exception as e:
            raise _background_error(e, step, self.directory) from e
        waited = time.perf_counter() - start
        if waiting_for is not None and (still_running and waited > 1e-3):
            self.save_waits_s.append(waited)
            message = (
                f"Checkpoint step {waiting_for} waited {waited:.3f} s for the background "
                f"save of step {step} to finish (one save in flight at a time)."
            )
            _log.warning(message)
            if self.verbose > 0:
                print(f"OrbaxCheckpoint: {message}")

    def _metadata(self, step: int, epoch_complete: bool) -> dict[str, Any]:
        """The metadata item without logs/user/best (see `_complete`)."""
        return {
            "format": metadata_lib.FORMAT,
            "step": int(step),
            "epoch": int(self._epoch),
            "epoch_complete": epoch_complete,
            "batch": int(self._steps_per_epoch if epoch_complete and self._steps_per_epoch else self._batch_in_epoch),
            "steps_per_epoch": self._steps_per_epoch,
            "total_batches": int(self._total_batches_seen),
            "save_freq": self.save_freq,
            "monitor": self.monitor,
            "save_weights_only": self.save_weights_only,
            "versions": metadata_lib.versions(),
            "layout": self._layout,
            "snapshot": self.snapshot_mode_used,
        }

    def _improved(self, logs: dict | None, where: str) -> bool:
        if self.monitor_op is None:
            self._set_monitor_op()
        current = (logs or {}).get(self.monitor)
        if current is None:
            warnings.warn(f"Can save best model only with {self.monitor} available, skipping save at {where}.",
                          stacklevel=3)
            return False
        if not self._is_improvement(current, self.best):
            return False
        self.best = current
        return True

    # ---- resuming ------------------------------------------------------------

    def _resume_from(self, step_dir: str) -> None:
        iterator = self.data_iterator if (self._tracker is not None and not self._tracker.used) else None
        info = resume.restore_step(self.model, step_dir, data_iterator=iterator)
        if self._tracker is not None and self._tracker.used and self._iterator_restored_from != step_dir:
            raise RuntimeError(
                f"batches() restored the data iterator from {self._iterator_restored_from!r} "
                f"but the model resumes from {step_dir!r}. Fix: do not write to "
                f"{self.directory!r} from another process while this run starts."
            )
        self.resumed = info
        meta = info.metadata
        if meta.get("epoch") is None:
            _log.warning("Step %s has no shardckpt metadata (written by Keras?): "
                         "weights restored, epoch not known; fit starts at its initial_epoch.", step_dir)
            return
        _keras.set_initial_epoch(self._model, info.next_epoch)
        self._total_batches_seen = int(meta.get("total_batches") or 0)
        self._last_saved_step = info.step
        if isinstance(self.save_freq, int):  # not "epoch"
            # Saves fall on the same batches as in the uninterrupted run.
            self._batches_since_save = self._total_batches_seen % self.save_freq
        elif not info.epoch_complete:
            self._replace_step = info.step
        if meta.get("best") is not None and not isinstance(meta["best"], str):
            self.best = float(meta["best"])
        if not info.epoch_complete:
            if self._tracker is None:
                _log.warning("Resuming from mid-epoch step %s without data_iterator: epoch %d "
                             "restarts from its first batch (not bit-exact).", step_dir, info.epoch)
                return
            self._resume_epoch = info.epoch
            self._resume_offset = int(info.batch or 0)
            self._resume_metrics = [np.asarray(v.value) for v in self.model.metrics_variables]
        _log.info("Resumed from %s: epoch %s, batch %s.", step_dir, info.epoch, info.batch)

    def _restore_iterator_early(self) -> None:
        """Sets the iterator's saved position before fit pulls its first batch."""
        if not self.resume:
            return
        step_dir = resume.latest_step_dir(self.directory)
        if step_dir is None:
            return
        item = resume.read_json_item(step_dir, resume.ITERATOR_ITEM)
        state = resume.iterator_state_for_process(item, jax.process_index())
        if state is not None:
            self.data_iterator.set_state(state)
        self._iterator_restored_from = step_dir

    # ---- helpers --------------------------------------------------------------

    def _reset_counters(self) -> None:
        self._epoch = 0
        self._batch_in_epoch = 0
        self._last_batch_seen = None
        self._batches_since_save = 0
        self._fit_batches = 0
        self._resume_epoch = None
        self._resume_offset = 0
        self._resume_metrics = None
        self._stopped_epoch_early = False
        self._batch_ends = 0
        self._last_saved_step = None
        self._replace_step = None
        params = getattr(self, "params", None) or {}
        self._steps_per_epoch = params.get("steps")
        model = getattr(self, "_model", None)
        optimizer = getattr(model, "optimizer", None)
        self._total_batches_seen = int(optimizer.iterations) if optimizer is not None and optimizer.built else 0

    def _make_checkpointer(self) -> Any:
        higher = self.monitor_op is not None and self.monitor_op(1.0, 0.0)
        policy = retention.preservation_policy(
            max_to_keep=self.max_to_keep, keep_best=self.keep_best, monitor=self.monitor,
            higher_is_better=bool(higher), keep_period=self.keep_period,
            keep_complete_epoch=self.save_freq == "epoch",
        )
        if self._location.is_remote:
            return bucket_save.BucketCheckpointer(self._location, policy=policy, compression=self.compression)
        return ocp.training.Checkpointer(
            self.directory,
            preservation_policy=policy,
            # Every call is a decision the callback already made.
            save_decision_policy=ocp.training.save_decision_policies.FixedIntervalPolicy(1),
            # Half-written steps of a killed run: never restored, removed here.
            cleanup_tmp_directories=True,
        )


def _json_context(*, compression: bool) -> Any:
    """The Orbax context of every save: JSON items, array compression and chunking.

    Our metadata items go to Orbax's JsonHandler; without the registry a dict
    would go to the PyTree handler (registered last), which cannot hold None or
    lists of mixed types.

    Arrays are stored in chunks of at most 64 MiB, or 4 MiB with zstd
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
    return context


def _complete(payload: dict[str, Any], meta: dict[str, Any], logs: dict[str, Any], user: Any, best: Any) -> dict:
    """Adds logs, user metadata and best value to the metadata item.

    Converting logs to numbers waits for the step that produced them; done on
    the save thread, the training thread does not wait.

    Returns:
        The numeric logs, which Orbax stores as the step's metrics (BestN ranks
        steps by them), and whether the step holds a whole epoch
        (`retention.EPOCH_COMPLETE_METRIC`).
    """
    json_logs = metadata_lib.json_logs(logs)
    meta = dict(meta, logs=json_logs, user=metadata_lib.jsonable(user),
                best=None if best is None else metadata_lib.json_number(best))
    payload[resume.METADATA_ITEM] = meta
    metrics = {k: v for k, v in json_logs.items() if isinstance(v, float)}
    metrics[retention.EPOCH_COMPLETE_METRIC] = 1.0 if meta["epoch_complete"] else 0.0
    return metrics


def _background_error(error: Exception, step: int | None, directory: str) -> BackgroundSaveError:
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


def _sync(key: str) -> None:
    if jax.process_count() > 1:
        # The v0 public barrier (the v1 one wants an Orbax operation id).
        orbax.checkpoint.multihost.sync_global_processes(key)
