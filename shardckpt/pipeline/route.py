"""`convert(src, dst, *, to=...)`: any checkpoint shardckpt reads to any format it writes.

Orbax is written by streaming (`shardckpt.conversion.converter`: no model
values, no device). The other targets are written by `shardckpt.export`
from the model loaded sharded: a keras-hub preset or Hugging Face folder by
`from_preset` (its own architecture), any other source into `model` (built
lazily, planned by `auto_layout`, filled by `load_sharded`). So both halves
stay in their own layers and this module, above them, only routes.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Literal, overload

from shardckpt import dtypes, storage
from shardckpt.conversion.converter import FORCE_FIX, ConvertReport
from shardckpt.conversion.converter import convert as to_orbax
from shardckpt.errors import ModelRequiredError
from shardckpt.exporting import ExportReport, export
from shardckpt.exporting.plans import max_shard_bytes
from shardckpt.formats import FORMATS, detect_format
from shardckpt.formats.orbax.writer import DEFAULT_COMPRESSION
from shardckpt.layout import auto_layout
from shardckpt.presets import load_preset
from shardckpt.restore import LoadReport, load_sharded
from shardckpt.storage import commit
from shardckpt.types import DType, Layout, Mesh, Model

TARGETS = ("orbax", "hf", "keras-hub", "safetensors")
"""What `to=` (the CLI's `--to`) writes."""


@overload
def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    to: Literal["orbax"] = ...,
    model: Model | None = None,
    layout: Layout = None,
    mesh: Mesh | None = None,
    dtype: DType = None,
    compression: str = DEFAULT_COMPRESSION,
    max_shard_size: float | str | None = None,
    max_inflight_bytes: int | None = None,
    force: bool = False,
    progress: bool | None = None,
) -> ConvertReport: ...


@overload
def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    to: Literal["hf", "keras-hub", "safetensors"],
    model: Model | None = None,
    layout: Layout = None,
    mesh: Mesh | None = None,
    dtype: DType = None,
    compression: str = DEFAULT_COMPRESSION,
    max_shard_size: float | str | None = None,
    max_inflight_bytes: int | None = None,
    force: bool = False,
    progress: bool | None = None,
) -> ExportReport: ...


