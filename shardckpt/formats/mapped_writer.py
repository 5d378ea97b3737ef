"""Writable memory maps of files whose layout is fixed: each array at its offset.

The writers (`safetensors_writer`, `h5_writer`) create files with every
array's bytes at a known offset (`TensorSlot`). `MappedFiles.put` writes a
piece at its elements: runs of contiguous destination bytes with `pwrite`
(no page fault per page, as writing through a map costs), short runs (a
piece of a transposed kernel whose rows are split between devices)
through a shared writable map of the file. Written pages belong to the
page cache (file-backed, not the process's anonymous memory). Several processes may map one file on a
shared disk and write disjoint pieces; each flushes (`msync`) and `fsync`s
its own writes before the commit. Whole blocks written with `MappedFiles.pwrite`
are synced and dropped from the page cache every `WRITEBACK_BYTES`.
"""

from __future__ import annotations

import math
import mmap
import os
import threading
from collections.abc import Mapping

import numpy as np

from shardckpt import storage
from shardckpt.formats.base import copy_into
from shardckpt.formats.safetensors_writer import TensorSlot

MIN_RUN_BYTES = 4096
"""Runs of at least a page are written with `pwrite`; shorter ones through the map."""

WRITEBACK_BYTES = 64 * 1024 * 1024
"""After this many bytes `pwrite` into a file, they are synced and dropped from the page cache."""


def _pwrite_all(fd: int, data: memoryview, position: int) -> None:
    """Writes all of `data` at `position`: `pwrite` may write less than asked (over 2 GiB, a
    signal, the file size limit), and the rest is written (or its error raised) by another call."""
    while len(data):
        n = os.pwrite(fd, data, position)
        data, position = data[n:], position + n


class MappedFiles:
    """Shared, writable maps of the files holding `slots`.

    Args:
        folder: The folder the slots' file names are relative to.
        slots: `{key: TensorSlot}`.
    """

    def __init__(self, folder: str, slots: Mapping[str, TensorSlot]) -> None:
        self._slots = dict(slots)
        self._maps: dict[str, tuple[int, mmap.mmap]] = {}
        self._folder = folder
        self._lock = threading.Lock()  # `pwrite` runs in a writer thread too
        self._unsynced: dict[int, int] = {}

    def _map(self, name: str) -> mmap.mmap:
        with self._lock:
            return self._open(name)

    def _open(self, name: str) -> mmap.mmap:
        entry = self._maps.get(name)
        if entry is None:
            fd = os.open(os.path.join(self._folder, name), os.O_RDWR)
            try:
                entry = (fd, mmap.mmap(fd, 0, access=mmap.ACCESS_WRITE))
            except BaseException:
                os.close(fd)
                raise
            self._maps[name] = entry
        return entry[1]

    def array(self, key: str) -> np.ndarray:
        """`key`'s bytes in its file, as a writable C-order array of its spec."""
        slot = self._slots[key]
        count = math.prod(slot.spec.shape)
        return np.ndarray(slot.spec.shape, slot.spec.dtype, buffer=self._map(slot.file), offset=slot.offset,
                          order="C") if count else np.empty(slot.spec.shape, slot.spec.dtype)

    def put(self, key: str, first: int, strides: tuple[int, ...], value: np.ndarray) -> None:
        """Writes `value` at elements `first + i . strides` of `key` (in elements, C order).

        The destination's axes are ordered by stride; the longest run of
        contiguous elements (the innermost axes that tile memory) is written
        with one `pwrite` per run, from a copy of `value` in that order and
        the stored dtype (no page faults on a mapping). Runs shorter than
        `MIN_RUN_BYTES` go through the writable map instead, where one
        system call per run would cost more than the page faults.
        """
        slot = self._slots[key]
        dtype = slot.spec.dtype
        item = dtype.itemsize
        shape = value.shape
        order = sorted(range(len(shape)), key=lambda a: -strides[a]) if shape else []
        run, expect = 1, 1
        contiguous_axes = 0
        for a in reversed(order):  # innermost first
            if shape[a] == 1:
                contiguous_axes += 1
                continue
            if strides[a] != expect:
                break
            run *= shape[a]
            expect *= shape[a]
            contiguous_axes += 1
        if run * item < MIN_RUN_BYTES:
            base = self.array(key).reshape(-1)
            target = np.lib.stride_tricks.as_strided(
                base[first:], shape=shape, strides=tuple(s * item for s in strides), writeable=True
            )
            target[...] = value
            return
        source = value.transpose(order) if shape else value
        if source.flags.c_contiguous and source.dtype == dtype:
            data = source
        else:  # a transposed piece: copied in cache-sized tiles (and cast on the way)
            data = np.empty(source.shape, dtype)
            copy_into(data, source)
        flat = data.reshape(-1).view(np.uint8).data
        outer = order[: len(order) - contiguous_axes]
        fd = self._fd(slot.file)
        run_bytes = run * item
        for n, index in enumerate(np.ndindex(*[shape[a] for a in outer])):
            element = first + sum(i * strides[a] for i, a in zip(index, outer, strict=True))
            _pwrite_all(fd, flat[n * run_bytes : (n + 1) * run_bytes], slot.offset + element * item)

    def dtype(self, key: str) -> np.dtype:
        """The stored dtype of `key`."""
        return self._slots[key].spec.dtype

    def pwrite(self, key: str, first: int, data: memoryview) -> None:
        """Writes `data` (bytes in the stored dtype) from element `first` of `key` on."""
        slot = self._slots[key]
        fd, position = self._fd(slot.file), slot.offset + first * slot.spec.dtype.itemsize
        _pwrite_all(fd, data, position)
        self._unsynced[fd] = self._unsynced.get(fd, 0) + len(data)
        if self._unsynced[fd] >= WRITEBACK_BYTES:
            # Written back and dropped as it goes (see `sync_and_drop`); the
            # final fsync then has little left to do.
            storage.sync_and_drop(fd)
            self._unsynced[fd] = 0

    def _fd(self, name: str) -> int:
        self._map(name)
        return self._maps[name][0]

    def flush(self) -> None:
        """Writes every dirty page back and syncs the files (before a commit)."""
        for fd, mapped in self._maps.values():
            mapped.flush()  # pieces written through the map
            os.fsync(fd)  # and those written with pwrite

    def close(self) -> None:
        for fd, mapped in self._maps.values():
            mapped.close()
            os.close(fd)
        self._maps.clear()
