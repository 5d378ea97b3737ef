"""Keras 3 `.weights.h5` files and the weights inside `.keras` archives.

Keras writes every variable as its own contiguous, uncompressed HDF5 dataset
(bfloat16 as 2-byte opaque data tagged `dtype="bfloat16"`). A contiguous
dataset is a plain run of bytes at `dataset.id.get_offset()`, so the reader
serves any box from the file's `storage.ByteSource`: a numpy slice of the
memory map of a local file, the box's byte runs read by ranges from a bucket
(strided h5py hyperslab reads are several times slower). Chunked or
compressed datasets, which other writers may produce, go through h5py.

A `.keras` archive is a zip whose `model.weights.h5` member Keras stores
uncompressed, so the same memory map works at the member's data offset.
"""

from __future__ import annotations

import struct
import zipfile
from typing import Any

import h5py
import ml_dtypes
import numpy as np

from shardckpt import storage
from shardckpt.errors import CorruptCheckpointError, ShardckptError
from shardckpt.formats import containers, h5_checks
from shardckpt.formats.base import ArraySpec, Box, MappedReader

_KERAS_WEIGHTS_MEMBER = "model.weights.h5"
_KERAS_ASSETS_FOLDER = "assets/"
"""Where a `.keras` archive keeps its layers' asset files (vocabularies), one folder per saveable."""
_ZIP_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # zip local file header, 30 bytes

_H5_ERRORS: tuple[type[Exception], ...] = (OSError, RuntimeError, ValueError, TypeError, KeyError)
"""What h5py raises on a damaged file: OSError mostly, but a damaged object
header surfaces as a bare RuntimeError ("Object visitation failed (addr
overflow ...)"), and bad attributes or types as ValueError / TypeError /
KeyError. Each becomes a `CorruptCheckpointError` naming the file."""


class _Dataset:
    __slots__ = ("dataset", "spec", "offset")

    def __init__(self, dataset: h5py.Dataset, spec: ArraySpec, offset: int | None):
        self.dataset = dataset
        self.spec = spec
        self.offset = offset  # absolute byte offset of a contiguous dataset in the file, or None


