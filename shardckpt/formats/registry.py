"""The table of formats: name, how each is detected, its reader and (once written) its writer.

Detection, opening, `inspect` and every error message that lists what
shardckpt reads use this one table, for local paths and buckets alike.

Adding a format: write its `Reader` (see `base`), then add one `Format` to
`FORMATS` in detection order. A reader that needs something from above this
layer (Hugging Face names need keras-hub's converters) is `provide`d there
at import; so is a writer (the export package fills the `writer` slots:
`shardckpt.export` looks its formats up here, `writer_for`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from shardckpt import storage
from shardckpt.formats.h5 import H5Reader
from shardckpt.formats.h5_sharded import ShardedH5Reader, is_sharded_index
from shardckpt.formats.hf import is_hf_folder
from shardckpt.formats.orbax import OrbaxReader, is_orbax_dir
from shardckpt.formats.preset import PresetReader, is_preset_dir
from shardckpt.formats.safetensors import SafetensorsReader


@dataclasses.dataclass(frozen=True, kw_only=True)
class Format:
    """One on-disk format.

    Attributes:
        name: The name `detect_format`, readers (`Reader.format`) and reports use.
        description: What it is, as error messages list it.
        suffixes: File-name endings that make a path this format (files).
        magic: The first bytes of such a file, for names without a suffix.
        detect: A check of the content: for files with a suffix, that it is
            this format after all (a `.json` index); for folders, the only test.
        reader: `(location, *, cache_bytes, model, task) -> Reader`; None until
            `provide`d.
        writer: `(model, dst, *, format, dtype, shard, max_inflight_bytes,
            progress, overwrite, start) -> ExportReport`, once one exists
            (`provide`d by the export package, `shardckpt.exporting.api`).
        aliases: Other names `writer_for` takes (`export(format=...)`'s).
        architecture: `(path) -> keras.Model` for formats that name their model
            (a Hugging Face config), built lazily; None otherwise.
        keys: Which key naming the checkpoint's keys follow
            (`shardckpt.restore.keys.keys_for`).
        folder: Whether the format is a folder.
        needs_model: Its reader needs the model (the names are another framework's).
    """

    name: str
    description: str
    suffixes: tuple[str, ...] = ()
    magic: bytes = b""
    detect: Callable[[storage.Location], bool] | None = None
    reader: Callable[..., Any] | None = None
    writer: Callable[..., Any] | None = None
    aliases: tuple[str, ...] = ()
    architecture: Callable[..., Any] | None = None
    keys: str = ""
    folder: bool = False
    needs_model: bool = False


def _h5_reader(location: storage.Location, **_: Any) -> H5Reader:
    return H5Reader(location)


_TABLE = (
    Format(
        name="safetensors",
        description="`.safetensors` files and `*.safetensors.index.json` sets",
        suffixes=(".safetensors", ".safetensors.index.json"),
        reader=lambda location, **_: SafetensorsReader(location),
        keys="path",
    ),
    # Keras' own files: one reader (a `.keras` archive holds a `.weights.h5`), told apart by name or magic.
    *(
        Format(name=name, description=description, suffixes=suffixes, magic=magic, reader=_h5_reader, keys="h5")
        for name, description, suffixes, magic in (
            ("h5", "Keras `.weights.h5` files", (".h5", ".hdf5"), b"\x89HDF\r\n\x1a\n"),
            ("keras", "`.keras` archives", (".keras",), b"PK\x03\x04"),
        )
    ),
    Format(
        name="h5-sharded",
        description="Keras sharded `.weights.json` indexes",
        suffixes=(".json",),
        detect=is_sharded_index,
        reader=lambda location, **_: ShardedH5Reader(location),
        keys="h5",
    ),
    Format(
        name="orbax",
        description="Orbax checkpoints (a root of step folders, or one step)",
        detect=is_orbax_dir,
        reader=lambda location, *, cache_bytes, **_: OrbaxReader(location, cache_bytes=cache_bytes),
        keys="state",
        folder=True,
    ),
    Format(
        name="preset",
        description="keras-hub preset folders",
        aliases=("keras-hub",),
        detect=is_preset_dir,
        reader=lambda location, *, task=None, **_: PresetReader(location, task=task),
        keys="preset",
        folder=True,
    ),
    Format(
        name="hf",
        description="Hugging Face folders (config.json with a model_type, and safetensors)",
        detect=is_hf_folder,
        keys="path",
        folder=True,
        needs_model=True,
    ),
    # Written only (`export(format="peft")`): LoRA factors as a PEFT adapter folder, no model to read.
    Format(name="peft", description="PEFT LoRA adapter folders (written by export only)"),
)

FORMATS: dict[str, Format] = {fmt.name: fmt for fmt in _TABLE}
"""Every format by name, in detection order (files by suffix first, then folders)."""


def provide(name: str, **slots: Callable[..., Any]) -> None:
    """Fills slots of format `name` (`reader`, `writer`, `architecture`) from a layer above this one.

    Raises:
        TypeError: a slot that is not one of these.
    """
    unknown = set(slots) - {"reader", "writer", "architecture"}
    if unknown:
        raise TypeError(f"Formats have no slot {sorted(unknown)}. Received: {sorted(slots)}")
    FORMATS[name] = dataclasses.replace(FORMATS[name], **slots)  # type: ignore[arg-type]


def writer_for(name: str) -> Callable[..., Any]:
    """The writer of format `name` (or of the format `name` is an alias of).

    Raises:
        ValueError: no such format, or one shardckpt only reads.
    """
    for fmt in FORMATS.values():
        if name == fmt.name or name in fmt.aliases:
            if fmt.writer is not None:
                return fmt.writer
    raise ValueError(f"format must be one of {', '.join(writable())}. Received: format={name!r}")


def writable() -> list[str]:
    """The names `writer_for` takes: a format's own, or its first alias where it has one."""
    return [(fmt.aliases or (fmt.name,))[0] for fmt in FORMATS.values() if fmt.writer is not None]


def supported() -> str:
    """Every format shardckpt reads, as a sentence for error messages."""
    return "; ".join(fmt.description for fmt in FORMATS.values() if fmt.keys)
