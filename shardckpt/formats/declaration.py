"""What a format declares: its name, the rules that identify it, its reader and writer.

A `Format` is data. Detection (`registry.detect`) reads its rules, never the
order formats are listed in: `suffixes` and `magic` identify files,
`markers` and `one_of` folders (names in one listing of the folder), and
`confirm` looks at content where names are not enough (a `.json` that is a
Keras index, a `config.json` with a `model_type`). When the rules of several
formats match, the highest `priority` wins.

The callables a format names may live above this layer (the Hugging Face
reader needs keras-hub's converters; writers are the export package's):
`Lazy("package.module:name")` names one, imported at its first call, so the
one list of formats (`catalog`) needs no import of the layers above.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
from collections.abc import Callable
from typing import Any

from shardckpt import storage

HEAD_BYTES = 16
"""Bytes of a file's beginning that `magic` rules are matched against."""


@dataclasses.dataclass(frozen=True)
class Lazy:
    """A callable named by "package.module:name", imported when first called.

    Attributes:
        target: "package.module:name" (a module-level callable).
    """

    target: str

    def resolve(self) -> Callable[..., Any]:
        """The callable itself (imports its module).

        Raises:
            ImportError: the module does not exist.
            AttributeError: the module has no such name.
        """
        module, _, name = self.target.partition(":")
        return getattr(importlib.import_module(module), name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve()(*args, **kwargs)


class Probe:
    """What detection looks at in one path, each fetched once and only when a rule asks.

    Attributes:
        location: The path looked at.
    """

    def __init__(self, location: storage.Location) -> None:
        self.location = location
        self._json: dict[str, Any] = {}

    @functools.cached_property
    def names(self) -> frozenset[str]:
        """Names directly under the path: one listing (one request in a bucket); empty for a file."""
        local = self.location.local_path
        if local is not None:
            return frozenset(os.listdir(local)) if os.path.isdir(local) else frozenset()
        return frozenset(storage.listdir(self.location))

    @functools.cached_property
    def is_folder(self) -> bool:
        """A local folder (empty or not), or a bucket prefix holding objects."""
        local = self.location.local_path
        return os.path.isdir(local) if local is not None else bool(self.names)

    @functools.cached_property
    def head(self) -> bytes:
        """The first `HEAD_BYTES` bytes of the file (fewer if it is shorter).

        Raises:
            CheckpointNotFoundError: there is no such file or object.
        """
        local = self.location.local_path
        if local is not None:
            with open(local, "rb") as f:
                return f.read(HEAD_BYTES)
        source = storage.open_source(self.location)  # one ranged read
        try:
            got = source.probe(slice(0, HEAD_BYTES))
            return got if isinstance(got, bytes) else source.read(0, got)
        finally:
            source.close()

    def json(self, name: str = "") -> Any:
        """The JSON document `name` inside the folder ("": the path itself); None if missing.

        Raises:
            CorruptCheckpointError: it is no valid JSON (naming the file).
        """
        if name not in self._json:
            location = self.location.join(name) if name else self.location
            self._json[name] = storage.read_json(location, fix="replace the damaged file.", missing_ok=True)
        return self._json[name]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Format:
    """One on-disk format: what identifies it, and what reads and writes it.

    Attributes:
        name: The name `detect_format`, readers (`Reader.format`) and reports use.
        description: What it is, as error messages list it.
        suffixes: File-name endings that identify a file of this format.
        magic: The first bytes of such a file (for a name with no known suffix).
        markers: Names that must all be directly in a folder of this format.
        one_of: Names of which at least one must be in such a folder too.
        confirm: A look at the content, for a path whose names match:
            `(Probe) -> bool`. A folder format with no `markers` / `one_of`
            is identified by `confirm` alone.
        confirms: What `confirm` requires, in words (error messages list it).
        priority: Which format a path is when the rules of several match:
            the highest. Unique among formats with rules.
        folder: Whether the format is a folder.
        reader: `(location, *, cache_bytes, model, task) -> Reader`; None for a
            format shardckpt only writes.
        writer: `(model, dst, *, format, dtype, shard, max_inflight_bytes,
            progress, overwrite, start) -> ExportReport`; None if shardckpt
            does not write it.
        aliases: Other names `writer_for` takes (`export(format=...)`'s).
        architecture: `(path) -> keras.Model` for formats that name their
            model (a config), built lazily; None otherwise.
        keys: Which key naming the checkpoint's keys follow
            (`shardckpt.restore.keys.keys_for`): "h5", "state", "preset" or
            "path" (variable paths).
        needs_model: Its reader needs the model (the names are another framework's).
    """

    name: str
    description: str
    suffixes: tuple[str, ...] = ()
    magic: bytes = b""
    markers: tuple[str, ...] = ()
    one_of: tuple[str, ...] = ()
    confirm: Callable[[Probe], bool] | None = None
    confirms: str = ""
    priority: int = 0
    folder: bool = False
    reader: Callable[..., Any] | None = None
    writer: Callable[..., Any] | None = None
    aliases: tuple[str, ...] = ()
    architecture: Callable[..., Any] | None = None
    keys: str = "path"
    needs_model: bool = False

    @property
    def detectable(self) -> bool:
        """Whether any rule can identify a path as this format."""
        return bool(self.suffixes or self.magic or self.folder)

    def listing_matches(self, names: frozenset[str]) -> bool:
        """Whether a folder listing `names` has this folder format's marker files."""
        return self.folder and set(self.markers) <= names and (not self.one_of or bool(names & set(self.one_of)))

    def rule(self) -> str:
        """The rules that identify the format, in words."""
        parts = []
        if self.suffixes:
            parts.append("named " + " or ".join(f"*{s}" for s in self.suffixes))
        if self.markers or self.one_of:
            held = [*self.markers, *([" or ".join(self.one_of)] if self.one_of else [])]
            parts.append("a folder holding " + " and ".join(held))
        if self.confirms:
            parts.append(self.confirms)
        return ", ".join(parts)
