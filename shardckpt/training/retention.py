"""Which steps to keep: Orbax preservation policies built from callback arguments.

A step survives if any policy keeps it: the latest `max_to_keep`, the best
`keep_best` by the monitored metric (never deleted for being old), and every
step that is a multiple of `keep_period`. With `max_to_keep=None` nothing is
ever deleted (Keras' meaning of None), so `keep_best` and `keep_period` only
matter together with `max_to_keep`.

With `save_freq="epoch"` the newest epoch-complete step is kept as well while
a newer step holds a partial epoch (a save on preemption). Steps are named by
epoch there, so the run that resumes from the partial step must delete it
before it saves the completed epoch under the same number; a kill between the
two would otherwise leave no checkpoint at all with `max_to_keep=1`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import orbax.checkpoint.experimental.v1 as ocp

_policies = ocp.training.preservation_policies

EPOCH_COMPLETE_METRIC = "shardckpt_epoch_complete"
"""Saved with each step's metrics (1.0 or 0.0) so policies can tell partial epochs."""


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


def preservation_policy(
    *,
    max_to_keep: int | None,
    keep_best: int | None,
    monitor: str,
    higher_is_better: bool,
    keep_period: int | None,
    keep_complete_epoch: bool = False,
) -> Any:
    """Returns an Orbax preservation policy, or None to keep every step.

    Args:
        max_to_keep: Keep the latest N steps; None keeps all.
        keep_best: Also keep the N best steps by `monitor`.
        monitor: Metric name, looked up in the metrics saved with each step.
        higher_is_better: Direction of `monitor` (from the callback's mode).
        keep_period: Also keep every step that is a multiple of this.
        keep_complete_epoch: Also keep the newest epoch-complete step
            (`save_freq="epoch"`; see the module's docstring).

    Returns:
        A policy for `ocp.training.Checkpointer(preservation_policy=...)`.

    Raises:
        ValueError: a count is not a positive integer.
    """
    for name, value in (("max_to_keep", max_to_keep), ("keep_best", keep_best), ("keep_period", keep_period)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name} must be a positive integer or None. Received: {name}={value!r}")
    if max_to_keep is None:
        return None
    policies: list[Any] = [_policies.LatestN(max_to_keep)]
    if keep_best is not None:
        worst = -math.inf if higher_is_better else math.inf

        def metric(metrics: Any) -> float:
            # Steps saved without the metric (e.g. mid-epoch, before validation)
            # rank last, so only LatestN / keep_period keep them.
            value = metrics.get(monitor) if isinstance(metrics, dict) else None
            if value is None or not math.isfinite(float(value)):
                return worst
            return float(value)

        # BestN keeps the last n after sorting; descending order keeps the lowest.
        policies.append(
            _policies.BestN(
                get_metric_fn=metric,
                reverse=not higher_is_better,
                n=keep_best,
                keep_checkpoints_without_metrics=False,
            )
        )
    if keep_period is not None:
        policies.append(_policies.EveryNSteps(keep_period))
    if keep_complete_epoch:
        policies.append(LatestCompleteEpoch())
    return policies[0] if len(policies) == 1 else _policies.AnyPreservationPolicy(policies)


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
