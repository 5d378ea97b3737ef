"""The transfer pipeline of accelerator hosts: reads into a ring of host buffers, overlapped with transfers.

Off host, every byte goes disk -> host buffer -> device. Done one piece at a
time (read, `device_put`, wait), each read waits for the previous transfer
and each transfer for the previous read. Here instead:

- reads land in a `Ring` of reused, page-aligned host buffers ("slots"),
  allocated once per load; the ring's bytes are bounded by the load's budget;
- reads run on the engine's worker threads (one variable per thread), so
  several are in flight;
- each slot's transfer starts as soon as the slot is full (`device_put`
  returns at once, the copy runs in the runtime) and is waited for only when
  the ring hands that slot out again: no `block_until_ready` per piece;
- where the platform has pinned host memory (JAX's `pinned_host` memory
  kind, GPUs), a slot's bytes go to pinned memory first, from which the
  device copies by DMA; elsewhere straight to the device, with a copy
  (`may_alias=False`: a CPU device would otherwise adopt the slot itself,
  which the ring then overwrites: there the slot is copied into a buffer
  the device owns).

A piece larger than a slot is read and transferred in row blocks that fit
one, and joined on its device (the device then holds the piece twice for a
moment: the blocks and the joined piece).

Mapped files on accelerators skip the slots: a piece that is one contiguous
run of a memory-mapped file (`mapped_run`) goes to its device straight from
the mapping, whole, in one `device_put` (the runtime stages it through its
own pinned buffers). Copying it into a slot first only added a pass over
every byte, and cutting it into blocks a join on the device. No slot holds
its bytes, so its rows may be larger than a slot (`fits`). Such a transfer
still takes a slot while it runs, unused, so the slots bound how many are in
flight; its read is the runtime's, inside the transfer (recorded as a read of
no duration).

Every read and transfer is recorded in a `Timeline` (the load report's):
when it started and ended. A transfer's end is when the pipeline saw it
done (it asks only when it needs the slot), so it is an upper bound.
"""

from __future__ import annotations

import collections
import dataclasses
import mmap
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from shardckpt.formats.base import Box, ChunkedReader, MappedReader, Reader, aligned_empty, copy_into
from shardckpt.restore import readplan

PAGE = mmap.PAGESIZE
"""Slots start on page boundaries (what DMA engines and `O_DIRECT` reads want)."""

SLOT_BYTES = 64 * 1024 * 1024
"""Largest slot: host-to-device copies from 64 MB pieces ran at 31 GB/s on an H200
(NOTES.md); larger slots only delay the first transfer."""

MIN_SLOTS = 2
"""Fewest slots: one filling while another transfers."""

RING_SHARE = 2
"""The ring takes 1/RING_SHARE of the budget; the rest stays for strategies that
bypass it (casts, pieces whose row is larger than a slot)."""


@dataclasses.dataclass(frozen=True)
class Event:
    """One read or transfer of the pipeline.

    Attributes:
        kind: "read" (bytes into a slot) or "transfer" (a slot to its device).
        key: The checkpoint key.
        piece: The piece (or row block) of that key: its index in the order sent.
        nbytes: Bytes moved.
        start: Seconds since the timeline began.
        end: Seconds since the timeline began (a transfer: when seen done).
    """

    kind: str
    key: str
    piece: int
    nbytes: int
    start: float
    end: float


class Timeline:
    """Events of one load, appended from any thread."""

    def __init__(self) -> None:
        self._origin = time.perf_counter()
        self._lock = threading.Lock()
        self.events: list[Event] = []

    def now(self) -> float:
        return time.perf_counter() - self._origin

    def add(self, event: Event) -> None:
        with self._lock:
            self.events.append(event)

    def overlapping(self) -> int:
        """How many (read, transfer) pairs ran at the same time."""
        reads = [e for e in self.events if e.kind == "read"]
        transfers = [e for e in self.events if e.kind == "transfer"]
        return sum(1 for r in reads for t in transfers if r.start < t.end and t.start < r.end)


@dataclasses.dataclass
class _Pending:
    arrays: list[jax.Array]
    key: str
    piece: int
    nbytes: int
    start: float


