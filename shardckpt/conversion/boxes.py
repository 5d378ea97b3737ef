"""Which boxes convert and verify stream an array in: C order, bounded, on whole chunks. Pure.

A checksum continues piece by piece only over the array's bytes in C order,
so every array is cut into blocks along one axis (`c_order_boxes`); convert
also aligns the blocks to the outer chunks it writes (`write_boxes`), so no
stored chunk is written twice.
"""

from __future__ import annotations

import math

import numpy as np

from shardckpt.formats.base import Box


def c_order_boxes(shape: tuple[int, ...], itemsize: int, max_bytes: int, *, rows: int | None = None) -> list[Box]:
    """Splits an array into boxes of at most `max_bytes`, in C order.

    The boxes are blocks along one axis `k` (single indices on the axes
    before it, whole extents after it), listed in lexicographic order, so
    their bytes concatenated are the array's C-order bytes. `k` is the first
    axis whose trailing block (`shape[k+1:]`) fits `max_bytes`.

    Args:
        shape: The array's shape.
        itemsize: Bytes per element.
        max_bytes: Most bytes in one box (at least one element is taken).
        rows: Block length along axis `k`, when the caller needs blocks
            aligned to its chunks; by default as many as fit.

    Returns:
        The boxes; `[()]` for a scalar.
    """
    if not shape:
        return [()]
    if 0 in shape:
        return [tuple(slice(0, n) for n in shape)]
    k = split_axis(shape, itemsize, max_bytes)
    trailing = math.prod(shape[k + 1 :]) * itemsize
    step = rows or max(1, max_bytes // trailing)
    boxes: list[Box] = []
    for lead in np.ndindex(*shape[:k]):
        head = tuple(slice(i, i + 1) for i in lead)
        tail = tuple(slice(0, n) for n in shape[k + 1 :])
        for start in range(0, shape[k], step):
            boxes.append(head + (slice(start, min(start + step, shape[k])),) + tail)
    return boxes


def split_axis(shape: tuple[int, ...], itemsize: int, max_bytes: int) -> int:
    """The axis `c_order_boxes` splits along (see there)."""
    for k in range(len(shape)):
        if math.prod(shape[k + 1 :]) * itemsize <= max_bytes:
            return k
    return len(shape) - 1


def write_boxes(
    shape: tuple[int, ...], itemsize: int, shard: tuple[int, ...], piece_bytes: int
) -> tuple[tuple[int, ...], list[Box]]:
    """Plans how convert writes one array.

    Args:
        shape: The array's shape.
        itemsize: Bytes per element as written.
        shard: The shard shape of the array's target layout (`shape` when
            none): outer chunks never span two shards.
        piece_bytes: Most bytes of one box.

    Returns:
        The outer chunk shape (Orbax's write shape) and C-order boxes that
        cover whole outer chunks (the last ones may be cut by the edge).
    """
    if not shape or 0 in shape:
        return shape, c_order_boxes(shape, itemsize, piece_bytes)
    k = split_axis(shape, itemsize, piece_bytes)
    trailing = int(np.prod(shape[k + 1 :], dtype=np.int64)) * itemsize
    rows = max(1, piece_bytes // trailing)
    write_rows = min(rows, shard[k], shape[k])
    rows = write_rows * max(1, rows // write_rows)
    write_shape = (1,) * k + (write_rows,) + tuple(min(s, n) for s, n in zip(shard[k + 1 :], shape[k + 1 :], strict=True))
    return write_shape, c_order_boxes(shape, itemsize, piece_bytes, rows=rows)
