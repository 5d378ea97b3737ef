"""`.safetensors` files and `*.safetensors.index.json` shard sets.

The format is an 8-byte little-endian header length, a JSON header mapping
each key to dtype, shape and a byte range, then raw little-endian data. The
header is parsed as JSON (nothing is executed or unpickled) and validated
against the file size; each box is then a numpy slice of a read-only memory
map, so a device's piece reads only its own bytes. The `safetensors` package
is not used because its numpy binding cannot return bfloat16 and reads whole
tensors for strided slices.
"""

from __future__ import annotations

import json
import mmap
import os
from typing import Any

import numpy as np

from shardckpt import storage
from shardckpt.errors import CheckpointNotFoundError, CorruptCheckpointError
from shardckpt.formats.base import DTYPES, ArraySpec, Box, MappedReader, region, strided

_MAX_HEADER = 100 * 1024 * 1024  # the reference implementation's own limit


class _File:
    def __init__(self, location: storage.Location, path: str) -> None:
        self.path = path
        self.map: mmap.mmap | None = None
        self.remote: Any = None
        self._fh: Any = None
        if location.local_path is None:
            # In a store: the header by two ranged reads, arrays box by box.
            self.remote = storage.backend(location).ranged(location)
            head = self.remote.read(0, 8)
            n = int.from_bytes(head, "little")
            if n > _MAX_HEADER:
                raise _corrupt(path, f"header length {n} is over {_MAX_HEADER}")
            raw = self.remote.read(8, 8 + n)
            size = None
        else:
            if not os.path.isfile(path):
                raise CheckpointNotFoundError(f"No safetensors file at {path!r}.")
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise _corrupt(path, "shorter than its 8-byte header length")
                n = int.from_bytes(head, "little")
                if n > _MAX_HEADER or 8 + n > size:
                    raise _corrupt(path, f"header length {n} does not fit the file size {size}")
                raw = f.read(n)
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise _corrupt(path, f"header is not valid JSON ({e})") from e
        header.pop("__metadata__", None)  # free-form strings, not arrays
        self.entries: dict[str, tuple[ArraySpec, int]] = {}
        data_start = 8 + n
        end_of_data = data_start
        for key, info in header.items():
            try:
                dtype = DTYPES[info["dtype"]]
                shape = tuple(int(d) for d in info["shape"])
                begin, end = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError) as e:
                raise _corrupt(path, f"header entry for {key!r} is malformed ({e!r})") from e
            spec = ArraySpec(shape=shape, dtype=dtype)
            if end - begin != spec.nbytes or (size is not None and data_start + end > size):
                raise _corrupt(
                    path,
                    f"array {key!r} ({info['dtype']}{list(shape)}) needs {spec.nbytes} "
                    f"bytes at {data_start + begin}..{data_start + end}, file has {size}",
                )
            end_of_data = max(end_of_data, data_start + end)
            self.entries[key] = (spec, data_start + begin)
        if self.remote is not None:
            self.remote.check_end(end_of_data)  # a truncated object fails here, not mid-load
        else:
            self._fh = open(path, "rb")
            self.map = mmap.mmap(self._fh.fileno(), 0, access=mmap.ACCESS_READ) if size else None

    def close(self) -> None:
        if self.map is not None:
            self.map.close()
        if self._fh is not None:
            self._fh.close()


def _corrupt(path: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{path!r} is not a valid safetensors file: {what}. It is truncated or "
        "damaged. Fix: re-download or re-save it."
    )


class SafetensorsReader(MappedReader):
    """Reader for one `.safetensors` file or a `*.safetensors.index.json` set.

    Args:
        path: A `.safetensors` file, or an index JSON whose `weight_map` maps
            keys to files in the same folder.

    Raises:
        CheckpointNotFoundError: a file does not exist.
        CorruptCheckpointError: a header is invalid or a file is truncated.
    """

    format = "safetensors"

    def __init__(self, path: str | storage.Location) -> None:
        location = storage.parse(path)
        local = location.local_path
        self.path = location.url if local is None or isinstance(path, storage.Location) else os.fspath(path)
        self._files: dict[str, _File] = {}
        self._where: dict[str, _File] = {}
        if self.path.endswith(".json"):
            data = storage.read_bytes(location) if local is None or os.path.isfile(local) else None
            if data is None:
                raise CheckpointNotFoundError(f"No safetensors index at {self.path!r}.")
            try:
                weight_map = json.loads(data)["weight_map"]
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
                raise CorruptCheckpointError(
                    f"{self.path!r} is not a safetensors index (needs a 'weight_map' "
                    f"object): {e!r}. Fix: pass the index written with the shards."
                ) from e
            folder = location.parent
            for key, name in weight_map.items():
                file = self._open(folder.join(name))
                if key not in file.entries:
                    raise CorruptCheckpointError(
                        f"Index {self.path!r} puts {key!r} in {name!r}, which has no "
                        "such array. Fix: regenerate the index with its shards."
                    )
                self._where[key] = file
        else:
            file = self._open(location, self.path)
            self._where = {k: file for k in file.entries}

    def _open(self, location: storage.Location, path: str | None = None) -> _File:
        path = location.url if path is None else path
        if path not in self._files:
            try:
                self._files[path] = _File(location, path)
            except BaseException:
                self.close()
                raise
        return self._files[path]

    def keys(self) -> list[str]:
        return list(self._where)

    def spec(self, key: str) -> ArraySpec:
        return self._where[key].entries[key][0]

    def view(self, key: str, box: Box) -> np.ndarray:
        """`box` of `key` without a copy: a read-only slice of the memory map.

        In a bucket, a fresh array of the box's bytes only (`RemoteObject.read_box`).
        """
        file = self._where[key]
        spec, offset = file.entries[key]
        if file.remote is not None:
            return file.remote.read_box(offset, spec.shape, spec.dtype, box)
        if file.map is None or spec.nbytes == 0:
            return region(np.zeros(spec.shape, spec.dtype), box)
        return region(np.ndarray(spec.shape, spec.dtype, buffer=file.map, offset=offset), box)

    def read(self, key: str, box: Box) -> np.ndarray:
        if self._where[key].remote is not None:
            return self.view(key, box)  # already a fresh array
        return np.array(self.view(key, box), copy=True, order="C")

    def is_mapped(self, key: str) -> bool:
        """True when `key` lives in a memory-mapped file (not read by ranges)."""
        return self._where[key].remote is None

    def read_strided(self, key: str, first: int, shape: tuple[int, ...], strides: tuple[int, ...]) -> np.ndarray:
        """`key.flat[first + i . strides]` for each index `i` of `shape` (strides in
        elements): from a bucket, only those elements' bytes (`RemoteObject.read_strided`)."""
        file = self._where[key]
        spec, offset = file.entries[key]
        if file.remote is not None:
            return file.remote.read_strided(offset, spec.dtype, first, shape, strides)
        return strided(self.view(key, tuple(slice(0, n) for n in spec.shape)).reshape(-1), first, shape, strides)

    def close(self) -> None:
        for file in self._files.values():
            file.close()
        self._files.clear()

