"""The counters of other callbacks of a `fit`, saved with each step and given back on resume.

`EarlyStopping` and `ReduceLROnPlateau` count epochs without improvement
(`wait`, `best`, a cooldown) and reset those counts in their own
`on_train_begin`. A resumed `fit` would therefore start their patience over:
measured (`tests/test_resume_variations.py`), patience 2, never improving,
resumed after epoch 2 of 4: the unbroken run stopped after epoch 3, the resumed
one trained all 4; `ReduceLROnPlateau` (patience 1, factor 0.5) ended at lr
0.005 or 0.0025 (listed after or before the checkpoint) against 0.00125.

Each step's metadata holds their numbers under "callbacks" (JSON, one entry a
callback, in the `fit`'s order), and the resumed `fit` gives them back once
every `on_train_begin` has run. Where the step was saved before a callback's
`on_epoch_end` of a whole epoch ran (it is listed after the checkpoint, or the
step was saved after the epoch's last batch), the resume runs that
`on_epoch_end` with the step's logs, as the unbroken run did after the save
(`ReduceLROnPlateau` lowers the rate then). What no step holds:
`EarlyStopping(restore_best_weights=True)`'s `best_weights` (a copy of every
weight); the resume says so, once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras

from shardckpt.training.metadata import jsonable

# The numbers each callback's on_train_begin resets, which decide what later epochs train.
_FIELDS: tuple[tuple[type, tuple[str, ...]], ...] = (
    (keras.callbacks.EarlyStopping, ("wait", "best", "stopped_epoch", "best_epoch")),
    (keras.callbacks.ReduceLROnPlateau, ("wait", "best", "cooldown_counter")),
)


def _fields(callback: Any) -> tuple[str, ...] | None:
    for cls, fields in _FIELDS:
        if isinstance(callback, cls):
            return fields
    return None


def _number(value: Any) -> Any:
    """A saved field back as Python number ("inf" / "nan", as `jsonable` writes them, as floats)."""
    return float(value) if isinstance(value, str) else value


def capture(callbacks: list[Any], checkpoint: Any, *, in_epoch_end: bool) -> list[dict[str, Any]]:
    """The counters of `callbacks` now, for a step's metadata.

    Args:
        callbacks: Every callback of the `fit`, in its order.
        checkpoint: The callback saving (its place in the list says which
            `on_epoch_end` ran before the save).
        in_epoch_end: The save happens in `on_epoch_end` (else after a batch:
            no `on_epoch_end` of that epoch ran).
    """
    entries = []
    seen_checkpoint = False
    for callback in callbacks:
        seen_checkpoint = seen_checkpoint or callback is checkpoint
        fields = _fields(callback)
        if fields is None:
            continue
        entries.append({
            "callback": type(callback).__name__,
            "state": {name: jsonable(getattr(callback, name, None)) for name in fields},
            "epoch_end_ran": in_epoch_end and not seen_checkpoint,
        })
    return entries


def restore(callbacks: list[Any], saved: list[dict[str, Any]], *, epoch: int, epoch_complete: bool,
            logs: dict[str, Any], say: Callable[[str], None]) -> None:
    """Gives the counters of a step back to the resumed `fit`'s callbacks (after their `on_train_begin`).

    Args:
        callbacks: Every callback of the resumed `fit`.
        saved: The step's "callbacks" metadata (`capture`).
        epoch: The epoch the step was saved in.
        epoch_complete: The step holds that whole epoch (the resume goes on with the next).
        logs: The step's logs (run through the `on_epoch_end` the step was saved before).
        say: Where a warning goes (matching failed, or a replay lacked its monitor).
    """
    tracked = [c for c in callbacks if _fields(c) is not None]
    names = [type(c).__name__ for c in tracked]
    if names != [entry.get("callback") for entry in saved]:
        say(f"the step saved the counters of {[e.get('callback') for e in saved]}, but this fit has {names}: "
            "they are not given back, and the patience of these callbacks starts over at the resumed epoch. "
            "Fix: resume with the callbacks the step was saved with")
        return
    epoch_logs = {k: _number(v) for k, v in logs.items()}
    for callback, entry in zip(tracked, saved, strict=True):
        for name, value in entry["state"].items():
            setattr(callback, name, _number(value))
        if not epoch_complete or entry.get("epoch_end_ran"):
            continue
        monitor = getattr(callback, "monitor", None)
        if monitor not in epoch_logs and monitor != "learning_rate":
            say(f"{type(callback).__name__} counted epoch {epoch} after the step was saved, and the step's logs "
                f"lack its monitor {monitor!r} (a step saved after the epoch's last batch holds no validation "
                "logs): its counters miss that epoch. Fix: save_freq='epoch', with the callback listed "
                "before the checkpoint")
            continue
        # The unbroken run called it after the save; so does the resume (fit's stop flag is its own).
        model = callback.model
        stop = model.stop_training
        callback.on_epoch_end(epoch, dict(epoch_logs))
        if model.stop_training and not stop:
            model.stop_training = stop
            say(f"{type(callback).__name__} stopped the run after epoch {epoch}, the step's epoch: the "
                "uninterrupted fit ended there; this resumed fit trains on")


def unrestored(callbacks: list[Any], epoch: int, saved: bool) -> str:
    """The warning for a `fit` resumed at `epoch` whose callbacks hold state no step holds ("" if none).

    Args:
        callbacks: Every callback of the `fit`.
        epoch: The epoch (0-based) the resumed `fit` continues with.
        saved: The step holds the counters (`capture`; steps of older
            versions do not).
    """
    if epoch == 0:
        return ""
    if not saved:
        named = [type(c).__name__ for c in callbacks if _fields(c) is not None]
        if not named:
            return ""
        return (f"the step holds no counters of {', '.join(named)} (saved by an older shardckpt): their "
                f"on_train_begin starts them over at epoch {epoch + 1}, so they may stop training or lower the "
                "learning rate at another epoch than the uninterrupted run. Fix: resume from a step saved by "
                "this version, or accept that their patience starts over")
    best_weights = [c for c in callbacks if isinstance(c, keras.callbacks.EarlyStopping) and c.restore_best_weights]
    if not best_weights:
        return ""
    return ("EarlyStopping(restore_best_weights=True)'s best_weights (a copy of every weight) are in no step: "
            f"its counters are given back, but from epoch {epoch + 1} on it holds only the weights of the epochs "
            "after the resume, so at the end it restores those if none of the earlier epochs beat them, "
            "where the uninterrupted run restored an earlier epoch's. Fix: keep_best=1 with monitor= its "
            "monitor, and restore that step after fit")
