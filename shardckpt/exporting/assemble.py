"""Stored ranges this process writes whole: pieces copied into a reused buffer, one `pwrite` per block.

A variable's remap sends each of its parts (`leaves`: a `Concat` splits the
variable along its joined axis) to one stored tensor. Where a part's
elements fill one contiguous byte range of the file (a transposed or
reshaped kernel, a keras-hub h5 dataset: `contiguous`) and this process
writes every piece of it (one process, or a variable replicated over the
processes' devices), the range is written in blocks along its outermost
stored axis: each block's elements are copied from the pieces that hold
them into a buffer in the stored layout and dtype (transposed in
cache-sized tiles, cast on the way), then written with one `pwrite`.

Writing piece by piece instead costs one system call (or one page fault)
per stored row of each piece: a kernel split over 8 devices whose stored
rows cross the split writes 1/8 of a row at a time. The buffer is
allocated once per export and reused (fresh pages cost a fault each), and
two of them alternate so that one block is copied while the previous one
is written (`Writer`: `pwrite` and numpy's copies release the GIL).
"""

from __future__ import annotations

import concurrent.futures
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from shardckpt.formats.base import copy_into
from shardckpt.formats.hf_remap import Box, Cast, Concat, Strided, Tensor

BLOCK_BYTES = 8 * 1024 * 1024
"""Bytes of one block (each of the two buffers); fewer when the budget is smaller."""

Leaf = tuple[Box, tuple[int, ...], str, int, tuple[int, ...]]
"""`(region, shift, key, first, strides)`: the variable's `region` (its own
coordinates) is stored in tensor `key` at elements `first + (x - shift) . strides`."""


def leaves(remap: Tensor, shape: tuple[int, ...], c_strides: Callable[[tuple[int, ...]], tuple[int, ...]]) -> list[Leaf]:
    """The parts of a variable of `shape` and where each is stored."""
    out: list[Leaf] = []

    def walk(t: Tensor, region: Box, shift: tuple[int, ...]) -> None:
        if isinstance(t, Cast):
            walk(t.child, region, shift)
        elif isinstance(t, Concat):
            for start, stop, part in t._spans():
                sub = region[: t.axis] + (slice(shift[t.axis] + start, shift[t.axis] + stop),) + region[t.axis + 1 :]
                walk(part, sub, shift[: t.axis] + (shift[t.axis] + start,) + shift[t.axis + 1 :])
        elif isinstance(t, Strided):
            out.append((region, shift, t.key, t.offset, t.strides))
        else:  # Identity: the stored tensor is the variable (C order)
            out.append((region, shift, t.sources()[0], 0, c_strides(tuple(t.shape))))

    walk(remap, tuple(slice(0, d) for d in shape), (0,) * len(shape))
    return out


def contiguous(shape: tuple[int, ...], strides: tuple[int, ...]) -> list[int] | None:
    """The axes from outermost to innermost stored, when the elements fill one range; else None."""
    order = sorted((a for a in range(len(shape)) if shape[a] > 1), key=lambda a: -strides[a])
    expect = 1
    for a in reversed(order):
        if strides[a] != expect:
            return None
        expect *= shape[a]
    return order


def _intersect(a: Box, b: Box) -> Box | None:
    out = tuple(slice(max(x.start, y.start), min(x.stop, y.stop)) for x, y in zip(a, b, strict=True))
    return out if all(s.start < s.stop for s in out) else None


def _rel(box: Box, origin: Box) -> tuple[slice, ...]:
    return tuple(slice(b.start - o.start, b.stop - o.start) for b, o in zip(box, origin, strict=True))


def owns_all(region: Box, pieces: list[tuple[Box, Any]]) -> bool:
    """Whether `pieces` (distinct, disjoint boxes) cover `region`."""
    covered = 0
    for box, _ in pieces:
        inter = _intersect(box, region)
        if inter is not None:
            covered += math.prod(s.stop - s.start for s in inter)
    return covered == math.prod(s.stop - s.start for s in region)


class Writer:
    """Two reused block buffers; a block is written by a worker thread while the next is copied.

    Args:
        block_bytes: Bytes of each buffer.
        pwrite: `(key, first element, bytes)`, writing a stored tensor's elements.
    """

    def __init__(self, block_bytes: int, pwrite: Callable[[str, int, memoryview], None]) -> None:
        self.block_bytes = block_bytes
        self._pwrite = pwrite
        self._buffers: list[np.ndarray] = []
        self._pending: list[concurrent.futures.Future[None] | None] = [None, None]
        self._next = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="shardckpt-export")

    def _buffer(self) -> tuple[int, np.ndarray]:
        i = self._next
        self._next = 1 - i
        pending = self._pending[i]
        if pending is not None:
            pending.result()  # its previous block is written: the buffer is free
            self._pending[i] = None
        while len(self._buffers) <= i:
            self._buffers.append(np.empty(self.block_bytes, np.uint8))
        return i, self._buffers[i]

    def write(self, leaf: Leaf, order: list[int], dtype: np.dtype, pieces: list[tuple[Box, Any]],
              host: Callable[[Any, tuple[slice, ...]], np.ndarray]) -> int:
        """Writes the leaf's range from `pieces`; returns the elements written.

        Returns 0 (nothing written) when one step of the outermost axis is larger than a buffer.
        """
        region, shift, key, first, strides = leaf
        outer = order[0] if order else 0
        shape = tuple(s.stop - s.start for s in region)
        step = math.prod(shape) // max(1, shape[outer]) * dtype.itemsize if shape else dtype.itemsize
        if step > self.block_bytes:
            return 0
        rows = self.block_bytes // step
        start = first + sum((r.start - s) * st for r, s, st in zip(region, shift, strides, strict=True))
        perm = order + [a for a in range(len(shape)) if a not in order]
        for lo, hi in _blocks(shape[outer] if shape else 1, rows):
            block = region[:outer] + (slice(region[outer].start + lo, region[outer].start + hi),) + region[outer + 1:]
            bshape = tuple(s.stop - s.start for s in block)
            i, buffer = self._buffer()
            count = math.prod(bshape)
            stored = buffer[: count * dtype.itemsize].view(dtype).reshape(tuple(bshape[a] for a in perm))
            for box, data in pieces:
                inter = _intersect(box, block)
                if inter is not None:
                    dst = stored[tuple(_rel(inter, block)[a] for a in perm)]
                    copy_into(dst, host(data, _rel(inter, box)).transpose(perm))
            offset = start + lo * (strides[outer] if shape else 0)
            view = buffer[: count * dtype.itemsize].data
            self._pending[i] = self._pool.submit(self._pwrite, key, offset, view)
        return math.prod(shape)

    def close(self) -> None:
        """Waits for the blocks in flight (raising their errors) and frees the buffers."""
        try:
            for pending in self._pending:
                if pending is not None:
                    pending.result()
        finally:
            self._pending = [None, None]
            self._pool.shutdown(wait=True)
            self._buffers.clear()


def _blocks(n: int, rows: int) -> Iterator[tuple[int, int]]:
    for lo in range(0, n, rows):
        yield lo, min(n, lo + rows)
