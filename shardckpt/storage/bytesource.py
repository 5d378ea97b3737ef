"""`ByteSource`: the bytes of one stored file, wherever it lives.

Every reader of a format whose arrays are byte ranges of a file (h5,
safetensors, Hugging Face folders) reads through one of these and never asks
where the file is: `open_source` gives a `MappedFile` for a local file (a
read-only memory map) and a `storage.ranged.RemoteObject` for an object in a
bucket (ranged reads). Both offer the same calls:

- `size`, `read(start, stop)` (small metadata reads) and `open()` (a
  seekable file object, for h5py and zipfile);
- `read_into(buffer, runs)`: the bytes of ascending runs, one after another,
  into a caller's buffer (the one primitive every array read is built on);
- `array(offset, shape, dtype, box)` / `strided(...)`: a box or strided
  selection of a C-ordered array stored at `offset`, a view of the map where
  the source is `mappable`, else a fresh array holding just those bytes;
- `read_box(...)`: always a fresh array (what `Reader.read` returns).

Which bytes a box is comes from `shardckpt.storage.byteplan` (pure).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from types import EllipsisType
from typing import BinaryIO

import numpy as np

from shardckpt.dtypes import aligned_empty
from shardckpt.errors import CheckpointNotFoundError, CorruptCheckpointError
from shardckpt.storage import byteplan
from shardckpt.storage.byteplan import Box, Run

Sizer = Callable[["ByteSource"], int]
"""Learns an object's size from its own bytes (a format's header; see `RemoteObject.size`)."""


class ByteSource:
    """The bytes of one stored file (see the module docstring).

    Subclasses implement `size`, `read`, `read_into`, `open` and `close`;
    `mappable` ones also `buffer`.

    Attributes:
        url: The file as the user names it (a path, or a `gs://` / `s3://` URL).
        mappable: Whether `array` and `strided` return views (no bytes read, no memory held).
    """

    url: str
    mappable: bool = False

    @property
    def size(self) -> int:
        """Bytes of the file."""
        raise NotImplementedError

    def read(self, start: int, stop: int) -> bytes:
        """Bytes `[start, stop)`."""
        raise NotImplementedError

    def probe(self, byte_range: slice) -> bytes | int:
        """The bytes of `byte_range` (a negative start counts from the end), or the
        file's size when it is too short for them: how a `Sizer` reads a header."""
        raise NotImplementedError

    def read_into(self, buffer: np.ndarray, runs: list[Run], *, offset: int = 0) -> None:
        """Fills `buffer` (bytes, C-contiguous) with the runs `[offset + a, offset + b)`, in order.

        Args:
            buffer: At least `byteplan.total(runs)` bytes.
            runs: Ascending, disjoint byte runs.
            offset: Added to every run (an array's position in the file).
        """
        raise NotImplementedError

    def check_end(self, end: int) -> None:
        """Raises `CorruptCheckpointError` unless the file has at least `end` bytes."""
        raise NotImplementedError

    def open(self) -> BinaryIO:
        """A read-only, seekable binary file object over the bytes."""
        raise NotImplementedError

    def close(self) -> None:
        """Releases the map or file handles."""

    def drop_cache(self) -> None:
        """Frees what `open()`'s file objects cache (once a reader has read a file's metadata)."""

    def buffer(self) -> mmap.mmap | None:
        """The whole file as one read-only buffer (mappable sources), else None."""
        return None

    def read_box(
        self, offset: int, shape: tuple[int, ...], dtype: np.dtype, box: Box, out: np.ndarray | None = None
    ) -> np.ndarray:
        """`box` of the C-ordered array of `shape` and `dtype` stored at `offset`, as a new array.

        Only the box's bytes are read. `out` (the box's shape, `dtype`, C order)
        receives them instead of a new array when given.
        """
        dtype = np.dtype(dtype)
        if out is None:
            out = aligned_empty(tuple(s.stop - s.start for s in box), dtype)
        whole = self._whole(offset, shape, dtype)
        if whole is not None:
            out[...] = _region(whole, box)  # one strided numpy copy, not a loop over runs
        elif out.size:
            self.read_into(out.reshape(-1).view(np.uint8), byteplan.runs(shape, dtype.itemsize, box), offset=offset)
        return out

    def array(self, offset: int, shape: tuple[int, ...], dtype: np.dtype, box: Box) -> np.ndarray:
        """`box` of the array stored at `offset`: a view of the map where `mappable`, else a new array."""
        dtype = np.dtype(dtype)
        whole = self._whole(offset, shape, dtype)
        if whole is None:
            return self.read_box(offset, shape, dtype, box)
        return _region(whole, box)

    def strided(
        self, offset: int, dtype: np.dtype, count: int, first: int, shape: tuple[int, ...], strides: tuple[int, ...]
    ) -> np.ndarray:
        """`flat[first + i . strides]` for each index `i` of `shape`, of the flat array of
        `count` elements of `dtype` stored at `offset` (strides in elements).

        A view of the map where `mappable`; else only those elements are read,
        in stored order, into one new buffer (the result is a view of it with
        the axes in the order asked).
        """
        dtype = np.dtype(dtype)
        whole = self._whole(offset, (count,), dtype)
        if whole is not None:
            itemsize = dtype.itemsize
            # np.ndarray checks that every element lies inside the array.
            return np.ndarray(
                shape, dtype, buffer=whole, offset=first * itemsize, strides=tuple(st * itemsize for st in strides)
            )
        if 0 in shape:
            return np.empty(shape, dtype)
        plan = byteplan.strided_runs(dtype.itemsize, first, shape, strides)
        out = aligned_empty(plan.shape, dtype)
        self.read_into(out.reshape(-1).view(np.uint8), plan.runs, offset=offset)
        view = out.transpose(np.argsort(plan.order))
        return np.flip(view, plan.flips) if plan.flips else view

    def _whole(self, offset: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray | None:
        buffer = self.buffer()
        if buffer is None:
            # An empty file has no map, and only empty arrays to serve.
            return np.zeros(shape, dtype) if self.mappable else None
        if 0 in shape:
            return np.zeros(shape, dtype)
        return np.ndarray(shape, dtype, buffer=buffer, offset=offset)


def _region(array: np.ndarray, box: Box) -> np.ndarray:
    """`array[box]`, a view even of a 0-d array (the trailing `...` keeps it one)."""
    index: tuple[slice | EllipsisType, ...] = (*box, Ellipsis)
    return array[index]


class MappedFile(ByteSource):
    """A local file, read through one read-only memory map.

    Args:
        path: The file.

    Raises:
        CheckpointNotFoundError: no such file.
    """

    mappable = True

    def __init__(self, path: str) -> None:
        self.url = path
        if not os.path.isfile(path):
            raise CheckpointNotFoundError(f"No checkpoint file at {path!r}. Fix: check the path.")
        self._file = open(path, "rb")
        self._size = os.fstat(self._file.fileno()).st_size
        # An empty file cannot be mapped; it has no bytes to serve either.
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if self._size else None

    @property
    def size(self) -> int:
        return self._size

    def read(self, start: int, stop: int) -> bytes:
        return self._map[start:stop] if self._map is not None else b""

    def probe(self, byte_range: slice) -> bytes | int:
        start, stop = byte_range.start, byte_range.stop
        if start < 0:
            start, stop = self._size + start, self._size
        if start < 0 or (stop or self._size) > self._size:
            return self._size
        return self.read(start, stop or self._size)

    def read_into(self, buffer: np.ndarray, runs: list[Run], *, offset: int = 0) -> None:
        source = np.frombuffer(self._map, np.uint8) if self._map is not None else np.empty(0, np.uint8)
        pos = 0
        for a, b in runs:
            n = b - a
            buffer[pos : pos + n] = source[offset + a : offset + b]
            pos += n

    def check_end(self, end: int) -> None:
        if end > self._size:
            raise CorruptCheckpointError(
                f"{self.url!r} is shorter than its own header says: it needs {end} bytes and has "
                f"{self._size}. The file is truncated or damaged. Fix: re-download or re-save it."
            )

    def open(self) -> BinaryIO:
        return open(self.url, "rb")

    def buffer(self) -> mmap.mmap | None:
        return self._map

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
        self._file.close()
