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
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import ml_dtypes
import numpy as np

from shardckpt.restore import hostmem, readplan
from shardckpt.restore import keys as naming
from shardckpt.errors import (
    CheckpointMismatchError,
    DtypeMismatchError,
    IndivisibleLayoutError,
)
from shardckpt.formats import Reader, open_reader
from shardckpt.formats.base import ALIGNMENT, aligned_empty
from shardckpt.restore.targets import TargetLayout, resolve_layout
from shardckpt.restore.lazy import is_unloaded, original_initializer
from shardckpt.progress import ByteProgress

DEFAULT_MAX_INFLIGHT = 256 * 1024 * 1024
# Reads run on a few threads: numpy copies, h5 page faults and tensorstore
# decoding all release the GIL, and overlapping them hides I/O latency.
_WORKERS = min(8, max(2, (os.cpu_count() or 2)))


@dataclasses.dataclass(kw_only=True)
class LoadReport:
    """What `load_sharded` did.

    Attributes:
        path: The checkpoint read (for Orbax: the step folder).
        format: "h5", "keras", "orbax" or "safetensors".
        arrays: Variables that received a value from the checkpoint.
        bytes_read: Bytes of array data read by this process.
        seconds: Wall time of the whole load.
        missing: Variable paths with no array in the checkpoint.
        unexpected: Checkpoint keys matching no variable.
        skipped: Optimizer/metric keys left unread because the model has no
            such variables (e.g. a full-state checkpoint into a fresh model).
        casts: "path: stored -> variable dtype" for every cast made.
        initialized: Lazily built variables initialised because the
            checkpoint lacked them (`strict=False` only).
    """

    path: str
    format: str
    arrays: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    missing: list[str] = dataclasses.field(default_factory=list)
    unexpected: list[str] = dataclasses.field(default_factory=list)
    skipped: list[str] = dataclasses.field(default_factory=list)
    casts: list[str] = dataclasses.field(default_factory=list)
    initialized: list[str] = dataclasses.field(default_factory=list)

    def __str__(self) -> str:
        rate = self.bytes_read / self.seconds / 2**30 if self.seconds else 0.0
        lines = [
            f"Loaded {self.arrays} arrays ({self.bytes_read / 2**20:.1f} MiB) from "
            f"{self.format} {self.path!r} in {self.seconds:.2f} s ({rate:.2f} GiB/s)."
        ]
        for label, items in (
            ("missing", self.missing),
            ("unexpected", self.unexpected),
            ("skipped (model has no such variables)", self.skipped),
            ("cast", self.casts),
            ("initialised (not in checkpoint)", self.initialized),
        ):
            if items:
                shown = ", ".join(items[:8]) + (f", ... ({len(items)} total)" if len(items) > 8 else "")
                lines.append(f"  {label}: {shown}")
        return "\n".join(lines)


@dataclasses.dataclass
class _Job:
    key: str
    variable: Any
    target: TargetLayout


