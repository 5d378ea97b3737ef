"""What `OrbaxCheckpoint` callbacks know of a model beyond their own `fit`.

Several callbacks can save one `fit` (a frequent local one beside a per-epoch
one in a bucket), and one model can be fit several times. Each callback keeps
its own count of batches, but the count must agree with the model's state:

- **The resume of a fit.** One callback restores its step; the others must go
  on from that step's batch count and position in the epoch, not from what
  they saw before the restore (their `on_train_begin` may even run before it).
  Keras gives every callback of a `fit` the same `params` dict, a new one per
  `fit` (`CallbackList.set_params`), so `(model, params)` names the fit.
- **The next fit of the same model.** `optimizer.iterations` counts optimizer
  updates, which are fewer than the batches with gradient accumulation or a
  loss-scale optimizer's skipped steps; the batches a fit ended at are kept
  with the iteration count they ended at, and a later fit starting from that
  same count goes on from those batches.

Models are held weakly: nothing here keeps a model alive.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

from shardckpt.training.resume import ResumeInfo


@dataclasses.dataclass(frozen=True)
class Resumed:
    """The resume of one `fit`.

    Attributes:
        owner: `id()` of the callback that resumed (not the callback itself: a
            value held here must not hold the model, its key, alive).
        directory: That callback's directory.
        info: The step restored, or None (nothing to resume from: the run starts over).
    """

    owner: int
    directory: str
    info: ResumeInfo | None


_resumes: weakref.WeakKeyDictionary[Any, tuple[dict[str, Any], Resumed]] = weakref.WeakKeyDictionary()
_ends: weakref.WeakKeyDictionary[Any, tuple[int, int]] = weakref.WeakKeyDictionary()


def publish_resume(model: Any, params: dict[str, Any], resumed: Resumed) -> None:
    """Records that a callback of the `fit` named by `(model, params)` resumed."""
    _resumes[model] = (params, resumed)


def resume_of(model: Any, params: dict[str, Any] | None) -> Resumed | None:
    """The resume of the `fit` named by `(model, params)`, or None when no callback of it resumed."""
    entry = _resumes.get(model)
    return entry[1] if entry is not None and params is not None and entry[0] is params else None


def record_end(model: Any, iterations: int, total: int) -> None:
    """Records that a `fit` of `model` ended at `total` batches and `iterations` optimizer updates."""
    _ends[model] = (iterations, total)


def batches_at_start(model: Any, iterations: int) -> int:
    """The batches trained when a `fit` of `model` starts at `iterations` optimizer updates.

    The batches a previous `fit` ended at, when the optimizer still holds the
    update count it ended with; else `iterations` (one update per batch).
    """
    end = _ends.get(model)
    return end[1] if end is not None and end[0] == iterations else iterations