class Slot:
    """One page-aligned host buffer of the ring, and the transfer still reading it."""

    def __init__(self, nbytes: int) -> None:
        # Anonymous private pages: page-aligned, not part of the malloc heap.
        self._map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.raw = np.frombuffer(self._map, np.uint8)
        self.pending: _Pending | None = None

    def array(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """The slot's first bytes as a C-ordered array of `shape` and `dtype`."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return self.raw[:nbytes].view(dtype).reshape(shape)


class Ring:
    """Reused host buffers: a slot is handed out again once its transfer is done.

    Args:
        budget_bytes: Most bytes the ring may hold.
        timeline: Where transfers are recorded when seen done.
        slots: How many slots (at least `MIN_SLOTS`); with `budget_bytes`
            it sets their size (page multiples, at most `SLOT_BYTES`).
    """

    def __init__(self, budget_bytes: int, timeline: Timeline, slots: int) -> None:
        count = max(MIN_SLOTS, slots)
        size = min(SLOT_BYTES, budget_bytes // count) // PAGE * PAGE
        self.slot_bytes = max(PAGE, size)
        self.nbytes = self.slot_bytes * count
        self.timeline = timeline
        self._free: collections.deque[Slot] = collections.deque(Slot(self.slot_bytes) for _ in range(count))
        self._busy: collections.deque[Slot] = collections.deque()
        self._cond = threading.Condition()

    def take(self) -> Slot:
        """A slot to fill: a free one, else the one whose transfer started first, once it is done."""
        with self._cond:
            self._cond.wait_for(lambda: bool(self._free or self._busy))
            slot = self._free.popleft() if self._free else self._busy.popleft()
        self._settle(slot)
        return slot

    def give(self, slot: Slot) -> None:
        """Returns a slot whose transfer has started (or that was not used)."""
        with self._cond:
            (self._busy if slot.pending is not None else self._free).append(slot)
            self._cond.notify()

    def drain(self) -> None:
        """Waits for every transfer still reading a slot."""
        with self._cond:
            busy = list(self._busy)
        for slot in busy:
            self._settle(slot)

    def _settle(self, slot: Slot) -> None:
        pending = slot.pending
        if pending is None:
            return
        jax.block_until_ready(pending.arrays)  # the slot's bytes are free after this
        self.timeline.add(
            Event("transfer", pending.key, pending.piece, pending.nbytes, pending.start, self.timeline.now())
        )
        slot.pending = None


def staging_kind(device: Any) -> str | None:
    """`"pinned_host"` where `device` is an accelerator with pinned host memory, else None.

    CPU devices list a `pinned_host` memory too, but their buffers are host
    memory already: there a second host copy would only cost time.
    """
    if device.platform == "cpu":
        return None
    try:
        kinds = {memory.kind for memory in device.addressable_memories()}
    except (AttributeError, NotImplementedError, jax.errors.JaxRuntimeError):
        return None  # a runtime without memory kinds: straight to the device
    return "pinned_host" if "pinned_host" in kinds else None


def send(data: np.ndarray, device: Any) -> jax.Array:
    """Starts copying `data` (a slot's bytes) to `device`; returns at once.

    The result never aliases `data`: the slot is reused once the copy is done.
    """
    if device.platform == "cpu":
        # A CPU device adopts an aligned host buffer even with may_alias=False
        # (JAX 0.10): the piece gets a buffer of its own, as the direct path gives it.
        own = aligned_empty(data.shape, data.dtype)
        own[...] = data
        return jax.device_put(own, device)
    kind = staging_kind(device)
    if kind is None:
        return jax.device_put(data, device, may_alias=False)
    staged = jax.device_put(data, jax.sharding.SingleDeviceSharding(device, memory_kind=kind), may_alias=False)
    return jax.device_put(staged, jax.sharding.SingleDeviceSharding(device))


def blocks(box: Box, row_bytes: int, slot_bytes: int, align: int = 1) -> list[Box] | None:
    """`box` cut along its first axis into blocks of at most `slot_bytes`, or None
    when one row of it (`row_bytes`) is already larger than a slot.

    With `align` (rows of a stored chunk), blocks are whole multiples of it
    where a slot holds at least one chunk's rows: a chunk cut across two
    blocks would be decoded (and its checksum verified) twice.
    """
    if not box:
        return [box]
    if row_bytes > slot_bytes:
        return None
    first = box[0]
    rows = max(1, slot_bytes // max(1, row_bytes))
    if align > 1 and rows >= align:
        rows = rows // align * align
    return [
        (slice(a, min(a + rows, first.stop)), *box[1:]) for a in range(first.start, max(first.stop, first.start + 1), rows)
    ]


def fits(
    parts: Sequence[readplan.Piece],
    itemsize: int,
    slot_bytes: int,
    views: Sequence[np.ndarray | None] | None = None,
) -> bool:
    """Whether every piece can go through the ring.

    A piece with a view in `views` (`mapped_runs`) goes to its devices whole,
    straight from the mapping: no slot holds its bytes, so its rows may be of
    any size. Any other piece is cut into row blocks within a slot, so each
    of its rows must fit one.
    """
    for i, part in enumerate(parts):
        if views is not None and views[i] is not None:
            continue
        shape = part.shape
        row = int(np.prod(shape[1:], dtype=np.int64)) * itemsize if shape else itemsize
        if row > slot_bytes:
            return False
    return True


def mapped_run(reader: Reader, key: str, box: Box, dtype: np.dtype, devices: Sequence[Any]) -> np.ndarray | None:
    """`box` of `key` as a view of a memory map, when it can go to `devices` straight from there.

    That is: accelerators only (a CPU device would adopt the view itself, a
    mapping the reader unmaps when it closes), a mapped file, the stored
    dtype in native byte order, and one contiguous run of bytes. Else None.
    """
    if not devices or any(d.platform == "cpu" for d in devices):
        return None
    if isinstance(reader, ChunkedReader) or not isinstance(reader, MappedReader) or not reader.is_mapped(key):
        return None
    view = reader.view(key, box)
    return view if sendable(view, dtype) else None


def mapped_runs(reader: Reader, key: str, parts: Sequence[readplan.Piece], dtype: np.dtype) -> list[np.ndarray | None]:
    """Each piece's view of a memory map where it goes straight from there (`mapped_run`), else None."""
    return [mapped_run(reader, key, p.box, dtype, p.devices) if p.box else None for p in parts]


def sendable(view: np.ndarray, dtype: np.dtype) -> bool:
    """Whether `view` can be handed to the runtime as it is: `dtype`, native byte order, C-contiguous."""
    return view.dtype == dtype and dtype.isnative and view.flags.c_contiguous


def fill(reader: Reader, key: str, box: Box, out: np.ndarray) -> None:
    """Reads `box` of `key` into `out` (the box's shape, stored dtype, C order)."""
    if isinstance(reader, ChunkedReader):
        reader.read_pieces(key, [box], [out])
    elif isinstance(reader, MappedReader):
        copy_into(out, reader.view(key, box))
    else:
        copy_into(out, reader.read(key, box))


def through_ring(
    ring: Ring,
    reader: Reader,
    key: str,
    parts: Sequence[readplan.Piece],
    dtype: np.dtype,
    advance: Callable[[int], None],
    views: Sequence[np.ndarray | None],
    align: int = 1,
) -> list[jax.Array]:
    """Every piece on each of its devices, read through the ring.

    `views`: `mapped_runs` of `parts` (the pieces that go whole from their mapping).
    `align`: rows of a stored chunk, which blocks keep whole (see `blocks`).

    Returns:
        One array per (piece, device), in the order of `parts` and their
        devices, as `jax.make_array_from_single_device_arrays` takes them.
        Their transfers may still be running.
    """
    timeline = ring.timeline
    singles: list[jax.Array] = []
    sent = 0
    for part, view in zip(parts, views, strict=True):
        if view is not None:
            slot = ring.take()  # unused: it bounds the transfers in flight
            try:
                start = timeline.now()
                timeline.add(Event("read", key, sent, view.nbytes, start, start))
                arrays = [jax.device_put(view, device) for device in part.devices]
                slot.pending = _Pending(arrays, key, sent, view.nbytes * len(arrays), start)
            finally:
                ring.give(slot)
            singles.extend(arrays)
            sent += 1
            advance(view.nbytes)
            continue
        shape = part.shape
        row = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize if shape else dtype.itemsize
        cut = blocks(part.box, row, ring.slot_bytes, align)
        if cut is None:
            raise ValueError(f"A row of {key!r} is larger than a slot of {ring.slot_bytes} bytes.")
        per_device: list[list[jax.Array]] = [[] for _ in part.devices]
        for block in cut:
            bshape = tuple(s.stop - s.start for s in block)
            slot = ring.take()
            try:
                data = slot.array(bshape, dtype)
                nbytes = data.nbytes
                start = timeline.now()
                if data.size:
                    fill(reader, key, block, data)
                timeline.add(Event("read", key, sent, nbytes, start, timeline.now()))
                start = timeline.now()
                arrays = [send(data, device) for device in part.devices]
                slot.pending = _Pending(arrays, key, sent, nbytes * len(arrays), start)
            finally:
                ring.give(slot)
            for i, array in enumerate(arrays):
                per_device[i].append(array)
            sent += 1
            advance(nbytes)
        for arrays in per_device:
            singles.append(arrays[0] if len(arrays) == 1 else _join(arrays))
    return singles


def _join(arrays: list[jax.Array]) -> jax.Array:
    """Row blocks of one piece, joined on their device."""
    return jnp.concatenate(arrays, axis=0)

