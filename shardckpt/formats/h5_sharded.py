"""Keras' sharded weights: a `.weights.json` index and its `.weights.h5` shards.

`model.save_weights("m.weights.json", max_shard_size=GB)` (Keras 3; keras-hub
presets above their `max_shard_size`) writes an index

    {"metadata": {"total_size": ...},
     "weight_map": {"/layers/dense/vars": "m_00000.weights.h5" | [files], ...}}

and shard files holding the same HDF5 group paths a single `.weights.h5`
would, each dataset whole in one file. So the keys are exactly those of the
single file (`layers/dense/vars/0`), and each key is served by the
`H5Reader` (memory-mapped) of the shard that holds it.

The index is checked completely when the reader opens, before any array is
read: every shard path stays inside the index's folder, every shard exists,
every group lies in the file(s) the index names, and each `vars` group's
datasets, over all shards, are numbered `0..n-1`. A problem raises a typed
error naming the group and the file, so a load fails before it touches a
variable.
"""

from __future__ import annotations

import numpy as np

from shardckpt import storage
from shardckpt.errors import CheckpointNotFoundError, CorruptCheckpointError
from shardckpt.formats import h5_checks
from shardckpt.formats.base import ArraySpec, Box, MappedReader
from shardckpt.formats.h5 import H5Reader


class ShardedH5Reader(MappedReader):
    """Reader for a Keras sharded `.weights.json` index and its shard files.

    Args:
        path: The `.weights.json` index.

    Raises:
        CheckpointNotFoundError: the index or a shard it names does not exist.
        CorruptCheckpointError: the index is not valid JSON / has no
            `weight_map`, names a file outside its folder, or a group is not
            in the shard the index names; or a shard is damaged.
    """

    format = "h5-sharded"

    def __init__(self, path: str | storage.Location) -> None:
        location = storage.parse(path)
        self.path = storage.shown(path, location)
        weight_map = _read_index(location)
        folder = location.parent
        self._shards: dict[str, H5Reader] = {}
        self._where: dict[str, H5Reader] = {}
        try:
            for group, names in weight_map.items():
                for name in names:
                    shard = self._open(folder, group, name)
                    self._route(group, name, shard)
            # Keras may continue a `vars` group in the next shard: numbered over all of them.
            h5_checks.check_vars_numbering(self.path, self._where)
        except BaseException:
            self.close()
            raise

    def _open(self, folder: storage.Location, group: str, name: str) -> H5Reader:
        if name in self._shards:
            return self._shards[name]
        full = storage.child(folder, name)
        if full is None:
            raise CorruptCheckpointError(
                f"The index {self.path!r} puts group {group!r} in {name!r}, which is "
                f"outside the index's folder {folder.url!r}. Shards must sit beside the "
                "index. Fix: re-save the weights, or correct the index."
            )
        try:
            shard = H5Reader(full, shard=True)
        except CheckpointNotFoundError as e:
            raise CheckpointNotFoundError(
                f"Shard {name!r} of {self.path!r} (holding group {group!r}) does not "
                f"exist at {full.url!r}. Fix: copy (or upload) every *.weights.h5 shard "
                "listed in the index next to it."
            ) from e
        self._shards[name] = shard
        return shard

    def _route(self, group: str, name: str, shard: H5Reader) -> None:
        prefix = group.strip("/") + "/"
        found = [k for k in shard.keys() if k.startswith(prefix) and "/" not in k[len(prefix) :]]
        if not found:
            raise CorruptCheckpointError(
                f"The index {self.path!r} puts group {group!r} in {name!r}, but that "
                "file holds no dataset under it. Fix: re-save the weights; the index "
                "and the shards come from different saves."
            )
        for key in found:
            other = self._where.get(key)
            if other is not None and other is not shard:
                raise CorruptCheckpointError(
                    f"Array {key!r} is stored twice, in {other.path.rsplit('/', 1)[-1]!r} "
                    f"and {name!r}, of the sharded weights {self.path!r}. Fix: re-save "
                    "the weights."
                )
            self._where[key] = shard

    def keys(self) -> list[str]:
        return list(self._where)

    def spec(self, key: str) -> ArraySpec:
        return self._where[key].spec(key)

    def is_mapped(self, key: str) -> bool:
        return self._where[key].is_mapped(key)

    def view(self, key: str, box: Box) -> np.ndarray:
        """`box` of `key` without a copy (see `H5Reader.view`)."""
        return self._where[key].view(key, box)

    def read(self, key: str, box: Box) -> np.ndarray:
        return self._where[key].read(key, box)

    def close(self) -> None:
        for shard in self._shards.values():
            shard.close()
        self._shards.clear()
        self._where.clear()


def _read_index(location: storage.Location) -> dict[str, list[str]]:
    """Returns the index's weight map, every value as a list of file names."""
    path = location.url
    index = storage.read_json(location, fix="re-save the weights with model.save_weights(..., max_shard_size=...).")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CorruptCheckpointError(
            f"{path!r} has no 'weight_map' object; it is not a Keras sharded weights "
            "index. Fix: pass the .weights.json written by model.save_weights(..., "
            "max_shard_size=...)."
        )
    out: dict[str, list[str]] = {}
    for group, names in weight_map.items():
        names = [names] if isinstance(names, str) else names
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            raise CorruptCheckpointError(
                f"The index {path!r} maps group {group!r} to {names!r}; expected a file "
                "name or a list of them. Fix: re-save the weights."
            )
        out[str(group)] = names
    return out


def is_sharded_index(path: str | storage.Location) -> bool:
    """True for a JSON file with a `weight_map` of `.h5` files (a Keras index)."""
    location = storage.parse(path)
    if location.endswith(".weights.json"):
        return True
    try:
        # A bucket's refusal (403, no bucket) is no answer: its typed error goes up.
        index = storage.read_json(location, fix="", missing_ok=True)
    except (CorruptCheckpointError, IsADirectoryError):
        return False
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        return False
    first = next(iter(weight_map.values()))
    first = first[0] if isinstance(first, list) and first else first
    return isinstance(first, str) and first.endswith(".h5")
