"""`inspect(path) -> CheckpointInfo`: what a checkpoint holds, without loading it.

Shapes and dtypes come from each format's metadata through the same readers
`load_sharded` uses (`shardckpt.formats`), so no array data is read. For an
Orbax checkpoint written by `shardckpt.OrbaxCheckpoint` the step's metadata
item and data-iterator state are read too (small JSON files).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

from shardckpt import storage
from shardckpt.formats import open_reader
from shardckpt.formats.orbax import ondisk
from shardckpt.natsort import natural_sorted


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArrayInfo:
    """One array of a checkpoint.

    Attributes:
        key: Its key ('/'-separated; Orbax: the state-tree path).
        shape: Global shape.
        dtype: Numpy dtype name.
        nbytes: Size in bytes, uncompressed.
    """

    key: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int


@dataclasses.dataclass(kw_only=True)
class CheckpointInfo:
    """What `inspect` found.

    Attributes:
        path: The file or folder described (for Orbax: the step folder).
        format: The format's name in `shardckpt.formats.FORMATS` ("h5", "orbax", ...).
        step: The Orbax step described, else None.
        steps: Every committed step of the Orbax root, ascending ([] otherwise).
        incomplete: Names of half-written Orbax steps (ignored by restore).
        items: Orbax checkpointables of the step ("pytree", "model_config", ...).
        arrays: The arrays, in natural order of their keys (`dense_2` before `dense_10`).
        metadata: The step's shardckpt metadata item, or None.
        iterator_state: The saved data-iterator states (one per process), or None.
    """

    path: str
    format: str
    step: int | None = None
    steps: list[int] = dataclasses.field(default_factory=list)
    incomplete: list[str] = dataclasses.field(default_factory=list)
    items: list[str] = dataclasses.field(default_factory=list)
    arrays: list[ArrayInfo] = dataclasses.field(default_factory=list)
    metadata: dict[str, Any] | None = None
    iterator_state: list[Any] | None = None

    @property
    def total_bytes(self) -> int:
        """Bytes of all arrays, uncompressed."""
        return sum(a.nbytes for a in self.arrays)

    def summary(self) -> list[str]:
        """The lines above the array table: steps, items, metadata, iterator state.

        Shared by `__str__` and `shardckpt inspect`, which prints the arrays
        as a rich table instead.
        """
        lines = []
        if self.steps:
            lines.append(f"steps: {self.steps} (showing {self.step})")
        if self.incomplete:
            lines.append(f"half-written (ignored): {self.incomplete}")
        if self.items:
            lines.append(f"items: {', '.join(self.items)}")
        if self.metadata:
            meta = self.metadata
            lines.append(
                f"epoch {meta.get('epoch')} batch {meta.get('batch')} "
                f"(epoch complete: {meta.get('epoch_complete')}), logs {meta.get('logs')}"
            )
            if meta.get("user") is not None:
                lines.append(f"user metadata: {_brief(meta['user'], repr)}")
            shown = {"epoch", "batch", "epoch_complete", "logs", "user"}
            rest = {k: v for k, v in meta.items() if k not in shown}
            if rest:  # versions, layout, save settings: for whoever debugs a resume
                lines.append(f"metadata: {_brief(rest, lambda v: json.dumps(v, default=str))}")
        if self.iterator_state is not None:
            lines.append(f"data iterator: {_brief(self.iterator_state, repr)}")
        return lines

    def __str__(self) -> str:
        lines = [f"{self.format} checkpoint {self.path!r}"] + [f"  {line}" for line in self.summary()]
        width = max([len(a.key) for a in self.arrays] + [3])
        lines.append(f"  {'key':<{width}}  {'shape':<18} {'dtype':<9} {'bytes':>12}")
        for a in self.arrays:
            lines.append(f"  {a.key:<{width}}  {str(a.shape):<18} {a.dtype:<9} {a.nbytes:>12,}")
        lines.append(f"  {len(self.arrays)} arrays, {self.total_bytes:,} bytes")
        return "\n".join(lines)


LONGEST_VALUE = 400
"""Characters of one metadata value `CheckpointInfo.summary` prints whole: a longer one (a
config pasted into the user metadata, an iterator's state) is cut so the lines stay readable.
`CheckpointInfo.metadata` and `shardckpt inspect --json` keep every value whole."""


def _brief(value: Any, text: Callable[[Any], str]) -> str:
    """`text(value)` with each dict value or list item longer than `LONGEST_VALUE` cut.

    `text` is `repr` or `json.dumps`: a dict's or list's shorter entries read
    exactly as `text` of the whole would write them.
    """
    if isinstance(value, dict):
        return "{" + ", ".join(f"{text(k)}: {_cut(text(v))}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_cut(text(v)) for v in value) + "]"
    return _cut(text(value))


def _cut(text: str) -> str:
    if len(text) <= LONGEST_VALUE:
        return text
    return f"{text[: LONGEST_VALUE // 2]}... ({len(text):,} characters; --json shows it whole)"


def inspect(path: str | os.PathLike) -> CheckpointInfo:
    """Describes a checkpoint: steps, arrays (shape, dtype, bytes), metadata.

    Example:

    ```python
    info = shardckpt.inspect("ckpts/")
    print(info)                      # a table of arrays
    info.metadata["user"], info.iterator_state
    ```

    Args:
        path: Anything `load_sharded` reads: an Orbax root (its latest
            committed step is described) or step folder, a `.weights.h5`,
            `.keras` or `.safetensors` file, a `*.safetensors.index.json`.

    Returns:
        A `CheckpointInfo`.

    Raises:
        CheckpointNotFoundError: nothing at `path`, or no committed step.
        IncompleteCheckpointError: `path` is a half-written Orbax step, or a
            root holding only such steps.
        UnknownFormatError: not a checkpoint format shardckpt reads.
        CorruptCheckpointError: metadata cannot be parsed.
    """
    reader = open_reader(storage.parse(path, what="path"))  # classified once, here
    try:
        info = CheckpointInfo(path=reader.path, format=reader.format)
        for key in natural_sorted(reader.keys()):  # dense_2 before dense_10
            spec = reader.spec(key)
            info.arrays.append(ArrayInfo(key=key, shape=tuple(spec.shape), dtype=str(spec.dtype), nbytes=spec.nbytes))
    finally:
        reader.close()
    if info.format == "orbax":
        _describe_orbax(info)
    return info


def _describe_orbax(info: CheckpointInfo) -> None:
    step_dir = info.path
    step = storage.parse(step_dir)  # a folder or a bucket URL
    root, name = step.parent.url, step.name
    if name.isdigit():
        info.step = int(name)
        info.steps = ondisk.committed_steps(root)
        info.incomplete = ondisk.incomplete_steps(root)
    info.items = ondisk.items(step_dir)
    info.metadata = ondisk.read_json_item(step_dir, ondisk.METADATA_ITEM)
    item = ondisk.read_json_item(step_dir, ondisk.ITERATOR_ITEM)
    info.iterator_state = None if item is None else list(item.get("process_states") or [])
