"""Each process writes the pieces of its own devices, at their places in the files.

A variable's value is a sharded `jax.Array`. Each distinct piece (box) is
written once, by one device holding it (`owned_pieces`: all processes
agree on the writer from the global sharding, and the processes together
write every piece exactly once), through the variable's remap: where each
element of the variable lives in the stored tensors.

- `Identity` (safetensors, keras-hub h5): the stored tensor is the variable.
- a recorded Hugging Face remap (`shardckpt.formats.hf_remap.Tensor`, the
  same objects `from_preset` reads with): `Strided` places the box in a
  strided view of its stored tensor (a transposed kernel's piece becomes the
  stored rows it occupies), `Concat` splits the box across its parts
  (stacked experts, fused projections), `Cast` is undone by the stored
  dtype.

Host memory: a piece is brought to the host in row blocks whose size, plus
one copy of the block in the stored layout and dtype (transposed, cast:
the source of `pwrite`, see `formats.mapped_writer.MappedFiles.put`),
stays within the budget (`shardckpt.budget.Budget`). Written pages are
page cache (file-backed), so nothing beyond the blocks in flight is held.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import numpy as np

from shardckpt.budget import Budget
from shardckpt.exporting.assemble import Writer, contiguous, leaves, owns_all
from shardckpt.formats.hf_remap import Box, Cast, Concat, Strided, Tensor


class Identity(Tensor):
    """The stored tensor `key` is the variable itself."""

    def __init__(self, key: str, shape: tuple[int, ...], dtype: Any) -> None:
        self.key = key
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)

    def sources(self) -> list[str]:
        return [self.key]


class Target(Protocol):
    """Where stored tensors are written (`formats.mapped_writer.MappedFiles`)."""

    def put(self, key: str, first: int, strides: tuple[int, ...], value: np.ndarray) -> None:
        """Writes `value` at elements `first + i . strides` of the stored tensor `key`."""
        ...

    def dtype(self, key: str) -> np.dtype:
        """The stored dtype of `key`."""
        ...


def _c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))


def write_box(remap: Tensor, box: Box, value: np.ndarray, target: Target) -> None:
    """Writes `value` (the variable's `box`) where its elements are stored."""
    if isinstance(remap, Identity):
        strides = _c_strides(remap.shape)
        target.put(remap.key, sum(s.start * st for s, st in zip(box, strides, strict=True)), strides, value)
    elif isinstance(remap, Strided):
        first = remap.offset + sum(s.start * st for s, st in zip(box, remap.strides, strict=True))
        target.put(remap.key, first, remap.strides, value)
    elif isinstance(remap, Cast):
        write_box(remap.child, box, value, target)
    elif isinstance(remap, Concat):
        axis, want = remap.axis, box[remap.axis]
        for start, stop, part in remap._spans():
            lo, hi = max(start, want.start), min(stop, want.stop)
            if lo < hi:
                sub = box[:axis] + (slice(lo - start, hi - start),) + box[axis + 1 :]
                write_box(part, sub, value[(slice(None),) * axis + (slice(lo - want.start, hi - want.start),)], target)
    else:
        raise TypeError(f"no writer for a {type(remap).__name__} remap")


def normalize(index: tuple[Any, ...], shape: tuple[int, ...]) -> Box:
    """A shard's index (slices with None) as a box of explicit bounds."""
    return tuple(slice(*s.indices(d)[:2]) for s, d in zip(index, shape, strict=True))


def owned_pieces(value: Any, salt: int = 0) -> list[tuple[Box, Any]]:
    """`(box, shard data)` of each piece this process writes.

    Every distinct piece is written once, by one of the devices holding a
    replica of it: replica `(k + salt) % replicas` for the k-th piece, with
    replicas ordered by device id. All processes compute the same choice
    from the global sharding, with no communication. Rotating the writer
    (by piece and by `salt`, the variable's ordinal) spreads replicated
    pieces over the processes: on a (2, 4) mesh whose "data" rows are two
    processes, variables replicated over "data" are written half by each,
    where "first replica writes" would leave every byte to process 0.
    """
    import jax

    shape = tuple(value.shape)
    if not hasattr(value, "addressable_shards"):  # a numpy value (never sharded)
        return [(tuple(slice(0, d) for d in shape), value)] if jax.process_index() == 0 else []
    groups: dict[tuple[tuple[int, int], ...], list[Any]] = {}
    for device, index in value.sharding.devices_indices_map(shape).items():
        box = normalize(index, shape)
        groups.setdefault(tuple((b.start, b.stop) for b in box), []).append(device)
    writers = {}
    for k, (box_key, devices) in enumerate(sorted(groups.items())):
        devices.sort(key=lambda d: d.id)
        writers[box_key] = devices[(k + salt) % len(devices)].id
    out = []
    for shard in value.addressable_shards:
        box = normalize(shard.index, shape)
        if writers[tuple((b.start, b.stop) for b in box)] == shard.device.id:
            out.append((box, shard.data))
    return out


def _on_host(data: Any) -> bool:
    devices = getattr(data, "devices", None)
    if devices is None:
        return True  # a numpy array
    return all(d.platform == "cpu" for d in devices())


def _host(data: Any, index: tuple[slice, ...]) -> np.ndarray:
    """`data[index]` on the host: a view of a CPU device's buffer, else copied from the device."""
    return np.asarray(data)[index] if _on_host(data) else np.asarray(data[index])


def write_value(value: Any, remap: Tensor, target: Target, budget: Budget, *, salt: int = 0,
                writer: Writer | None = None) -> int:
    """Writes this process's pieces of `value`; returns the bytes written (in `value`'s dtype).

    With a `writer`, each stored range this process writes whole is
    assembled block by block (`export.assemble`); the rest piece by piece.
    """
    pieces = [(box, data) for box, data in owned_pieces(value, salt) if all(b.stop > b.start for b in box)]
    shape = tuple(value.shape)
    if writer is None or not shape or not pieces:
        return _write_pieces(pieces, remap, target, budget)
    itemsize = np.dtype(value.dtype).itemsize
    written = 0
    for leaf in leaves(remap, shape, _c_strides):
        region, shift, key, first, strides = leaf
        mine = [(box, data) for box, data in pieces if _overlap(box, region)]
        if not mine:
            continue
        order = contiguous(tuple(r.stop - r.start for r in region), strides)
        if order is not None and owns_all(region, mine):
            n = writer.write(leaf, order, target.dtype(key), mine, _host)
            if n:
                written += n * itemsize
                continue
        # This part piece by piece: the pieces' overlaps with it, through the part's own view.
        base = first + sum((r.start - s) * st for r, s, st in zip(region, shift, strides, strict=True))
        part = Strided(key, target.dtype(key), tuple(r.stop - r.start for r in region), strides, base)
        clipped = []
        for box, data in mine:
            inter = tuple(slice(max(b.start, r.start), min(b.stop, r.stop)) for b, r in zip(box, region, strict=True))
            local = tuple(slice(i.start - b.start, i.stop - b.start) for i, b in zip(inter, box, strict=True))
            clipped.append((tuple(slice(i.start - r.start, i.stop - r.start) for i, r in zip(inter, region, strict=True)),
                            data if local == tuple(slice(0, b.stop - b.start) for b in box)
                            # a view where the data is in host memory; a device slice otherwise
                            else np.asarray(data)[local] if _on_host(data) else data[local]))
        written += _write_pieces(clipped, part, target, budget)
    return written


def _overlap(a: Box, b: Box) -> bool:
    return all(max(x.start, y.start) < min(x.stop, y.stop) for x, y in zip(a, b, strict=True))


def _write_pieces(pieces: list[tuple[Box, Any]], remap: Tensor, target: Target, budget: Budget) -> int:
    """Each piece in row blocks within the budget; returns the bytes written (in the pieces' dtype)."""
    written = 0
    for box, data in pieces:
        shape = tuple(b.stop - b.start for b in box)
        if not shape:  # a scalar
            with budget.holding(data.dtype.itemsize):
                write_box(remap, box, np.asarray(data), target)
            written += data.dtype.itemsize
            continue
        row = math.prod(shape[1:]) * np.dtype(data.dtype).itemsize
        # A CPU device's buffer is host memory: numpy views it without a copy,
        # and row blocks are views. Elsewhere each block is sliced on the
        # device and copied to the host on its own.
        host = np.asarray(data) if _on_host(data) else None
        # A block, and its copy in the stored layout and dtype (pwrite's source).
        rows = max(1, budget.limit // max(1, 2 * row))
        for lo in range(0, shape[0], rows):
            hi = min(shape[0], lo + rows)
            with budget.holding(2 * (hi - lo) * row):
                if host is not None:
                    block = host[lo:hi]
                else:
                    block = np.asarray(data[lo:hi] if hi - lo < shape[0] else data)
                sub = (slice(box[0].start + lo, box[0].start + hi),) + box[1:]
                write_box(remap, sub, block, target)
                del block
            written += (hi - lo) * row
    return written
