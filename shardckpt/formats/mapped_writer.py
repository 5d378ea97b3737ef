"""Writable memory maps of files whose layout is fixed: each array at its offset.

The writers (`safetensors_writer`, `h5_writer`) create files with every
array's bytes at a known offset (`TensorSlot`). `MappedFiles` maps them
shared and writable, and `array(key)` is the array's region as a numpy
array: a piece of a variable is written by assigning to a (possibly
strided) view of it, so a transposed piece lands in its rows without a
transposed copy, a cast happens element by element in numpy's small
buffers, and the written pages belong to the page cache (file-backed, not
the process's anonymous memory). Several processes may map one file on a
shared disk and write disjoint pieces; each flushes (`msync`) and `fsync`s
its own writes before the commit.
"""

from __future__ import annotations

import math
import mmap
import os
from collections.abc import Mapping

import numpy as np

from shardckpt.formats.safetensors_writer import TensorSlot


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

    def _map(self, name: str) -> mmap.mmap:
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

    def flush(self) -> None:
        """Writes every dirty page back and syncs the files (before a commit)."""
        for fd, mapped in self._maps.values():
            mapped.flush()
            os.fsync(fd)

    def close(self) -> None:
        for fd, mapped in self._maps.values():
            mapped.close()
            os.close(fd)
        self._maps.clear()
