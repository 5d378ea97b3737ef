"""What the saves of `OrbaxCheckpoint` cost, one entry per save, over every `fit`."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(kw_only=True)
class SaveTimes:
    """Seconds per save (the callback's `save_blocking_s`, `save_waits_s`, `save_writes_s`).

    Attributes:
        blocking: Training blocked by each save (wait, snapshot, hand-over).
        waits: Each wait for the save in flight (appended by `saving.StepWriter`).
        writes: Each write, snapshot handed over to step committed (`saving.StepWriter`).
    """

    blocking: list[float] = dataclasses.field(default_factory=list)
    waits: list[float] = dataclasses.field(default_factory=list)
    writes: list[float] = dataclasses.field(default_factory=list)
