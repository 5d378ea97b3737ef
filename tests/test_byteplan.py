"""The byte planner (`shardckpt.storage.byteplan`) and the byte sources built on it.

Planning is checked against numpy itself: the runs of a box, read out of the
array's bytes one after another, are exactly `array[box]`'s bytes; a strided
selection's runs rebuild `flat[first + i . strides]`. `merge` is checked for
its three limits (gap, waste, part). Then every `ByteSource` of a local file
(the memory map) serves the same bytes as numpy for boxes, strided
selections and raw runs.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from shardckpt import storage
from shardckpt.storage import byteplan


def _gather(raw: bytes, runs: list[tuple[int, int]]) -> bytes:
    return b"".join(raw[a:b] for a, b in runs)


@pytest.mark.parametrize("dtype", [np.float32, np.int8, np.float64])
@pytest.mark.parametrize(
    "shape,box",
    [
        ((), ()),
        ((7,), (slice(2, 5),)),
        ((6, 5), (slice(0, 6), slice(0, 5))),
        ((6, 5), (slice(1, 4), slice(0, 5))),
        ((6, 5), (slice(0, 6), slice(1, 3))),
        ((4, 3, 5), (slice(1, 3), slice(0, 3), slice(2, 4))),
        ((4, 3, 5), (slice(0, 4), slice(1, 2), slice(0, 5))),
        ((4, 3, 5), (slice(2, 2), slice(0, 3), slice(0, 5))),
    ],
)
def test_runs_are_the_bytes_of_the_box(shape, box, dtype):
    array = np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape)
    runs = byteplan.runs(shape, array.itemsize, box)
    assert runs == sorted(runs) and all(a < b for a, b in runs)
    assert _gather(array.tobytes(), runs) == np.ascontiguousarray(array[(*box, Ellipsis)]).tobytes()
    assert byteplan.total(runs) == array[(*box, Ellipsis)].nbytes


def test_whole_rows_are_one_run():
    assert byteplan.runs((6, 5), 4, (slice(1, 4), slice(0, 5))) == [(20, 80)]
    assert byteplan.runs((6, 5), 4, (slice(0, 6), slice(1, 3))) == [(4 + 20 * r, 12 + 20 * r) for r in range(6)]


@pytest.mark.parametrize(
    "first,shape,strides",
    [
        (0, (4, 6), (6, 1)),  # row-major view
        (0, (6, 4), (1, 6)),  # its transpose
        (5, (3, 2), (-1, 12)),  # a flipped axis
        (2, (2, 3, 2), (12, 1, 6)),  # an axis permutation
        (0, (0, 3), (3, 1)),  # empty
    ],
)
def test_strided_runs_rebuild_the_selection(first, shape, strides):
    flat = np.arange(24, dtype=np.int32)
    want = np.ndarray(shape, flat.dtype, buffer=flat, offset=first * 4, strides=tuple(4 * s for s in strides))
    if 0 in shape:
        return
    plan = byteplan.strided_runs(4, first, shape, strides)
    got = np.frombuffer(_gather(flat.tobytes(), plan.runs), np.int32).reshape(plan.shape)
    got = got.transpose(np.argsort(plan.order))
    if plan.flips:
        got = np.flip(got, plan.flips)
    np.testing.assert_array_equal(got, want)


def test_merge_joins_close_runs_and_keeps_every_byte():
    runs = [(0, 100), (110, 200), (10_000, 10_100)]
    requests = byteplan.merge(runs, gap=50, waste=0.5, part=1 << 20)
    assert [(r.start, r.stop) for r in requests] == [(0, 200), (10_000, 10_100)]
    assert [list(r.runs) for r in requests] == [[(0, 100), (110, 200)], [(10_000, 10_100)]]


def test_merge_refuses_gaps_over_the_waste_fraction():
    # Gaps of 10 bytes between runs of 10 bytes: a request would be half gaps.
    runs = [(20 * i, 20 * i + 10) for i in range(5)]
    assert len(byteplan.merge(runs, gap=1000, waste=0.125, part=1 << 20)) == 5
    assert len(byteplan.merge(runs, gap=1000, waste=1.0, part=1 << 20)) == 1


def test_merge_cuts_long_runs_into_parts():
    requests = byteplan.merge([(0, 10), (10, 35)], gap=0, waste=0.0, part=10)
    assert [(r.start, r.stop) for r in requests] == [(0, 10), (10, 20), (20, 30), (30, 35)]
    assert all(r.stop - r.start <= 10 for r in requests)
    covered = list(itertools.chain.from_iterable(r.runs for r in requests))
    assert byteplan.total(covered) == 35


def test_mapped_file_serves_the_bytes_numpy_holds(tmp_path):
    array = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    path = tmp_path / "raw.bin"
    offset = 13  # an odd offset: views still work, reads are aligned copies
    path.write_bytes(b"x" * offset + array.tobytes())
    source = storage.open_source(storage.parse(path))
    try:
        assert source.mappable and source.size == offset + array.nbytes
        box = (slice(2, 7), slice(1, 4))
        view = source.array(offset, array.shape, array.dtype, box)
        fresh = source.read_box(offset, array.shape, array.dtype, box)
        np.testing.assert_array_equal(view, array[box])
        np.testing.assert_array_equal(fresh, array[box])
        assert fresh.flags.c_contiguous and fresh.flags.writeable and not view.flags.writeable
        np.testing.assert_array_equal(source.strided(offset, array.dtype, array.size, 0, (6, 8), (1, 6)), array.T)
        np.testing.assert_array_equal(source.strided(offset, array.dtype, array.size, 7, (3, 2), (6, -1)), array[1:4, 1::-1])
        out = np.empty(12, np.uint8)
        source.read_into(out, [(0, 4), (24, 32)], offset=offset)
        assert out.tobytes() == array.tobytes()[0:4] + array.tobytes()[24:32]
        assert source.probe(slice(0, offset)) == b"x" * offset
        assert source.probe(slice(0, 10 * source.size)) == source.size
    finally:
        source.close()
