"""`load_sharded`: checkpoint -> reader -> key matching -> read plan -> jax.Array.

Each variable is filled straight into its target sharding: the reader returns
only the boxes this process's devices hold (see `readplan`), the pieces are
put on their devices, and `jax.make_array_from_single_device_arrays`
assembles the global array. No full tensor goes through one device, and the
host holds a full tensor only when the variable is replicated.

Variables are replaced one at a time, so a model built normally peaks at the
model plus the variables in flight, never two copies of the model.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from keras import distribution as kd

from shardckpt import _keras, dtypes, storage
from shardckpt import budget as budgets
from shardckpt.errors import CheckpointMismatchError, IndivisibleLayoutError, LayoutError, renaming_fix
from shardckpt.formats import Reader, open_reader
from shardckpt.lazy import is_unloaded, original_initializer
from shardckpt.progress import ByteProgress, ReadTally, key_lines, read_line, some
from shardckpt.restore import assets, hostmem, pipeline, slots
from shardckpt.restore import keys as naming
from shardckpt.restore.strategies import Budget, Job, load_variable
from shardckpt.restore.targets import (
    TargetLayout,
    check_mesh,
    check_unambiguous_keys,
    resolve_layout,
    warn_unmatched_keys,
)
from shardckpt.structure import explicit_names, finalize_loaded, slot_references
from shardckpt.types import Layout, Model, PlanLike

# Reads run on one thread per usable core: numpy copies, h5 page faults and
# tensorstore decoding all release the GIL, and a stored chunk is decoded on
# one core, so a many-core host decodes as many chunks at once as it has
# cores (the budget still bounds the bytes they hold).
_WORKERS = min(32, max(2, budgets.usable_cores()))

_TRANSFERS = ("auto", "ring", "direct")

_log = logging.getLogger("shardckpt")


@dataclasses.dataclass(kw_only=True)
class LoadReport(ReadTally):
    """What `load_sharded` did.

    Attributes:
        path, format, bytes_read: See `shardckpt.progress.ReadTally`.
        arrays: Variables that received a value from the checkpoint.
        seconds: Wall time of the whole load.
        missing: Variable paths with no array in the checkpoint.
        kept: Paths of optimizer and metric variables that keep their
            current values because the checkpoint holds none of their
            collection (a weights-only checkpoint), or holds its optimizer's
            variables by position in another number (Keras h5; see `miscounted`).
        unexpected: Checkpoint keys matching no variable (a Hugging Face
            folder: tensors of the model's own modules no variable reads).
        skipped: Stored arrays left unread because the model has no such
            variables: optimizer/metric keys (e.g. a full-state checkpoint
            into a fresh model); a Hugging Face folder's buffers, heads of
            another class and the output embedding of a tied model
            (`shardckpt.presets.hf_unread`).
        miscounted: Groups of a Keras h5 checkpoint (a layer's or the
            optimizer's `vars`), stored by position, that hold another number
            of arrays than the model's: "group: N stored, M in the model
            (paths)". None of their variables is loaded (they are `missing`,
            an optimizer's `kept`; their arrays `unexpected`): equal positions
            are not the same variables there (`BatchNormalization(center=False)`
            against a checkpoint with `beta`), as Keras' `load_weights` skips them.
        casts: "path: stored -> variable dtype" for every cast made.
        initialized: Lazily built variables given their own initial value:
            the checkpoint lacked them (`strict=False` only), or the format
            never stores them (Keras h5: seed-generator states, LoRA factors).
        lora_zeroed: LoRA factors of a normally built model set to zero
            because the checkpoint holds merged kernels and no factors (as
            Keras' `load_weights` does), so LoRA is not applied twice.
        slots_moved: Optimizer slots the checkpoint gave no value (one
            without optimizer state: a `.weights.h5`, a weights-only step)
            that were sharded otherwise than their variable, moved onto its
            sharding with their values unchanged: an optimizer built before
            the load of a model built under `lazy_init()` places them by
            their own paths (`shardckpt.restore.slots`).
        assets: Asset files loaded into the layers that keep state in them
            (an adapted `StringLookup`'s `vocabulary.txt`), by their folder
            in a `.keras` archive's `assets/` or an Orbax step's "assets",
            as `keras.saving.load_model` loads them (`shardckpt.restore.assets`).
        max_inflight_bytes: The host-memory budget the load ran with (the
            host's default, `shardckpt.budget.default_max_inflight_bytes`,
            when none was given; on a host with accelerators, at least 4 GiB
            per local accelerator within 1/32 of memory,
            `shardckpt.budget.inflight_bytes_for_accelerators`).
        budget_rule: "given", or how the default was chosen ("host default:
            16 cores, 125.0 GB, 1 accelerator").
        transfer: How pieces went to their devices: "ring" (the transfer
            pipeline, `shardckpt.restore.pipeline`) or "direct".
        ring_bytes: Host bytes of the pipeline's ring (0 without one), held
            from the budget for the whole load.
        timeline: Every read and transfer of the pipeline, with when it
            started and ended (`pipeline.Event`); empty without one.
    """

    seconds: float = 0.0
    missing: list[str] = dataclasses.field(default_factory=list)
    kept: list[str] = dataclasses.field(default_factory=list)
    unexpected: list[str] = dataclasses.field(default_factory=list)
    skipped: list[str] = dataclasses.field(default_factory=list)
    miscounted: list[str] = dataclasses.field(default_factory=list)
    casts: list[str] = dataclasses.field(default_factory=list)
    initialized: list[str] = dataclasses.field(default_factory=list)
    lora_zeroed: list[str] = dataclasses.field(default_factory=list)
    slots_moved: list[str] = dataclasses.field(default_factory=list)
    assets: list[str] = dataclasses.field(default_factory=list)
    max_inflight_bytes: int = 0
    budget_rule: str = "given"
    transfer: str = "direct"
    ring_bytes: int = 0
    timeline: list[pipeline.Event] = dataclasses.field(default_factory=list, repr=False)

    def __str__(self) -> str:
        lines = [read_line("Loaded", self.arrays, self.bytes_read, f"{self.format} {self.path!r}", self.seconds) + "."]
        lines += key_lines((
            ("stored by position in another number, not loaded", self.miscounted),
            ("missing", self.missing),
            ("unexpected", self.unexpected),
            ("skipped (model has no such variables)", self.skipped),
            ("optimizer/metric variables kept at their current values", self.kept),
            ("cast", self.casts),
            ("initialised (not in checkpoint)", self.initialized),
            ("LoRA factors zeroed (merged kernels loaded)", self.lora_zeroed),
            ("optimizer slots moved to their variable's sharding", self.slots_moved),
            ("assets loaded", self.assets),
        ))
        if self.transfer == "ring":
            lines.append(
                f"Transfers through a ring of {self.ring_bytes / 2**20:.0f} MiB of host buffers (budget {self.budget})."
            )
        return "\n".join(lines)

    @property
    def missing_paths(self) -> list[str]:
        """The variable paths of `missing` (its lines are "path (key 'k')": `KeyMatch.missing_lines`)."""
        return [line.split(" (key ", 1)[0] for line in self.missing]

    @property
    def budget(self) -> str:
        """The budget and how it was chosen, in words: "256 MiB, given"."""
        return f"{self.max_inflight_bytes / 2**20:.0f} MiB, {self.budget_rule}"


def load_sharded(
    model: Model,
    path: str | os.PathLike[str],
    *,
    layout: Layout = None,
    strict: bool = True,
    max_inflight_bytes: int | None = None,
    progress: bool | None = None,
    allow_other_mesh: bool = False,
    transfer: str = "auto",
) -> LoadReport:
    """Loads a checkpoint into `model`, each variable directly in its sharding.

    Works on models built under `shardckpt.lazy_init()` (variables get their
    first value) and on models built normally (values are replaced variable by
    variable). Afterwards, as after Keras' `load_weights`, layers that define
    `finalize_state()` (an adapted `Normalization`) recompute the state they
    derive from their loaded variables. All checks (keys, shapes, dtypes,
    divisibility) run before any variable is touched, so a failing call
    leaves the model as it was.

    Example:

    ```python
    with shardckpt.lazy_init():
        model = build_model()
    keras.distribution.set_distribution(plan.distribution())
    print(shardckpt.load_sharded(model, "model.weights.h5"))
    ```

    Args:
        model: A Keras 3 model (JAX backend).
        path: A `.weights.h5` or `.keras` file, a sharded `.weights.json`
            index (Keras' `save_weights(..., max_shard_size=...)`), a keras-hub
            preset folder (the backbone's weights, and `task.weights.h5` when
            `model` is a task), an Orbax root (its latest committed step) or
            step folder, a `.safetensors` file or a `*.safetensors.index.json`,
            or a Hugging Face folder (config.json with a model_type and
            safetensors) into the keras-hub model `shardckpt.presets.hf.build`
            builds.
        layout: Where variables go. None: the active Keras distribution, else
            each variable's current sharding; a lazily built variable has
            none: device 0 on a one-device host, a `LayoutError` on a host of
            several devices (it would compute on one device only). Also
            a `keras.distribution.LayoutMap`, a `Distribution`, or a plan with
            `layout_map()` / `sharding_for(variable)` (`shardckpt.auto_layout`);
            a `LayoutPlan` is first bound to `model` (`plan.bind`: matched
            by structure, so generated layer names may differ).
        strict: Raise on missing or unexpected keys. With False, load what
            matches; lazily built variables the checkpoint lacks are
            initialised with their own initializer, in their sharding, and
            one WARNING (logger "shardckpt") names what was initialised,
            kept or left unread.
        max_inflight_bytes: Most bytes of host memory the load holds at once
            beyond the final state: chunks being decoded, fresh reads and,
            off host, pieces on their way to their devices. A variable needing
            more is loaded alone. On a normally built model on CPU devices,
            the host memory of replaced values is given back to the OS after
            every quarter of this many bytes (glibc would keep it in its
            heaps, so the process would end holding the old model too; see
            `shardckpt.restore.hostmem`). On compressed checkpoints (Orbax) it also
            sets how many chunks are decoded in parallel: a bigger budget
            uses more cores. Off host, half of it is the transfer pipeline's
            ring of host buffers; an accelerator runtime's own host staging
            of transfers comes on top. None: the host's default, 64 MiB per
            usable core, at least 256 MiB, at most min(4 GiB, memory / 32)
            (`shardckpt.budget.inflight_bytes_for`); with local accelerators,
            at least 4 GiB per accelerator within memory / 32
            (`shardckpt.budget.inflight_bytes_for_accelerators`).
        progress: Show a progress bar. None: when stderr is a terminal.
        allow_other_mesh: Accept a `layout` whose mesh differs from the active
            distribution's, or (with none active) covers only some of the
            devices. Refused by default: every variable would move off the
            mesh the model computes on, usually a `LayoutMap` built for another
            mesh. Pass True for a model kept on a sub-mesh on purpose.
        transfer: How pieces reach their devices. "auto": through the
            transfer pipeline (`shardckpt.restore.pipeline`: a ring of reused
            host buffers, reads overlapped with transfers) when any variable
            goes to an accelerator, else "direct" (on CPU devices the pieces
            read become the devices' buffers, no copy). "ring" / "direct"
            force one; the ring copies every piece on CPU devices too.

    Returns:
        A `LoadReport`. Stored arrays skipped because the model has no such
        variables (optimizer state into a model without one, a Hugging Face
        folder's buffers and other heads) are also logged in one INFO line.

    Raises:
        CheckpointNotFoundError: nothing at `path`, or no committed step.
        UnknownFormatError: `path` is not a format shardckpt reads.
        CorruptCheckpointError: a file is truncated or damaged.
        IncompleteCheckpointError: an Orbax step was never committed.
        CheckpointMismatchError: keys missing/unexpected (strict) or shapes differ.
        DtypeMismatchError: a stored dtype cannot be cast to the variable's.
        IndivisibleLayoutError: a mesh axis does not divide a sharded dimension.
        MeshMismatchError: `layout` is on another mesh (see `allow_other_mesh`).
        UnplannedVariableError: a `LayoutPlan` has no placement for a variable.
        LayoutError: no layout for a lazily built variable on a host of several
            devices, a layout of more axes than its variable has dimensions, or
            a `LayoutMap` with several keys matching one variable's path.
    """
    report = load(
        model, path, layout=layout, strict=strict, max_inflight_bytes=max_inflight_bytes, progress=progress,
        allow_other_mesh=allow_other_mesh, transfer=transfer,
    )
    say_skipped(report)
    if not strict:
        say_fallbacks(report)
    return report


def load(
    model: Model,
    path: str | os.PathLike[str],
    *,
    layout: Layout = None,
    strict: bool = True,
    max_inflight_bytes: int | None = None,
    progress: bool | None = None,
    allow_other_mesh: bool = False,
    transfer: str = "auto",
) -> LoadReport:
    """`load_sharded` without its log lines (`say_skipped`, `say_fallbacks`).

    For a caller that says what the load left in its own words, once
    (`from_preset`: a task's head its preset has no weights for).
    """
    start = time.perf_counter()
    # Classified once, here: below, the `Location` travels (an unsupported
    # scheme:// is refused before anything else is looked at).
    location = storage.parse(path, what="path")
    accelerators = sum(1 for d in jax.local_devices() if d.platform != "cpu")
    chosen = "given" if max_inflight_bytes is not None else budgets.describe_default(accelerators)
    max_inflight_bytes = budgets.resolve(max_inflight_bytes, accelerators=accelerators)
    if layout is None:
        # A plan's distribution (`LayoutPlan.distribution()`): its plan bound
        # to this model by structure, whatever names Keras generated.
        for_model = getattr(kd.distribution(), "for_model", None)
        if callable(for_model):
            layout = for_model(model)
    if isinstance(layout, PlanLike):
        # A LayoutPlan matches variables by structure: bound to this instance,
        # generated layer names that differ from the planned model's do not
        # matter, and a variable it does not know is refused (never replicated).
        layout = layout.bind(model)
    else:
        warn_unmatched_keys(layout, model)
        check_unambiguous_keys(layout, model)
    check_mesh(layout, allow_other_mesh=allow_other_mesh)
    if transfer not in _TRANSFERS:
        raise ValueError(f"transfer must be one of {_TRANSFERS}. Received: transfer={transfer!r}")
    reader = open_reader(
        location, cache_bytes=budgets.chunk_cache_bytes(max_inflight_bytes), model=model, task=naming.is_task(model)
    )
    try:
        report = LoadReport(
            path=reader.path, format=reader.format, max_inflight_bytes=max_inflight_bytes, budget_rule=chosen
        )
        # On a host of several devices, a lazily built variable is never put on
        # one device by default (see `resolve_layout`).
        unplaced = "raise" if jax.device_count() > 1 else "first_device"
        # Optimizer slots go where their variables go, as Keras places them (see `targets`).
        references = slot_references(model)
        layout_of = resolve_layout(layout, unplaced=unplaced, references=references)
        jobs, to_init = match_jobs(model, reader, report, strict, layout_of)
        # Layers whose state is in asset files (an adapted StringLookup's
        # vocabulary), as Keras' load_model loads them; before any variable
        # is touched, so a strict failure leaves the variables as they were.
        report.assets = assets.load_assets(model, reader, assets.stored_assets(reader), strict=strict)
        total = sum(reader.spec(job.key).nbytes for job in jobs)
        show = sys.stderr.isatty() if progress is None else progress
        with ByteProgress(total, f"loading {os.path.basename(reader.path)}", enabled=show) as bar:
            _run(jobs, reader, report, max_inflight_bytes, bar.advance, transfer)
        for variable, target in to_init:
            if is_unloaded(variable):
                _initialize(variable, target)
                report.initialized.append(variable.path)
            else:  # a LoRA factor beside a merged kernel: zero, as Keras' load_own_variables sets it
                variable.assign(np.zeros(variable.shape, variable.dtype))
                report.lora_zeroed.append(variable.path)
        # A slot follows its variable's final sharding.
        report.slots_moved = slots.follow_variables(model, references, {id(job.variable) for job in jobs})
        # As Keras' load_weights does: layers holding state derived from their
        # variables (an adapted Normalization's mean / variance) recompute it.
        finalize_loaded(model, [job.variable for job in jobs] + [variable for variable, _ in to_init])
    finally:
        reader.close()
    report.seconds = time.perf_counter() - start
    return report


def say_skipped(report: LoadReport) -> None:
    """Logs (INFO) the stored arrays the load skipped because the model has no such variables.

    INFO, not WARNING: the model's own variables are all loaded, so its
    result is the checkpoint's (an inference model from a training
    checkpoint, a backbone from a folder with another head). Process 0 alone
    says it: every process of a `jax.distributed` load finds the same.
    """
    if report.skipped and jax.process_index() == 0:
        _log.info(
            "%s %r: %d stored array(s) skipped, the model has no such variables: %s.",
            report.format, report.path, len(report.skipped), some(report.skipped),
        )


def say_fallbacks(report: LoadReport) -> None:
    """Warns once where a `strict=False` load left the model other than the checkpoint.

    `strict=False` is asked for, but what it skips is decided by the
    checkpoint, not by the caller: each variable initialised or kept instead
    of loaded, and each stored array left unread, makes the model compute
    something the checkpoint did not. Said in one line (with the report's
    lists), never per variable; by process 0 alone (every process finds the same).
    """
    if jax.process_index() != 0:
        return
    initialized = set(report.initialized)
    missing = report.missing_paths
    fresh = [p for p in missing if p in initialized]
    kept = [p for p in missing if p not in initialized]
    said = []
    if report.miscounted:
        # First: it explains the missing and unexpected keys of those groups below.
        said.append(
            f"{len(report.miscounted)} group(s) of variables Keras stores by position hold another number "
            f"of them than the model's, so none of theirs was loaded ({'; '.join(report.miscounted[:4])}"
            f"{', ...' if len(report.miscounted) > 4 else ''})"
        )
    if fresh:
        # (their initializer's, or what their layer's build assigned: `lazy.original_initializer`)
        said.append(f"{len(fresh)} variable(s) the checkpoint lacks got the values a build gives ({some(fresh)})")
    if kept:
        said.append(f"{len(kept)} variable(s) the checkpoint lacks keep their current values ({some(kept)})")
    if report.unexpected:
        said.append(
            f"{len(report.unexpected)} stored array(s) the model has no variable for were not loaded "
            f"({some(report.unexpected)})"
        )
    if said:
        _log.warning(
            "load_sharded(strict=False) of %r: %s. The model differs from the checkpoint there. Fix: load "
            "into the architecture that wrote the checkpoint; strict=True (the default) refuses such a "
            "load and lists each difference.",
            report.path, "; ".join(said),
        )


def match_jobs(
    model: Any,
    reader: Reader,
    report: LoadReport,
    strict: bool,
    layout_of: Callable[[Any], TargetLayout],
) -> tuple[list[Job], list[tuple[Any, TargetLayout]]]:
    """Pairs keys with variables and checks everything before any I/O."""
    wanted, lora_absent = naming.align_lora(model, naming.keys_for(model, reader.format, reader.keys()), reader.keys())
    found = naming.match(wanted, reader, explicit=explicit_names(model))
    report.missing = found.missing_lines()
    report.kept = [variable.path for _, variable in found.kept]
    report.unexpected = found.unexpected
    report.skipped = found.skipped
    report.miscounted = found.miscounted
    # Checkpoint problems first (dtypes as they are found, then keys and
    # shapes), then where each variable goes.
    for key, variable in found.pairs:
        stored, target_dtype = reader.spec(key).dtype, np.dtype(variable.dtype)
        dtypes.check_cast(variable.path, key, stored, target_dtype, source=reader.path)
        if stored != target_dtype:
            report.casts.append(f"{variable.path}: {stored} -> {target_dtype}")
    # Else the reader's own advice, if it gave one (a Hugging Face folder's unexpected tensors).
    found.fix = _unbuilt_state_fix(model, found) or found.fix
    found.raise_if_mismatched(reader.path, strict=strict)
    if not strict:
        _refuse_little(model, found, reader.path)
    jobs: list[Job] = []
    for key, variable in found.pairs:
        target = layout_of(variable)
        _check_divisible(variable, target)
        jobs.append(Job(key, variable, target))
    missing_vars = [variable for _, variable in found.missing + found.fresh]
    to_init = [(v, layout_of(v)) for v in missing_vars if is_unloaded(v)]
    # Variables the format never stores (Keras h5 keeps no seed-generator
    # state and no LoRA factors): a lazily built one gets its own initial
    # value, which is what Keras' build + load_weights leaves there.
    named = {id(v) for v in wanted.values()}
    to_init += [(v, layout_of(v)) for v in _unique(model.variables) if id(v) not in named and is_unloaded(v)]
    # LoRA factors of a checkpoint of merged kernels, holding values: zeroed after the load.
    to_init += [(v, layout_of(v)) for v in lora_absent if not is_unloaded(v)]
    for variable, target in to_init:
        _check_divisible(variable, target)
    return jobs, to_init


def _unbuilt_state_fix(model: Any, found: naming.KeyMatch) -> str | None:
    """The advice for a full-state checkpoint into a model whose optimizer or metrics are not built yet.

    A compiled model's optimizer has its step counter and learning rate, and
    no slots before its first step; compiled metrics get their variables on
    the first fit/evaluate. Every such key of the checkpoint is then
    unexpected, and the fix is to build them, not to rename layers. None when
    the problems are others.
    """
    if found.missing or found.mismatched or not found.unexpected:
        return None
    if not all(naming.is_optional_key(k, found.format) for k in found.unexpected):
        return None
    optimizer = getattr(model, "optimizer", None)
    fixes = []
    if optimizer is not None and not getattr(optimizer, "built", True):
        fixes.append(
            "the model's optimizer is not built yet, so it has no slots for the checkpoint's "
            "optimizer state: build it first (model.optimizer.build(model.trainable_variables)), "
            "or resume with shardckpt.restore_latest(model, directory), which builds it"
        )
    if any(k.startswith("metrics_variables/") for k in found.unexpected):
        fixes.append(
            "the model's compiled metrics have no variables until the first fit/evaluate: run one "
            "(model.evaluate on a batch) before loading, or pass strict=False to load everything "
            "else and leave the metrics at zero"
        )
    return "; ".join(fixes) + "." if fixes else None


def _refuse_little(model: Any, found: naming.KeyMatch, path: str) -> None:
    """Refuses a `strict=False` load that fills less than half of the model's weights.

    `strict=False` skips a few differing variables; a checkpoint that fills
    none, or under half of the weight bytes, is another model (or keyed for
    another build of it), and returning would leave the model random without a word.

    Raises:
        CheckpointMismatchError: listing what is missing and unexpected.
    """
    weights = _unique(list(model.weights))
    total = sum(_nbytes(v) for v in weights)
    if not weights or not total:
        return
    ids = {id(v) for _, v in found.pairs}
    loaded = [v for v in weights if id(v) in ids]
    share = sum(_nbytes(v) for v in loaded) / total
    if loaded and share >= 0.5:
        return
    # Every layer named by the user: the names that differ come first (as a strict load's advice).
    renamed = renaming_fix(*found.names) + "; or " if found.names is not None and any(found.names) else ""
    raise CheckpointMismatchError(
        path,
        missing=found.missing_lines(),
        unexpected=found.unexpected,
        fmt=found.format,
        note=(
            f"strict=False would load {len(loaded)} of the model's {len(weights)} weights "
            f"({share:.0%} of their bytes) and leave the rest at their initial values: the "
            "checkpoint holds another model, or names its variables otherwise."
        ),
        fix=renamed + (
            "load the checkpoint into the architecture that wrote it (same layers and "
            "configuration), or check the path; strict=False is for a few differing variables, "
            "not for most of the model."
        ),
        names=found.names,
    )


def _nbytes(variable: Any) -> int:
    return int(np.prod(variable.shape, dtype=np.int64)) * np.dtype(variable.dtype).itemsize


def _unique(variables: list[Any]) -> list[Any]:
    # In order of first appearance; keyed by identity (variables hash by value).
    return list({id(v): v for v in variables}.values())


def _check_divisible(variable: Any, target: TargetLayout) -> None:
    sharding = target.sharding
    spec = getattr(sharding, "spec", None)
    mesh = getattr(sharding, "mesh", None)
    if spec is None or mesh is None:
        return
    if len(spec) > len(variable.shape):
        # JAX fails on it deep inside (an IndexError, or a sharding of
        # another rank kept on the array); said here, before any read.
        where = f"its layout {tuple(target.keras_layout.axes)}" if target.keras_layout is not None else "its layout"
        raise LayoutError(
            f"Variable {variable.path!r} of shape {tuple(variable.shape)} (rank {len(variable.shape)}) gets "
            f"{where}, partition spec {spec}: {len(spec)} axes for {len(variable.shape)} dimension(s). Fix: "
            "give its LayoutMap entry (or rule) one mesh axis or None per dimension, e.g. "
            f"{tuple([None] * len(variable.shape))}, or a key that matches the variables of that rank only. "
            f"Received: layout={spec}"
        )
    for dim, axes in enumerate(spec):
        if axes is None or dim >= len(variable.shape):
            continue
        names = axes if isinstance(axes, tuple) else (axes,)
        ways = int(np.prod([mesh.shape[a] for a in names]))
        if variable.shape[dim] % ways:
            raise IndivisibleLayoutError(
                f"Variable {variable.path!r} of shape {tuple(variable.shape)}: "
                f"dimension {dim} ({variable.shape[dim]}) is sharded over mesh axes "
                f"{names} of total size {ways}, which does not divide it. Fix: "
                "replicate this dimension in the layout (None), or use a mesh axis "
                "size that divides it."
            )


def _wants_ring(jobs: list[Job], transfer: str) -> bool:
    if transfer != "auto":
        return transfer == "ring"
    devices: set[Any] = {d for job in jobs for d in job.target.sharding.addressable_devices}
    return any(d.platform != "cpu" for d in devices)


def _run(
    jobs: list[Job],
    reader: Reader,
    report: LoadReport,
    max_inflight: int,
    advance: Callable[[int], None],
    transfer: str = "auto",
) -> None:
    ring = None
    if jobs and _wants_ring(jobs, transfer):
        timeline = pipeline.Timeline()
        ring = pipeline.Ring(max_inflight // pipeline.RING_SHARE, timeline, slots=_WORKERS + pipeline.MIN_SLOTS)
        report.transfer, report.ring_bytes, report.timeline = "ring", ring.nbytes, timeline.events
    # The ring's bytes are out of the budget for the whole load; the
    # strategies that bypass it (casts, rows larger than a slot) share the rest.
    budget = Budget(max(1, max_inflight - (ring.nbytes if ring is not None else 0)))
    try:
        _run_jobs(jobs, reader, report, max_inflight, advance, budget, ring)
    finally:
        if ring is not None:
            ring.drain()  # every transfer done: the load's time includes them


def _run_jobs(
    jobs: list[Job],
    reader: Reader,
    report: LoadReport,
    max_inflight: int,
    advance: Callable[[int], None],
    budget: Budget,
    ring: pipeline.Ring | None,
) -> None:
    # Host bytes of replaced values not yet given back to the OS; trimmed every
    # quarter budget, so what the heap keeps of them stays within the budget's
    # scale (see `hostmem`).
    freed = 0
    # Largest first so the long reads overlap the many small ones.
    order = sorted(jobs, key=lambda j: -reader.spec(j.key).nbytes)
    with concurrent.futures.ThreadPoolExecutor(_WORKERS) as pool:
        futures = [pool.submit(load_variable, job, reader, budget, advance, ring) for job in order]
        try:
            for future in concurrent.futures.as_completed(futures):
                done, released = future.result()
                report.bytes_read += done
                report.arrays += 1
                freed += released
                if freed >= max(1, max_inflight // 4):
                    hostmem.trim()  # here, while the workers go on
                    freed = 0
        except BaseException:
            for f in futures:
                f.cancel()
            raise
        finally:
            if freed:
                hostmem.trim()


def _initialize(variable: Any, target: TargetLayout) -> None:
    initializer = original_initializer(variable)
    if target.keras_layout is not None or isinstance(target.sharding, jax.sharding.NamedSharding):
        _keras.initialize(variable, initializer, layout=target.keras_layout or target.sharding)
    else:  # one device: Keras' own default placement, then moved
        _keras.initialize(variable, initializer, layout=None)
        value = jax.device_put(_keras.current_value(variable), target.sharding)
        _keras.set_value(variable, value, layout=None)
