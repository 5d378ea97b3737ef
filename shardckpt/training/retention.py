"""Which steps to keep: Orbax preservation policies built from callback arguments.

A step survives if any policy keeps it: the latest `max_to_keep`, the best
`keep_best` by the monitored metric (never deleted for being old), and every
step that is a multiple of `keep_period`. With `max_to_keep=None` no step is
deleted (Keras' meaning of None) but a superseded preemption step (below), so
`keep_best` and `keep_period` only matter together with `max_to_keep`.

With `save_freq="epoch"` the newest epoch-complete step is kept as well while
a newer step holds a partial epoch (a save on preemption). Steps are named by
epoch there, so the run that resumes from the partial step must delete it
before it saves the completed epoch under the same number; a kill between the
two would otherwise leave no checkpoint at all with `max_to_keep=1`.

A step saved on a preemption notice (`PREEMPTION_METRIC`) is a resume point
only, as Keras' `BackupAndRestore` backup is: it does not count against
`max_to_keep`, is never one of the `keep_best` steps (its logs are a partial
epoch's running means, not a `save_best_only` improvement), and it survives
only while no newer step is committed (`TransientPreemptionSteps`); the
resumed fit deletes it when it ends without having saved. Steps whose
monitored value is missing or not finite (NaN, inf) are never among the best
(`BestFinite`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import orbax.checkpoint.experimental.v1 as ocp

_policies = ocp.training.preservation_policies

EPOCH_COMPLETE_METRIC = "shardckpt_epoch_complete"
"""Saved with each step's metrics (1.0 or 0.0) so policies can tell partial epochs."""

PREEMPTION_METRIC = "shardckpt_preemption"
"""Saved (1.0) with the metrics of a step saved on a preemption notice alone;
absent from every other step, and from steps written by Keras or older versions."""


def is_preemption_step(metrics: Any) -> bool:
    """Whether a step's saved metrics mark it as a preemption step (`PREEMPTION_METRIC`)."""
    return isinstance(metrics, dict) and metrics.get(PREEMPTION_METRIC) == 1.0


class LatestCompleteEpoch:
    """Orbax preservation policy: keeps the newest step that holds a whole epoch.

    Steps saved without `EPOCH_COMPLETE_METRIC` (by Keras, or before it
    existed) count as complete.
    """

    def should_preserve(self, checkpoints: Any, *, context: Any) -> list[bool]:
        del context
        keep = [False] * len(checkpoints)
        for i in range(len(checkpoints) - 1, -1, -1):
            metrics = checkpoints[i].metrics
            if not isinstance(metrics, dict) or metrics.get(EPOCH_COMPLETE_METRIC, 1.0) == 1.0:
                keep[i] = True
                break
        return keep


class BestFinite:
    """Orbax preservation policy: the `n` best steps among those with a finite `monitor` value.

    Orbax's `BestN` ranks every step that has metrics; one whose value is
    missing or NaN can only be given a rank (last), so while fewer than `n`
    steps have a value it is kept as one of the best, and with `n` steps or
    fewer it keeps them all. Here such steps are not ranked at all: only
    `LatestN` (or `keep_period`) keeps them.

    Args:
        monitor: Metric name, looked up in each step's saved metrics.
        higher_is_better: Direction of `monitor`.
        n: How many of the best to keep.
    """

    def __init__(self, *, monitor: str, higher_is_better: bool, n: int) -> None:
        self.monitor, self.n = monitor, n
        # BestN keeps the last n after sorting; descending order keeps the lowest.
        self._best = _policies.BestN(get_metric_fn=lambda metrics: float(metrics[monitor]),
                                     reverse=not higher_is_better, n=n)

    def should_preserve(self, checkpoints: Any, *, context: Any) -> list[bool]:
        ranked = [i for i, info in enumerate(checkpoints) if _finite(info.metrics, self.monitor)]
        keep = [False] * len(checkpoints)
        for i, kept in zip(ranked, self._best.should_preserve([checkpoints[i] for i in ranked], context=context)):
            keep[i] = bool(kept)
        return keep


