"""Which boxes of an array to read for the shards this process holds. Pure.

Given an array's shape and the index each addressable device needs, the plan
groups devices that need the same piece (replicas read once), then chooses
reads:

- "union": when the pieces tile their bounding box (the usual case: every
  sharding of a `NamedSharding` on one host), read the box once, in slabs of
  whole rows along axis 0, and copy each slab's parts into the pieces. Every
  byte is read once, sequentially; a column-sharded kernel costs one pass over
  the file instead of one strided pass per device.
- "per piece": when the pieces are scattered (a process holding every other
  row block of a 2D-sharded array) or the caller wants each piece finished
  before the next starts (accelerators: a finished piece moves to its device
  and leaves the host), each piece is its own region.

Slabs hold at most `budget` bytes (at least one row), aligned to storage
chunks where the format has them so a compressed chunk is decoded once.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from shardckpt.formats.base import Box

__all__ = ["Box", "Copy", "Piece", "Read", "normalize", "pieces", "plan", "volume"]

# A bounding box is read whole when it is at most this much larger than the
# pieces it covers; above it, reading per piece wastes less I/O.
_UNION_SLACK = 1.25


@dataclasses.dataclass(frozen=True)
class Piece:
    """One distinct piece of the array and the devices that hold a copy."""

    box: Box
    devices: tuple[Any, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(s.stop - s.start for s in self.box)


@dataclasses.dataclass(frozen=True)
class Copy:
    """Copy `src` of a read's data into `dst` of piece number `piece`."""

    piece: int
    dst: Box
    src: Box


@dataclasses.dataclass(frozen=True)
class Read:
    """Read `box` of the array, then make `copies` out of it."""

    box: Box
    copies: tuple[Copy, ...]


def normalize(index: Sequence[slice], shape: tuple[int, ...]) -> Box:
    """Turns a device index (slices with None bounds) into explicit bounds."""
    out = []
    for s, n in zip(index, shape, strict=True):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"Strided shard index {s} is not supported.")
        out.append(slice(start, stop))
    return tuple(out)


def pieces(index_map: Mapping[Any, Sequence[slice] | None], shape: tuple[int, ...]) -> list[Piece]:
    """Groups devices by the piece they hold, in first-seen order (None: the whole array)."""
    grouped: dict[tuple[tuple[int, int], ...], list[Any]] = {}
    for device, index in index_map.items():
        box = normalize(index, shape) if index is not None else tuple(slice(0, n) for n in shape)
        grouped.setdefault(tuple((s.start, s.stop) for s in box), []).append(device)
    return [
        Piece(tuple(slice(a, b) for a, b in key), tuple(devs)) for key, devs in grouped.items()
    ]


def volume(box: Box) -> int:
    """Number of elements in `box`."""
    return math.prod(s.stop - s.start for s in box)


def _bounding(boxes: Sequence[Box]) -> Box:
    return tuple(
        slice(min(b[d].start for b in boxes), max(b[d].stop for b in boxes))
        for d in range(len(boxes[0]))
    )


def _intersect(a: Box, b: Box) -> Box | None:
    out = tuple(slice(max(x.start, y.start), min(x.stop, y.stop)) for x, y in zip(a, b))
    return None if any(s.start >= s.stop for s in out) else out


def _shift(box: Box, origin: Box) -> Box:
    return tuple(slice(s.start - o.start, s.stop - o.start) for s, o in zip(box, origin))


def _slabs(region: Box, itemsize: int, budget: int, chunk_rows: int | None) -> list[Box]:
    if not region:
        return [region]
    rows = region[0]
    row_bytes = max(1, volume(region[1:]) * itemsize)
    step = max(1, budget // row_bytes)
    if chunk_rows:
        step = max(chunk_rows, step - step % chunk_rows)
    out = []
    start = rows.start
    while start < rows.stop:
        stop = start + step
        if chunk_rows:  # end on a chunk boundary so no chunk is decoded twice
            stop = max(start + 1, stop - stop % chunk_rows)
        stop = min(stop, rows.stop)
        out.append((slice(start, stop),) + tuple(region[1:]))
        start = stop
    return out


def plan(
    itemsize: int,
    parts: Sequence[Piece],
    *,
    budget: int,
    chunk_rows: int | None = None,
    per_piece: bool = False,
) -> list[Read]:
    """Plans the reads that fill every piece.

    Args:
        itemsize: Bytes per element as stored.
        parts: The distinct pieces (see `pieces`).
        budget: Most bytes one read may return (at least one row is read).
        chunk_rows: Storage chunk height along axis 0, if reads should align.
        per_piece: Plan each piece on its own even when they tile a box.

    Returns:
        Reads in order; every element of every piece is written exactly once.
    """
    boxes = [p.box for p in parts]
    union = _bounding(boxes)
    tiled = volume(union) <= _UNION_SLACK * sum(volume(b) for b in boxes)
    regions = [union] if tiled and not per_piece else boxes
    reads = []
    for region in regions:
        for slab in _slabs(region, itemsize, budget, chunk_rows):
            copies = []
            for i, box in enumerate(boxes):
                common = _intersect(slab, box) if slab else ()
                if common is not None:
                    copies.append(Copy(i, _shift(common, box), _shift(common, slab)))
            if copies:
                reads.append(Read(slab, tuple(copies)))
    return reads
