"""Peak anonymous memory sampling shared by the benchmarks in tools/.

Counts `RssAnon` from /proc/self/status: pages of memory-mapped checkpoint
files are reclaimable page cache and would inflate plain RSS.
"""

from __future__ import annotations

import threading
import time


def rss_anon() -> int:
    """Anonymous resident bytes of this process (0 where /proc is missing)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class PeakSampler:
    """Samples `rss_anon()` every `interval` seconds in a thread; `.peak` is the max."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.peak = rss_anon()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_anon())
            time.sleep(self.interval)

    def __enter__(self) -> "PeakSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_anon())


def warm_memory(nbytes: int) -> None:
    """Touches and frees `nbytes` of anonymous memory.

    Some VMs (this project's Firecracker sandboxes) back guest memory lazily
    and take freed pages back within seconds; a page touched for the first
    time since then costs a host fault. Touching 1.6 GB took 0.2-0.3 s
    right after another process freed memory and 2.8 s a few seconds later,
    so a timed load's result depended on how long the process had been idle.
    Calling this just before each timed section gives every loader the same
    (warm) memory, as on a machine whose memory is backed for good.
    """
    import numpy as np

    block = np.ones(nbytes, np.uint8)  # np.ones writes every page
    del block
