"""Objects in buckets read by byte ranges: nothing is downloaded whole.

`.weights.h5`, `.keras` and `.safetensors` objects in `gs://` / `s3://`
buckets are read through TensorStore's kvstore of the bucket (the same
kvstore spec, credentials, endpoints and deadlines as Orbax checkpoints
there) with ranged reads (`KvStore.read(key, byte_range=...)`):

- `RemoteObject.read_box` reads the bytes of one box of a contiguous array
  (an h5 dataset, a safetensors tensor): the box's runs of contiguous bytes,
  neighbours closer than `GAP` merged into one request, requests cut at
  `PART` bytes and issued concurrently, at most `INFLIGHT_BYTES` in flight
  in the process;
- `RemoteFile` is a read-only seekable file object over an object (what
  `h5py.File` and `zipfile` need for their metadata), with a small bounded
  cache of `BLOCK`-sized blocks so HDF5's many small metadata reads do not
  each become a request.

Every read of a `RemoteObject` is pinned to one version of the object: each
answer carries the version that served it (TensorStore's storage generation:
the object generation on GCS, the ETag on S3), the first one is kept, and an
answer from any other version raises `ObjectChangedError`, so an object
replaced in the middle of a load never yields a mix of old and new bytes.

The formats' readers ask a backend that is not `mappable` for these instead
of a memory map (`H5Reader`, `SafetensorsReader`, ...).
"""

from __future__ import annotations

import collections
import io
import re
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from shardckpt.budget import Budget
from shardckpt.dtypes import aligned_empty
from shardckpt.errors import CorruptCheckpointError
from shardckpt.storage import deadlines, sizing
from shardckpt.storage.location import Location

if TYPE_CHECKING:
    from shardckpt.storage.objectstore import ObjectStore

Box = tuple[slice, ...]
"""One slice per dimension (as `shardckpt.formats.base.Box`)."""

GAP = 256 * 1024
"""Runs of a box closer than this are one request (a request costs more than reading the gap)."""
WASTE = 0.125
"""Most bytes of gaps a request may carry, as a fraction of the bytes it is for."""
PART = 4 * 1024 * 1024
"""Largest single request; longer spans are split, and the parts read concurrently."""
INFLIGHT_BYTES = 32 * 1024 * 1024
"""Bytes of requests in flight at once, over every thread: what ranged reads hold
beside their results (which restore's budget covers)."""
BLOCK = 64 * 1024
"""Block of `RemoteFile`'s cache (HDF5 and zip metadata)."""
CACHE_BLOCKS = 32
"""Blocks `RemoteFile` keeps (2 MiB per open file)."""
_TAIL = 64 * 1024  # read from an object's end to learn its size (zip directory)
_HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"