def load_sharded(
    model: Any,
    path: str | os.PathLike,
    *,
    layout: Any = None,
    strict: bool = True,
    max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT,
    progress: bool | None = None,
) -> LoadReport:
    """Loads a checkpoint into `model`, each variable directly in its sharding.

    Works on models built under `shardckpt.lazy_init()` (variables get their
    first value) and on models built normally (values are replaced variable by
    variable). All checks (keys, shapes, dtypes, divisibility) run before any
    variable is touched, so a failing call leaves the model as it was.

    Example:

    ```python
    with shardckpt.lazy_init():
        model = build_model()
    keras.distribution.set_distribution(plan.distribution())
    print(shardckpt.load_sharded(model, "model.weights.h5"))
    ```

    Args:
        model: A Keras 3 model (JAX backend).
        path: A `.weights.h5` or `.keras` file, an Orbax root (its latest
            committed step) or step folder, a `.safetensors` file or a
            `*.safetensors.index.json`, or a Hugging Face folder (config.json
            with a model_type and safetensors) into the keras-hub model
            `shardckpt.presets.hf.build(folder)` builds.
        layout: Where variables go. None: the active Keras distribution, else
            each variable's current sharding (or device 0 for a lazy one). Also
            a `keras.distribution.LayoutMap`, a `Distribution`, or a plan with
            `layout_map()` / `sharding_for(variable)` (`shardckpt.auto_layout`).
        strict: Raise on missing or unexpected keys. With False, load what
            matches; lazily built variables the checkpoint lacks are
            initialised with their own initializer, in their sharding.
        max_inflight_bytes: Most bytes of host memory the load holds at once
            beyond the final state: chunks being decoded, fresh reads and,
            off host, pieces on their way to their devices. A variable needing
            more is loaded alone. On a normally built model on CPU devices,
            the host memory of replaced values is given back to the OS after
            every quarter of this many bytes (glibc would keep it in its
            heaps, so the process would end holding the old model too; see
            `shardckpt.restore.hostmem`). On compressed checkpoints (Orbax) it also
            sets how many chunks are decoded in parallel: a bigger budget
            uses more cores. An accelerator runtime's own host staging of
            transfers comes on top (an H100 load peaked 0.79 GB over its
            final state with the default).
        progress: Show a progress bar. None: when stderr is a terminal.

    Returns:
        A `LoadReport`.

    Raises:
        CheckpointNotFoundError: nothing at `path`, or no committed step.
        UnknownFormatError: `path` is not a format shardckpt reads.
        CorruptCheckpointError: a file is truncated or damaged.
        IncompleteCheckpointError: an Orbax step was never committed.
        CheckpointMismatchError: keys missing/unexpected (strict) or shapes differ.
        DtypeMismatchError: a stored dtype cannot be cast to the variable's.
        IndivisibleLayoutError: a mesh axis does not divide a sharded dimension.
    """
    start = time.perf_counter()
    if max_inflight_bytes < 1:
        raise ValueError(f"max_inflight_bytes must be positive. Received: {max_inflight_bytes}")
    reader = open_reader(os.fspath(path), cache_bytes=_chunk_cache_bytes(max_inflight_bytes), model=model)
    try:
        report = LoadReport(path=reader.path, format=reader.format)
        jobs, to_init = _match(model, reader, report, strict, resolve_layout(layout))
        total = sum(reader.spec(job.key).nbytes for job in jobs)
        show = sys.stderr.isatty() if progress is None else progress
        with ByteProgress(total, f"loading {os.path.basename(reader.path)}", enabled=show) as bar:
            _run(jobs, reader, report, max_inflight_bytes, bar.advance)
        for variable, target in to_init:
            _initialize(variable, target)
            report.initialized.append(variable.path)
    finally:
        reader.close()
    report.seconds = time.perf_counter() - start
    return report


# Decoded-chunk cache of compressed formats; see `_chunk_cache_bytes`.
_CHUNK_CACHE = 32 * 1024 * 1024


def _chunk_cache_bytes(max_inflight_bytes: int) -> int:
    """Size of the decoded-chunk cache of compressed formats (Orbax).

    Every piece of a variable is requested in one tensorstore batch, which
    decodes a chunk shared by the pieces once for all of them, so the cache
    need not hold big chunks until every piece is read. It must hold the small
    things every read goes through (zarr shard indexes, OCDBT nodes): without
    any cache, restoring 1 MiB chunks took 1.8-2.2 s instead of 1.45 s.
    Measured on the 1.6 GB model of tools/bench_restore.py: with 32 MiB, peak
    memory over the final state was 0.10-0.12 GB; with a 256 MiB cache, 0.31
    GB, as consumed 64 MiB chunks stayed cached (on an H100, where the cache
    was 256 MiB until then, 0.86-0.90 GB).
    """
    return min(max_inflight_bytes, _CHUNK_CACHE)


