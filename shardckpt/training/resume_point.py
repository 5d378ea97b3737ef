"""Which committed step a resuming `fit` continues from, and the line that says so.

A step saved in the middle of an epoch can only be continued exactly when the
data continues where it stopped too: the callback must have seen `fit` draw
its batches from `OrbaxCheckpoint.batches()`, whose iterator position is in
the step. Any other input (arrays, a `PyDataset`, a generator, a dataset) is
restarted by the resumed `fit` at the first batch of an epoch, as Keras'
`BackupAndRestore` restarts it. Then the run resumes from the newest step that
holds whole epochs (kept beside partial ones: `retention`), or from the start
when there is none, and the steps after it are deleted: the resumed run writes
them again, bit-identical.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax

from shardckpt import storage
from shardckpt.errors import IteratorPositionError
from shardckpt.formats.orbax.ondisk import ITERATOR_ITEM, METADATA_ITEM, committed_steps, read_json_item
from shardckpt.training import resume
from shardckpt.training.iterators import IteratorTracker
from shardckpt.training.resume import ResumeInfo

WHY_NOT_MID_EPOCH = (
    "it holds part of an epoch and fit does not draw its batches from OrbaxCheckpoint.batches(), "
    "so the data cannot continue where it stopped"
)


@dataclasses.dataclass(kw_only=True)
class ResumePoint:
    """Where a resuming `fit` starts.

    Attributes:
        step_dir: The step folder to restore; None: train from the start.
        latest: The newest committed step.
        newer: Committed steps after `step_dir`, which the run writes again.
        why: Why the latest step is not the one restored ("" when it is).
    """

    step_dir: str | None
    latest: int
    newer: list[int]
    why: str = ""


def choose(directory: str, *, mid_epoch: bool) -> ResumePoint | None:
    """Picks the step to resume from; None when `directory` holds no committed step.

    Args:
        directory: The checkpoint root (local or a bucket URL).
        mid_epoch: The data continues where the latest step stopped (`fit`
            draws from `batches()`): a partial epoch may be continued.
    """
    location = storage.parse(directory)
    if not storage.isdir(location):
        return None
    steps = committed_steps(location.url)
    if not steps:
        return None

    def whole(step: int) -> bool:
        # Steps without shardckpt metadata (Keras-written) hold no position: whole.
        meta = read_json_item(location.join(str(step)).url, METADATA_ITEM) or {}
        return bool(meta.get("epoch_complete", True))

    latest = steps[-1]
    if mid_epoch or whole(latest):
        return ResumePoint(step_dir=location.join(str(latest)).url, latest=latest, newer=[])
    for step in reversed(steps[:-1]):
        if whole(step):
            return ResumePoint(step_dir=location.join(str(step)).url, latest=latest,
                               newer=[s for s in steps if s > step], why=WHY_NOT_MID_EPOCH)
    return ResumePoint(step_dir=None, latest=latest, newer=list(steps), why=WHY_NOT_MID_EPOCH)


def trained_past(directory: str, point: ResumePoint, batches: int) -> list[int]:
    """The steps a start from the beginning would delete that the model has trained past already.

    "From the beginning" is exact for the model a rerun builds, which has
    trained none of the run's batches: the resumed `fit` writes the deleted
    steps again. A model that has trained as far as a step was saved (a
    second `fit` of it in the same process, a model stopped by a preemption
    and fit again) goes on from its current weights instead, and its saves
    come after those steps: they would be deleted and never written again.

    Args:
        directory: The checkpoint root of `point`.
        point: Where the resuming `fit` starts.
        batches: The batches the model has trained (the callback's count at
            the start of `fit`).

    Returns:
        The steps of `point.newer` saved at or before `batches` batches; none
        where `point` restores a step (the model goes back to that step).
    """
    if point.step_dir is not None:
        return []
    location = storage.parse(directory)
    past = []
    for step in point.newer:
        saved = (read_json_item(location.join(str(step)).url, METADATA_ITEM) or {}).get("total_batches")
        if isinstance(saved, int) and saved <= batches:
            past.append(step)
    return past


def restore(model: Any, point: ResumePoint, *, tracker: IteratorTracker | None, data_iterator: Any,
            iterator_restored_from: str | None, on_process_count_change: str = "error") -> ResumeInfo | None:
    """Restores `point`'s step into `model` (None when the run starts from the beginning).

    The data iterator gets the step's position here unless `batches()` has
    started already: it set the position before fit's first pull
    (`set_iterator`), from the step that must be this one.

    Raises:
        IteratorPositionError: `batches()` took its position from another
            step (the directory changed in between).
    """
    if point.step_dir is None:
        return None
    started = tracker is not None and tracker.used
    info = resume.restore_step(model, point.step_dir, data_iterator=None if started else data_iterator,
                               on_process_count_change=on_process_count_change)
    if started and iterator_restored_from != point.step_dir:
        raise IteratorPositionError(
            f"batches() restored the data iterator from {iterator_restored_from!r} but the model resumes "
            f"from {point.step_dir!r}. Fix: do not write to the checkpoint directory from another process "
            "while this run starts.")
    return info


def set_iterator(data_iterator: Any, step_dir: str | None, *, on_process_count_change: str = "error") -> str | None:
    """Gives `data_iterator` this process's position saved in `step_dir`; returns `step_dir`.

    Raises:
        IteratorCountError: the step holds positions of another process count
            and `on_process_count_change` is "error".
    """
    if step_dir is not None:
        item = read_json_item(step_dir, ITERATOR_ITEM)
        state = resume.iterator_state_for_process(item, jax.process_index(), jax.process_count(), step_dir=step_dir,
                                                  on_count_change=on_process_count_change)
        if state is not None:
            data_iterator.set_state(state)
    return step_dir


def describe(point: ResumePoint, info: ResumeInfo | None, *, epochs: int | None, directory: str,
             caveat: str = "", initial_epoch: int | None = None) -> tuple[int, str]:
    """The one line a resume logs, and its level: the step and epoch, or that the run is complete.

    WARNING when the latest step is not the one continued (work is redone),
    when there is nothing left to train, with a `caveat` (why the data the
    resumed `fit` draws is not the uninterrupted run's), or where the step
    overrides another `initial_epoch` given to `fit`; INFO otherwise.
    """
    if info is None:
        return logging.WARNING, (
            f"not resuming from step {point.latest} in {directory}: {point.why}, and no step holds a whole "
            f"epoch; training starts from the beginning (exact). Steps {point.newer} will be written again. "
            "Fix: feed fit from OrbaxCheckpoint.batches() to resume mid-epoch.")
    # Epochs are counted from 1 here, as Keras' progress bar shows them ("Epoch 2/2").
    def epoch(index: int) -> str:
        return f"epoch {index + 1}" + (f"/{epochs}" if epochs is not None else "")

    where = (f"{epoch(info.epoch)} complete" if info.epoch_complete
             else f"{epoch(info.epoch)}, {info.batch}/{info.metadata.get('steps_per_epoch')} batches done"
             ) if info.epoch is not None else ""
    if info.epoch is None:
        where = ("a step its writer (Keras' callback?) gave no shardckpt metadata: weights restored, epoch and "
                 "data position not known, so the run is not exact")
    line = f"resumed from step {info.step} in {directory} ({where})"
    overridden = ""
    if info.epoch is not None and initial_epoch and initial_epoch != info.next_epoch:
        # The step decides where fit goes on (the uninterrupted run's epoch); the argument is dropped.
        overridden = (f" fit(initial_epoch={initial_epoch}) is not used: the step sets it to {info.next_epoch}, "
                      "where the uninterrupted run went on. Fix: leave initial_epoch out of a fit with "
                      "resume=True (the step sets it).")
    if point.why:
        exact = "" if caveat else "exact; "
        line = (f"step {point.latest} not resumed: {point.why}; {line}, the newest step of whole epochs "
                f"({exact}steps {point.newer} will be written again). Fix: feed fit from "
                "OrbaxCheckpoint.batches() to resume mid-epoch")
    if epochs is not None and info.epoch is not None and info.next_epoch >= epochs:
        done = f"The run is already complete: all {epochs} epochs are trained; fit trains nothing."
        return logging.WARNING, f"{line}. {done}{overridden}"
    if info.epoch is None:
        return logging.WARNING, f"{line}."
    line = f"{line}; fit continues at {epoch(info.next_epoch)}."
    if caveat:
        return logging.WARNING, f"{line} Not exact: {caveat}.{overridden}"
    return (logging.WARNING if point.why or overridden else logging.INFO), line + overridden


@dataclasses.dataclass(kw_only=True, eq=False)
class ResumeState:
    """The callback's `resume` options and where the current `fit` resumes from.

    `batches()` may set the iterator's position before `fit` calls the
    callback's `on_train_begin` (fit peeks its input first): then the step is
    not decided yet and the latest one is taken; `restore` checks afterwards
    that the model resumed from that same step.

    Attributes:
        enabled: Restore the latest committed step when `fit` starts (`resume`).
        on_process_count_change: "error" or "restart_iterators" (see `resume`).
        info: What the latest resume restored (None: none, or from the start).
        step_dir: The step this `fit` resumes from, once `decided`.
        decided: `on_train_begin` has chosen `step_dir` for this `fit`.
        iterator_restored_from: The step `batches()` took the position from.
    """

    enabled: bool = False
    on_process_count_change: str = "error"
    info: ResumeInfo | None = dataclasses.field(default=None, init=False)
    step_dir: str | None = dataclasses.field(default=None, init=False)
    decided: bool = dataclasses.field(default=False, init=False)
    iterator_restored_from: str | None = dataclasses.field(default=None, init=False)

    def choose(self, directory: str, *, mid_epoch: bool) -> ResumePoint | None:
        """Decides this `fit`'s step (see `choose`)."""
        point = choose(directory, mid_epoch=mid_epoch)
        self.step_dir = None if point is None else point.step_dir
        return point

    def restore(self, model: Any, point: ResumePoint, *, tracker: IteratorTracker | None,
                data_iterator: Any) -> ResumeInfo | None:
        """Restores `point` (see `restore`) and keeps what it restored as `info`."""
        self.info = restore(model, point, tracker=tracker, data_iterator=data_iterator,
                            iterator_restored_from=self.iterator_restored_from,
                            on_process_count_change=self.on_process_count_change)
        return self.info

    def restore_iterator(self, directory: str, data_iterator: Any) -> None:
        """Gives `data_iterator` its position before `fit` pulls the first batch (when resuming)."""
        if self.enabled:
            step_dir = self.step_dir if self.decided else resume.latest_step_dir(directory)
            self.iterator_restored_from = set_iterator(
                data_iterator, step_dir, on_process_count_change=self.on_process_count_change)