class Traffic:
    """Requests and bytes asked of buckets by this module, for tests and benches.

    Attributes:
        requests: Ranged reads issued.
        bytes: Bytes they asked for.
        largest: Bytes of the largest one.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = 0
        self.bytes = 0
        self.largest = 0

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.requests += 1
            self.bytes += nbytes
            self.largest = max(self.largest, nbytes)

    def reset(self) -> None:
        with self._lock:
            self.requests = self.bytes = self.largest = 0


TRAFFIC = Traffic()
"""Every ranged read of this module (requests, bytes requested) since the last `reset`."""


_IN_FLIGHT = Budget(INFLIGHT_BYTES)
"""Bytes of ranged reads in flight across all threads."""


class RemoteObject:
    """One object in a bucket, read by byte ranges.

    Args:
        location: The object.
        store: Its backend.

    Raises:
        CheckpointNotFoundError: (on the first read) the object does not exist.
    """

    def __init__(self, location: Location, store: ObjectStore) -> None:
        self.location = location
        self.url = location.url
        self._backend = store
        self._store = store.open(location.parent)
        self._key = location.name.encode()
        self._size: int | None = None
        self._generation: bytes | None = None  # the version every read must come from
        self._pin_lock = threading.Lock()

    def _request(self, start: int, stop: int) -> Any:
        TRAFFIC.add(stop - start)
        return self._store.read(self._key, byte_range=slice(start, stop))

    def _result(self, future: Any, start: int, stop: int) -> bytes:
        try:
            result = deadlines.wait(future)
        except (ValueError, TimeoutError) as e:
            if "OUT_OF_RANGE" in str(e):
                self._check_unchanged()  # a shorter version replaced the one this load read
            raise self._error(e, start, stop) from e
        if result.state == "missing":
            raise self.missing()
        self._pin(result.stamp.generation)
        value = result.value
        if len(value) != stop - start:
            raise self._truncated(start, stop, f"got {len(value)} bytes")
        return value

    def _pin(self, generation: bytes) -> None:
        """Keeps the first answer's version; raises `ObjectChangedError` for another one."""
        with self._pin_lock:
            if self._generation is None:
                self._generation = generation
                return
            expected = self._generation
        if generation != expected:
            raise self._backend.replaced(self.location, expected, generation)

    def _check_unchanged(self) -> None:
        """Raises `ObjectChangedError` when the object is no longer the version pinned (one byte is read).

        A range past the end of a pinned object is then the replacement, not a
        truncated upload. Any failure of this probe leaves the caller's error to be raised.
        """
        if self._generation is None:
            return
        TRAFFIC.add(1)
        try:
            result = deadlines.wait(self._store.read(self._key, byte_range=slice(0, 1)))
        except (ValueError, TimeoutError):
            return  # (an empty new version, or the store failing): the range's own error is raised
        if result.state != "missing":
            self._pin(result.stamp.generation)

    def missing(self) -> BaseException:
        """The error for "no such object": `BucketNotFoundError` when the bucket is missing."""
        return self._backend.missing(self.location, what="no such object")

    def _error(self, error: Exception, start: int, stop: int) -> BaseException:
        typed = self._backend.translate(error, self.location)
        if typed is not error:
            return typed
        if "OUT_OF_RANGE" in str(error):
            return self._truncated(start, stop, " ".join(str(error).split())[:300])
        return error

    def _truncated(self, start: int, stop: int, said: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{self.url!r} is shorter than its own header says: bytes {start}..{stop} "
            f"cannot be read ({said}). The object is truncated or damaged. Fix: upload it again."
        )

    def read(self, start: int, stop: int) -> bytes:
        """Bytes `[start, stop)` of the object, in one request."""
        if stop <= start:
            return b""
        return self._result(self._request(start, stop), start, stop)

    def check_end(self, end: int) -> None:
        """Raises `CorruptCheckpointError` unless the object has at least `end` bytes."""
        if end > 0:
            self.read(end - 1, end)

    @property
    def size(self) -> int:
        """The object's size in bytes, for the file object h5py and zipfile seek in.

        The kvstore API reports no object size, so it comes from the object
        itself: an HDF5 file's is its superblock's end-of-file address
        (checked to exist), a zip's follows from its end record (in its last
        64 KiB); an object too short for a probe is named with its size in
        TensorStore's refusal.
        """
        if self._size is None:
            self._size = self._probe_size()
        return self._size

    def _probe_size(self) -> int:
        head = self._probe(slice(0, 64))
        if isinstance(head, int):
            return head  # shorter than 64 bytes: its size came with the refusal
        if head.startswith(_HDF5_MAGIC):
            size = sizing.hdf5_end(head, self.url)
            self.check_end(size)
            return size
        tail = self._probe(slice(-_TAIL, None))
        if isinstance(tail, int):
            return tail
        zip_size = sizing.zip_end(tail)
        if zip_size is None:
            raise CorruptCheckpointError(
                f"{self.url!r} is neither an HDF5 file nor a zip archive with its end "
                "record: it is truncated or no .weights.h5 / .keras file. Fix: upload it again."
            )
        return zip_size

    def _probe(self, byte_range: slice) -> bytes | int:
        """The bytes of `byte_range`, or the object's size when it is too short for them.

        TensorStore refuses a range the object cannot fill (OUT_OF_RANGE) and
        names the object's total size in the refusal.
        """
        TRAFFIC.add(abs((byte_range.stop or 0) - byte_range.start))
        try:
            result = deadlines.wait(self._store.read(self._key, byte_range=byte_range))
        except (ValueError, TimeoutError) as e:
            found = re.search(r"total size (\d+)", str(e)) if "OUT_OF_RANGE" in str(e) else None
            if found is None:
                raise self._error(e, byte_range.start, byte_range.stop or 0) from e
            return int(found.group(1))
        if result.state == "missing":
            raise self.missing()
        self._pin(result.stamp.generation)
        return bytes(result.value)

    def read_box(self, offset: int, shape: tuple[int, ...], dtype: np.dtype, box: Box) -> np.ndarray:
        """`box` of the C-ordered array of `shape` and `dtype` stored at byte `offset`, as a new array.

        Only the box's bytes are requested (plus gaps under `GAP` between its
        runs), in concurrent requests of at most `PART` bytes.
        """
        dtype = np.dtype(dtype)
        out = aligned_empty(tuple(s.stop - s.start for s in box), dtype)
        if out.size:
            self.read_runs(offset, _runs(shape, dtype.itemsize, box), out.reshape(-1).view(np.uint8))
        return out

    def read_strided(
        self, offset: int, dtype: np.dtype, first: int, shape: tuple[int, ...], strides: tuple[int, ...]
    ) -> np.ndarray:
        """`stored.flat[first + i . strides]` for each index `i` of `shape`, of the
        flat array of `dtype` stored at byte `offset` (see `hf_remap.Fetch`).

        Only those elements are requested: in the stored order (strides
        sorted), the axis of stride 1 makes the runs. Returns a view (axes
        in the order asked) of one new buffer.
        """
        dtype = np.dtype(dtype)
        if 0 in shape:
            return np.empty(shape, dtype)
        strides = tuple(strides)
        flips = [d for d, st in enumerate(strides) if st < 0]
        for d in flips:  # read in increasing order, flip back at the end
            first += (shape[d] - 1) * strides[d]
        strides = tuple(abs(st) for st in strides)
        order = sorted(range(len(shape)), key=lambda d: -strides[d])  # stored order: outer first
        tshape = tuple(shape[d] for d in order)
        tstrides = [strides[d] for d in order]
        run = tshape[-1] if tshape and tstrides[-1] == 1 else 1
        outer = tshape[:-1] if run > 1 or not tshape else tshape
        starts = np.array([first], np.int64)
        for n, st in zip(outer, tstrides[: len(outer)], strict=True):
            starts = (starts[:, None] + np.arange(n, dtype=np.int64)[None, :] * st).reshape(-1)
        size = dtype.itemsize
        runs = [(int(a) * size, (int(a) + run) * size) for a in starts]
        buffer = aligned_empty(tshape, dtype)
        self.read_runs(offset, runs, buffer.reshape(-1).view(np.uint8))
        view = buffer.transpose(np.argsort(order))
        return np.flip(view, tuple(flips)) if flips else view

    def read_runs(self, offset: int, runs: list[tuple[int, int]], out: np.ndarray) -> None:
        """Reads byte runs `[a, b)` (after `offset`, ascending) into `out`, one after another."""
        pos = 0
        requests = _merge(runs)
        for (start, _, members), data in zip(requests, self._fetch(offset, requests), strict=True):
            view = memoryview(data)
            for a, b in members:
                n = b - a
                out[pos : pos + n] = np.frombuffer(view[a - start : b - start], np.uint8)
                pos += n
            del view, data

    def _fetch(self, offset: int, requests: list[tuple[int, int, list[tuple[int, int]]]]) -> Iterator[bytes]:
        """The requests' bytes, in order, issued ahead as far as `_IN_FLIGHT` allows.

        A thread waits for room only when it holds none (nothing pending), so
        threads never wait on each other while holding bytes.
        """
        pending: collections.deque[tuple[Any, int, int, int]] = collections.deque()
        it = iter(requests)
        nxt = next(it, None)
        try:
            while nxt is not None or pending:
                while nxt is not None:
                    size = nxt[1] - nxt[0]
                    held = _IN_FLIGHT.try_acquire(size) if pending else _IN_FLIGHT.acquire(size)
                    if held is None:
                        break
                    start, stop = offset + nxt[0], offset + nxt[1]
                    pending.append((self._request(start, stop), start, stop, held))
                    nxt = next(it, None)
                future, start, stop, held = pending.popleft()
                try:
                    data = self._result(future, start, stop)
                finally:
                    _IN_FLIGHT.release(held)
                yield data
        finally:
            for _, _, _, held in pending:  # an error or an abandoned read
                _IN_FLIGHT.release(held)

    def open(self) -> io.BufferedReader:
        """A read-only, seekable file object over the object (see `RemoteFile`)."""
        return io.BufferedReader(RemoteFile(self), buffer_size=8192)


