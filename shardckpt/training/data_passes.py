"""Where `fit`'s pass over its input stands when an epoch begins, and what a resume there restarts.

Keras' `fit` with `steps_per_epoch` keeps one iterator over its input across
epochs and starts a new pass only when the data runs out (`EpochIterator`):
with arrays or a `PyDataset` of 6 batches and `steps_per_epoch=4`, epoch 1
trains batches 4 and 5 of the first shuffle; with a generator, every epoch
goes on where the previous one stopped. A resumed `fit` starts its first
epoch on a new pass, from the first batch. That equals the uninterrupted run
only where that run also started a new pass at that epoch; elsewhere the
resumed run trains other batches, and the callback says so (only
`OrbaxCheckpoint.batches()` carries the data's position in the step). The
same holds for a `PyDataset` that changes itself in `on_epoch_end`.
"""

from __future__ import annotations

import math
from typing import Any

import keras


def pass_offset(epoch: int, *, steps_per_epoch: int | None, num_batches: int | None,
                steps_per_execution: int = 1) -> int | None:
    """Batches of the current pass the uninterrupted `fit` has drawn when `epoch` begins.

    Mirrors `EpochIterator._enumerate_iterator`: without `steps_per_epoch`
    every epoch is one whole pass; with it, an epoch takes `steps_per_epoch`
    batches (in executions of `steps_per_execution`) or what is left of the
    pass, and the next pass starts once the data is used up.

    Args:
        epoch: The epoch (0-based) a resumed `fit` starts with.
        steps_per_epoch: As passed to `fit` (None: not passed).
        num_batches: Batches in one pass of the data (None: not known, a generator).
        steps_per_execution: The model's.

    Returns:
        0 where the epoch begins a new pass (a resume there is exact), the
        batches drawn from the pass so far, or None where that is not known
        (a stream of no known length past its first epoch).
    """
    if steps_per_epoch is None or epoch == 0:
        return 0
    if num_batches is None:
        return None
    per_epoch = math.ceil(steps_per_epoch / steps_per_execution)
    seen = 0
    for _ in range(epoch):
        seen += min(per_epoch, math.ceil((num_batches - seen) / steps_per_execution)) * steps_per_execution
        if seen >= num_batches:
            seen = 0
    return seen


def restart_caveat(epoch: int, *, steps_per_epoch: int | None, num_batches: int | None,
                   steps_per_execution: int = 1) -> str:
    """Why a `fit` resumed at `epoch` trains other batches than the uninterrupted run ("" if it does not).

    Epochs are named from 1 in the text, as Keras' progress bar names them.
    """
    offset = pass_offset(epoch, steps_per_epoch=steps_per_epoch, num_batches=num_batches,
                         steps_per_execution=steps_per_execution)
    if offset == 0:
        return ""
    fix = ("Fix: feed fit from OrbaxCheckpoint.batches() with a data_iterator that has get_state()/"
           "set_state() (its position is saved with each step)")
    if offset is None:
        return (f"fit passes steps_per_epoch={steps_per_epoch} with an input of no known length (a generator), "
                f"so the uninterrupted run would go on at epoch {epoch + 1} X the resumed fit draws from a new input, from its start, "
                f"which is the same data only if the input repeats every {steps_per_epoch} batches. {fix}")
    return (f"fit passes steps_per_epoch={steps_per_epoch}, fewer than the {num_batches} batches of one pass of "
            f"the data, so Keras goes on with the same pass across epochs: the uninterrupted run would begin "
            f"epoch {epoch + 1} at batch {offset} of its pass, the resumed fit begins a new pass (another "
            f"shuffle) at its first batch. {fix}, or pass a steps_per_epoch that divides {num_batches} (or none)")


def dataset_caveat(py_dataset: Any, epoch: int) -> str:
    """Why a `PyDataset` that changes itself between epochs resumes unlike the uninterrupted run ("" if not).

    `fit` calls its `on_epoch_begin` / `on_epoch_end` (a reshuffle of its own
    order, as Keras' docs suggest); what they change lives in the dataset
    object, not in the model, so no step holds it: the resumed `fit` begins
    `epoch` with the dataset as newly built, not as `epoch` epochs left it.
    """
    if py_dataset is None or epoch == 0:
        return ""
    hooks = [name for name in ("on_epoch_begin", "on_epoch_end")
             if getattr(type(py_dataset), name, None) is not getattr(keras.utils.PyDataset, name)]
    if not hooks:
        return ""
    return (f"fit draws from {type(py_dataset).__name__}, a PyDataset with its own {' and '.join(hooks)}: what "
            f"they change (a reshuffled order) is held by the dataset object and saved in no step, so the "
            f"resumed fit begins epoch {epoch + 1} with the dataset as newly built, not as {epoch} epoch(s) left "
            "it. Fix: shuffle with fit(shuffle=True) (its order is restored), or feed fit from "
            "OrbaxCheckpoint.batches() with a data_iterator whose get_state()/set_state() hold that order")
