"""Which bytes a box of a stored array is: pure planning, no I/O.

A C-ordered array stored contiguously at some offset (an h5 dataset, a
safetensors tensor) holds any rectangular box of it as a sequence of runs of
contiguous bytes; `runs` lists them, `strided_runs` does the same for an
arbitrary strided selection (the elements a Hugging Face remap takes), and
`merge` groups runs into requests for storage that charges per request
(buckets): neighbours closer than a gap become one request as long as the
gaps stay a small fraction of it, and long runs are cut into parts that can
be read concurrently. `shardckpt.storage.bytesource` turns the plans into
reads.
"""

from __future__ import annotations

import dataclasses

import numpy as np

Box = tuple[slice, ...]
"""One slice per dimension (as `shardckpt.formats.base.Box`)."""

Run = tuple[int, int]
"""Bytes `[a, b)`."""


@dataclasses.dataclass(frozen=True)
class Request:
    """One read that serves several runs.

    Attributes:
        start: First byte read.
        stop: One past the last byte read.
        runs: The runs it serves, ascending, each inside `[start, stop)`.
    """

    start: int
    stop: int
    runs: tuple[Run, ...]


def runs(shape: tuple[int, ...], itemsize: int, box: Box) -> list[Run]:
    """Byte runs `[a, b)` of `box` in a C-ordered array of `shape`, ascending.

    Trailing axes the box covers whole join the run of the axis before them,
    so a box of whole rows is one run.
    """
    nd = len(shape)
    if nd == 0:
        return [(0, itemsize)]
    if any(s.stop <= s.start for s in box):
        return []
    k = nd - 1
    while k > 0 and box[k].start == 0 and box[k].stop == shape[k]:
        k -= 1
    strides = [itemsize] * nd
    for d in range(nd - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    length = (box[k].stop - box[k].start) * strides[k]
    starts = np.array([box[k].start * strides[k]], np.int64)
    for d in range(k - 1, -1, -1):
        outer = np.arange(box[d].start, box[d].stop, dtype=np.int64) * strides[d]
        starts = (outer[:, None] + starts[None, :]).reshape(-1)
    return [(int(a), int(a) + length) for a in starts]


@dataclasses.dataclass(frozen=True)
class Strided:
    """A strided selection in stored order: what `strided_runs` plans.

    Attributes:
        runs: The byte runs, ascending.
        shape: The selection's shape with its axes in stored order (outer first).
        order: `order[i]` is the axis of the asked shape at stored position `i`.
        flips: Axes (of the asked shape) whose stride was negative.
    """

    runs: list[Run]
    shape: tuple[int, ...]
    order: tuple[int, ...]
    flips: tuple[int, ...]


def strided_runs(itemsize: int, first: int, shape: tuple[int, ...], strides: tuple[int, ...]) -> Strided:
    """The runs of `flat[first + i . strides]` for each index `i` of `shape` (strides in elements).

    The selection is read in increasing address order: negative strides are
    flipped, and axes sorted by stride, so the axis of stride 1 (if any)
    makes the runs. Its elements then lie in the runs in the order of the
    returned `shape`; `order` and `flips` give back the asked axes.
    """
    strides = tuple(strides)
    flips = tuple(d for d, st in enumerate(strides) if st < 0)
    for d in flips:
        first += (shape[d] - 1) * strides[d]
    positive = tuple(abs(st) for st in strides)
    order = tuple(sorted(range(len(shape)), key=lambda d: -positive[d]))
    tshape = tuple(shape[d] for d in order)
    tstrides = [positive[d] for d in order]
    run = tshape[-1] if tshape and tstrides[-1] == 1 else 1
    outer = tshape[:-1] if run > 1 or not tshape else tshape
    starts = np.array([first], np.int64)
    for n, st in zip(outer, tstrides[: len(outer)], strict=True):
        starts = (starts[:, None] + np.arange(n, dtype=np.int64)[None, :] * st).reshape(-1)
    out = [(int(a) * itemsize, (int(a) + run) * itemsize) for a in starts]
    return Strided(runs=out, shape=tshape, order=order, flips=flips)


def merge(runs: list[Run], *, gap: int, waste: float, part: int) -> list[Request]:
    """Groups ascending runs into requests: gaps up to `gap` bytes, at most `part` bytes each.

    A gap joins a request only while the request's gaps stay within `waste`
    (a fraction) of the bytes it is for: the columns of a column-sharded
    kernel that another process holds are not requested, so each process
    asks for little more than its own pieces. A run longer than `part` is
    cut into requests of its own.

    Args:
        runs: Byte runs, ascending and disjoint.
        gap: Largest gap between two runs of one request.
        waste: Most gap bytes of a request, as a fraction of its wanted bytes.
        part: Largest request.
    """
    out: list[tuple[int, int, list[Run]]] = []
    wanted = 0  # bytes of the runs in out[-1]
    for a, b in runs:
        while b - a > part:
            out.append((a, a + part, [(a, a + part)]))
            a += part
            wanted = part
        if out:
            start, stop, members = out[-1]
            joined = wanted + b - a
            if 0 <= a - stop <= gap and b - start <= part and (b - start) - joined <= waste * joined:
                members.append((a, b))
                out[-1] = (start, b, members)
                wanted = joined
                continue
        out.append((a, b, [(a, b)]))
        wanted = b - a
    return [Request(start, stop, tuple(members)) for start, stop, members in out]


def total(runs: list[Run]) -> int:
    """Bytes of `runs`."""
    return sum(b - a for a, b in runs)