def _finite(metrics: Any, monitor: str) -> bool:
    value = metrics.get(monitor) if isinstance(metrics, dict) else None
    # (NaN and inf are saved as the strings "nan" / "inf": metadata.json_number.)
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


class TransientPreemptionSteps:
    """Orbax preservation policy: `inner` over the regular steps; a preemption step lives while newest.

    A preemption step (`PREEMPTION_METRIC`) is kept while it is the newest
    step, whatever `inner` says, and deleted once a newer step is committed;
    `inner` never sees it, so it takes no place of `max_to_keep` or
    `keep_best`.

    Args:
        inner: The policy of the regular steps; None keeps every one.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def should_preserve(self, checkpoints: Any, *, context: Any) -> list[bool]:
        regular = [i for i, info in enumerate(checkpoints) if not is_preemption_step(info.metrics)]
        keep = [False] * len(checkpoints)
        kept = ([True] * len(regular) if self.inner is None else
                self.inner.should_preserve([checkpoints[i] for i in regular], context=context))
        for i, k in zip(regular, kept):
            keep[i] = bool(k)
        if checkpoints and is_preemption_step(checkpoints[-1].metrics):
            keep[-1] = True
        return keep


def preservation_policy(
    *,
    max_to_keep: int | None,
    keep_best: int | None,
    monitor: str,
    higher_is_better: bool,
    keep_period: int | None,
    keep_complete_epoch: bool = False,
) -> Any:
    """Returns the Orbax preservation policy of the callback's arguments.

    Args:
        max_to_keep: Keep the latest N steps; None keeps all (but preemption steps).
        keep_best: Also keep the N best steps by `monitor`.
        monitor: Metric name, looked up in the metrics saved with each step.
        higher_is_better: Direction of `monitor` (from the callback's mode).
        keep_period: Also keep every step that is a multiple of this.
        keep_complete_epoch: Also keep the newest epoch-complete step
            (`save_freq="epoch"`; see the module's docstring).

    Returns:
        A policy for `ocp.training.Checkpointer(preservation_policy=...)`:
        preemption steps are handled apart (`TransientPreemptionSteps`).

    Raises:
        ValueError: a count is not a positive integer.
    """
    for name, value in (("max_to_keep", max_to_keep), ("keep_best", keep_best), ("keep_period", keep_period)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name} must be a positive integer or None. Received: {name}={value!r}")
    if max_to_keep is None:
        return TransientPreemptionSteps(None)
    policies: list[Any] = [_policies.LatestN(max_to_keep)]
    if keep_best is not None:
        # Steps saved without the metric (e.g. mid-epoch, before validation)
        # or with NaN are not ranked: only LatestN / keep_period keep them.
        policies.append(BestFinite(monitor=monitor, higher_is_better=higher_is_better, n=keep_best))
    if keep_period is not None:
        policies.append(_policies.EveryNSteps(keep_period))
    if keep_complete_epoch:
        policies.append(LatestCompleteEpoch())
    return TransientPreemptionSteps(policies[0] if len(policies) == 1 else _policies.AnyPreservationPolicy(policies))


@dataclasses.dataclass(kw_only=True)
class Retention:
    """The callback's retention options: which of its steps survive.

    Attributes:
        max_to_keep: Keep the latest N steps; None keeps every step.
        keep_best: Also keep the N best steps by the monitored metric.
        keep_period: Also keep every step that is a multiple of this.
    """

    max_to_keep: int | None = 1
    keep_best: int | None = None
    keep_period: int | None = None

    def policy(self, *, monitor: str, higher_is_better: bool, keep_complete_epoch: bool) -> Any:
        """The Orbax preservation policy of one `fit` (see `preservation_policy`)."""
        return preservation_policy(
            max_to_keep=self.max_to_keep, keep_best=self.keep_best, monitor=monitor,
            higher_is_better=higher_is_better, keep_period=self.keep_period,
            keep_complete_epoch=keep_complete_epoch)
