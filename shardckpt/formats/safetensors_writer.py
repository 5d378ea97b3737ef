"""Writes safetensors files whose layout is fixed before any data exists.

The header (names, dtypes, shapes, byte ranges) depends only on specs, so it
is computed and written first and the file is sized to its final length;
every array's bytes then go to a known offset (`TensorSlot`), written by
whichever process owns each piece (`shardckpt.formats.mapped_writer`). No
tensor is ever held whole to write it.

Sharded folders follow Hugging Face's naming: `model-00001-of-00003.safetensors`
plus `model.safetensors.index.json` (`{"metadata": {"total_size": ...},
"weight_map": {key: file}}`); a key is never split across files.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence

import numpy as np

from shardckpt.formats.base import DTYPES, ArraySpec

_NAMES = {dtype: name for name, dtype in DTYPES.items()}
INDEX_SUFFIX = ".index.json"


@dataclasses.dataclass(frozen=True, kw_only=True)
class TensorSlot:
    """Where one array's C-order bytes live in a file.

    Attributes:
        file: The file's name inside the folder.
        offset: Byte offset of the array's first element.
        spec: Shape and dtype.
    """

    file: str
    offset: int
    spec: ArraySpec


def dtype_name(dtype: np.dtype) -> str:
    """The safetensors name of a numpy dtype ("F32", "BF16", ...).

    Raises:
        TypeError: safetensors has no such dtype.
    """
    try:
        return _NAMES[np.dtype(dtype)]
    except KeyError:
        raise TypeError(f"safetensors stores no {np.dtype(dtype)} arrays. Received: dtype={dtype}") from None


def header(specs: Mapping[str, ArraySpec], metadata: Mapping[str, str] | None = None) -> tuple[bytes, dict[str, int]]:
    """The file's first bytes (length + JSON, padded to 8) and each key's data offset.

    Keys are laid out in the mapping's order; offsets are from the file's start.
    """
    entries: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
    relative, cursor = {}, 0
    for key, spec in specs.items():
        entries[key] = {"dtype": dtype_name(spec.dtype), "shape": list(spec.shape),
                        "data_offsets": [cursor, cursor + spec.nbytes]}
        relative[key] = cursor
        cursor += spec.nbytes
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data to 8 bytes
    start = 8 + len(raw)
    return len(raw).to_bytes(8, "little") + raw, {k: start + r for k, r in relative.items()}


def file_size(specs: Mapping[str, ArraySpec], metadata: Mapping[str, str] | None = None) -> int:
    head, _ = header(specs, metadata)
    return len(head) + sum(s.nbytes for s in specs.values())


def plan_files(specs: Mapping[str, ArraySpec], max_shard_bytes: int | None, *, stem: str = "model") -> dict[str, list[str]]:
    """Splits keys (in order) into files of at most `max_shard_bytes` of data.

    A key larger than the limit gets a file of its own. Returns `{file name:
    keys}`: `model.safetensors` when the keys fill one file (no limit, all
    within it, or a lone key larger than it), else Hugging Face's
    `model-0000i-of-0000n.safetensors`.
    """
    groups: list[list[str]] = [[]]
    size = 0
    for key, spec in specs.items():
        if max_shard_bytes is not None and groups[-1] and size + spec.nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += spec.nbytes
    n = len(groups)
    if n == 1:
        # As huggingface_hub's `split_state_dict_into_shards` names a single shard: a lone
        # `model-00001-of-00001.safetensors` would come with no index (`create_folder` writes one
        # for several files), and neither transformers nor keras-hub looks for it.
        return {f"{stem}.safetensors": groups[0]}
    return {f"{stem}-{i + 1:05d}-of-{n:05d}.safetensors": keys for i, keys in enumerate(groups)}


def create(path: str, specs: Mapping[str, ArraySpec], metadata: Mapping[str, str] | None = None) -> dict[str, int]:
    """Writes the header of `path` and sizes it; returns each key's data offset.

    The data region is left as a hole (zeros) for the pieces' writers.
    """
    head, offsets = header(specs, metadata)
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(len(head) + sum(s.nbytes for s in specs.values()))
    return offsets


def create_folder(folder: str, specs: Mapping[str, ArraySpec], files: Mapping[str, Sequence[str]],
                  *, index_name: str = "model.safetensors.index.json") -> dict[str, TensorSlot]:
    """Creates every file of `files` (and the index when there are several)."""
    slots: dict[str, TensorSlot] = {}
    for name, keys in files.items():
        offsets = create(os.path.join(folder, name), {k: specs[k] for k in keys})
        slots.update({k: TensorSlot(file=name, offset=offsets[k], spec=specs[k]) for k in keys})
    if len(files) > 1:
        index = {
            "metadata": {"total_size": sum(s.nbytes for s in specs.values())},
            "weight_map": {k: name for name, keys in files.items() for k in keys},
        }
        with open(os.path.join(folder, index_name), "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2)
    return slots
