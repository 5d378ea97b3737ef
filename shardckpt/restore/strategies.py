"""How one variable's pieces get from a reader onto their devices.

`load_variable` is the dispatcher; it picks one of three strategies by the
reader's declared capabilities (`shardckpt.formats.base`) and by where the
pieces go:

- `by_chunk` (a `ChunkedReader`, pieces off host, each piece exactly one
  stored chunk): each decoded chunk goes to its devices as the decoder
  returned it, no host copy of ours;
- `into_pieces` (a `ChunkedReader` whose chunk fits the budget): the reader
  decodes straight into one buffer per piece, a shared chunk once;
- `by_slabs` (every reader): `readplan` slabs of whole rows, views where the
  reader is a `MappedReader`, each slab's parts copied into the pieces;
- `by_ring` (accelerators, or when the load asks for it): every piece read
  into the slots of the load's `pipeline.Ring` and sent to its devices from
  there, transfers overlapped with the next reads (see `pipeline`).

Every strategy holds its bytes of `Budget` for the variable at once (a
second wait while holding part of it could deadlock) and ends in `place`,
which builds the global `jax.Array` and makes it the variable's value.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from shardckpt import _keras
from shardckpt.budget import Budget
from shardckpt.formats.base import (
    ALIGNMENT,
    ArraySpec,
    ChunkedReader,
    MappedReader,
    Reader,
    aligned_empty,
    copy_into,
    region,
)
from shardckpt.lazy import is_unloaded
from shardckpt.restore import hostmem, pipeline, readplan
from shardckpt.restore.targets import TargetLayout

Advance = Callable[[int], None]
"""Progress callback: bytes of the checkpoint just read."""


@dataclasses.dataclass
class Job:
    """One variable to load and the checkpoint key it comes from."""

    key: str
    variable: Any
    target: TargetLayout


@dataclasses.dataclass(frozen=True)
class Load:
    """What every strategy needs to know about one variable's load."""

    job: Job
    stored: ArraySpec  # as in the checkpoint
    shape: tuple[int, ...]
    dtype: np.dtype  # the variable's
    parts: list[readplan.Piece]  # this process's distinct pieces
    on_host: bool  # every device is a CPU device

    @classmethod
    def of(cls, job: Job, reader: Reader) -> Load:
        shape = tuple(job.variable.shape)
        parts = readplan.pieces(job.target.sharding.addressable_devices_indices_map(shape), shape)
        return cls(
            job=job,
            stored=reader.spec(job.key),
            shape=shape,
            dtype=np.dtype(job.variable.dtype),
            parts=parts,
            on_host=all(d.platform == "cpu" for p in parts for d in p.devices),
        )

    @property
    def cast(self) -> bool:
        return self.stored.dtype != self.dtype

    def piece_bytes(self, itemsize: int) -> int:
        """Bytes of all pieces at `itemsize` bytes per element."""
        return sum(readplan.volume(p.box) for p in self.parts) * itemsize

    def extra_piece_bytes(self, itemsize: int) -> int:
        """Bytes of the new pieces that are memory beyond the final state.

        Off host they are copies on their way to the devices. On host they
        become the devices' buffers, final memory, unless the variable still
        holds its old value (a model built normally), alive until the new one
        replaces it.
        """
        extra = not self.on_host or not is_unloaded(self.job.variable)
        return self.piece_bytes(itemsize) if extra else 0


Strategy = Callable[[Load, Any, Budget, Advance], tuple[int, int]]
"""`(load, reader, budget, advance) -> (bytes read, host bytes of the replaced value)`."""


def load_variable(
    job: Job, reader: Reader, budget: Budget, advance: Advance, ring: pipeline.Ring | None = None
) -> tuple[int, int]:
    """Loads one variable with the strategy that fits its reader and devices.

    Args:
        ring: The load's transfer pipeline, where it has one (accelerators).

    Returns:
        Bytes read, and host bytes of the value it replaced (now free).
    """
    load = Load.of(job, reader)
    if ring is not None and not load.cast:
        views = pipeline.mapped_runs(reader, job.key, load.parts, load.stored.dtype)
        if _ringable(load, reader, ring, views):
            return by_ring(load, reader, ring, advance, views)
    return choose(load, reader, budget)(load, reader, budget, advance)