def _runs(shape: tuple[int, ...], itemsize: int, box: Box) -> list[tuple[int, int]]:
    """Byte ranges `[a, b)` of `box` in a C-ordered array of `shape`, in order."""
    nd = len(shape)
    if nd == 0:
        return [(0, itemsize)]
    # Axes after `k` are covered whole: one run spans them and box[k].
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


def _merge(runs: list[tuple[int, int]]) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """Groups runs into requests `(start, stop, runs)`: gaps under `GAP`, at most `PART` bytes.

    A gap joins a request only while the request's gaps stay within `WASTE`
    of its wanted bytes: the columns of a column-sharded kernel that another
    process (or device) holds are not requested, so each process asks for
    little more than its own pieces.
    """
    out: list[tuple[int, int, list[tuple[int, int]]]] = []
    wanted = 0  # bytes of the runs in out[-1]
    for a, b in runs:
        while b - a > PART:  # a long run: parts of its own, read concurrently
            out.append((a, a + PART, [(a, a + PART)]))
            a += PART
            wanted = PART
        if out:
            start, stop, members = out[-1]
            gap = a - stop
            joined = wanted + b - a
            if 0 <= gap <= GAP and b - start <= PART and (b - start) - joined <= WASTE * joined:
                members.append((a, b))
                out[-1] = (start, b, members)
                wanted = joined
                continue
        out.append((a, b, [(a, b)]))
        wanted = b - a
    return out


