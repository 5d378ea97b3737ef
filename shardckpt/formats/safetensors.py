"""`.safetensors` files and `*.safetensors.index.json` shard sets.

The format is an 8-byte little-endian header length, a JSON header mapping
each key to dtype, shape and a byte range, then raw little-endian data. The
header is parsed as JSON (nothing is executed or unpickled) and validated
against the file size; each box is then read from the file's
`storage.ByteSource` (a numpy slice of a read-only memory map locally, its
byte runs by ranges in a bucket), so a device's piece reads only its own bytes. The `safetensors` package
is not used because its numpy binding cannot return bfloat16 and reads whole
tensors for strided slices.
"""

from __future__ import annotations

import json

import numpy as np

from shardckpt import storage
from shardckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, UnknownFormatError
from shardckpt.formats.base import DTYPES, ArraySpec, Box, MappedReader
from shardckpt.progress import some

_MAX_HEADER = 100 * 1024 * 1024  # the reference implementation's own limit


class _File:
    """One `.safetensors` file: its header's entries, and its bytes (`storage.ByteSource`)."""

    def __init__(self, location: storage.Location, path: str) -> None:
        self.path = path
        self.source = storage.open_source(location)
        try:
            self.entries = self._parse()
        except BaseException:
            self.source.close()
            raise

    def _parse(self) -> dict[str, tuple[ArraySpec, int]]:
        path = self.path
        head = self.source.probe(slice(0, 8))
        if isinstance(head, int):
            raise _corrupt(path, "shorter than its 8-byte header length")
        n = int.from_bytes(head, "little")
        if n > _MAX_HEADER:
            raise _corrupt(path, f"header length {n} is over {_MAX_HEADER}")
        raw = self.source.probe(slice(8, 8 + n))
        if isinstance(raw, int):
            raise _corrupt(path, f"header length {n} does not fit the file size {raw}")
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise _corrupt(path, f"header is not valid JSON ({e})") from e
        header.pop("__metadata__", None)  # free-form strings, not arrays
        entries: dict[str, tuple[ArraySpec, int]] = {}
        data_start = 8 + n
        end_of_data = data_start
        for key, info in header.items():
            if isinstance(info, dict) and isinstance(info.get("dtype"), str) and info["dtype"] not in DTYPES:
                raise UnknownFormatError(
                    f"Array {key!r} of {path!r} has safetensors dtype {info['dtype']!r}, which shardckpt does not "
                    f"read (it reads {', '.join(DTYPES)}). Fix: convert that tensor to one of these dtypes "
                    f"(for example with the safetensors package), or leave it out of the file. "
                    f"Received: dtype={info['dtype']!r}"
                )
            try:
                dtype = DTYPES[info["dtype"]]
                shape = tuple(int(d) for d in info["shape"])
                begin, end = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError) as e:
                raise _corrupt(path, f"header entry for {key!r} is malformed ({e!r})") from e
            spec = ArraySpec(shape=shape, dtype=dtype)
            if end - begin != spec.nbytes:
                raise _corrupt(
                    path,
                    f"array {key!r} ({info['dtype']}{list(shape)}) needs {spec.nbytes} "
                    f"bytes at {data_start + begin}..{data_start + end}",
                )
            end_of_data = max(end_of_data, data_start + end)
            entries[key] = (spec, data_start + begin)
        self.source.check_end(end_of_data)  # a truncated file fails here, not mid-load
        return entries

    def close(self) -> None:
        self.source.close()


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
        CheckpointNotFoundError: `path` does not exist.
        CorruptCheckpointError: a header is invalid, a file is truncated, or
            a file the index lists does not exist.
        UnknownFormatError: an array's dtype is not one shardckpt reads
            (`formats.base.DTYPES`).
    """

    format = "safetensors"

    def __init__(self, path: str | storage.Location) -> None:
        location = storage.parse(path)
        self.path = storage.shown(path, location)
        self._files: dict[str, _File] = {}
        self._where: dict[str, _File] = {}
        if self.path.endswith(".json"):
            try:
                data = storage.read_bytes(location)
            except IsADirectoryError:
                data = None
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
                file = self._open_listed(folder.join(name), name, [k for k, n in weight_map.items() if n == name])
                if key not in file.entries:
                    raise CorruptCheckpointError(
                        f"Index {self.path!r} puts {key!r} in {name!r}, which has no "
                        "such array. Fix: regenerate the index with its shards."
                    )
                self._where[key] = file
        else:
            file = self._open(location, self.path)
            self._where = {k: file for k in file.entries}

    def _open_listed(self, location: storage.Location, name: str, keys: list[str]) -> _File:
        """Opens a file the index lists; its absence is damage to the set, named with the index."""
        try:
            return self._open(location)
        except CheckpointNotFoundError as e:  # (a missing bucket is `BucketNotFoundError`, raised as is)
            raise CorruptCheckpointError(
                f"The index {self.path!r} puts {len(keys)} array(s) ({some(keys, 4)}) in {name!r}, which does "
                f"not exist at {location.url!r}. Fix: copy (or upload) every .safetensors file the index lists "
                "beside it, or download the set again."
            ) from e

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
        """`box` of `key`: a read-only slice of the memory map where the file has one
        (`is_mapped`), else a fresh array of the box's bytes only."""
        file = self._where[key]
        spec, offset = file.entries[key]
        return file.source.array(offset, spec.shape, spec.dtype, box)

    def read(self, key: str, box: Box) -> np.ndarray:
        file = self._where[key]
        spec, offset = file.entries[key]
        return file.source.read_box(offset, spec.shape, spec.dtype, box)

    def is_mapped(self, key: str) -> bool:
        """True when `view` of `key` is a view of a memory map (no bytes read, no memory held)."""
        return self._where[key].source.mappable

    def read_strided(self, key: str, first: int, shape: tuple[int, ...], strides: tuple[int, ...]) -> np.ndarray:
        """`key.flat[first + i . strides]` for each index `i` of `shape` (strides in
        elements): a view of the memory map, or only those elements' bytes read."""
        file = self._where[key]
        spec, offset = file.entries[key]
        count = int(np.prod(spec.shape, dtype=np.int64))
        return file.source.strided(offset, spec.dtype, count, first, shape, strides)

    def close(self) -> None:
        for file in self._files.values():
            file.close()
        self._files.clear()