def _match(
    model: Any,
    reader: Reader,
    report: LoadReport,
    strict: bool,
    layout_of: Callable[[Any], TargetLayout],
) -> tuple[list[_Job], list[tuple[Any, TargetLayout]]]:
    """Pairs keys with variables and checks everything before any I/O."""
    wanted = naming.keys_for(model, reader.format)
    stored = set(reader.keys())
    collections_stored = {k.split("/", 1)[0] for k in stored}
    jobs: list[_Job] = []
    seen: set[int] = set()
    mismatched: list[str] = []
    missing_vars: list[Any] = []
    for key, variable in wanted.items():
        if not naming.is_variable(variable):
            mismatched.append(
                f"{key}: the layer saves a computed value here (quantized or LoRA "
                "layer), which load_sharded cannot place; load it with "
                "model.load_weights"
            )
            continue
        if key not in stored:
            optional = naming.is_optional_key(key)
            if optional and key.split("/", 1)[0] not in collections_stored:
                continue  # e.g. a weights-only checkpoint: optimizer keeps its state
            if id(variable) not in seen:
                missing_vars.append(variable)
                report.missing.append(f"{variable.path} (key {key!r})")
            continue
        stored.discard(key)
        if id(variable) in seen:
            continue  # a shared variable saved under two keys: load it once
        seen.add(id(variable))
        spec = reader.spec(key)
        if tuple(spec.shape) != tuple(variable.shape):
            mismatched.append(
                f"{variable.path}: checkpoint {key!r} has shape {tuple(spec.shape)}, "
                f"the variable {tuple(variable.shape)}"
            )
            continue
        target_dtype = np.dtype(variable.dtype)
        _check_cast(variable.path, key, spec.dtype, target_dtype)
        if spec.dtype != target_dtype:
            report.casts.append(f"{variable.path}: {spec.dtype} -> {target_dtype}")
        target = layout_of(variable)
        _check_divisible(variable, target)
        jobs.append(_Job(key, variable, target))
    for key in sorted(stored):
        if naming.is_optional_key(key) and not any(k.startswith(key.split("/", 1)[0] + "/") for k in wanted):
            report.skipped.append(key)
        else:
            report.unexpected.append(key)
    if mismatched or (strict and (report.missing or report.unexpected)):
        raise CheckpointMismatchError(
            reader.path,
            missing=report.missing if strict else (),
            unexpected=report.unexpected if strict else (),
            mismatched=mismatched,
        )
    to_init = [(v, layout_of(v)) for v in missing_vars if is_unloaded(v)]
    for variable, target in to_init:
        _check_divisible(variable, target)
    return jobs, to_init


# Casts Keras' own loading would make without losing meaning: float width
# changes, integer width changes, and integers or booleans into floats. A float
# checkpoint loaded into an integer variable is a mistake, not a cast.
_CASTS = {"f": "f", "i": "iu", "u": "iu", "b": "bf"}


def _kind(dtype: np.dtype) -> str:
    """numpy's dtype kind, with ml_dtypes' bfloat16/float8 (kind "V") as floats."""
    if dtype.kind != "V":
        return dtype.kind
    try:
        ml_dtypes.finfo(dtype)
        return "f"
    except ValueError:
        pass
    try:
        ml_dtypes.iinfo(dtype)
        return "i"
    except ValueError:
        return "V"


def _check_cast(path: str, key: str, stored: np.dtype, target: np.dtype) -> None:
    if stored == target:
        return
    # Integers and booleans may also go into floats.
    kind = _kind(stored)
    allowed = _CASTS.get(kind, "") + ("f" if kind in "iu" else "")
    if _kind(target) not in allowed:
        raise DtypeMismatchError(
            f"Variable {path!r}: checkpoint {key!r} holds {stored}, which does not "
            f"cast to the variable's {target} without losing meaning. Fix: build "
            f"the variable with dtype {stored} (or a wider one of the same kind), "
            "or convert the checkpoint."
        )


def _check_divisible(variable: Any, target: TargetLayout) -> None:
    sharding = target.sharding
    spec = getattr(sharding, "spec", None)
    mesh = getattr(sharding, "mesh", None)
    if spec is None or mesh is None:
        return
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