class RemoteFile(io.RawIOBase):
    """A read-only seekable file over a `RemoteObject`, as `h5py.File` and `zipfile` want.

    Reads are served from a cache of `CACHE_BLOCKS` blocks of `BLOCK` bytes
    (least recently used out); a read of a block or more bypasses it.
    """

    def __init__(self, obj: RemoteObject) -> None:
        super().__init__()
        self.obj = obj
        self.name = obj.url
        self._pos = 0
        self._blocks: collections.OrderedDict[int, bytes] = collections.OrderedDict()
        self._lock = threading.Lock()

    def readable(self) -> bool:
        return True

    def drop_cache(self) -> None:
        """Frees the cached blocks (once a reader has read the file's metadata)."""
        with self._lock:
            self._blocks.clear()

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            pos = offset
        elif whence == io.SEEK_CUR:
            pos = self._pos + offset
        elif whence == io.SEEK_END:
            pos = self.obj.size + offset
        else:
            raise ValueError(f"whence must be 0, 1 or 2. Received: {whence}")
        if pos < 0:
            raise OSError(f"negative seek position {pos} in {self.name!r}")
        self._pos = pos
        return pos

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        size = self.obj.size
        n = max(0, min(len(out), size - self._pos))
        if n == 0:
            return 0
        start = self._pos
        if n >= BLOCK:
            out[:n] = self.obj.read(start, start + n)
        else:
            done = 0
            while done < n:
                pos = start + done
                block = self._block(pos // BLOCK, size)
                at = pos % BLOCK
                take = min(n - done, len(block) - at)
                out[done : done + take] = block[at : at + take]
                done += take
        self._pos = start + n
        return n

    def _block(self, index: int, size: int) -> bytes:
        with self._lock:
            block = self._blocks.get(index)
            if block is not None:
                self._blocks.move_to_end(index)
                return block
        start = index * BLOCK
        block = self.obj.read(start, min(size, start + BLOCK))
        with self._lock:
            self._blocks[index] = block
            while len(self._blocks) > CACHE_BLOCKS:
                self._blocks.popitem(last=False)
        return block
