"""Objects in buckets read by byte ranges: nothing is downloaded whole.

`.weights.h5`, `.keras` and `.safetensors` objects in `gs://` / `s3://`
buckets are read through TensorStore's kvstore of the bucket (the same
kvstore spec, credentials, endpoints and deadlines as Orbax checkpoints
there) with ranged reads (`KvStore.read(key, byte_range=...)`):

- `RemoteObject` is the `ByteSource` of an object: its `read_into` reads
  runs of bytes (a box of an h5 dataset or a safetensors tensor, as
  `byteplan` lists them), neighbours closer than `GAP` merged into one
  request, requests cut at `PART` bytes and issued concurrently, at most
  `INFLIGHT_BYTES` in flight in the process;
- `RemoteFile` is a read-only seekable file object over an object (what
  `h5py.File` and `zipfile` need for their metadata), with a small bounded
  cache of `BLOCK`-sized blocks so HDF5's many small metadata reads do not
  each become a request.

Every read of a `RemoteObject` is pinned to one version of the object: each
answer carries the version that served it (TensorStore's storage generation:
the object generation on GCS, the ETag on S3), the first one is kept, and an
answer from any other version raises `ObjectChangedError`, so an object
replaced in the middle of a load never yields a mix of old and new bytes.

`shardckpt.storage.open_source` gives one of these for an object in a
bucket, and a `MappedFile` for a local file; the readers do not tell them apart.
"""

from __future__ import annotations

import collections
import io
import re
import threading
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np
import tensorstore as ts

from shardckpt.budget import Budget
from shardckpt.errors import CorruptCheckpointError
from shardckpt.storage import byteplan, deadlines
from shardckpt.storage.byteplan import Run
from shardckpt.storage.bytesource import ByteSource, Sizer
from shardckpt.storage.location import Location

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
_UNBOUNDED = 1 << 60  # a range no object fills: its refusal names the object's size


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


class Store(Protocol):
    """What a `RemoteObject` asks of the object store it reads from (an `ObjectStore`).

    Declared here, beside its one user, so that this module needs nothing of
    the store's own module: the store builds its objects, not the other way round.
    """

    def open(self, location: Location) -> ts.KvStore:
        """TensorStore's kvstore of the folder `location`."""
        ...

    def translate(self, error: BaseException, location: Location, *, action: str = "reading") -> BaseException:
        """A typed error for a failed request, or `error` itself."""
        ...

    def missing(self, location: Location, *, what: str) -> BaseException:
        """The error for a missing object."""
        ...

    def replaced(self, location: Location, expected: bytes, found: bytes) -> BaseException:
        """The error for a read served by another version than the one pinned."""
        ...


class RemoteObject(ByteSource):
    """One object in a bucket, read by byte ranges (a `ByteSource`).

    Args:
        location: The object.
        store: Its backend.
        sizer: How the object's size is learnt from its bytes (see `size`).

    Raises:
        CheckpointNotFoundError: (on the first read) the object does not exist.
    """

    def __init__(self, location: Location, store: Store, sizer: Sizer | None = None) -> None:
        self.location = location
        self._sizer = sizer
        self.url = location.url
        self._backend = store
        self._store = store.open(location.parent)
        self._key = location.name.encode()
        self._size: int | None = None
        self._generation: bytes | None = None  # the version every read must come from
        self._pin_lock = threading.Lock()
        self._opened: list[RemoteFile] = []

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
        """The object's size in bytes, learnt from the object itself.

        The kvstore API reports no object size, so the format that opened the
        object sizes it from its own header (the `Sizer` it passed to
        `storage.open_source`, say from an HDF5 superblock); without one, the
        object's size is what TensorStore names when it refuses a range past
        the end.
        """
        if self._size is None:
            self._size = self._sizer(self) if self._sizer is not None else self._refused_size()
        return self._size

    def _refused_size(self) -> int:
        found = self.probe(slice(0, _UNBOUNDED))
        if isinstance(found, int):
            return found
        raise CorruptCheckpointError(f"{self.url!r} is larger than {_UNBOUNDED} bytes: it cannot be a checkpoint file.")

    def probe(self, byte_range: slice) -> bytes | int:
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

    def read_into(self, buffer: np.ndarray, runs: list[Run], *, offset: int = 0) -> None:
        """Reads the runs (ascending) into `buffer`, one after another: runs closer than
        `GAP` share a request, requests are at most `PART` bytes and run concurrently."""
        pos = 0
        requests = byteplan.merge(runs, gap=GAP, waste=WASTE, part=PART)
        for request, data in zip(requests, self._fetch(offset, requests), strict=True):
            view = memoryview(data)
            for a, b in request.runs:
                n = b - a
                buffer[pos : pos + n] = np.frombuffer(view[a - request.start : b - request.start], np.uint8)
                pos += n
            del view, data

    def _fetch(self, offset: int, requests: list[byteplan.Request]) -> Iterator[bytes]:
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
                    size = nxt.stop - nxt.start
                    held = _IN_FLIGHT.try_acquire(size) if pending else _IN_FLIGHT.acquire(size)
                    if held is None:
                        break
                    start, stop = offset + nxt.start, offset + nxt.stop
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
        raw = RemoteFile(self)
        self._opened.append(raw)
        return io.BufferedReader(raw, buffer_size=8192)

    def drop_cache(self) -> None:
        """Frees the cached blocks of every file object `open` gave."""
        for raw in self._opened:
            raw.drop_cache()


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
