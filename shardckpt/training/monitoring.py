"""`monitor` for `save_best_only` and `keep_best`: improvement, and a warning once when it is missing.

Keras' checkpoint callbacks warn "Can save best model only with <monitor>
available, skipping." when the logs of a save lack the monitored value. The
same happens here for `keep_best`, which would otherwise rank steps by a value
that never comes (e.g. `val_loss` at a mid-epoch save), and the warning names
the keys the logs did hold. A value that is there but NaN or infinite is
warned about the same way for `keep_best` (such a step is never ranked among
the best, `retention.BestFinite`). One warning per `fit`, for either.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from shardckpt import userwarn
from shardckpt._keras import MonitorCallback


def _finite(value: Any) -> bool:
    """Whether a log value (Python, NumPy or JAX scalar) is a finite number."""
    try:
        return math.isfinite(float(np.asarray(value)))
    except (TypeError, ValueError):
        return False


class BestTracking(MonitorCallback):
    """Keras' `MonitorCallback` (monitor, mode, best) plus the missing-monitor warning."""

    _warned_monitor = False
    best: float | None  # set by MonitorCallback.__init__ (initial_value_threshold)

    def _improved(self, logs: dict | None, where: str) -> bool:
        """True (and `best` updated) when the monitored value improved at this save."""
        if self.monitor_op is None:
            self._set_monitor_op()
        current = (logs or {}).get(self.monitor)
        if current is None:
            self._warn_monitor_missing(logs, f"save_best_only skips the save at {where}")
            return False
        if not self._is_improvement(current, self.best):
            return False
        self.best = current
        return True

    def _check_monitor_for_keep_best(self, logs: dict | None, keep_best: int | None) -> None:
        if keep_best is None:
            return
        if self.monitor not in (logs or {}):
            self._warn_monitor_missing(logs, f"keep_best={keep_best} ranks steps by it; a step without it "
                                             "is never kept as one of the best")
        elif not _finite((logs or {})[self.monitor]):
            self._warn_monitor_not_finite((logs or {})[self.monitor], f"keep_best={keep_best}")

    def _warn_monitor_not_finite(self, value: Any, who: str) -> None:
        if self._warned_monitor:
            return
        self._warned_monitor = True
        userwarn.warn(
            f"{self.monitor} is {value!r} at this save: {who} ranks steps by it, and a step without a finite "
            f"value is never kept as one of the best (only max_to_keep or keep_period keep it). Fix: find "
            f"why {self.monitor} is not finite (keras.callbacks.TerminateOnNaN stops fit at the first NaN "
            "loss). Said once per fit.")

    def _warn_monitor_missing(self, logs: dict | None, consequence: str) -> None:
        if self._warned_monitor:
            return
        self._warned_monitor = True
        userwarn.warn(
            f"Can save best model only with {self.monitor} available: the logs at this save hold "
            f"{sorted(logs or {})}, and {consequence}. Fix: monitor one of those keys, or save when it is "
            "there (validation metrics exist at epoch ends: save_freq='epoch'). Said once per fit.")
