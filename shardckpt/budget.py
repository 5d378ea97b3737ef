"""Host-memory budgets shared by restore, convert and verify.

`max_inflight_bytes` is the one knob of every streaming path: the most bytes
of array data a call holds in host memory at once beyond its result. Its
default, and the decoded-chunk cache that compressed formats get from it,
live here so the library, the CLI and the benchmarks agree.

The default scales with the host (`default_max_inflight_bytes`): on
compressed checkpoints the budget sets how many chunks decode at once, so a
fixed 256 MiB left most cores of a large host idle (README, Benchmarks).
"""

from __future__ import annotations

import contextlib
import operator
import os
import threading
from collections.abc import Iterator

MIB = 1024 * 1024
GIB = 1024 * MIB

PER_CORE_BYTES = 64 * MIB
"""Budget per usable core: room for one 64 MiB chunk decoding on each (Keras'
Orbax checkpoints store each shard as one chunk, 64 MiB in the benchmarks)."""

MIN_INFLIGHT_BYTES = 256 * MIB
"""Floor of the default: two cores need no more to keep their decoding busy."""

MAX_INFLIGHT_BYTES = 4 * GIB
"""Cap of the default: beyond 4 GiB an H100 host's 16 cores gained nothing."""

MEMORY_FRACTION = 32
"""The default never exceeds 1/32 of the host's (or cgroup's) memory."""

ACCELERATOR_BYTES = 4 * GIB
"""Budget per local accelerator: room for the transfer ring (half of it) and the
decoding behind it, which the per-core rule leaves starved on a 16-core host
(figures: CHANGELOG). Still bounded by 1/`MEMORY_FRACTION` of memory."""

CHUNK_CACHE_BYTES = 32 * 1024 * 1024
"""Largest decoded-chunk cache of a compressed format's reader (Orbax)."""

_CGROUP_MEMORY_MAX = "/sys/fs/cgroup/memory.max"  # cgroup v2
_CGROUP_V1_LIMIT = "/sys/fs/cgroup/memory/memory.limit_in_bytes"


