"""Writes Keras `.weights.h5` files whose datasets are filled later, piece by piece.

Every dataset is created contiguous, uncompressed and allocated early (its
bytes reserved at creation, no fill written), as Keras' own `save_weights`
leaves its datasets contiguous. The file is closed before any data is
written: each dataset's bytes are then a fixed byte range of the file
(`dataset.id.get_offset()`), which the pieces' writers fill at their offsets
(`shardckpt.formats.mapped_writer`), one process or several, with no HDF5
library call and no full tensor in memory.

Groups and their attributes follow Keras' `H5IOStore`: `<object path>/vars`
with the object's metadata as attributes (`name`), datasets `0`, `1`, ...;
bfloat16 datasets carry `attrs["dtype"] = "bfloat16"` as Keras writes them.
Sharded files follow Keras' `ShardedH5IOStore`: `<stem>_0000i.weights.h5`
and `<stem>.weights.json` (`{"metadata": ..., "weight_map": {"/<group>/vars":
file}}`), no group split across files.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence

import h5py
import ml_dtypes
import numpy as np

from shardckpt.formats.base import ArraySpec
from shardckpt.formats.safetensors_writer import TensorSlot

_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


def group_of(key: str) -> str:
    """`layers/dense/vars/0` -> `layers/dense/vars`."""
    return key.rsplit("/", 1)[0]


def _dataset(group: h5py.Group, name: str, spec: ArraySpec) -> h5py.Dataset:
    # bfloat16 has no HDF5 type: Keras stores its bytes as h5py stores
    # ml_dtypes' bfloat16 (an opaque 2-byte type) with a dtype attribute.
    if spec.dtype == _BFLOAT16:
        tid = h5py.h5t.py_create(_BFLOAT16)
    else:
        tid = h5py.h5t.py_create(spec.dtype, logical=True)
    space = h5py.h5s.create_simple(tuple(spec.shape)) if spec.shape else h5py.h5s.create(h5py.h5s.SCALAR)
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_layout(h5py.h5d.CONTIGUOUS)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)  # bytes reserved now: an offset exists
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    dcpl.set_obj_track_times(False)  # no timestamps: equal exports are equal files
    dsid = h5py.h5d.create(group.id, name.encode(), tid, space, dcpl=dcpl)
    dataset = h5py.Dataset(dsid)
    if spec.dtype == _BFLOAT16:
        dataset.attrs["dtype"] = "bfloat16"
    return dataset


def create(path: str, specs: Mapping[str, ArraySpec], groups: Mapping[str, Mapping[str, str]],
           *, empty_groups: bool = True) -> dict[str, int]:
    """Creates `path` with every dataset of `specs` allocated; returns their byte offsets.

    Args:
        path: The file.
        specs: `{"<object path>/vars/<i>": spec}`, in Keras' save order.
        groups: `{"<object path>/vars": attributes}` for the groups to create
            (Keras creates one for each object that stores a variable).
        empty_groups: Also create the groups of `groups` that hold no
            dataset here (Keras creates a named object's group even when it
            has no variable); for sharded files only in the first.

    Returns:
        `{key: byte offset}`; a zero-sized dataset has no bytes and no entry.
    """
    offsets: dict[str, int] = {}
    with h5py.File(path, "w") as f:
        made: dict[str, h5py.Group] = {}
        for name, attrs in groups.items():
            if attrs and (name in made or not empty_groups):
                continue
            if attrs:  # Keras creates a group with metadata even with no variable in it
                made[name] = f.require_group(name)
                for attr, value in attrs.items():
                    made[name].attrs[attr] = value
        for key, spec in specs.items():
            name = group_of(key)
            group = made.get(name)
            if group is None:
                group = made[name] = f.require_group(name)
                for attr, value in groups.get(name, {}).items():
                    group.attrs[attr] = value
            dataset = _dataset(group, key.rsplit("/", 1)[1], spec)
            offset = dataset.id.get_offset()
            if offset is not None:
                offsets[key] = int(offset)
    return offsets


def plan_files(specs: Mapping[str, ArraySpec], max_shard_bytes: int | None, *, stem: str) -> dict[str, list[str]]:
    """Keys per file: `<stem>.weights.h5`, or Keras' shards (whole groups per file)."""
    if max_shard_bytes is None:
        return {f"{stem}.weights.h5": list(specs)}
    by_group: dict[str, list[str]] = {}
    for key in specs:
        by_group.setdefault(group_of(key), []).append(key)
    files: list[list[str]] = [[]]
    size = 0
    for keys in by_group.values():
        nbytes = sum(specs[k].nbytes for k in keys)
        if files[-1] and size + nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].extend(keys)
        size += nbytes
    return {f"{stem}_{i:05d}.weights.h5": keys for i, keys in enumerate(files)}


def create_files(folder: str, specs: Mapping[str, ArraySpec], files: Mapping[str, Sequence[str]],
                 groups: Mapping[str, Mapping[str, str]], *, index: str | None = None) -> dict[str, TensorSlot]:
    """Creates every file; for sharded files also Keras' `<stem>.weights.json` index."""
    slots: dict[str, TensorSlot] = {}
    for i, (name, keys) in enumerate(files.items()):
        offsets = create(os.path.join(folder, name), {k: specs[k] for k in keys}, groups, empty_groups=i == 0)
        slots.update({k: TensorSlot(file=name, offset=offsets[k], spec=specs[k]) for k in keys if k in offsets})
    if index is not None:
        weight_map: dict[str, str | list[str]] = {}
        for name, keys in files.items():
            for group in dict.fromkeys(group_of(k) for k in keys):
                weight_map[f"/{group}"] = name
        with open(os.path.join(folder, index), "w", encoding="utf-8") as f:
            total = float(sum(s.nbytes for s in specs.values()))  # Keras writes a float
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=4)
    return slots
