"""`save_freq="auto"`: the smallest interval whose saves finish in the background.

A save falls due when the batches since the previous save reach the interval
and that save's background write is done, so a due save never waits for the
one before it (a write slower than expected postpones the save by whole
batches instead of stalling training). After each save the interval becomes
the batches that fit in the previous write's time, with a margin:
`ceil(write_s * MARGIN / batch_s)`, where `batch_s` is the training time per
batch since the previous save returned. The first save comes after the first
batch (nothing is measured before it). The interval is logged when it is
first derived and at every change.
"""

from __future__ import annotations

import dataclasses
import math
import time

MARGIN = 1.2
"""Room above the last write's time: writes of equal size vary with the
disk and with what else runs; a save that is due just as the previous one
ends would otherwise be postponed every other time."""


@dataclasses.dataclass
class AutoInterval:
    """The batches between saves, re-derived after every save.

    Attributes:
        interval: Batches between saves (1 until a write is measured).
        since_save: Batches since the last save.
    """

    interval: int = 1
    since_save: int = 0
    _since_time: float = dataclasses.field(default_factory=time.perf_counter)
    _said = False

    def due(self, add: int, *, writer_busy: bool) -> bool:
        """Counts `add` batches; True when a save is due now (the previous one done)."""
        self.since_save += add
        return self.since_save >= self.interval and not writer_busy

    def saved(self, last_write_s: float | None) -> str | None:
        """Called when a save returns (`last_write_s`: the previous save's write).

        Returns:
            A line saying the interval and why, the first time it is derived
            and whenever it changes; else None.
        """
        now = time.perf_counter()
        batches, elapsed = self.since_save, now - self._since_time
        self.since_save, self._since_time = 0, now
        if last_write_s is None or batches == 0:
            return None
        batch_s = elapsed / batches
        interval = interval_for(last_write_s, batch_s)
        if interval == self.interval and self._said:
            return None
        self.interval, self._said = interval, True
        return (f"save_freq='auto': a save every {interval} batches (the last write took {last_write_s:.3f} s, "
                f"a batch {batch_s:.3f} s, x{MARGIN} of margin).")


def interval_for(write_s: float, batch_s: float) -> int:
    """The fewest batches (at least 1) of `batch_s` each that last `write_s` with the margin."""
    return max(1, math.ceil(write_s * MARGIN / max(batch_s, 1e-9)))