def inflight_bytes_for(cores: int, memory_bytes: int) -> int:
    """The default budget of a host with `cores` usable cores and `memory_bytes` of memory.

    Rule: `clamp(64 MiB x cores, 256 MiB, min(4 GiB, memory / 32))`, i.e.
    64 MiB per core, at least 256 MiB, at most 4 GiB and at most 1/32 of
    memory; the 256 MiB floor wins over the memory bound (a host with less
    than 8 GiB still gets 256 MiB). Examples:
    2 cores / 24 GB -> 256 MiB; 16 cores / 128 GB -> 1 GiB; 64 cores /
    512 GB -> 4 GiB; 64 cores / 16 GiB -> 512 MiB.

    Args:
        cores: Cores this process may run on (at least 1 is assumed).
        memory_bytes: Memory available to this process (physical memory,
            or the cgroup limit when lower).

    Returns:
        Bytes, a multiple of 1 MiB.
    """
    wanted = PER_CORE_BYTES * max(1, cores)
    ceiling = min(MAX_INFLIGHT_BYTES, max(0, memory_bytes) // MEMORY_FRACTION)
    budget = max(MIN_INFLIGHT_BYTES, min(wanted, ceiling))
    return budget // MIB * MIB


def inflight_bytes_for_accelerators(cores: int, memory_bytes: int, accelerators: int) -> int:
    """The default budget of a host feeding `accelerators` local devices (GPUs, TPUs).

    Rule: `max(inflight_bytes_for(cores, memory), min(4 GiB x accelerators,
    memory / 32))`: the core rule, raised to 4 GiB per accelerator as far as
    the memory rule allows (the 4 GiB cap of the core rule is about cores
    decoding, not about feeding devices). Examples: 16 cores / 125 GB / 1
    GPU -> 3.6 GiB (memory / 32) instead of 1 GiB; 96 cores / 2 TB / 8 GPUs
    -> 32 GiB; no accelerator -> `inflight_bytes_for`.

    Returns:
        Bytes, a multiple of 1 MiB.
    """
    base = inflight_bytes_for(cores, memory_bytes)
    if accelerators < 1:
        return base
    feed = min(ACCELERATOR_BYTES * accelerators, max(0, memory_bytes) // MEMORY_FRACTION)
    return max(base, feed) // MIB * MIB


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, else `os.cpu_count()`)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def host_memory_bytes() -> int:
    """Physical memory, or the cgroup's memory limit when lower (containers)."""
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # sysconf names missing (not POSIX)
        memory = 0
    limit = _cgroup_limit()
    if limit and (not memory or limit < memory):
        return limit
    return memory


def _cgroup_limit() -> int | None:
    for path in (_CGROUP_MEMORY_MAX, _CGROUP_V1_LIMIT):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():  # "max" (v2) means no limit
            return int(text)
    return None


def default_max_inflight_bytes(accelerators: int = 0) -> int:
    """The default `max_inflight_bytes` of this host: `inflight_bytes_for` its cores and memory,
    or `inflight_bytes_for_accelerators` when a load feeds `accelerators` local devices.

    What `load_sharded`, `convert`, `verify` and `--max-inflight-mb` use when
    no budget is given.
    """
    return inflight_bytes_for_accelerators(usable_cores(), host_memory_bytes(), accelerators)


def describe_default(accelerators: int = 0) -> str:
    """How this host's default was chosen, for reports: "16 cores, 125.0 GB, 1 accelerator"."""
    text = f"host default: {usable_cores()} cores, {host_memory_bytes() / 1e9:.1f} GB"
    if accelerators:
        text += f", {accelerators} accelerator{'s' if accelerators > 1 else ''}"
    return text


def resolve(max_inflight_bytes: int | None, *, accelerators: int = 0) -> int:
    """`max_inflight_bytes`, or the host's default for None: the one check of every entry point.

    Args:
        max_inflight_bytes: Given by the caller, or None.
        accelerators: Local accelerator devices the call feeds (restore), for the default.

    Raises:
        ValueError: not a positive number of bytes.
    """
    if max_inflight_bytes is None:
        return default_max_inflight_bytes(accelerators)
    try:
        value = operator.index(max_inflight_bytes)  # ints, numpy ints
    except TypeError:
        value = 0
    if isinstance(max_inflight_bytes, bool) or value < 1:
        raise ValueError(
            "max_inflight_bytes must be a positive number of bytes (None: the host's default). "
            f"Received: max_inflight_bytes={max_inflight_bytes!r}"
        )
    return value


def chunk_cache_bytes(max_inflight_bytes: int) -> int:
    """Size of the decoded-chunk cache of compressed formats (Orbax).

    Restore asks for every piece of a variable in one batch, which decodes a
    chunk shared by the pieces once for all of them, so the cache need not
    hold big chunks until every piece is read. It must hold the small things
    every read goes through (zarr shard indexes, OCDBT nodes): without any
    cache, reads of small chunks were about a third slower. A larger cache
    keeps consumed chunks alive, memory beyond the budget (see CHANGELOG for
    the figures that set 32 MiB). The cap holds whatever the budget: a host
    whose default budget is 1-4 GiB still gets 32 MiB, since what the cache
    must hold does not grow with the number of chunks decoding at once.
    """
    return min(max_inflight_bytes, CHUNK_CACHE_BYTES)


class Budget:
    """Caps bytes of host memory held at once across worker threads."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._cond = threading.Condition()

    def acquire(self, n: int) -> int:
        """Waits for room, holds `n` bytes (at most the limit) and returns what it holds."""
        n = min(n, self.limit)  # one variable needing more than the cap runs alone
        with self._cond:
            self._cond.wait_for(lambda: self.used + n <= self.limit)
            self.used += n
        return n

    def try_acquire(self, n: int) -> int | None:
        """Like `acquire`, but returns None at once when there is no room."""
        n = min(n, self.limit)
        with self._cond:
            if self.used + n > self.limit:
                return None
            self.used += n
        return n

    def release(self, n: int) -> None:
        with self._cond:
            self.used -= n
            self._cond.notify_all()

    @contextlib.contextmanager
    def holding(self, n: int) -> Iterator[None]:
        """Holds `n` bytes (at most the limit) for the body."""
        held = self.acquire(n)
        try:
            yield
        finally:
            self.release(held)