class _Budget:
    """Caps bytes of read data alive at once across worker threads."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._cond = threading.Condition()

    def acquire(self, n: int) -> int:
        n = min(n, self.limit)  # one read larger than the cap runs alone
        with self._cond:
            self._cond.wait_for(lambda: self.used + n <= self.limit)
            self.used += n
        return n

    def release(self, n: int) -> None:
        with self._cond:
            self.used -= n
            self._cond.notify_all()


def _run(
    jobs: list[_Job],
    reader: Reader,
    report: LoadReport,
    max_inflight: int,
    advance: Callable[[int], None],
) -> None:
    budget = _Budget(max_inflight)
    # Host bytes of replaced values not yet given back to the OS; trimmed every
    # quarter budget, so what the heap keeps of them stays within the budget's
    # scale (see `hostmem`).
    freed = 0
    # Largest first so the long reads overlap the many small ones.
    order = sorted(jobs, key=lambda j: -reader.spec(j.key).nbytes)
    with concurrent.futures.ThreadPoolExecutor(_WORKERS) as pool:
        futures = [pool.submit(_load_one, job, reader, budget, advance) for job in order]
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


def _load_one(
    job: _Job, reader: Reader, budget: _Budget, advance: Callable[[int], None]
) -> tuple[int, int]:
    """Loads one variable.

    Returns:
        Bytes read, and host bytes of the value it replaced (now free).
    """
    spec = reader.spec(job.key)
    shape = tuple(job.variable.shape)
    dtype = np.dtype(job.variable.dtype)
    sharding = job.target.sharding
    parts = readplan.pieces(sharding.addressable_devices_indices_map(shape), shape)
    on_host = all(d.platform == "cpu" for p in parts for d in p.devices)
    if (
        not on_host
        and hasattr(reader, "is_chunk")
        and all(reader.is_chunk(job.key, p.box) for p in parts)
    ):
        return _load_by_chunk(job, reader, parts, budget, advance)
    if hasattr(reader, "read_pieces") and reader.chunk_bytes(job.key) <= budget.limit:
        count = sum(readplan.volume(p.box) for p in parts)
        # Held while reading: the chunk being decoded, and the pieces unless
        # they are final memory (see `_pieces_are_extra`).
        need = reader.chunk_bytes(job.key)
        if _pieces_are_extra(job, on_host):
            need += count * (spec.dtype.itemsize + (dtype.itemsize if spec.dtype != dtype else 0))
        held = budget.acquire(need)
        try:
            released = _place(job, shape, sharding, parts, _read_pieces(job, reader, parts, dtype, spec))
        finally:
            budget.release(held)
        done = count * spec.dtype.itemsize
        advance(done)
        return done, released
    chunk_rows = reader.chunk_rows(job.key) if hasattr(reader, "chunk_rows") else None
    reads = readplan.plan(
        shape,
        spec.dtype.itemsize,
        parts,
        budget=budget.limit,
        chunk_rows=chunk_rows,
        # Off host, each piece is its own read: a fresh read then holds one
        # piece's data, not a slab spanning several.
        per_piece=not on_host and len(parts) > 1,
    )
    fetch = getattr(reader, "view", reader.read)  # zero-copy where the format allows
    fresh = not hasattr(reader, "view")  # data we own, not a view of a memory map
    # Held for the whole variable, taken at once (a second wait while holding
    # part of the budget could deadlock): a fresh read's data, and the pieces
    # unless they are final memory. A view of a memory map holds no memory.
    need = max(readplan.volume(r.box) for r in reads) * spec.dtype.itemsize if fresh and reads else 0
    if _pieces_are_extra(job, on_host):
        need += sum(readplan.volume(p.box) for p in parts) * dtype.itemsize
    held = budget.acquire(need)
    try:
        buffers: list[np.ndarray | None] = [None] * len(parts)
        done = 0
        for read in reads:
            data = fetch(job.key, read.box)
            for copy in read.copies:
                if fresh and _covers(copy.dst, parts[copy.piece].shape):
                    part = data[copy.src]
                    if _adoptable(part, dtype):
                        # A fresh read holds this piece contiguously (row blocks,
                        # replicas): the piece is a view, no copy. The views of
                        # one read cover disjoint bytes, so devices never share.
                        buffers[copy.piece] = part
                        continue
                if buffers[copy.piece] is None:
                    buffers[copy.piece] = aligned_empty(parts[copy.piece].shape, dtype)
                buffers[copy.piece][copy.dst] = data[copy.src]
            del data
            nbytes = readplan.volume(read.box) * spec.dtype.itemsize
            done += nbytes
            advance(nbytes)
        released = _place(job, shape, sharding, parts, buffers)
    finally:
        budget.release(held)
    return done, released


def _load_by_chunk(
    job: _Job, reader: Any, parts: list[readplan.Piece], budget: _Budget, advance: Callable[[int], None]
) -> tuple[int, int]:
    """Sends each piece that is exactly one stored chunk to its devices as decoded.

    For accelerators: the host holds one decoded chunk per variable in flight
    instead of a chunk and a copy of it (on an H100 the default budget then
    decodes twice as many chunks in parallel). Each piece leaves the host
    before the next is read. On CPU devices the copy is what makes a buffer
    the devices can adopt, so this path is not used there.
    """
    spec = reader.spec(job.key)
    shape = tuple(job.variable.shape)
    dtype = np.dtype(job.variable.dtype)
    cast = dtype.itemsize / spec.dtype.itemsize if spec.dtype != dtype else 0.0
    need = int(reader.chunk_bytes(job.key) * (1 + cast))
    held = budget.acquire(need)
    done = 0
    try:
        singles = []
        for part in parts:
            data = reader.read(job.key, part.box)
            if data.dtype != dtype:
                data = data.astype(dtype)
            placed = [jax.device_put(data, device) for device in part.devices]
            del data
            jax.block_until_ready(placed)  # the decoded chunk is free after this
            singles.extend(placed)
            nbytes = readplan.volume(part.box) * spec.dtype.itemsize
            done += nbytes
            advance(nbytes)
        value = jax.make_array_from_single_device_arrays(shape, job.target.sharding, singles)
        released = hostmem.host_bytes(_assign(job.variable, value, job.target))
    finally:
        budget.release(held)
    return done, released


def _pieces_are_extra(job: _Job, on_host: bool) -> bool:
    """Whether a variable's new pieces are memory beyond the final state.

    Off host they are copies on their way to the devices. On host they become
    the devices' buffers, final memory, unless the variable still holds its
    old value (a model built normally), alive until the new one replaces it.
    """
    return not on_host or not is_unloaded(job.variable)


def _read_pieces(
    job: _Job,
    reader: Any,
    parts: list[readplan.Piece],
    dtype: np.dtype,
    spec: Any,
) -> list[np.ndarray]:
    """Lets the reader decode straight into per-piece buffers (Orbax).

    All pieces in one call: the reader decodes a chunk they share once.
    """
    buffers = [aligned_empty(p.shape, spec.dtype) for p in parts]
    reader.read_pieces(job.key, [p.box for p in parts], buffers)
    if spec.dtype != dtype:
        buffers = [_cast(b, dtype) for b in buffers]
    return buffers


def _cast(buffer: np.ndarray, dtype: np.dtype) -> np.ndarray:
    out = aligned_empty(buffer.shape, dtype)
    out[...] = buffer
    return out


def _place(
    job: _Job,
    shape: tuple[int, ...],
    sharding: jax.sharding.Sharding,
    parts: list[readplan.Piece],
    buffers: list[np.ndarray],
) -> int:
    """Puts the pieces on their devices and makes them the variable's value.

    Off host, waits until the transfers are done and drops the caller's host
    copies (`buffers` is emptied), so a budget released after this call
    covered them.

    Returns:
        Host bytes of the value replaced (`hostmem.host_bytes`), free once this returns.
    """
    singles = [
        # Only CPU devices adopt host buffers; an accelerator copies anyway.
        jax.device_put(buffers[i] if j == 0 or device.platform != "cpu" else _replica(buffers[i]), device)
        for i, part in enumerate(parts)
        for j, device in enumerate(part.devices)
    ]
    value = jax.make_array_from_single_device_arrays(shape, sharding, singles)
    old = _assign(job.variable, value, job.target)
    if any(d.platform != "cpu" for p in parts for d in p.devices):
        buffers.clear()
        value.block_until_ready()  # the host copies are free after this
    # `old` is freed as this returns, unless the user still holds the array.
    return hostmem.host_bytes(old)


def _replica(buffer: np.ndarray) -> np.ndarray:
    # On CPU, device_put adopts an aligned buffer instead of copying it; each
    # device must own its memory (a donating train step updates it in place).
    copy = aligned_empty(buffer.shape, buffer.dtype)
    copy[...] = buffer
    return copy


def _covers(box: readplan.Box, shape: tuple[int, ...]) -> bool:
    return all(s.start == 0 and s.stop == n for s, n in zip(box, shape))


def _adoptable(data: np.ndarray, dtype: np.dtype) -> bool:
    return (
        data.dtype == dtype
        and data.flags.c_contiguous
        and data.flags.writeable
        and data.ctypes.data % ALIGNMENT == 0
    )


def _assign(variable: Any, value: jax.Array, target: TargetLayout) -> Any:
    """Makes `value` the variable's value; returns the value it replaced (None if lazy)."""
    # Bypass `Variable.assign`, which would re-place the value on the variable's
    # previous layout; the target layout becomes the variable's layout so that
    # later assigns (optimizer updates) keep it.
    variable._layout = target.keras_layout if target.keras_layout is not None else target.sharding
    old, variable._value = variable._value, value
    variable._initializer = None  # drops lazy_init's sentinel
    return old


def _initialize(variable: Any, target: TargetLayout) -> None:
    initializer = original_initializer(variable)
    variable._initializer = None
    if target.keras_layout is not None or isinstance(target.sharding, jax.sharding.NamedSharding):
        variable._layout = target.keras_layout or target.sharding
        # Keras jits the initializer with the layout as out_shardings, so the
        # value is created directly in its sharding.
        variable._initialize_with_initializer(initializer)
    else:  # one device: Keras' own default placement
        variable._layout = None
        variable._initialize_with_initializer(initializer)
        variable._value = jax.device_put(variable._value, target.sharding)