def _ringable(load: Load, reader: Reader, ring: pipeline.Ring, views: list[np.ndarray | None]) -> bool:
    """Whether `load` can go through the ring: no cast (slots hold stored bytes, and
    the variable's dtype would need a second buffer), every row of a piece cut
    into slots within a slot (a piece sent whole from its mapping, `views`,
    takes no slot's bytes), and a stored chunk (decoded whole) within a slot too."""
    if load.cast or not pipeline.fits(load.parts, load.stored.dtype.itemsize, ring.slot_bytes, views):
        return False
    return not isinstance(reader, ChunkedReader) or reader.chunk_bytes(load.job.key) <= ring.slot_bytes


def by_ring(
    load: Load, reader: Reader, ring: pipeline.Ring, advance: Advance, views: list[np.ndarray | None]
) -> tuple[int, int]:
    """Reads every piece into the ring's slots and sends each slot to its devices as it fills.

    Pieces with a view in `views` (`pipeline.mapped_runs`) go whole, straight
    from their mapping. Nothing waits for a transfer here: the ring does, when
    it hands the slot out again (and the engine, for all of them, before the
    load returns). The ring's bytes are held from the budget for the whole load.
    """
    align = (reader.chunk_rows(load.job.key) or 1) if isinstance(reader, ChunkedReader) else 1
    singles = pipeline.through_ring(ring, reader, load.job.key, load.parts, load.stored.dtype, advance, views, align)
    value = jax.make_array_from_single_device_arrays(load.shape, load.job.target.sharding, singles)
    released = hostmem.host_bytes(assign(load.job.variable, value, load.job.target))
    return load.piece_bytes(load.stored.dtype.itemsize), released


def choose(load: Load, reader: Reader, budget: Budget) -> Strategy:
    """The strategy for `load` (see the module docstring)."""
    if isinstance(reader, ChunkedReader):
        key = load.job.key
        if not load.on_host and all(reader.is_chunk(key, p.box) for p in load.parts):
            return by_chunk
        if reader.chunk_bytes(key) <= budget.limit:
            return into_pieces
    return by_slabs


def by_chunk(load: Load, reader: ChunkedReader, budget: Budget, advance: Advance) -> tuple[int, int]:
    """Sends each piece that is exactly one stored chunk to its devices as decoded.

    For accelerators: the host holds one decoded chunk per variable in flight
    instead of a chunk and a copy of it, so the same budget decodes twice as
    many chunks in parallel. Each piece leaves the host before the next is
    read. On CPU devices the copy is what makes a buffer the devices can
    adopt, so `choose` does not pick this there.
    """
    key, itemsize = load.job.key, load.stored.dtype.itemsize
    cast = load.dtype.itemsize / itemsize if load.cast else 0.0
    done = 0
    with budget.holding(int(reader.chunk_bytes(key) * (1 + cast))):
        singles = []
        for part in load.parts:
            data = reader.read(key, part.box)
            if data.dtype != load.dtype:
                data = data.astype(load.dtype)
            placed = [jax.device_put(data, device) for device in part.devices]
            del data
            jax.block_until_ready(placed)  # the decoded chunk is free after this
            singles.extend(placed)
            nbytes = readplan.volume(part.box) * itemsize
            done += nbytes
            advance(nbytes)
        value = jax.make_array_from_single_device_arrays(load.shape, load.job.target.sharding, singles)
        released = hostmem.host_bytes(assign(load.job.variable, value, load.job.target))
    return done, released


def into_pieces(load: Load, reader: ChunkedReader, budget: Budget, advance: Advance) -> tuple[int, int]:
    """Lets the reader decode straight into one buffer per piece, all in one call.

    Held while reading: the chunk being decoded, and the pieces (as stored,
    plus their cast) unless they are final memory.
    """
    key, stored = load.job.key, load.stored.dtype
    need = reader.chunk_bytes(key) + load.extra_piece_bytes(
        stored.itemsize + (load.dtype.itemsize if load.cast else 0)
    )
    with budget.holding(need):
        buffers = [aligned_empty(p.shape, stored) for p in load.parts]
        reader.read_pieces(key, [p.box for p in load.parts], buffers)
        if load.cast:
            buffers = [_copy(b, load.dtype) for b in buffers]
        released = place(load, buffers)
    done = load.piece_bytes(stored.itemsize)
    advance(done)
    return done, released


