"""The pure read planner: every element of every piece written exactly once, reads bounded."""

from __future__ import annotations

import itertools

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from shardckpt.restore import readplan


def _execute(shape, parts, reads):
    """Runs a plan on an index array; returns the pieces and a write count."""
    source = np.arange(int(np.prod(shape))).reshape(shape)
    pieces = [np.full(p.shape, -1) for p in parts]
    counts = [np.zeros(p.shape, int) for p in parts]
    for read in reads:
        data = source[read.box]
        for c in read.copies:
            pieces[c.piece][c.dst] = data[c.src]
            counts[c.piece][c.dst] += 1
    return source, pieces, counts


MESHES = [(1, 8), (2, 4), (4, 2), (8, 1)]
SPECS = [P(), P("model"), P(None, "model"), P("model", None), P("data", "model"), P(("data", "model"))]


@pytest.mark.parametrize("mesh_shape,spec", list(itertools.product(MESHES, SPECS)))
@pytest.mark.parametrize("budget", [8, 100, 10**9])
def test_plan_fills_every_piece_once(mesh_shape, spec, budget):
    mesh = Mesh(np.array(jax.devices()).reshape(mesh_shape), ("data", "model"))
    shape = (16, 24)
    sharding = NamedSharding(mesh, spec)
    parts = readplan.pieces(sharding.addressable_devices_indices_map(shape), shape)
    assert sum(len(p.devices) for p in parts) == 8
    reads = readplan.plan(4, parts, budget=budget)
    source, pieces, counts = _execute(shape, parts, reads)
    for part, piece, count in zip(parts, pieces, counts):
        np.testing.assert_array_equal(piece, source[part.box])
        assert (count == 1).all()
    for read in reads:  # at least one row, otherwise within the budget
        rows = read.box[0].stop - read.box[0].start
        assert rows == 1 or readplan.volume(read.box) * 4 <= budget
    # Tiled pieces are read as one region: total bytes read equal the union's.
    union = tuple(slice(min(p.box[d].start for p in parts), max(p.box[d].stop for p in parts)) for d in range(2))
    assert sum(readplan.volume(r.box) for r in reads) == readplan.volume(union)


def test_replicas_are_read_once():
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    shape = (8, 8)
    parts = readplan.pieces(NamedSharding(mesh, P(None, "model")).addressable_devices_indices_map(shape), shape)
    assert len(parts) == 4 and all(len(p.devices) == 2 for p in parts)
    reads = readplan.plan(4, parts, budget=10**9)
    assert len(reads) == 1 and readplan.volume(reads[0].box) == 64


def test_scattered_pieces_are_read_per_piece():
    parts = [readplan.Piece((slice(0, 2), slice(0, 4)), ("a",)), readplan.Piece((slice(6, 8), slice(0, 4)), ("b",))]
    reads = readplan.plan(4, parts, budget=10**9)
    assert [r.box for r in reads] == [parts[0].box, parts[1].box]


def test_slabs_align_to_chunks():
    shape = (100, 10)
    parts = readplan.pieces({"d": (slice(None), slice(None))}, shape)
    reads = readplan.plan(4, parts, budget=30 * 10 * 4, chunk_rows=16)
    starts = [r.box[0].start for r in reads]
    assert all(s % 16 == 0 for s in starts)
    assert sum(r.box[0].stop - r.box[0].start for r in reads) == 100


def test_scalar():
    parts = readplan.pieces({"a": (), "b": ()}, ())
    reads = readplan.plan(4, parts, budget=1)
    assert reads == [readplan.Read((), (readplan.Copy(0, (), ()),))]


def test_per_piece_mode_finishes_pieces_in_order():
    parts = [readplan.Piece((slice(0, 8), slice(4 * i, 4 * i + 4)), (i,)) for i in range(2)]
    reads = readplan.plan(4, parts, budget=10**9, per_piece=True)
    assert [c.piece for r in reads for c in r.copies] == [0, 1]
