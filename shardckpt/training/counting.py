"""Counting the batches `fit` trains, across epochs, saves and resumes.

Keras calls `on_train_batch_end(batch)` with the batch index in the epoch, and
with `steps_per_execution > 1` only once per execution (the index then jumps).
`BatchCount` turns those calls into counts that steps are named and saved by:
batches in the epoch, batches of this `fit`, batches since the run began
(restored on resume), batches since the last scheduled save.

A resume in the middle of an epoch makes `fit` start that epoch at its first
batch index while the data continues where it stopped: the count starts at
the saved offset, and the epoch is ended early once its remaining batches ran
(the callback sets `stop_training` to a marker, and clears it at the epoch's end only where
it still holds the marker: another callback's stop in that epoch stands).
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class BatchCount:
    """Where one `fit` stands; a new one is made at each `on_train_begin`.

    Attributes:
        steps_per_epoch: `fit`'s steps per epoch (None: not known).
        total: Batches trained since the run began (the optimizer's
            iteration count, or the resumed step's).
        epoch: The epoch running.
        in_epoch: Batches of `epoch` done (a resumed epoch starts at its offset).
        fit_batches: Batches this `fit` trained (how far the data moved).
        since_save: Batches since the last scheduled save (integer `save_freq`),
            counted on across the fits of one callback.
        ends: `on_train_batch_end` calls so far (the preemption sync counter).
        resume_epoch: The epoch a mid-epoch resume continues, until it ends.
        resume_offset: Its batches done before the resume.
        resume_metrics: Its metric accumulators at the save.
        stopped_early: The resumed epoch was ended through `stop_training`.
    """

    steps_per_epoch: int | None = None
    total: int = 0
    epoch: int = 0
    in_epoch: int = 0
    fit_batches: int = 0
    since_save: int = 0
    ends: int = 0
    resume_epoch: int | None = None
    resume_offset: int = 0
    resume_metrics: list[Any] | None = None
    stopped_early: bool = False
    _last_batch: int | None = None

    @classmethod
    def start(cls, params: dict[str, Any] | None, model: Any, *, since_save: int = 0) -> BatchCount:
        """The count at the start of `fit` (`params` of the callback).

        Args:
            params: The callback's `params` (`steps`: batches per epoch).
            model: The model `fit` trains (its optimizer's update count).
            since_save: Batches counted toward an integer `save_freq` by the
                callback's previous `fit` since its last save. Keras' callback
                keeps that count across fits; restarting it at 0 would make a
                loop of fits shorter than `save_freq` never save.
        """
        optimizer = getattr(model, "optimizer", None)
        total = int(optimizer.iterations) if optimizer is not None and optimizer.built else 0
        return cls(steps_per_epoch=(params or {}).get("steps"), total=total, since_save=since_save)

    @property
    def epoch_complete(self) -> bool:
        """True once every batch of the epoch is done."""
        return bool(self.steps_per_epoch and self.in_epoch >= self.steps_per_epoch)

    def begin_epoch(self, epoch: int) -> bool:
        """Starts `epoch`; True when it is the epoch a mid-epoch resume continues."""
        self.epoch, self.in_epoch, self._last_batch = epoch, 0, None
        if self.resume_epoch != epoch:
            return False
        self.in_epoch = self.resume_offset
        return True

    def end_batch(self, batch: int) -> int:
        """Counts the batches up to index `batch`; returns how many that was."""
        if self._last_batch is None or batch <= self._last_batch:
            add = batch + 1
        else:
            add = batch - self._last_batch
        self._last_batch = batch
        self.in_epoch += add
        self.fit_batches += add
        self.total += add
        return add

    def resumed_epoch_done(self) -> bool:
        """True when the resumed epoch has run its remaining batches (end it now)."""
        return self.resume_epoch == self.epoch and self.in_epoch >= (self.steps_per_epoch or 0) > 0

    def scheduled_save_due(self, add: int, save_freq: str | int) -> bool:
        """True when an integer `save_freq` falls due after `add` more batches."""
        if isinstance(save_freq, str):  # "epoch": saved at the epoch's end
            return False
        self.since_save += add
        if self.since_save < save_freq:
            return False
        self.since_save = 0
        return True

    def continue_after(self, meta: dict[str, Any], *, save_freq: str | int, metrics: list[Any] | None) -> None:
        """Continues the count of a resumed step (`meta`: its metadata item).

        Args:
            meta: The step's metadata (`total_batches`, `epoch`, `batch`...).
            save_freq: The callback's; integer saves fall on the same batches
                as in the uninterrupted run.
            metrics: The metric accumulators restored with a partial epoch, to
                give back at its start (None: another callback gives them).
        """
        self.total = int(meta.get("total_batches") or 0)
        if isinstance(save_freq, int):
            # Stored since it is not `total % save_freq` where saves fall off the multiples
            # (steps_per_execution > 1: Keras' count restarts at each save).
            stored = meta.get("batches_since_save")
            if isinstance(stored, int) and meta.get("save_freq") == save_freq:
                self.since_save = stored
            else:
                self.since_save = self.total % save_freq
        if not meta.get("epoch_complete", True):
            self.resume_epoch, self.resume_offset = int(meta["epoch"]), int(meta.get("batch") or 0)
            self.resume_metrics = metrics
