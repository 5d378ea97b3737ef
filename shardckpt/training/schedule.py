"""When `OrbaxCheckpoint` saves, and which step on disk a save replaces.

Steps are named as Keras names them: the epoch for `save_freq="epoch"`, the
batches trained for an integer (or "auto") `save_freq`. A resumed run with
`save_freq="epoch"` that continues a step saved in the middle of an epoch
saves the completed epoch under the same number; Orbax never overwrites a
step, so that one step is deleted first (`claim`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

from shardckpt.training.autofreq import AutoInterval
from shardckpt.training.counting import BatchCount
from shardckpt.training.resume import ResumeInfo


@dataclasses.dataclass(kw_only=True, eq=False)
class SaveSchedule:
    """`save_freq` and the saves of the current `fit`.

    Attributes:
        save_freq: "epoch", "auto" or a number of batches (checked by `options`).
        auto: `save_freq="auto"`'s interval during a `fit`, else None.
        last_saved: The step saved last (or resumed from) in this `fit`.
        replace: The partial-epoch step this `fit` resumed from, which the
            save of its epoch replaces.
    """

    save_freq: str | int = "epoch"
    auto: AutoInterval | None = dataclasses.field(default=None, init=False)
    last_saved: int | None = dataclasses.field(default=None, init=False)
    replace: int | None = dataclasses.field(default=None, init=False)

    @property
    def per_epoch(self) -> bool:
        """True for `save_freq="epoch"`: a save at each epoch's end, named by the epoch."""
        return self.save_freq == "epoch"

    def begin(self) -> None:
        """Forgets the previous `fit`'s saves."""
        self.last_saved = self.replace = None

    def begin_auto(self) -> None:
        """Starts `save_freq="auto"`'s interval (after the resume, as the first save's timing starts then).

        Raises:
            ValueError: `save_freq="auto"` with more than one process.
        """
        self.auto = None
        if self.save_freq == "auto":
            if jax.process_count() > 1:
                # Each process would time its own writes and save at other batches.
                raise ValueError("save_freq='auto' needs a single process: each process would pick its own "
                                 f"interval. Fix: pass an integer save_freq. Received: {jax.process_count()} processes")
            self.auto = AutoInterval()

    def resumed(self, info: ResumeInfo) -> None:
        """Continues after the resumed step `info` (which holds shardckpt's metadata)."""
        self.last_saved = info.step
        if self.per_epoch and not info.epoch_complete:
            self.replace = info.step

    def due_after_batch(self, count: BatchCount, add: int, *, writer_busy: Callable[[], bool]) -> bool:
        """True when a save is due after `add` more batches (`writer_busy`: a save is in flight)."""
        due = count.scheduled_save_due(add, self.save_freq)
        if self.auto is not None:
            due = self.auto.due(add, writer_busy=writer_busy())
        return due

    def first_step(self, count: BatchCount, initial_epoch: int | None) -> int:
        """The lowest step number a save of this `fit` can have (`initial_epoch`: the epoch it starts at)."""
        return (initial_epoch or 0) if self.per_epoch else count.total + 1

    def writes_below(self, newest: int, first: int) -> bool:
        """True when this `fit`'s saves (from step `first` on) would sort at or below the committed step
        `newest`: a resumed partial epoch's step is the only one a save may replace."""
        return newest > first or (newest == first and newest != self.replace)

    def step_now(self, count: BatchCount) -> int:
        """The step a save made now is named by."""
        return count.epoch if self.per_epoch else count.total

    def holds(self, step: int) -> bool:
        """True when this `fit` saved `step` already and it is not to be replaced."""
        return step == self.last_saved and step != self.replace

    def claim(self, step: int) -> bool:
        """Records a save of `step`; True when the step on disk must be deleted first."""
        replace = step == self.replace
        if replace:
            self.replace = None
        self.last_saved = step
        return replace

    def saved(self, last_write_s: float | None) -> str | None:
        """After a save: "auto"'s line when its interval was derived or changed (see `AutoInterval.saved`)."""
        return None if self.auto is None else self.auto.saved(last_write_s)