class H5Reader(MappedReader):
    """Reader for `.weights.h5` and `.keras` files.

    Args:
        path: A `.weights.h5` file or a `.keras` archive, local or a
            `gs://` / `s3://` URL (read by byte ranges, see `storage.ranged`).
        shard: The file is one shard of Keras' sharded weights, whose `vars`
            groups may continue in other shards: the caller checks their
            numbering over all shards (`h5_checks.check_vars_numbering`).

    Raises:
        CheckpointNotFoundError: `path` does not exist.
        CorruptCheckpointError: not a readable HDF5 file / zip archive, or its
            header is damaged (see `h5_checks`): a dataset's bytes lie past
            the end of the file (truncated), its stored size is not its shape's,
            two datasets share bytes, a `vars` group's members are not datasets
            numbered `0..n-1`.
    """

    format = "h5"

    def __init__(self, path: str | storage.Location, *, shard: bool = False) -> None:
        location = storage.parse(path)
        self.path = storage.shown(path, location)
        self._zip: zipfile.ZipFile | None = None
        self._member = None
        # A memory map locally, ranged reads in a bucket: h5py and zipfile see
        # a file object over it, arrays are read box by box.
        self._source = containers.open_container(location)
        self._file: Any = None
        try:
            size = self._source.size  # in a bucket, the first request: a missing object raises here
            self._file = self._source.open()
        except BaseException:
            self._source.close()
            raise
        base = 0
        try:
            if zipfile.is_zipfile(self._file):
                self.format = "keras"
                self._zip = zipfile.ZipFile(self._file)
                info = self._zip.getinfo(_KERAS_WEIGHTS_MEMBER)
                base = self._member_data_offset(info)
                self._member = self._zip.open(info)
                self._h5 = h5py.File(self._member, "r")
            else:
                self._h5 = h5py.File(self._file, "r")
        except ShardckptError:  # a bucket's refusal while reading the header
            self._close_files()
            raise
        except KeyError as e:
            self._close_files()
            raise CorruptCheckpointError(
                f"{self.path!r} is a zip archive without {_KERAS_WEIGHTS_MEMBER!r}; "
                "it is not a Keras 3 `.keras` file. Fix: pass a file written by "
                "`model.save(...)` or `model.save_weights(...)`."
            ) from e
        except _H5_ERRORS + (zipfile.BadZipFile, struct.error) as e:
            self._close_files()
            raise CorruptCheckpointError(
                f"Cannot open {self.path!r} as HDF5 / .keras: {e}. The file is "
                "truncated or damaged. Fix: re-create it from its source."
            ) from e
        self._datasets: dict[str, _Dataset] = {}
        extents: list[h5_checks.Extent] = []
        try:
            self._h5.visit(lambda name: self._add(name, base, size, extents))
            h5_checks.check_no_overlap(self.path, extents)
            if not shard:
                h5_checks.check_vars_numbering(self.path, self._datasets)
        except ShardckptError:  # typed already (a truncated array, a bucket's refusal)
            self.close()
            raise
        except _H5_ERRORS as e:
            self.close()
            raise CorruptCheckpointError(
                f"The HDF5 structure of {self.path!r} cannot be read: {type(e).__name__}: {e}. "
                "Its header or an object header is damaged. Fix: re-create it from its source."
            ) from e
        # Metadata is read: the many shards of a sharded preset keep no cached
        # metadata blocks while their arrays are read.
        self._source.drop_cache()

    def _read_at(self, offset: int, n: int) -> bytes:
        return self._source.read(offset, offset + n)

    def _member_data_offset(self, info: zipfile.ZipInfo) -> int:
        if info.compress_type != zipfile.ZIP_STORED:
            return -1  # compressed member: no memory map, h5py reads through zip
        fields = _ZIP_LOCAL_HEADER.unpack(self._read_at(info.header_offset, _ZIP_LOCAL_HEADER.size))
        name_len, extra_len = fields[-2], fields[-1]
        return info.header_offset + _ZIP_LOCAL_HEADER.size + name_len + extra_len

    def _add(self, name: str, base: int, size: int, extents: list[h5_checks.Extent]) -> None:
        try:
            obj = self._h5[name]
        except _H5_ERRORS as e:  # HDF5 refuses a data address past the file's end here
            raise CorruptCheckpointError(
                f"The header of {name!r} in {self.path!r} is damaged: {type(e).__name__}: {e}. "
                "Fix: re-create the file from its source (re-save the weights, or copy it again)."
            ) from e
        h5_checks.check_vars_member(self.path, name, isinstance(obj, h5py.Dataset))
        if not isinstance(obj, h5py.Dataset):
            return
        dtype = obj.dtype
        if obj.attrs.get("dtype") == "bfloat16":
            dtype = np.dtype(ml_dtypes.bfloat16)
        spec = ArraySpec(shape=tuple(int(n) for n in obj.shape), dtype=np.dtype(dtype))
        offset = None
        raw = obj.id.get_offset()
        # Variable-length data (strings) holds heap references, not values:
        # never served from bytes; h5py reads it, `verify` skips it.
        plain = not spec.dtype.hasobject
        if plain and base >= 0 and raw is not None and obj.chunks is None and obj.compression is None:
            offset = base + raw
            extent = h5_checks.Extent(name, offset, spec.nbytes, int(obj.id.get_storage_size()))
            h5_checks.check_extent(self.path, extent, size)
            extents.append(extent)
        self._datasets[name] = _Dataset(obj, spec, offset)

    def keys(self) -> list[str]:
        return list(self._datasets)

    def spec(self, key: str) -> ArraySpec:
        return self._datasets[key].spec

    def is_mapped(self, key: str) -> bool:
        """True when `view` of `key` is a view of a memory map (no bytes read, no memory held)."""
        return self._source.mappable and self._datasets[key].offset is not None

    def view(self, key: str, box: Box) -> np.ndarray:
        """`box` of `key`: a view of the memory map where the file has one (`is_mapped`),
        else a fresh array (ranged reads of the box's bytes, or h5py)."""
        entry = self._datasets[key]
        if entry.offset is None:
            return self.read(key, box)
        return self._source.array(entry.offset, entry.spec.shape, entry.spec.dtype, box)

    def read(self, key: str, box: Box) -> np.ndarray:
        entry = self._datasets[key]
        spec = entry.spec
        if entry.offset is not None:
            return self._source.read_box(entry.offset, spec.shape, spec.dtype, box)
        try:
            data = entry.dataset[box] if spec.shape else entry.dataset[()]
        except _H5_ERRORS as e:
            raise CorruptCheckpointError(
                f"Reading array {key!r} of {self.path!r} failed: {e}. The file is "
                "damaged. Fix: re-create it from its source."
            ) from e
        return np.asarray(np.asarray(data).view(spec.dtype), order="C")

    def assets(self) -> dict[str, Any] | None:
        """A `.keras` archive's asset files as `{folder: {... file: uint8 array}}`; None for a `.weights.h5`.

        Only the `assets/` members are read (never the weights member), the
        tree `keras.saving.load_model` gives the layers' `load_assets`.
        """
        if self._zip is None:
            return None
        tree: dict[str, Any] = {}
        for info in self._zip.infolist():
            if info.is_dir() or not info.filename.startswith(_KERAS_ASSETS_FOLDER):
                continue
            *folders, name = info.filename[len(_KERAS_ASSETS_FOLDER):].split("/")
            node = tree
            for folder in folders:
                node = node.setdefault(folder, {})
            node[name] = np.frombuffer(self._zip.read(info), np.uint8)
        return tree

    def close(self) -> None:
        self._datasets.clear()
        self._h5.close()
        self._close_files()

    def _close_files(self) -> None:
        if self._member is not None:
            self._member.close()
        if self._zip is not None:
            self._zip.close()
        if self._file is not None:
            self._file.close()
        self._source.close()
