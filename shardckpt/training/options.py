"""Checking `OrbaxCheckpoint`'s arguments when it is built, before any `fit`.

Keras' callback raises on a bad `save_freq` at construction; the additions are
checked the same way, so a typo fails at once rather than at the first save.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardckpt.training import retention
from shardckpt.training import snapshot as snapshot_lib
from shardckpt.training.resume import check_on_count_change  # noqa: F401  (checked at construction too)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def validate(
    *,
    save_freq: str | int,
    snapshot: str,
    snapshot_budget_bytes: int,
    metadata: dict[str, Any] | Callable[[int, dict], dict] | None,
    max_to_keep: int | None,
    keep_best: int | None,
    keep_period: int | None,
    monitor: str,
) -> None:
    """Raises on the first argument out of range (Keras' messages where Keras has one).

    Raises:
        ValueError: `save_freq`, `snapshot`, `snapshot_budget_bytes` or a
            retention count is out of range.
        TypeError: `metadata` is neither a dict nor callable.
    """
    if save_freq not in ("epoch", "auto") and not _positive_int(save_freq):
        raise ValueError(f"Unrecognized save_freq: {save_freq}. Expected save_freq are 'epoch' or integer values "
                         "(or 'auto': the smallest interval whose saves finish in the background)")
    if snapshot not in snapshot_lib.MODES:
        raise ValueError(f"snapshot must be one of {snapshot_lib.MODES}. Received: snapshot={snapshot!r}")
    if not _positive_int(snapshot_budget_bytes):
        raise ValueError(f"snapshot_budget_bytes must be a positive integer. Received: {snapshot_budget_bytes!r}")
    if metadata is not None and not (isinstance(metadata, dict) or callable(metadata)):
        raise TypeError(
            "metadata must be a JSON dict or a callable (epoch, logs) -> dict. "
            f"Received: metadata={metadata!r}"
        )
    # The counts, as the Orbax policies will take them at the first fit.
    retention.preservation_policy(
        max_to_keep=max_to_keep, keep_best=keep_best, monitor=monitor,
        higher_is_better=False, keep_period=keep_period,
    )
