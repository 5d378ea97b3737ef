"""`OrbaxCheckpoint`: Keras' Orbax callback with little blocking and exact resume.

A drop-in for `keras.callbacks.OrbaxCheckpoint` (same arguments and on-disk
layout). This module is the callback's control flow: it coordinates
collaborators, each holding one group of the arguments and its state:
`retention.Retention` (which steps survive), `schedule.SaveSchedule` (when
to save, which step a save replaces), `snapshot_policy.SnapshotPolicy` (the
copy a background save writes from), `contents.StepContents` (metadata,
config, assets beside the arrays), `iterators.DataPosition` (the data
iterator's position), `resume_point.ResumeState` (which step a resuming fit
continues from), `preemption.PreemptionStop` (SIGTERM -> save, commit, stop),
`save_times.SaveTimes`. Beside them: `options` (argument checks), `counting`
(batches per epoch, fit, run), `saving` (the step writer: local or bucket,
one save in flight), `monitoring` (best by `monitor`), `resume` / `hostrng`
(restoring a step bit-identically).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from shardckpt import _keras, storage
from shardckpt.errors import ConfigurationError, StepExistsError
from shardckpt.formats.orbax import ondisk
from shardckpt.state import check_unique_paths
from shardckpt.state import collections as state_collections
from shardckpt.training import (
    data_passes,
    fitstate,
    hostrng,
    options,
    other_callbacks,
    quiet,
    resume_point,
    resumed_lr,
    saving,
)
from shardckpt.training import snapshot as snapshot_lib
from shardckpt.training.contents import StepContents
from shardckpt.training.counting import BatchCount
from shardckpt.training.iterators import DataPosition
from shardckpt.training.monitoring import BestTracking
from shardckpt.training.preemption import PreemptionStop
from shardckpt.training.resume import ResumeInfo
from shardckpt.training.resume_point import ResumeState
from shardckpt.training.retention import Retention
from shardckpt.training.save_times import SaveTimes
from shardckpt.training.schedule import SaveSchedule
from shardckpt.training.snapshot_policy import SnapshotPolicy

_log = logging.getLogger("shardckpt")

NOT_FROM_FIT = (
    "on_train_begin was not called from Keras' Model.fit of this model (a training loop of your own, or a Keras "
    "whose fit names its epoch iterator otherwise): the state of the other callbacks (EarlyStopping, "
    "ReduceLROnPlateau) is not saved with the steps, fit's initial_epoch and its input's length are not read, "
    "and a resumed step's epoch is left for a fit that is not there. Fix: train with model.fit, or resume your "
    "own loop with shardckpt.restore_latest(model, directory) and its info.next_epoch."
)
"""Said once a fit (process 0) where `_keras.fit_input` finds no `fit` calling back."""


class _EndsResumedEpoch:
    """What `model.stop_training` is set to while the callback ends a resumed epoch early.

    Keras' loop only tests the flag for truth. A callback that stops `fit`
    (`EarlyStopping`, `TerminateOnNaN`) sets `True` over this marker, so at the
    epoch's end the callback clears the flag only where it still holds the
    marker, and never cancels another callback's stop.
    """

    def __bool__(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "True (shardckpt: the resumed epoch's remaining batches ran)"


ENDS_RESUMED_EPOCH = _EndsResumedEpoch()


class _Kept:
    """An attribute of the callback that one of its collaborators keeps.

    Reading and assigning it reads and assigns the collaborator's, so every
    argument stays an attribute of the same name, as on Keras' callback.
    """

    def __init__(self, part: str, name: str) -> None:
        self.part, self.name = part, name

    def __get__(self, owner: Any, cls: type | None = None) -> Any:
        if owner is None:
            return self
        return getattr(getattr(owner, self.part), self.name)

    def __set__(self, owner: Any, value: Any) -> None:
        setattr(getattr(owner, self.part), self.name, value)


class OrbaxCheckpoint(BestTracking):
    """Saves and resumes training state with Orbax, asynchronously and exactly.

    Arguments up to `save_weights_only` are Keras' (order, meaning); the rest
    are keyword-only additions. Steps are named as Keras names them: the epoch
    for `save_freq="epoch"`, the batches trained for an integer `save_freq`.

    Resume (`resume=True`): `fit` continues after the latest committed step,
    in the middle of its epoch only when `fit` draws from `self.batches()`
    (the step holds the iterator's position); with other inputs, from the
    newest whole-epoch step or the start (`resume_point`), said in one line.

    Preemption (`save_on_preemption=True`): a SIGTERM (or JAX's preemption
    notice) saves at the next step boundary, waits for the commit and stops
    `fit`; `preempted_step` names the step (`preemption`).

    Example:

    ```python
    ckpt = shardckpt.OrbaxCheckpoint(
        "ckpts/", save_freq=100, max_to_keep=3, keep_best=1,
        metadata={"run": "exp-7"}, data_iterator=it, resume=True)
    model.fit(ckpt.batches(), steps_per_epoch=500, epochs=10, callbacks=[ckpt])
    ```

    Args:
        directory: Root folder of the checkpoints, or a `gs://bucket/...` /
            `s3://bucket/...` URL (see `step_save`).
        monitor: Metric for `save_best_only` and `keep_best`.
        verbose: 1 prints a line per save, per wait and at resume.
        save_best_only: Save only when `monitor` improves.
        mode: "auto", "min" or "max": the direction of `monitor`.
        save_freq: "epoch", or save every this many batches, or "auto": the
            smallest interval whose saves finish in the background, re-derived
            from each write's time and logged when it changes (`autofreq`;
            one process only).
        initial_value_threshold: Initial "best" value for `save_best_only`.
        max_to_keep: Keep the latest N steps (None: every step); 1 as in Keras.
        save_on_background: Training waits only for a snapshot (False: for the write).
        save_weights_only: Model variables only (such a step cannot resume exactly:
            a resume from it restores the weights, and a warning says the
            optimizer and metrics keep their values).
        keep_best: Also keep the N best steps by `monitor` (with `max_to_keep`).
        keep_period: Also keep every step that is a multiple of this.
        metadata: A JSON dict, or a callable `(epoch, logs) -> dict`, saved under
            "user" in each step's metadata. It is stored as JSON and read back
            as JSON: keys become strings, tuples lists, NumPy/JAX arrays lists,
            their scalars numbers, and NaN / inf the strings "nan" / "inf".
        data_iterator: An object with `get_state()` / `set_state(state)`.
        resume: Restore the latest committed step when `fit` starts (see above).
        compression: zstd-compress array chunks as Keras does (off: a third of
            a save's CPU time for ~10% less disk; tools/bench_save.py).
        save_on_preemption: Save and stop at the next step boundary on a
            preemption notice (see above).
        snapshot: The copy a background save writes from: "device", "host"
            (pinned host memory, in pieces of `snapshot_budget_bytes`) or
            "auto" ("device" on CPU devices, whose memory is the host's, and on
            accelerators whose `memory_stats()` show room); see `snapshot`.
            Each save's log line names the mode and why.
        snapshot_budget_bytes: Host mode's piece size and "auto"'s margin (256 MiB).
        on_process_count_change: On resume, when the step's data-iterator
            positions come from another number of processes: "error" (raise
            `IteratorCountError`) or "restart_iterators" (model, optimizer and
            counters resume; each iterator keeps its own position, with a warning).

    Every argument is an attribute of its name; one assigned between fits
    is the next fit's. What the fits did:

    Attributes:
        resumed: The `ResumeInfo` of the latest resume, or None.
        preempted_step: The step committed on a preemption notice in the
            last fit, or None; `preemption_mode` says how it watched.
        snapshot_modes: Each save's snapshot mode ("device" or "host");
            `snapshot_mode_used` is the latest.
        save_blocking_s: Seconds each save held training up;
            `save_waits_s`: each wait for the save in flight; `save_writes_s`:
            each write, snapshot handed over to step committed.
        checkpointer: The checkpointer of the current (or last) fit: shardckpt's
            own (`step_save.StepCheckpointer`; buckets, and local folders
            of one process) or Orbax's `Checkpointer` (local folders of
            several processes). Both save, delete, wait and close alike.

    Raises:
        ValueError: an argument is out of range.
        TypeError: `data_iterator` lacks `get_state`/`set_state`, or `metadata`
            is neither a dict nor callable.
    """

    # Arguments and results kept by the collaborators, under their public names.
    save_freq = _Kept("_schedule", "save_freq")
    max_to_keep = _Kept("_retention", "max_to_keep")
    keep_best = _Kept("_retention", "keep_best")
    keep_period = _Kept("_retention", "keep_period")
    metadata = _Kept("_contents", "metadata")
    compression = _Kept("_contents", "compression")
    data_iterator = _Kept("_data", "data_iterator")
    resume = _Kept("_resume", "enabled")
    on_process_count_change = _Kept("_resume", "on_process_count_change")
    resumed = _Kept("_resume", "info")
    save_on_preemption = _Kept("_preemption", "enabled")
    preempted_step = _Kept("_preemption", "step")
    preemption_mode = _Kept("_preemption", "mode")
    snapshot = _Kept("_snapshots", "mode")
    snapshot_budget_bytes = _Kept("_snapshots", "budget_bytes")
    snapshot_mode_used = _Kept("_snapshots", "mode_used")
    snapshot_modes = _Kept("_snapshots", "modes")
    save_blocking_s = _Kept("_times", "blocking")
    save_waits_s = _Kept("_times", "waits")
    save_writes_s = _Kept("_times", "writes")

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
        on_process_count_change: str = "error",
    ) -> None:
        super().__init__(monitor, mode, initial_value_threshold)
        options.check_on_count_change(on_process_count_change)
        options.validate(save_freq=save_freq, snapshot=snapshot, snapshot_budget_bytes=snapshot_budget_bytes,
                         metadata=metadata, max_to_keep=max_to_keep, keep_best=keep_best, keep_period=keep_period,
                         monitor=monitor)
        # A gs:// or s3:// URL saves through step_save.
        self._location = storage.parse(directory, what="directory")
        self.directory = self._location.url
        self.verbose, self.save_best_only = verbose, save_best_only
        self.save_on_background, self.save_weights_only = save_on_background, save_weights_only
        self._retention = Retention(max_to_keep=max_to_keep, keep_best=keep_best, keep_period=keep_period)
        self._schedule = SaveSchedule(save_freq=save_freq)
        self._snapshots = SnapshotPolicy(mode=snapshot, budget_bytes=snapshot_budget_bytes)
        self._contents = StepContents(metadata, compression=compression)
        self._resume = ResumeState(enabled=resume, on_process_count_change=on_process_count_change)
        self._data = DataPosition(data_iterator, on_first_pull=self._restore_iterator_early)
        self._preemption = PreemptionStop(enabled=save_on_preemption)
        self._times = SaveTimes()
        self._count = BatchCount()  # the current (or last) fit's
        self._writer: saving.StepWriter | None = None  # the current (or last) fit's
        # What the current fit has started, for `_stop_before_training`: its writer, then its watch and filter.
        self._writer_open = self._in_fit = False
        self._callbacks: list[Any] = []  # the current fit's, EarlyStopping & co among them

    @property
    def checkpointer(self) -> Any:
        """The checkpointer of the current (or last) fit (see the class docstring), or None before one."""
        return None if self._writer is None else self._writer.checkpointer

    # ---- public API ---------------------------------------------------------

    def batches(self) -> Iterator[Any]:
        """The batches of `data_iterator`, to pass to `fit` (call once per fit).

        The iterator gets the resumed position before its first pull, and its
        state is recorded before every pull, so a save holds the position after
        exactly the batches trained on, and when `fit` ends the iterator is
        put back there (Keras may have pulled more). Only this input resumes
        mid-epoch.

        Raises:
            ValueError: the callback has no `data_iterator`.
        """
        if self._data.tracker is None:
            raise ValueError("OrbaxCheckpoint.batches() needs data_iterator=... in the constructor.")
        batches = self._data.batches()
        self._resume.decided = False
        return batches

    def wait_until_finished(self) -> None:
        """Blocks until every started save is written (on every process).

        Raises:
            BackgroundSaveError: a background save failed.
        """
        if self._writer is not None:
            self._writer.wait()
        saving.sync("shardckpt_wait_until_finished")

    def is_multihost_enabled(self) -> bool:
        """True when JAX runs more than one process (as Keras' callback)."""
        return jax.process_count() > 1

    def is_primary_host(self) -> bool:
        """True on process 0 (as Keras' callback)."""
        return jax.process_index() == 0

    # ---- Keras callback hooks -----------------------------------------------

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._writer_open = self._in_fit = False
        self._callbacks = []
        try:
            self._begin_fit()
        except Exception:
            # Keras calls no on_train_end after a hook raised: whatever this fit started stops here.
            self._stop_fit_before_training()
            raise

    def _begin_fit(self) -> None:
        """`on_train_begin`'s work (see there for what a failure undoes)."""
        # An integer save_freq counts on from the previous fit's batches, as in Keras' callback.
        self._count = BatchCount.start(self.params, self._model, since_save=self._count.since_save)
        self._count.total = fitstate.batches_at_start(self._model, self._count.total)
        self._started = False  # on_epoch_begin not yet called in this fit
        # The preemption step this fit resumed from while no save of this fit superseded it.
        self._resumed_preemption_step: int | None = None
        self._adopted: fitstate.Resumed | None = None  # another callback's resume this one went on from
        self._resumed_lr: np.ndarray | None = None  # the rate of a step saved mid-epoch (`resumed_lr`)
        self._restored: ResumeInfo | None = None  # the step this callback restored in this fit
        drawn = _keras.fit_input(self._model)
        if drawn is None:
            self._say(logging.WARNING, NOT_FROM_FIT, once=True)
        # EarlyStopping / ReduceLROnPlateau among them: their counters go into each step.
        self._callbacks = [] if drawn is None else drawn.callbacks
        self._fit_initial_epoch = 0 if drawn is None else drawn.initial_epoch  # fit(initial_epoch=...)
        self._schedule.begin()
        self._warned_monitor = False
        # Keras' trainer reads the initial epoch right after this hook (see _keras).
        self._previous_initial_epoch = _keras.initial_epoch(self._model)
        if self.monitor_op is None and (self.keep_best is not None or self.save_best_only):
            self._set_monitor_op()
        # fit peeks its input before this hook: a started batches() is what it draws.
        tracked = self._data.begin_fit()
        policy = self._retention.policy(
            monitor=self.monitor, higher_is_better=bool(self.monitor_op is not None and self.monitor_op(1.0, 0.0)),
            # Without batches() only whole-epoch steps resume exactly: keep the newest.
            keep_complete_epoch=self._schedule.per_epoch or not tracked)
        self._writer = saving.StepWriter(self._location, policy=policy, compression=self.compression,
                                         background=self.save_on_background, context=self._contents.context,
                                         waits_s=self._times.waits, writes_s=self._times.writes)
        self._writer_open = True
        self._contents.begin(self.model, weights_only=self.save_weights_only)
        # Refused before the first step rather than at the first save (the snapshot checks too):
        # fit has built the optimizer, and Adafactor's factored slots share paths.
        groups = state_collections(self._model, weights_only=self.save_weights_only)
        check_unique_paths(groups, getattr(self._model, "optimizer", None))
        if self.resume:
            self._refuse_a_second_resume()
            self._restore_at_start(tracked)
        self._resume.decided = True
        # After the resume: the arrays the saves will copy.
        self._snapshots.prepare(self._model, weights_only=self.save_weights_only)
        self._schedule.begin_auto()
        quiet.start()  # after the resume: a failed one never reaches on_train_end to stop it
        self._preemption.start()
        self._in_fit = True

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        if not self._started:
            # Every callback's on_train_begin ran: a resume by any of them is done.
            self._started = True
            try:
                self._go_on_from_resume()
                self._give_back_other_callbacks()
                self._refuse_saves_below_committed_steps(first_epoch=epoch)
            except Exception:
                self._stop_fit_before_training()
                raise
        if self._count.begin_epoch(epoch) and self._count.resume_metrics is not None:
            # fit reset the metrics before this hook; give back the partial
            # epoch's accumulators so epoch-end logs match the unbroken run.
            for variable, value in zip(self.model.metrics_variables, self._count.resume_metrics):
                variable.assign(value)

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self._resumed_lr is not None:
            # Every on_epoch_begin of the resumed epoch ran: undo a schedule's second step.
            restored, self._resumed_lr = self._resumed_lr, None
            if resumed_lr.put_back(self._model, restored):
                self._say(logging.INFO, "the learning rate an on_epoch_begin set for the resumed epoch is put "
                                        f"back to the step's ({float(restored)!r}): that epoch's schedule step "
                                        "is in the step already.", once=True)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        count = self._count
        add = count.end_batch(batch)
        if count.resumed_epoch_done():
            count.stopped_early = True
            # `_model`, not `model`: the property would sync the JAX state every batch.
            if not self._model.stop_training:  # (a callback before this one may have stopped fit)
                self._model.stop_training = ENDS_RESUMED_EPOCH
        writer = self._writer
        assert writer is not None  # set in on_train_begin
        due = self._schedule.due_after_batch(count, add, writer_busy=writer.busy)
        if due and (
                not self.save_best_only or self._improved(logs, f"batch {batch}")):
            # A save after an epoch's last batch resumes at the next epoch.
            self._save(count.total, logs, epoch_complete=count.epoch_complete)
        count.ends += 1
        if self._preemption.reached(count.ends):
            self._save_for_preemption(logs)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self.preempted_step is not None:
            # Saved and committed already; fit must stop after this epoch.
            self._model.stop_training = True
            return
        if self._count.stopped_early:
            self._count.stopped_early = False
            if self._model.stop_training is ENDS_RESUMED_EPOCH:  # no other callback stopped fit since
                self._model.stop_training = False
        self._count.resume_epoch = None
        if not self._schedule.per_epoch:
            return
        if self.save_best_only and not self._improved(logs, f"epoch {epoch}"):
            return
        self._save(epoch, logs, epoch_complete=self._epoch_ended_whole(epoch), in_epoch_end=True)

    def _epoch_ended_whole(self, epoch: int) -> bool:
        """Whether `epoch` ran all its batches; says so when `stop_training` cut it short.

        Keras ends an epoch that a callback stopped (`model.stop_training`)
        with `on_epoch_end` as if it were whole. Saved as whole, its step
        would resume at the next epoch and skip the batches never trained;
        saved as a partial epoch, a resume trains them (the same step is
        saved again once the epoch is whole, as after a preemption).
        """
        count = self._count
        if count.steps_per_epoch:
            if count.epoch_complete:
                return True
            self._say(logging.WARNING,
                      f"epoch {epoch} ended after {count.in_epoch} of its {count.steps_per_epoch} batches "
                      f"(model.stop_training was set): step {epoch} is saved as a partial epoch, so a resume "
                      "does not skip the batches left (Keras counts the epoch whole).", once=True)
            return False
        if self._model.stop_training:
            # No length to compare with: Keras knows none either (steps_per_epoch=None).
            self._say(logging.WARNING,
                      f"model.stop_training was set by the end of epoch {epoch}, whose number of batches is not "
                      f"known (steps_per_epoch=None): step {epoch} is saved as a whole epoch, so if fit was "
                      "stopped before the data ran out, a resume starts at the next epoch without the batches "
                      "left. Fix: pass steps_per_epoch to fit.", once=True)
        return True

    def on_train_end(self, logs: dict | None = None) -> None:
        self._in_fit = self._writer_open = False
        self._preemption.stop()
        optimizer = getattr(self._model, "optimizer", None)
        if optimizer is not None and optimizer.built:
            fitstate.record_end(self._model, int(optimizer.iterations), self._count.total)
        # Keras may have pulled batches it did not train on; the next fit starts after the trained ones.
        self._data.rewind(self._count.fit_batches)
        _keras.set_initial_epoch(self._model, self._previous_initial_epoch)
        try:
            if self._writer is not None:
                self._drop_resumed_preemption_step(self._writer)
                self._writer.end()
            saving.sync("shardckpt_checkpoint_cleanup")
        finally:
            quiet.stop()

    # ---- saving ------------------------------------------------------------

    def _drop_resumed_preemption_step(self, writer: saving.StepWriter) -> None:
        """Deletes the preemption step this fit resumed from, at the end of a fit that saved nothing.

        A preemption step is a resume point only (`retention`): once the fit
        it let go on has ended, it is neither the best (`save_best_only`
        skipped every save of the rest of the run) nor the run's end, and
        `restore_latest` would pick it over the steps the run meant to keep.
        A fit preempted again keeps its own, newer preemption step.
        """
        step = self._resumed_preemption_step
        self._resumed_preemption_step = None
        if step is None or self.preempted_step is not None:
            return
        writer.delete(step)
        self._say(logging.INFO, f"step {step}, saved on a preemption notice and resumed from, is deleted: the "
                                "resumed fit ended without a newer step.", once=True)

    def _save_for_preemption(self, logs: dict | None) -> None:
        """Saves the state after this batch, waits for the commit, stops fit."""
        step = self._schedule.step_now(self._count)
        if not self._schedule.holds(step):
            # (A scheduled save of this very batch already holds the state, and stays a regular step.)
            self._save(step, logs, epoch_complete=self._count.epoch_complete, preemption=True)
        assert self._writer is not None  # set in on_train_begin
        self._writer.wait()
        saving.sync("shardckpt_preemption_save")
        self.preempted_step = step
        self._model.stop_training = True
        self._say(logging.WARNING, f"preemption notice: step {step} committed to {self.directory}; fit stops.")

    def _save(self, step: int, logs: dict | None, *, epoch_complete: bool, preemption: bool = False,
              in_epoch_end: bool = False) -> None:
        """Saves `step`; `preemption`: on a preemption notice alone (a transient step, see `retention`).

        `in_epoch_end`: saved in `on_epoch_end` (which other callbacks' ran, `other_callbacks`).
        """
        # Any save supersedes (or, under the same number, replaces) the preemption step resumed from.
        self._resumed_preemption_step = None
        writer = self._writer
        assert writer is not None  # set in on_train_begin
        start = time.perf_counter()
        writer.finish_pending(waiting_for=step)
        if self._schedule.claim(step):
            writer.delete(step)
        if not preemption:  # (never ranked: its monitor value does not matter)
            self._check_monitor_for_keep_best(logs, self.keep_best)
        model = self.model  # Callback.model syncs the JAX state into the variables
        tree, choice = self._snapshots.take(model, weights_only=self.save_weights_only)
        logs = dict(logs or {})
        user = self._contents.user(self._count.epoch, logs)
        # Counters are read now: training moves them on while the save runs.
        meta = self._contents.step_metadata(
            self._count, step, epoch_complete=epoch_complete, save_freq=self.save_freq, monitor=self.monitor,
            weights_only=self.save_weights_only, snapshot=choice.mode, preemption=preemption)
        meta["callbacks"] = other_callbacks.capture(self._callbacks, self, in_epoch_end=in_epoch_end)
        items = self._contents.items(tree, self._data.states(self._count.fit_batches))
        last_write_s = writer.writes_s[-1] if writer.writes_s else None  # read before this save's write ends
        writer.save(step, items, meta, logs, user, self.best,
                    before_write=snapshot_lib.before_write(tree, choice), off_devices=snapshot_lib.off_devices(choice))
        self.save_blocking_s.append(time.perf_counter() - start)
        if (line := self._schedule.saved(last_write_s)) is not None:
            self._say(logging.INFO, line)
        self._say(logging.INFO, f"step {step} {'started' if self.save_on_background else 'written'} in "
                                f"{self.directory} (training blocked {self.save_blocking_s[-1] * 1e3:.1f} ms; "
                                f"snapshot {choice.mode!r}: {choice.reason}).")

    # ---- resuming ------------------------------------------------------------

    def _restore_at_start(self, tracked: bool) -> None:
        point = self._resume.choose(self.directory, mid_epoch=tracked)
        if point is None:  # nothing to resume from: the run starts over, and the other callbacks with it
            fitstate.publish_resume(self._model, self.params, fitstate.Resumed(owner=id(self), directory=self.directory, info=None))
            return
        assert self._writer is not None  # set in on_train_begin
        self._refuse_a_restart_of_a_trained_model(point)
        for step in point.newer:  # the resumed run writes them again, bit-identical
            self._writer.delete(step)
        info = self._resume.restore(self.model, point, tracker=self._data.tracker, data_iterator=self.data_iterator)
        if info is not None and info.metadata.get("preemption"):
            self._resumed_preemption_step = info.step
        if info is not None and info.epoch is not None:  # (None: a step Keras wrote, weights only)
            _keras.start_fit_at(self._model, info.next_epoch)
            self._schedule.resumed(info)
            if info.metadata.get("best") is not None and not isinstance(info.metadata["best"], str):
                self.best = float(info.metadata["best"])
            hostrng.restore(info.metadata.get("host_rng"))
            if not info.epoch_complete:
                self._resumed_lr = resumed_lr.capture(self._model)
            self._restored = info
            self._count.continue_after(info.metadata, save_freq=self.save_freq,
                                       metrics=[np.asarray(v.value) for v in self.model.metrics_variables])
        fitstate.publish_resume(self._model, self.params, fitstate.Resumed(owner=id(self), directory=self.directory, info=info))
        self._say(*resume_point.describe(point, info, epochs=(self.params or {}).get("epochs"),
                                         directory=self.directory, caveat=self._data_caveat(info, tracked),
                                         initial_epoch=self._fit_initial_epoch),
                  once=True)

    def _refuse_a_restart_of_a_trained_model(self, point: resume_point.ResumePoint) -> None:
        """Refuses a start from the beginning that the model, trained already, cannot make.

        Where no step can be continued (`resume_point.choose`), the run
        starts over and deletes the steps it will write again; that holds for
        the fresh model of a rerun only (`resume_point.trained_past`).

        Raises:
            ConfigurationError: naming the steps, the model's batches and the fix.
        """
        past = resume_point.trained_past(self.directory, point, self._count.total)
        if not past:
            return
        raise ConfigurationError(
            f"resume=True: step {point.latest} in {self.directory} is not continued: {point.why}, and no step "
            f"holds a whole epoch, so the run would start from the beginning and delete steps {point.newer} to "
            f"write them again; but this model has trained {self._count.total} batches already, as far as steps {past} were "
            "saved (a second fit of the same model in this process?): fit would go on from its current weights, "
            "not from the beginning, and never write those steps again. Fix: set resume=False on the callback "
            "for a fit that goes on from the model as it is (ckpt.resume = False after the first fit), or feed "
            "fit from OrbaxCheckpoint.batches() so a step can be continued mid-epoch. Received: resume=True, "
            f"model at {self._count.total} batches, steps {point.newer}")

    def _data_caveat(self, info: ResumeInfo | None, tracked: bool) -> str:
        """Why the resumed `fit` will not train as the uninterrupted run did ("" where it will, or is not known).

        Only `batches()` carries the data's position; any other input starts
        over at the resumed epoch, which is exact only where the
        uninterrupted run started over there too (`data_passes`). What of other
        callbacks' state no step holds gets a warning of its own
        (`other_callbacks`).
        """
        if info is None or info.epoch is None:
            return ""
        drawn = _keras.fit_input(self._model)
        if drawn is None:
            return ""
        if (unsaved := other_callbacks.unrestored(drawn.callbacks, info.next_epoch,
                                                  saved="callbacks" in info.metadata)):
            self._say(logging.WARNING, unsaved + ".", once=True)
        if tracked:
            return ""
        return (data_passes.restart_caveat(info.next_epoch, steps_per_epoch=drawn.steps_per_epoch,
                                           num_batches=drawn.num_batches,
                                           steps_per_execution=drawn.steps_per_execution)
                or data_passes.dataset_caveat(drawn.py_dataset, info.next_epoch))

    def _give_back_other_callbacks(self) -> None:
        """Gives the counters of the step restored back to `EarlyStopping` & co (`other_callbacks`).

        Here, not in `on_train_begin`: theirs resets them, and may run after this callback's.
        """
        info, self._restored = self._restored, None
        if info is None or info.epoch is None or "callbacks" not in info.metadata:
            return
        other_callbacks.restore(self._callbacks, info.metadata["callbacks"], epoch=info.epoch,
                                epoch_complete=info.epoch_complete, logs=info.metadata.get("logs") or {},
                                say=lambda line: self._say(logging.WARNING, line + ".", once=True))

    def _refuse_a_second_resume(self) -> None:
        """Refuses `resume=True` where another callback of this `fit` resumed already.

        Raises:
            ConfigurationError: naming both directories and the fix.
        """
        other = fitstate.resume_of(self._model, self.params)
        if other is None:
            return
        raise ConfigurationError(
            f"Two OrbaxCheckpoint callbacks of this fit have resume=True ({other.directory!r} and "
            f"{self.directory!r}): each would restore its own step into the same model, the later one over "
            "the earlier. Fix: resume=True on one of them only, the one holding the newest step (after a "
            "preemption, the one that saves most often); the others go on from the step it resumes. "
            "Received: resume=True twice")

    def _go_on_from_resume(self) -> None:
        """Where another callback of this `fit` resumed, counts on from the step it restored.

        This callback's count was taken at its `on_train_begin`, perhaps
        before that restore; it goes on from the restored step's batches and
        position in the epoch (the metric accumulators of a partial epoch are
        given back by the callback that resumed).
        """
        shared = fitstate.resume_of(self._model, self.params)
        if shared is None or shared.owner == id(self):
            return
        self._adopted = shared
        if shared.info is not None and shared.info.epoch is not None:
            self._count.continue_after(shared.info.metadata, save_freq=self.save_freq, metrics=None)
        else:  # restarted from the beginning, or a step Keras wrote: the optimizer's count
            optimizer = getattr(self._model, "optimizer", None)
            iterations = int(optimizer.iterations) if optimizer is not None and optimizer.built else 0
            self._count.total = fitstate.batches_at_start(self._model, iterations)

    def _stop_before_training(self) -> None:
        """Undoes what `on_train_begin` started, for a `fit` refused before its first batch."""
        if self._in_fit:
            self._in_fit = False
            self._preemption.stop()
            quiet.stop()
        if self._writer_open and self._writer is not None:
            self._writer_open = False
            self._writer.close(None)

    def _stop_fit_before_training(self) -> None:
        """Stops this callback and every other `OrbaxCheckpoint` of the `fit` whose `on_train_begin` ran.

        A hook that raises ends `fit` without `on_train_end`: the callbacks
        that started would keep their SIGTERM handler (the process's next
        SIGTERM, after `fit`, would be taken for a notice and not end it) and
        the absl filter. Those listed after this one have started too when it
        refuses at the first `on_epoch_begin`, not when its `on_train_begin`
        fails; `_in_fit` says which did.
        """
        started = [c for c in self._callbacks if isinstance(c, OrbaxCheckpoint) and c is not self and c._in_fit]
        self._stop_before_training()
        for callback in started:
            callback._stop_before_training()

    def _refuse_saves_below_committed_steps(self, *, first_epoch: int) -> None:
        """Refuses a `fit` whose saves would be numbered at or below a step already committed.

        Steps are ordered by number: retention keeps the highest, a resume
        continues the highest, and a save under a committed number fails.
        Another run's steps left in the directory (`resume=False`), or steps
        named by another `save_freq` (batches against epochs), would make
        this run's saves vanish as they are written, or fail one save in.
        (Keras' callback loses them without a word.)

        Args:
            first_epoch: The epoch this `fit` starts at (`on_epoch_begin`'s):
                a resumed step's, else `fit(initial_epoch=...)`.

        Raises:
            StepExistsError: naming the newest step and the fix.
        """
        steps = ondisk.committed_steps(self._location)
        if not steps:
            return
        newest = max(steps)
        first = self._schedule.first_step(self._count, first_epoch)
        if not self._schedule.writes_below(newest, first):
            return
        saved = (ondisk.read_json_item(ondisk.join(self.directory, str(newest)), ondisk.METADATA_ITEM) or {})
        if (self._adopted is not None and self._schedule.per_epoch and newest == first
                and saved.get("epoch_complete") is False):
            # This folder's partial step of the epoch another callback resumed (both saved at a
            # preemption): the epoch's save replaces it, as it would had this callback resumed.
            self._schedule.replace = newest
            return
        named = "epochs" if self._schedule.per_epoch else "batches trained"
        if self._adopted is not None:
            fix = (f"resume=True on this callback instead of on the one for {self._adopted.directory!r}: "
                   f"step {newest} here is further on than the step that one resumed")
        elif not self.resume:
            fix = f"pass resume=True to continue from step {newest}, or save into a new directory"
            if self._schedule.per_epoch and self._count.total > 0:
                # A further fit of a model that trained those epochs (fit in a loop): resume=True would
                # restore the newest step and, with the same `epochs`, train nothing.
                fix = (f"for a further fit of this model after the epochs it trained, number its epochs on: "
                       f"fit(initial_epoch={newest + 1}, epochs={newest + 1} + more), as Keras does; or {fix}")
        elif saved.get("save_freq") not in (None, self.save_freq):
            fix = f"save with the save_freq step {newest} was saved with ({saved['save_freq']!r}), or into a new directory"
        else:
            fix = "save into a new directory"
        kept = ("" if self.max_to_keep is None else
                f"retention (max_to_keep={self.max_to_keep}) keeps the highest, so this run's steps would be "
                "deleted as they are written; ")
        raise StepExistsError(
            f"{self.directory!r} holds committed step {newest}, and this fit's saves (named by {named}, "
            f"save_freq={self.save_freq!r}) start at step {first}. Steps are ordered by number: {kept}a "
            "resume continues the highest, not this run's; a save under a committed number fails. "
            f"Fix: {fix}, or delete the old steps. Received: steps {steps}")

    def _restore_iterator_early(self) -> None:
        """Sets the iterator's saved position before fit pulls its first batch."""
        self._resume.restore_iterator(self.directory, self.data_iterator)

    def _say(self, level: int, message: str, *, once: bool = False) -> None:
        """Logs `message` (and prints it at verbose > 0).

        `once`: the line is the same on every process of a `jax.distributed`
        run (the checkpoint's step, the fit's epochs, not this process's
        timings): process 0 alone says it.
        """
        if once and jax.process_index() != 0:
            return
        _log.log(level, "OrbaxCheckpoint: %s", message)
        if self.verbose > 0:
            print(f"OrbaxCheckpoint: {message}")
