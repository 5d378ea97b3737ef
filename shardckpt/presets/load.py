"""`from_preset(preset)`: detect the folder's kind, build lazily, plan, load sharded.

keras-hub's own `from_preset` under `ModelParallel` builds the model with
random weights on their devices, then `load_weights` reads each full tensor
onto the default device before it is placed (keras#21634, keras-hub#1341).
Here nothing is initialised: the model is built under `lazy_init()`, the
layout is planned on the unloaded model, and `load_sharded` reads each
device's piece straight into its sharding.

Kinds of folder (`preset_kind`, asked of the formats' registry), as
keras-hub's own loader tells them apart by `config.json`:
- "keras-hub": `registered_name` (a serialised Keras object) and the
  backbone's weights; built by `shardckpt.presets.kerashub`;
- "hf": `model_type` (a Hugging Face transformers config) and safetensors;
  built by `shardckpt.presets.hf.build(folder, dtype=...)`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any, Literal

from shardckpt import _keras, _keras_hub, storage
from shardckpt.errors import CheckpointMismatchError, UnknownFormatError
from shardckpt.formats import detect_format
from shardckpt.formats.preset import TASK_WEIGHTS, has_files
from shardckpt.layout import auto_layout
from shardckpt.layout.choose import announce
from shardckpt.presets import hf, kerashub
from shardckpt.progress import some
from shardckpt.restore import LoadReport
from shardckpt.restore.engine import load, say_skipped
from shardckpt.types import DType, Layout, Mesh, Model

_log = logging.getLogger("shardckpt")

_KINDS = {"preset": "keras-hub", "hf": "hf"}
"""The formats (`shardckpt.formats.FORMATS`) `from_preset` builds a model from, by kind."""


def preset_kind(folder: str) -> str:
    """Returns "keras-hub" or "hf" for a preset folder (local, or a bucket URL).

    The formats' registry decides (`shardckpt.formats.detect_format`), as it
    does for `load_sharded`, `convert` and the CLI.

    Raises:
        CheckpointNotFoundError: nothing at `folder`.
        UnknownFormatError: `folder` is no format shardckpt reads, or one that
            does not name its model (an Orbax checkpoint, a weights file).
    """
    fmt = detect_format(folder)
    if fmt not in _KINDS:
        raise UnknownFormatError(
            f"{folder!r} is a checkpoint of format {fmt!r}, which holds weights but does not name its model, "
            f"so it is no preset. Fix: build the model and load it with shardckpt.load_sharded(model, "
            f"{folder!r}), or pass a keras-hub preset folder or a Hugging Face folder."
        )
    return _KINDS[fmt]


def from_preset(
    preset: str | os.PathLike,
    *,
    mesh: Mesh | Literal["auto"] | None = None,
    layout: Layout = None,
    dtype: DType = None,
    cls: type[Model] | None = None,
    fsdp: bool = False,
    devices: int | Sequence[Any] | None = None,
    max_inflight_bytes: int | None = None,
) -> Model:
    """Builds a pretrained model and loads every variable straight into its sharding.

    The model is built under `shardckpt.lazy_init()` from the preset's config
    (no initializer runs, no weight memory), the layout is planned
    (`shardckpt.auto_layout`) unless `layout` is given, the Keras
    distribution is set to it, and `shardckpt.load_sharded` reads each
    device's piece of every variable. No full tensor is assembled on one
    device unless the layout replicates it.

    Example:

    ```python
    model = shardckpt.from_preset("llama3_preset/")          # mesh="auto": chosen for the model
    model = shardckpt.from_preset("llama3_preset/", mesh=(1, 8))   # all 8 devices on "model"
    model = shardckpt.from_preset("gemma_preset/", mesh=(2, 4), dtype="bfloat16")
    lm = shardckpt.from_preset("preset/", cls=keras_hub.models.CausalLM)
    ```

    Args:
        preset: A keras-hub preset folder, local or in a bucket (`gs://...`,
            `s3://...`; weights read by byte ranges) (`config.json`,
            `metadata.json`, `model.weights.h5` or a sharded
            `model.weights.json` + shards; for a task `task.json` and
            `task.weights.h5`), a Hugging Face model folder (`config.json`
            with `model_type`, safetensors), or a keras-hub handle
            (`kaggle://...`, `hf://...`, a built-in preset name), fetched
            through keras-hub's download cache.
        mesh: The device mesh to plan on: a `keras.distribution.DeviceMesh`,
            a shape such as `(2, 4)` over ("data", "model") (`(1, n)`: every
            device on the "model" axis), or "auto" (the shape `auto_layout`
            picks for the model: clean and balanced, fitting the device
            memory where the platform reports it). None: "auto", and the
            chosen mesh and why are logged (INFO, logger "shardckpt") in one
            line. Ignored when `layout` is given.
        layout: Where variables go, instead of `auto_layout`: a `LayoutPlan`
            (bound to the built model by structure, `plan.bind`), a
            `keras.distribution.LayoutMap` or a `Distribution`.
        dtype: The model's dtype policy (e.g. "bfloat16"), as keras-hub's
            `dtype=`; stored values are cast while loading.
        cls: The keras-hub class to build (a `Backbone` or `Task` subclass,
            e.g. `keras_hub.models.CausalLM`). None: the preset's backbone.
            keras-hub folders only; a Hugging Face folder builds the
            backbone its `config.json` names. A task whose preset has no
            `task.weights.h5` gets its own layers' initial values, as in
            keras-hub, and one WARNING (logger "shardckpt") names them.
        fsdp: Plan parameters split over the data axis too (FSDP; see
            `auto_layout`). Ignored when `layout` is given.
        devices: A device count or devices for `mesh` given by shape or
            "auto" (default: all). Ignored when `layout` is given.
        max_inflight_bytes: Most bytes of host memory the load holds at once
            beyond the final state, as `load_sharded`'s (None: its default,
            this host's budget, larger with local accelerators).

    Returns:
        The model, every variable loaded in its sharding, with the
        distribution set (`keras.distribution.distribution()`).

    Raises:
        CheckpointNotFoundError: no preset at `preset`, or a file it needs.
        UnknownFormatError: the folder is no preset shardckpt reads.
        MissingDependencyError: keras-hub is needed and not installed.
        CheckpointMismatchError, CorruptCheckpointError, LayoutError, ...:
            see `load_sharded` and `auto_layout`.
    """
    model, _ = load_preset(
        preset, mesh=mesh, layout=layout, dtype=dtype, cls=cls, fsdp=fsdp, devices=devices,
        max_inflight_bytes=max_inflight_bytes,
    )
    return model


def load_preset(
    preset: str | os.PathLike,
    *,
    mesh: Mesh | Literal["auto"] | None = None,
    layout: Layout = None,
    dtype: DType = None,
    cls: type[Model] | None = None,
    fsdp: bool = False,
    devices: int | Sequence[Any] | None = None,
    max_inflight_bytes: int | None = None,
) -> tuple[Model, LoadReport]:
    """`from_preset`, returning the load's report too (`shardckpt.convert` reports it).

    Args and Raises: see `from_preset`.

    Returns:
        The model, and the `LoadReport` of its weights' load.
    """
    source = os.fspath(preset)
    task = cls is not None and kerashub.is_task_class(cls)
    folder = _local_folder(source, task=task)
    kind = preset_kind(folder)
    if kind == "hf":
        model = hf.build(folder, dtype=dtype)
    elif storage.parse(folder).local_path is None:
        # keras-hub reads presets from local folders: it builds from a copy of
        # the bucket folder's small files (configs, tokenizer assets); the
        # weights stay in the bucket and are read by byte ranges below.
        with kerashub.local_configs(folder) as local:
            model = kerashub.build(local, dtype=dtype, cls=cls)
    else:
        # A handle is given to keras-hub itself, which fetches what the build
        # needs (tokenizer assets of a task's preprocessor, say).
        model = kerashub.build(folder if os.path.isdir(source) else source, dtype=dtype, cls=cls)
    distribution = _distribution(model, mesh, layout, fsdp=fsdp, devices=devices)
    import keras

    keras.distribution.set_distribution(distribution)
    # A task whose preset carries no task weights (a backbone preset loaded as
    # a task) gets its own layers' initial values, as keras-hub gives them.
    strict = not (task and not _has_task_weights(folder))
    report = _load(model, folder, distribution, strict=strict, kind=kind, max_inflight_bytes=max_inflight_bytes)
    say_skipped(report)
    if not strict:
        _check_only_task_layers_missing(model, report)
        _say_head_initialized(folder, model, report)
    if task and kind == "keras-hub":
        model.compile()  # keras-hub's default compilation, deferred by `kerashub.build`
    return model, report


# from_preset has no strict=: the advice for a keras-hub preset whose weights
# do not fit its config (tests/test_fix_hints.py follows it).
_PRESET_FIX = (
    "the preset's config.json and weights files come from different saves (or were "
    "edited): re-save it with save_to_preset, which writes both together."
)


def _load(
    model: Any, folder: str, distribution: Any, *, strict: bool, kind: str, max_inflight_bytes: int | None
) -> LoadReport:
    from shardckpt.errors import CheckpointMismatchError

    try:
        # Without load_sharded's log lines: the one said here names the preset's cause.
        return load(model, folder, layout=distribution, strict=strict, max_inflight_bytes=max_inflight_bytes)
    except CheckpointMismatchError as e:
        if kind != "keras-hub":
            raise
        raise CheckpointMismatchError(
            e.path, missing=e.missing, unexpected=e.unexpected, mismatched=e.mismatched, fix=_PRESET_FIX
        ) from e


def _has_task_weights(folder: str) -> bool:
    return has_files(folder, TASK_WEIGHTS)[0]


def _check_only_task_layers_missing(model: Any, report: Any) -> None:
    backbone = {id(v) for v in model.backbone.weights}
    paths = {v.path: id(v) for v in model.weights}
    missing_backbone = [m for m in report.missing if paths.get(m.split(" (key")[0]) in backbone]
    if missing_backbone or report.unexpected:
        raise CheckpointMismatchError(
            report.path, missing=missing_backbone, unexpected=report.unexpected, fix=_PRESET_FIX
        )


def _say_head_initialized(folder: str, model: Any, report: LoadReport) -> None:
    """Warns once that a task's own layers got their initializers' values, not the preset's.

    keras-hub does the same for a backbone preset loaded as a task, and says
    nothing: the task then predicts from untrained layers.
    """
    head = report.missing_paths
    if not head:
        return  # a task with no variables of its own (a causal LM's head is its backbone's)
    _log.warning(
        "from_preset(%r, cls=%s): the preset has no %s (a backbone preset, or task weights not saved), "
        "so the task's own %d variable(s) got their initializers' values, not trained ones: %s. Its "
        "outputs are those of an untrained head. Fix: fine-tune the task before using it (and "
        "save_to_preset it, which writes %s), or pass a preset saved from this task.",
        folder, type(model).__name__, TASK_WEIGHTS, len(head), some(head), TASK_WEIGHTS,
    )


def _local_folder(source: str, *, task: bool) -> str:
    """The local folder of `source`: itself, or keras-hub's download of a handle."""
    if os.path.isdir(source):
        return source
    scheme = source.split("://", 1)[0].lower() if "://" in source else None
    if scheme in kerashub.HANDLE_SCHEMES or (scheme is None and not os.path.exists(source) and _is_builtin(source)):
        return kerashub.download(source, task=task)
    if scheme is not None:
        # An unsupported scheme raises UnsupportedURLError here, never a local folder.
        location = storage.parse(source, what="preset")
        return location.url  # a bucket folder, or a file:// URL's local path
    return source  # preset_kind names what is missing


def _is_builtin(name: str) -> bool:
    try:
        return name in _keras_hub.preset_utils().BUILTIN_PRESETS
    except ImportError:
        return False


def _distribution(model: Any, mesh: Any, layout: Any, *, fsdp: bool = False, devices: Any = None) -> Any:
    """The Keras distribution to load into: `layout`'s, or `auto_layout`'s on `mesh`."""
    import keras

    if layout is None:
        plan = auto_layout(model, "auto" if mesh is None else mesh, devices=devices, fsdp=fsdp)
        if mesh is None:
            announce(plan, "from_preset")
        return plan.distribution()
    if callable(getattr(layout, "bind", None)):
        # A LayoutPlan made on another instance: matched by structure, so the
        # distribution's exact-path layout map fits this model's names.
        layout = layout.bind(model)
    if isinstance(layout, keras.distribution.LayoutMap):
        return keras.distribution.ModelParallel(layout_map=layout)
    if hasattr(layout, "distribution") and callable(layout.distribution):
        return layout.distribution()
    if isinstance(layout, _keras.Distribution):
        return layout
    raise TypeError(
        "layout must be a shardckpt LayoutPlan, a keras.distribution.LayoutMap or a "
        f"Distribution. Received: layout={layout!r}"
    )
