"""`export(model, dst)`: a sharded model written out, each process writing its own pieces.

Order of work, the same in every process:

1. Plan, before anything is written: the model is checked
   (`export.model.check_exportable`: not quantized, every variable loaded),
   the format's tensors and their remaps are computed (`export.hf.plan`,
   `export.kerashub`, or variable paths for safetensors), and an existing
   `dst` is refused unless `overwrite=True`. Every refusal happens here.
2. Lay out: process 0 creates `<dst>.shardckpt-partial/` and every data
   file at its final size, headers first (safetensors header, HDF5
   datasets allocated contiguous), so each array's bytes have a fixed
   offset. All processes wait for it (`multihost_utils.sync_global_devices`).
3. Write: each process writes the pieces its devices hold (replica 0 of
   each, so a replicated piece is written once) at their offsets through
   writable maps (`formats.mapped_writer`), in blocks within
   `max_inflight_bytes`; it flushes and syncs, then all wait.
4. Commit: process 0 writes the small files (config, tokenizer), then
   renames the folder to `dst` (`storage.commit`: synced, then renamed). A
   crash before that leaves only the `.shardckpt-partial` folder, which no
   loader takes for a model and the next export to `dst` removes.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from shardckpt import budget as _budget
from shardckpt import dtypes, storage
from shardckpt.errors import DestinationExistsError, UnsupportedURLError
from shardckpt.exporting import model as _model
from shardckpt.exporting import plans
from shardckpt.exporting.assemble import BLOCK_BYTES, Writer
from shardckpt.exporting.pieces import write_value
from shardckpt.formats import h5_writer, registry, safetensors_writer
from shardckpt.formats.mapped_writer import MappedFiles
from shardckpt.formats.orbax.ondisk import COMMIT_MARKER
from shardckpt.progress import ByteProgress, key_lines
from shardckpt.storage import commit
from shardckpt.types import DType, Model

if TYPE_CHECKING:
    from shardckpt.restore import LoadReport

_log = logging.getLogger("shardckpt")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExportReport:
    """What one process wrote.

    Attributes:
        path: The exported folder.
        format: "hf", "keras-hub", "safetensors", "orbax" or "peft".
        files: Data files of the folder (every process's).
        arrays: Stored tensors in the folder.
        bytes_total: Bytes of tensor data in the folder.
        bytes_written: Bytes of tensor data this process wrote.
        seconds: Wall time of this call.
        process_index: This process's `jax.process_index()`.
        load: The load of the model before it was exported, where
            `shardckpt.convert` loaded it (`to="hf"`, "keras-hub",
            "safetensors"): its `LoadReport`, the budget it ran with
            included. None from `export` itself.
        casts: "variable path: from -> to" for each variable stored in
            another dtype than its own (`dtype=`), as `ConvertReport.casts`.
    """

    path: str
    format: str
    files: list[str]
    arrays: int
    bytes_total: int
    bytes_written: int
    seconds: float
    process_index: int
    load: LoadReport | None = None
    casts: list[str] = dataclasses.field(default_factory=list)

    def __str__(self) -> str:
        text = [
            f"exported {self.arrays} arrays ({self.bytes_total / 1e6:.1f} MB, this process wrote "
            f"{self.bytes_written / 1e6:.1f} MB) as {self.format} to {self.path} in {self.seconds:.2f} s",
            *key_lines((("cast", self.casts),)),
        ]
        if self.load is None:
            return "\n".join(text)
        lines = [str(self.load)]
        if self.load.transfer != "ring":  # the ring's line names the budget already
            lines.append(f"Host-memory budget of the load: {self.load.budget}.")
        return "\n".join([*lines, *text])


# Formats not split into files, and why (`max_shard_size` is refused for them).
_UNSPLIT = {
    "orbax": "an Orbax checkpoint is chunked, not split into files.",
    "peft": "a PEFT adapter is one adapter_model.safetensors, the file PEFT reads.",
}


def _barrier(name: str) -> None:
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _lay_out(plan: plans.Plan, folder: str) -> dict[str, safetensors_writer.TensorSlot]:
    if plan.kind == "safetensors":
        return safetensors_writer.create_folder(folder, plan.specs, plan.files)
    slots: dict[str, safetensors_writer.TensorSlot] = {}
    stems: dict[str, dict[str, list[str]]] = {}
    for name, keys in plan.files.items():
        stems.setdefault(keys[0].split(":", 1)[0] if keys else name, {})[name] = keys
    for stem, files in stems.items():
        plain = {name: [k.split(":", 1)[1] for k in keys] for name, keys in files.items()}
        specs = {k.split(":", 1)[1]: s for k, s in plan.specs.items() if k.startswith(f"{stem}:")}
        groups = {g.split(":", 1)[1]: a for g, a in plan.groups.items() if g.startswith(f"{stem}:")}
        made = h5_writer.create_files(folder, specs, plain, groups, index=plan.index if stem == "model" else None)
        slots.update({f"{stem}:{k}": s for k, s in made.items()})
    return slots


def _slots(plan: plans.Plan, folder: str) -> dict[str, safetensors_writer.TensorSlot]:
    """Every key's slot, read back from the laid-out files (processes other than 0)."""
    if plan.kind == "safetensors":
        out = {}
        for name, keys in plan.files.items():
            _, offsets = safetensors_writer.header({k: plan.specs[k] for k in keys})
            out.update({k: safetensors_writer.TensorSlot(file=name, offset=offsets[k], spec=plan.specs[k]) for k in keys})
        return out
    import h5py

    out = {}
    for name, keys in plan.files.items():
        with h5py.File(os.path.join(folder, name), "r") as f:
            for key in keys:
                offset = f[key.split(":", 1)[1]].id.get_offset()
                if offset is not None:
                    out[key] = safetensors_writer.TensorSlot(file=name, offset=int(offset), spec=plan.specs[key])
    return out


def _check_destination(dst: str, overwrite: bool) -> None:
    if os.path.lexists(dst) and not overwrite:
        raise DestinationExistsError(
            f"{dst!r} already exists. Fix: choose another destination, remove it, or pass overwrite=True."
        )
    if os.path.exists(dst) and not os.path.isdir(dst):
        raise DestinationExistsError(f"{dst!r} exists and is not a folder; export writes a folder. Fix: remove it.")


def _export_orbax(model: Any, dst: str, *, format: str, dtype: Any, shard: int | None,  # noqa: A002
                  max_inflight_bytes: int | None, progress: bool | None, overwrite: bool,
                  start: float) -> ExportReport:
    """The orbax writer (`formats.registry`): one Orbax step of the weights, one process."""
    from shardckpt.exporting.orbax import export_orbax

    _check_destination(dst, overwrite)
    stage = commit.begin(dst, overwrite=overwrite, marker=COMMIT_MARKER, shared=True, who="export")
    try:
        arrays, total, marker, casts = export_orbax(model, stage.location.path, dtype=dtype,
                                                    budget=_budget.Budget(_budget.resolve(max_inflight_bytes)))
        stage.commit(marker)
    except BaseException:
        stage.discard()
        raise
    return ExportReport(path=dst, format=format, files=[], arrays=arrays, bytes_total=total, bytes_written=total,
                        seconds=time.perf_counter() - start, process_index=0, casts=casts)


def export(
    model: Model,
    dst: str | os.PathLike,
    *,
    format: str = "hf",  # noqa: A002 (the contract's name)
    max_shard_size: float | str | None = None,
    dtype: DType = None,
    max_inflight_bytes: int | None = None,
    progress: bool | None = None,
    overwrite: bool = False,
) -> ExportReport:
    """Writes a (sharded) model as a Hugging Face folder, a keras-hub preset, safetensors, Orbax or a PEFT adapter.

    No tensor is gathered: each process writes only its own devices' pieces
    (a replicated piece once) straight into the files at their offsets.

    Example:

    ```python
    model = shardckpt.from_preset("Llama-3.2-1B/", mesh=(2, 4))
    ...  # fine-tune
    shardckpt.export(model, "out_hf/")                                   # Hugging Face
    shardckpt.export(model, "out_preset/", format="keras-hub", max_shard_size=5)
    ```

    Args:
        model: A keras-hub backbone or task (any Keras model for
            "safetensors"), every variable loaded, sharded or not.
        dst: The folder to create.
        format: "hf" (`config.json` + `model.safetensors`, Hugging Face
            names and layouts; a task also writes its tokenizer files as
            keras-hub's exporter does), "keras-hub" (a preset keras-hub's
            `from_preset` reads), "safetensors" (`model.safetensors`,
            keys = variable paths; any Keras model) or "orbax" (one Orbax
            step of the weights, as Keras' `load_weights(dir)` reads; one
            process) or "peft" (a LoRA model's factors alone as a PEFT
            adapter folder: `adapter_config.json`, `adapter_model.safetensors`;
            `export.peft`: trainable variables other than the factors go
            in too, a non-trainable one never, even if changed while
            frozen). A task's head goes to "hf" under its Hugging
            Face head class (`export.hf_heads`); a LoRA layer is stored
            merged, without factors, in every format but "peft".
        max_shard_size: Split weights into files of at most this size: a
            number of GB (as keras-hub's `save_to_preset`) or a string such
            as "500MB". None: one file. Not for "orbax" or "peft" (refused).
        dtype: Store floating-point tensors in this dtype (e.g. "bfloat16");
            None: each variable's own dtype. A floating-point dtype only.
        max_inflight_bytes: Most bytes of tensor data this process holds in
            host memory at once (`shardckpt.budget`); None: the host's default.
        progress: Show a progress bar; None: when stderr is a terminal.
        overwrite: Replace an existing `dst` (only once the new folder is complete).

    Returns:
        An `ExportReport` for this process.

    Raises:
        DestinationExistsError: `dst` exists and `overwrite` is False.
        UnsupportedModelError: no mapping to the format for this
            architecture, a task head with no Hugging Face head map (naming
            its variables), a LoRA layer PEFT cannot express, or a quantized
            model (before anything is written).
        UnloadedVariableError: a variable holds no value.
        DtypeMismatchError: `dtype` is not a floating-point dtype.
        ValueError: `max_shard_size` does not parse, or is given with
            format="orbax" or "peft".
    """
    start = time.perf_counter()
    write = registry.writer_for(format)  # an unknown format is refused first
    location = storage.parse(dst, what="dst")  # an unsupported scheme:// is refused here
    # The rule `convert(to="orbax")` applies: a cast to int8 would truncate every weight (99% zeros).
    dtype = dtypes.float_dtype(dtype)
    _model.check_exportable(model)
    shard = plans.max_shard_bytes(max_shard_size)
    if shard is not None and format in _UNSPLIT:
        # Refused, not ignored, as `convert(to="orbax")` refuses it.
        raise ValueError(
            f"max_shard_size applies to format='hf', 'keras-hub' and 'safetensors'; {_UNSPLIT[format]} "
            f"Fix: drop it. Received: format={format!r}, max_shard_size={max_shard_size!r}"
        )
    if location.is_remote and format == "orbax":
        raise UnsupportedURLError(
            f"dst={location.url!r}: format='orbax' writes local folders. Fix: export format='safetensors' or "
            f"'hf' into the bucket, or save Orbax steps there with shardckpt.OrbaxCheckpoint. Received: "
            f"dst={location.url!r}"
        )
    if location.is_remote:
        from shardckpt.exporting.bucket import export_to_bucket

        # A PEFT adapter is one file whatever its size: no limit to pass on (`_UNSPLIT`).
        limit = None if format in _UNSPLIT else shard or _budget.resolve(max_inflight_bytes)
        return export_to_bucket(
            location, export, model, shard=limit, overwrite=overwrite,
            format=format, dtype=dtype, max_inflight_bytes=max_inflight_bytes, progress=progress,
        )
    return write(model, location.path, format=format, dtype=dtype, shard=shard,
                 max_inflight_bytes=max_inflight_bytes, progress=progress, overwrite=overwrite, start=start)


def _export_files(planner: Callable[[Any, Any, int | None], plans.Plan], model: Any, dst: str, *,
                  format: str, dtype: Any, shard: int | None,  # noqa: A002
                  max_inflight_bytes: int | None, progress: bool | None, overwrite: bool,
                  start: float) -> ExportReport:
    """The writer of a file-based format (`formats.registry`): plan, lay out, fill, commit."""
    import jax

    plan = planner(model, dtype, shard)
    _check_destination(dst, overwrite)
    process = jax.process_index()
    # One stage every process writes into (`storage.commit`); process 0 commits it.
    partial = commit.shared_location(dst).path
    if process == 0:
        stage = commit.begin(dst, overwrite=overwrite, shared=True, who="export")
        slots = _lay_out(plan, partial)
    _barrier(f"shardckpt-export-laid-out:{dst}")
    if process != 0:
        slots = _slots(plan, partial)
    getters = _model.value_getters(model)
    limit = _budget.resolve(max_inflight_bytes)
    mapped = MappedFiles(partial, slots)
    # Two block buffers (`export.assemble`) take half the budget at most; pieces written one by one the rest.
    writer = Writer(min(BLOCK_BYTES, limit // 4), mapped.pwrite)
    budget = _budget.Budget(limit - 2 * writer.block_bytes)
    total = sum(s.nbytes for s in plan.specs.values())
    written = 0
    show = sys.stderr.isatty() if progress is None else progress
    overflows = dtypes.Overflows(dtype)
    try:
        # numpy's anonymous "overflow encountered in cast" gives way to one warning naming the variables.
        with ByteProgress(total, f"export {format}", enabled=show) as bar, np.errstate(over="ignore"):
            for ordinal, (variable, remap) in enumerate(plan.writes):
                keys = [k for k in remap.sources() if k in slots]
                if not keys:
                    continue  # zero-sized
                stored_dtype = plan.specs[keys[0]].dtype
                itemsize = stored_dtype.itemsize
                value = _model.value_of(variable, getters)
                if dtypes.narrows_range(value.dtype, stored_dtype):
                    overflows.add(variable.path, _model.overflowed(value, stored_dtype))
                n = write_value(value, remap, mapped, budget, salt=ordinal, writer=writer)
                stored = n // max(1, np.dtype(value.dtype).itemsize) * itemsize
                written += stored
                bar.advance(stored)
        writer.close()
        mapped.flush()
    finally:
        try:
            writer.close()  # raises a failed block write, if the body did not already
        finally:
            mapped.close()  # the maps and descriptors go either way
    _barrier(f"shardckpt-export-written:{dst}")
    said = overflows.message(f"export format={format!r} to {dst!r}")
    if said and process == 0:  # every process counted the same global values
        _log.warning("%s", said)
    if process == 0:
        if plan.small_files is not None:
            plan.small_files(partial)
        stage.commit()
    _barrier(f"shardckpt-export-committed:{dst}")
    return ExportReport(
        path=dst, format=format, files=sorted(plan.files), arrays=len(plan.specs), bytes_total=total,
        bytes_written=written, seconds=time.perf_counter() - start, process_index=process, casts=plan.casts(),
    )


# The writers the formats' catalog names (`shardckpt.formats.catalog`, imported at first use).
write_hf = functools.partial(_export_files, plans.plan_hf)
write_keras_hub = functools.partial(_export_files, plans.plan_keras_hub)
write_safetensors = functools.partial(_export_files, plans.plan_safetensors)
write_peft = functools.partial(_export_files, plans.plan_peft)
write_orbax = _export_orbax
