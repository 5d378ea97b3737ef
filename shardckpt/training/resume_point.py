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

from shardckpt.formats import storage
from shardckpt.formats.orbax.ondisk import METADATA_ITEM, committed_steps, read_json_item
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


def describe(point: ResumePoint, info: ResumeInfo | None, *, epochs: int | None, directory: str) -> str:
    """The one line a resume logs: the step and epoch, or that the run is complete."""
    if info is None:
        return (f"not resuming from step {point.latest} in {directory}: {point.why}, and no step holds a whole "
                f"epoch; training starts from the beginning (exact). Steps {point.newer} will be written again. "
                "Fix: feed fit from OrbaxCheckpoint.batches() to resume mid-epoch.")
    where = (f"epoch {info.epoch} complete" if info.epoch_complete
             else f"epoch {info.epoch}, batch {info.batch} of {info.metadata.get('steps_per_epoch')}")
    if info.epoch is None:
        where = "a step without shardckpt metadata (written by Keras?): weights restored, epoch not known"
    line = f"resumed from step {info.step} in {directory} ({where})"
    if point.why:
        line = (f"step {point.latest} not resumed: {point.why}; {line}, the newest step of whole epochs "
                f"(exact; steps {point.newer} will be written again). Fix: feed fit from "
                "OrbaxCheckpoint.batches() to resume mid-epoch")
    if epochs is not None and info.epoch is not None and info.next_epoch >= epochs:
        return f"{line}. The run is already complete: all {epochs} epochs are trained; fit trains nothing."
    return f"{line}; fit continues at epoch {info.next_epoch}." if info.epoch is not None else f"{line}."
