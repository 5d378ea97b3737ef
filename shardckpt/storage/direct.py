"""Writing whole files past the page cache (`O_DIRECT`), each made durable before it is closed.

A buffered write copies every byte into the page cache and leaves the kernel
to write it back; on some machines that copy, the allocation of fresh cache
pages and the dirty-page throttling are what bound a large write, not the
disk (figures: CHANGELOG). `O_DIRECT` moves the bytes from the caller's
buffer to the device, so the file is written at the disk's speed, with no
page cache taken and none left dirty behind.

`O_DIRECT` wants the buffer's address, the file offset and the length
aligned to the device's block: the bytes go through a page-aligned buffer
(a ring of `DirectWriter`'s, one per file being written, reused by later files), in whole blocks; the
last partial block is written after `O_DIRECT` is cleared on the descriptor.
A file system that refuses `O_DIRECT` (tmpfs, some network file systems)
gets ordinary buffered writes of the same bytes instead: the file is the
same, only the path differs (a DEBUG line says so, once per process).
"""

from __future__ import annotations

import concurrent.futures
import errno
import fcntl
import logging
import mmap
import os
import threading
from collections.abc import Iterable

_log = logging.getLogger("shardckpt")

ALIGN = 4096
"""The alignment of `O_DIRECT` transfers used: a page, a multiple of every common block size."""
RING_BYTES = 16 * 1024 * 1024
"""The aligned buffer's size (a multiple of `2 * ALIGN`): each `write` call moves half of it."""

_told_buffered = False
_O_DIRECT = getattr(os, "O_DIRECT", 0)


STREAMS = 2
"""Files a `DirectWriter` is meant to write at once (`streams`), each through an aligned buffer of its own."""


class DirectWriter:
    """Writes files through page-aligned buffers, with `O_DIRECT` where the file system takes it.

    Several threads may call `write` at once (up to `streams` is what its
    users plan for): each call takes an aligned buffer of its own, reused by
    later calls.

    Args:
        ring_bytes: Each aligned buffer's size (a multiple of `2 * ALIGN`):
            two halves, one filled while the other is written.
        streams: The number of files its users write at once. One file goes
            to disk at the speed its one thread gets the CPU to copy it;
            several keep the disk busy beside a busy CPU (figures: CHANGELOG).

    Attributes:
        direct_files: Files written with `O_DIRECT`; `buffered_files`: files
            written through the page cache (the file system refused it).
    """

    def __init__(self, ring_bytes: int = RING_BYTES, streams: int = STREAMS) -> None:
        if ring_bytes <= 0 or ring_bytes % (2 * ALIGN):
            raise ValueError(f"ring_bytes must be a positive multiple of {2 * ALIGN}. Received: "
                             f"ring_bytes={ring_bytes}")
        if streams < 1:
            raise ValueError(f"streams must be at least 1. Received: streams={streams}")
        self._rings: list[mmap.mmap] = []  # free page-aligned anonymous maps, allocated as calls need them
        self._lock = threading.Lock()
        self.ring_bytes = ring_bytes
        self.streams = streams
        self.direct_files = 0
        self.buffered_files = 0

    def write(self, path: str, pieces: Iterable[bytes | memoryview]) -> int:
        """Writes `pieces`, in order, as the new file `path`; fsyncs it. Returns its size.

        Raises:
            FileExistsError: `path` exists (files are written once).
            OSError: the write or the fsync failed (the partial file is removed).
        """
        with self._lock:
            ring = self._rings.pop() if self._rings else None
        if ring is None:
            ring = mmap.mmap(-1, self.ring_bytes)
        try:
            fd, direct = _open_new(path)
            try:
                size = self._write_all(fd, pieces, direct, ring)
                os.fsync(fd)
            except BaseException:
                os.close(fd)
                os.remove(path)
                raise
            os.close(fd)
        finally:
            with self._lock:
                self._rings.append(ring)
        with self._lock:
            if direct:
                self.direct_files += 1
            else:
                self.buffered_files += 1
        return size

    def _write_all(self, fd: int, pieces: Iterable[bytes | memoryview], direct: bool, buffer: mmap.mmap) -> int:
        """Copies `pieces` into one half of `buffer` while the other half is written (a thread:
        `os.write` lets go of the GIL), so the copies and the device's transfers overlap."""
        ring = memoryview(buffer)
        half = self.ring_bytes // 2
        halves = [ring[:half], ring[half:]]
        current, filled, total = 0, 0, 0
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="shardckpt-direct") as pool:
            pending: concurrent.futures.Future | None = None
            try:
                for piece in pieces:
                    view = memoryview(piece).cast("B")
                    while view.nbytes:
                        take = min(view.nbytes, half - filled)
                        halves[current][filled : filled + take] = view[:take]
                        filled += take
                        view = view[take:]
                        if filled == half:
                            if pending is not None:
                                pending.result()  # the other half is free again
                            pending = pool.submit(_write_fully, fd, halves[current])
                            total += filled
                            current, filled = 1 - current, 0
                if pending is not None:
                    pending.result()
                    pending = None
                whole = filled - filled % ALIGN
                if whole:
                    _write_fully(fd, halves[current][:whole])
                if filled > whole:
                    if direct:  # the tail is not a whole block: written through the page cache
                        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_DIRECT)
                    _write_fully(fd, halves[current][whole:filled])
                return total + filled
            finally:
                if pending is not None:
                    concurrent.futures.wait([pending])  # never leave a write running from a buffer
                for view in (*halves, ring):
                    view.release()


def _open_new(path: str) -> tuple[int, bool]:
    """Creates `path` for writing: `O_DIRECT` if the file system takes it. Returns (fd, direct).

    The flag is set after the file is created (`fcntl`): an `open` refused for
    `O_DIRECT` may have created the file already on some kernels.
    """
    global _told_buffered
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    if not _O_DIRECT:
        return fd, False
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | _O_DIRECT)
    except OSError as e:
        if e.errno != errno.EINVAL:  # EINVAL: this file system does not do O_DIRECT
            os.close(fd)
            os.remove(path)
            raise
        if not _told_buffered:
            _told_buffered = True
            _log.debug("%s: the file system refuses O_DIRECT (%s); writing through the page cache "
                       "(the same bytes; said once).", os.path.dirname(path), e)
        return fd, False
    return fd, True


def _write_fully(fd: int, view: memoryview) -> None:
    while view.nbytes:
        written = os.write(fd, view)
        view = view[written:]