@overload
def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    to: str,
    model: Model | None = None,
    layout: Layout = None,
    mesh: Mesh | None = None,
    dtype: DType = None,
    compression: str = DEFAULT_COMPRESSION,
    max_shard_size: float | str | None = None,
    max_inflight_bytes: int | None = None,
    force: bool = False,
    progress: bool | None = None,
) -> ConvertReport | ExportReport: ...


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    to: str = "orbax",
    model: Model | None = None,
    layout: Layout = None,
    mesh: Mesh | None = None,
    dtype: DType = None,
    compression: str = DEFAULT_COMPRESSION,
    max_shard_size: float | str | None = None,
    max_inflight_bytes: int | None = None,
    force: bool = False,
    progress: bool | None = None,
) -> ConvertReport | ExportReport:
    """Converts a checkpoint to an Orbax checkpoint, a Hugging Face folder, a keras-hub preset or safetensors.

    `to="orbax"` streams the arrays into an Orbax step folder (no model
    values, no device; see `shardckpt.conversion.converter.convert`). The other
    targets load the model sharded, then `shardckpt.export` it: each
    device's piece is written where it belongs, never gathered.

    Example:

    ```python
    shardckpt.convert("gemma_preset/", "gemma_orbax/")                  # architecture from config.json
    shardckpt.convert("gemma_preset/", "gemma_hf/", to="hf", dtype="bfloat16")
    with shardckpt.lazy_init():
        model = build_model()
    shardckpt.convert("model.weights.h5", "out/", to="safetensors", model=model)
    ```

    Args:
        src: A `.keras` file, a `.weights.h5` file, a `.safetensors` file, a
            `*.safetensors.index.json` set, a keras-hub preset folder or a
            Hugging Face folder, local or in a bucket.
        dst: The folder to create, or a `gs://` / `s3://` URL.
        to: "orbax" (default), "hf", "keras-hub" or "safetensors".
        model: The architecture (a Keras model, ideally built under
            `shardckpt.lazy_init()`); needed for `.weights.h5` and
            safetensors sources; a `.keras` file, a keras-hub preset and a
            Hugging Face folder carry their own.
        layout: Target layout (a `LayoutPlan`, `LayoutMap` or Distribution).
            Orbax: chunks are aligned to its shards. Other targets: the model
            is loaded into it.
        mesh: A mesh shape such as `(2, 4)` or a `DeviceMesh`. Orbax: chunks
            follow `auto_layout` on it (None: whole arrays). Other targets:
            the mesh the model is loaded on (None: `mesh="auto"`).
        dtype: Cast floating-point arrays to this dtype (e.g. "bfloat16").
        compression: Orbax only: "none" or "zstd".
        max_shard_size: Other targets: files of at most this size (e.g. "5GB").
        max_inflight_bytes: Most bytes of array data in memory at once (None:
            the host's default). Other targets: it bounds the model's load
            (`load_sharded`'s budget; None: its default, larger with local
            accelerators) and then the writing.
        force: Replace an existing `dst`.
        progress: Show a progress bar. None: when stderr is a terminal.

    Returns:
        A `ConvertReport` (orbax) or an `ExportReport` (the other targets;
        its `load` is the model's `LoadReport`).

    Raises:
        ValueError: `to` is not one of `TARGETS`, or an option of another target.
        ModelRequiredError: the source has no architecture and `model` is None.
        DestinationExistsError, CheckpointNotFoundError, UnknownFormatError,
        CheckpointMismatchError, ...: see `shardckpt.conversion.converter.convert`,
            `shardckpt.from_preset`, `shardckpt.load_sharded` and `shardckpt.export`.
    """
    if to not in TARGETS:
        raise ValueError(f"to must be one of {', '.join(TARGETS)}. Received: to={to!r}")
    if to == "orbax":
        if max_shard_size is not None:
            raise ValueError(
                "max_shard_size applies to to='hf', 'keras-hub' and 'safetensors'; an Orbax checkpoint is "
                f"chunked, not split into files. Fix: drop it. Received: max_shard_size={max_shard_size!r}"
            )
        return to_orbax(
            src, dst, model=model, layout=layout, mesh=mesh, dtype=dtype, compression=compression,
            max_inflight_bytes=max_inflight_bytes, force=force, progress=progress,
        )
    if compression != DEFAULT_COMPRESSION:
        raise ValueError(
            f"compression applies to to='orbax'; {to!r} files are not compressed. Fix: drop it. "
            f"Received: compression={compression!r}"
        )
    dtypes.float_dtype(dtype)  # refused before the model is loaded, as `to="orbax"` refuses it
    max_shard_bytes(max_shard_size)  # so is a size that does not parse: a load can take minutes
    if not force:  # and an existing dst, in convert's words (not export's)
        commit.refuse_existing(storage.parse(dst, what="dst"), fix=FORCE_FIX)
    loaded, load = _load(src, to=to, model=model, layout=layout, mesh=mesh, max_inflight_bytes=max_inflight_bytes)
    report = export(
        loaded, dst, format=to, max_shard_size=max_shard_size, dtype=dtype,
        max_inflight_bytes=max_inflight_bytes, progress=progress, overwrite=force,
    )
    return dataclasses.replace(report, load=load)


def _load(
    src: str | os.PathLike, *, to: str, model: Any, layout: Any, mesh: Any, max_inflight_bytes: int | None
) -> tuple[Any, LoadReport]:
    """The model of `src`, loaded sharded (and the Keras distribution set to its plan), and the load's report."""
    import keras

    source = storage.parse(src, what="src").url
    if model is None and _names_its_model(source):
        return load_preset(source, mesh=mesh, layout=layout, max_inflight_bytes=max_inflight_bytes)
    if model is None:
        if not source.endswith(".keras"):
            raise ModelRequiredError(
                f"to={to!r} from {source!r} needs the architecture: pass --model package.module:function, a "
                ".keras file or a keras-hub preset folder (in Python: model=<a Keras model, e.g. built under "
                "shardckpt.lazy_init()>); a .keras file, a keras-hub preset or a Hugging Face folder carries its own."
            )
        from shardckpt.conversion.architecture import load_architecture

        model = load_architecture(source)
    plan = layout if layout is not None else auto_layout(model, "auto" if mesh is None else mesh)
    distribution = plan.distribution() if callable(getattr(plan, "distribution", None)) else plan
    if isinstance(distribution, keras.distribution.LayoutMap):
        distribution = keras.distribution.ModelParallel(layout_map=distribution)
    keras.distribution.set_distribution(distribution)
    return model, load_sharded(model, source, layout=distribution, max_inflight_bytes=max_inflight_bytes)


def _names_its_model(source: str) -> bool:
    """Whether `source`'s format builds its own model (`Format.architecture`: presets, Hugging Face folders).

    Asked of the formats' registry: a source it does not recognise, or a
    damaged `config.json`, raises its own typed error here.
    """
    return FORMATS[detect_format(source)].architecture is not None