def by_slabs(load: Load, reader: Reader, budget: Budget, advance: Advance) -> tuple[int, int]:
    """Reads `readplan` slabs and copies each slab's parts into the pieces.

    A memory-mapped `MappedReader`'s views hold no memory; another reader's fresh read is
    held, and where it holds a piece contiguously (row blocks, replicas) the
    piece is a view of it, not a copy.
    """
    key, itemsize = load.job.key, load.stored.dtype.itemsize
    reads = readplan.plan(
        itemsize,
        load.parts,
        budget=budget.limit,
        chunk_rows=reader.chunk_rows(key) if isinstance(reader, ChunkedReader) else None,
        # Off host, each piece is its own read: a fresh read then holds one
        # piece's data, not a slab spanning several.
        per_piece=not load.on_host and len(load.parts) > 1,
    )
    mapped = isinstance(reader, MappedReader) and reader.is_mapped(key)
    fetch = reader.view if isinstance(reader, MappedReader) and mapped else reader.read
    need = 0 if mapped or not reads else max(readplan.volume(r.box) for r in reads) * itemsize
    need += load.extra_piece_bytes(load.dtype.itemsize)
    with budget.holding(need):
        # A piece with a 0 dimension holds no element, so no read copies into
        # it: its (empty) buffer is made here.
        buffers: list[np.ndarray | None] = [
            aligned_empty(p.shape, load.dtype) if 0 in p.shape else None for p in load.parts
        ]
        done = 0
        for read in reads:
            data = fetch(key, read.box)
            for copy in read.copies:
                if not mapped and _covers(copy.dst, load.parts[copy.piece].shape):
                    part = region(data, copy.src)
                    if _adoptable(part, load.dtype):
                        # The views of one read cover disjoint bytes, so
                        # devices never share memory.
                        buffers[copy.piece] = part
                        continue
                buffer = buffers[copy.piece]
                if buffer is None:
                    buffer = buffers[copy.piece] = aligned_empty(load.parts[copy.piece].shape, load.dtype)
                copy_into(region(buffer, copy.dst), region(data, copy.src))
            del data
            nbytes = readplan.volume(read.box) * itemsize
            done += nbytes
            advance(nbytes)
        released = place(load, buffers)  # type: ignore[arg-type]  # every piece is filled
    return done, released


def place(load: Load, buffers: list[np.ndarray]) -> int:
    """Puts the pieces on their devices and makes them the variable's value.

    Off host, waits until the transfers are done and drops the caller's host
    copies (`buffers` is emptied), so a budget released after this call
    covered them.

    Returns:
        Host bytes of the value replaced (`hostmem.host_bytes`), free once this returns.
    """
    singles = [
        # Only CPU devices adopt host buffers; an accelerator copies anyway.
        jax.device_put(buffers[i] if j == 0 or device.platform != "cpu" else _copy(buffers[i]), device)
        for i, part in enumerate(load.parts)
        for j, device in enumerate(part.devices)
    ]
    value = jax.make_array_from_single_device_arrays(load.shape, load.job.target.sharding, singles)
    old = assign(load.job.variable, value, load.job.target)
    if not load.on_host:
        buffers.clear()
        value.block_until_ready()  # the host copies are free after this
    # `old` is freed as this returns, unless the user still holds the array.
    return hostmem.host_bytes(old)


def assign(variable: Any, value: jax.Array, target: TargetLayout) -> Any:
    """Makes `value` the variable's value in `target`; returns the value it replaced."""
    layout = target.keras_layout
    if layout is None and isinstance(target.sharding, jax.sharding.NamedSharding):
        layout = target.sharding
    # Keras records a TensorLayout, a NamedSharding or None (its default
    # placement); a SingleDeviceSharding there breaks variables made from this
    # one later (optimizer slots built by fit: "no attribute 'mesh'").
    return _keras.set_value(variable, value, layout=layout)


def _copy(buffer: np.ndarray, dtype: np.dtype | None = None) -> np.ndarray:
    """An aligned copy (cast to `dtype`). On CPU, `device_put` adopts an aligned
    buffer instead of copying it, so each replica needs memory of its own (a
    donating train step updates it in place)."""
    out = aligned_empty(buffer.shape, buffer.dtype if dtype is None else dtype)
    out[...] = buffer
    return out


def _covers(box: readplan.Box, shape: tuple[int, ...]) -> bool:
    return all(s.start == 0 and s.stop == n for s, n in zip(box, shape, strict=True))


def _adoptable(data: np.ndarray, dtype: np.dtype) -> bool:
    return (
        data.dtype == dtype
        and data.flags.c_contiguous
        and data.flags.writeable
        and data.ctypes.data % ALIGNMENT == 0
    )
