"""`convert(src, dst)`: Keras h5 / safetensors -> an Orbax checkpoint, streaming.

Data path: source reader (memory-mapped h5 / safetensors) -> C-order pieces
of at most a quarter of `max_inflight_bytes` -> cast (optional) and CRC-32 ->
TensorStore transaction -> one OCDBT commit per batch (`shardckpt.formats.orbax.writer`).
At most two batches are alive (one being filled, one committing), and
TensorStore may hold an encoded copy of a committing batch, so array data in
memory stays within `max_inflight_bytes`. No array is ever whole in memory
unless it fits a piece.

The output is a single Orbax step folder whose `pytree` item is the
weights-only state tree `{"trainable_variables": {...}, "non_trainable_variables":
{...}}` nested by `variable.path`: exactly what `model.get_state_tree()` holds
(minus optimizer and metrics), so Keras' `model.load_weights(dst)` and
`shardckpt.load_sharded(model, dst)` both read it.

Which source key is which variable (and whether it is trainable) is not in
a `.weights.h5` or safetensors file; it comes from the model's architecture:
the `.keras` file's own config, or `model=`. Keys are matched with
`shardckpt.restore.keys`, the same code `load_sharded` uses.

Chunking: each array is written in blocks (Orbax's "write shape") no
larger than a piece and no larger than its shard under `layout`/`mesh` when
given, which Orbax's `chunk_byte_size` splits into stored chunks of at most
`shardckpt.formats.orbax.writer.CHUNK_BYTES` (31 MiB uncompressed, 4 MiB
with zstd, measured): the chunk is what a restore reads, so a device of any
later mesh reads at most one partial chunk's worth beyond its shard at each
edge, and a compressed array's chunks decode in parallel.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from shardckpt import budget as budgets
from shardckpt import dtypes, state, storage
from shardckpt.conversion import boxes, integrity
from shardckpt.conversion.architecture import built, load_architecture
from shardckpt.errors import ModelRequiredError, UnknownFormatError
from shardckpt.formats import FORMATS, detect_format, open_reader
from shardckpt.formats.base import MappedReader, Reader
from shardckpt.formats.hf import HFReader
from shardckpt.formats.orbax import ondisk
from shardckpt.formats.orbax import writer as orbax_writer
from shardckpt.formats.orbax.writer import COMPRESSIONS, DEFAULT_COMPRESSION, OrbaxStepWriter, write_assets
from shardckpt.layout.auto import auto_layout
from shardckpt.lazy import is_unloaded, original_initializer
from shardckpt.progress import ByteProgress, format_bytes, key_lines, read_line
from shardckpt.restore import keys as naming
from shardckpt.restore.assets import stored_assets
from shardckpt.restore.targets import resolve_layout
from shardckpt.storage import commit
from shardckpt.structure import explicit_names, index_variables
from shardckpt.types import DType, Layout, Mesh, Model

_log = logging.getLogger("shardckpt")

FORCE_FIX = "pass force=True (--force)"
"""What replaces an existing destination of `convert` (its messages say so)."""


@dataclasses.dataclass(kw_only=True)
class ConvertReport:
    """What `convert` wrote.

    Attributes:
        src: The source file.
        dst: The Orbax step folder written.
        format: The source format's name in `shardckpt.formats.FORMATS`.
        arrays: Arrays written.
        bytes_read: Bytes of array data read from the source.
        bytes_on_disk: Size of `dst` on disk (in a bucket: its objects' summed sizes, see `storage.du`).
        seconds: Wall time of the conversion.
        compression: "none" or "zstd".
        skipped: Source keys not converted (optimizer state: the output holds
            weights only).
        casts: "key: from -> to" for each array cast by `dtype=`.
        uncast: Floating-point arrays `dtype=` leaves in their dtype: indices
            (int4 / GPTQ group indices `g_idx`, float32 under every Keras
            policy), which the cast would change beyond its exact integers.
        initialized: Variables the source format cannot hold (seed-generator
            states in Keras h5), written with their initial value as Keras'
            own build + load_weights + save would.
        rounding: Set when the source's converter stores another dtype than
            the source's (keras-hub's Mistral converter rounds every tensor
            through float16): what was written, and how `dtype=` avoids a
            second rounding. Also logged as a warning.
    """

    src: str
    dst: str
    format: str
    arrays: int = 0
    bytes_read: int = 0
    bytes_on_disk: int = 0
    seconds: float = 0.0
    compression: str = DEFAULT_COMPRESSION
    skipped: list[str] = dataclasses.field(default_factory=list)
    casts: list[str] = dataclasses.field(default_factory=list)
    uncast: list[str] = dataclasses.field(default_factory=list)
    initialized: list[str] = dataclasses.field(default_factory=list)
    rounding: str | None = None

    def __str__(self) -> str:
        source = f"{self.format} {self.src!r} to Orbax {self.dst!r}"
        lines = [
            f"{read_line('Converted', self.arrays, self.bytes_read, source, self.seconds)}; "
            f"{format_bytes(self.bytes_on_disk)} on disk, compression {self.compression}, "
            f"{integrity.ALGORITHM} checksum per array."
        ]
        lines += key_lines((
            ("skipped (optimizer state; output holds weights only)", self.skipped),
            ("cast", self.casts),
            ("not cast (indices, float32 as Keras keeps them)", self.uncast),
            ("initial values (not in the source format)", self.initialized),
        ))
        if self.rounding:
            lines.append(f"  dtype: {self.rounding}")
        return "\n".join(lines)


@dataclasses.dataclass
class _Item:
    src_key: str
    dst_key: str
    shape: tuple[int, ...]
    stored: np.dtype
    target: np.dtype
    shard: tuple[int, ...]
    value: np.ndarray | None = None  # set for variables the source format cannot hold


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    model: Model | None = None,
    layout: Layout = None,
    mesh: Mesh | None = None,
    dtype: DType = None,
    compression: str = DEFAULT_COMPRESSION,
    max_inflight_bytes: int | None = None,
    force: bool = False,
    progress: bool | None = None,
) -> ConvertReport:
    """Converts Keras weights or safetensors into an Orbax checkpoint.

    The result is one Orbax step folder in the weights-only state-tree layout
    Keras' `model.load_weights(dst)` reads, also readable by
    `shardckpt.load_sharded(model, dst)` onto any mesh. Arrays are streamed:
    no model values are allocated and no device is used. The folder is
    written under a temporary name beside `dst` and renamed when complete;
    on any failure nothing is left at `dst`.

    Example:

    ```python
    shardckpt.convert("model.keras", "model_orbax")
    with shardckpt.lazy_init():
        model = build_model()
    shardckpt.convert("model.weights.h5", "model_orbax", model=model, force=True)
    ```

    Args:
        src: A `.keras` file, a `.weights.h5` file, a `.safetensors` file,
            a `*.safetensors.index.json` set, or a Hugging Face folder
            (config.json with a model_type and safetensors: the keras-hub
            backbone keras-hub's converter maps it to, names and layouts
            converted on the way).
        dst: The Orbax step folder to create, or a `gs://` / `s3://` URL.
            In a bucket the step is written in place and committed by
            writing Orbax's `commit_success.txt` last (there is no rename):
            a conversion that dies leaves objects that every reader refuses
            as uncommitted, and which the next `force=True` run replaces.
        model: The architecture: a Keras model (ideally built under
            `shardckpt.lazy_init()`), or a zero-argument function that builds
            one (`model=build_model`: called under `lazy_init()`, so no
            weight memory is allocated); needed for `.weights.h5` and
            safetensors sources, optional for `.keras` (its config is used)
            and Hugging Face folders (`shardckpt.presets.hf.build`).
        layout: Target layout (a `LayoutPlan`, `LayoutMap` or Distribution);
            chunks are aligned to its shards. Values are not placed anywhere.
        mesh: A mesh shape such as `(1, 8)` or a `DeviceMesh`; without
            `layout`, `shardckpt.auto_layout(model, mesh)` gives the shards.
        dtype: Cast floating-point arrays to this dtype (e.g. "bfloat16");
            integer and boolean arrays are kept, and so are float arrays
            Keras reads as indices (int4 group indices; `ConvertReport.uncast`).
        compression: "none" or "zstd" (see README, "Compression").
        max_inflight_bytes: Most bytes of array data in memory at once (None:
            the host's default, `shardckpt.budget.default_max_inflight_bytes`).
        force: Replace an existing `dst` (locally only once the new one is
            complete; in a bucket the old objects are deleted first).
        progress: Show a progress bar. None: when stderr is a terminal.

    Returns:
        A `ConvertReport`.

    Raises:
        DestinationExistsError: `dst` exists and `force` is False.
        ModelRequiredError: the source has no architecture and `model` is None;
            `model` is neither a Keras model nor a zero-argument function
            returning one.
        CheckpointNotFoundError, UnknownFormatError: `src` is missing, an Orbax
            checkpoint already, or no format shardckpt reads.
        CorruptCheckpointError: `src` is truncated or damaged.
        CheckpointMismatchError: source keys and model variables disagree.
        DtypeMismatchError: `dtype` is not a floating-point dtype.
    """
    start = time.perf_counter()
    # Classify both paths before anything touches the disk: a URL of an
    # unsupported scheme must never become a local folder.
    src_location = storage.parse(src, what="src")
    dst_location = storage.parse(dst, what="dst")
    src, dst = src_location.url, dst_location.url
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {COMPRESSIONS}. Received: compression={compression!r}")
    max_inflight_bytes = budgets.resolve(max_inflight_bytes)
    if not force:
        commit.refuse_existing(dst_location, fix=FORCE_FIX)  # before any work
    target_dtype = dtypes.float_dtype(dtype)
    if model is not None:
        model = built(model)
    if model is None:
        architecture = FORMATS[detect_format(src_location)].architecture
        if architecture is not None:  # a Hugging Face folder names its model
            model = architecture(src)
    reader = open_reader(src_location, model=model, task=None if model is None else naming.is_task(model))
    try:
        if reader.format == "orbax":
            raise UnknownFormatError(
                f"{src!r} is an Orbax checkpoint already. Fix: load it directly; convert reads "
                ".keras, .weights.h5, .safetensors and *.safetensors.index.json files."
            )
        if model is None:
            model = _model_for(src, reader.format)
        report = ConvertReport(src=src, dst=dst, format=reader.format, compression=compression)
        report.rounding = _converter_rounding(reader, target_dtype)
        if report.rounding:
            _log.warning("convert %r: %s", src, report.rounding)
        items = _match(reader, model, report, target_dtype, _shard_fn(model, layout, mesh))
        report.casts = [f"{i.src_key}: {i.stored} -> {i.target}" for i in items if i.stored != i.target]
        _write(reader, items, dst_location, report, max_inflight_bytes, force, progress)
    finally:
        reader.close()
    report.bytes_on_disk = storage.du(dst_location)
    report.seconds = time.perf_counter() - start
    return report


def _converter_rounding(reader: Reader, target: np.dtype | None) -> str | None:
    """Says when keras-hub's converter stores another float dtype than the folder's; with
    `target`, drops that rounding so each value is cast once, from the source.

    keras-hub's Mistral converter casts every tensor to float16 in its hooks:
    a float32 folder comes out as float16 (what its `from_preset` loads), and
    a cast to bfloat16 after it would round every value twice.
    """
    if not isinstance(reader, HFReader):
        return None
    changed: Counter[tuple[str, str]] = Counter()
    keys = reader.keys()
    for key in keys:
        source, given = reader.source_dtype(key), np.dtype(reader.spec(key).dtype)
        if source is not None and source != given and dtypes.is_float(source) and dtypes.is_float(given):
            changed[(str(source), str(given))] += 1
    if not changed:
        return None
    what = ", ".join(f"{n} of {len(keys)} arrays {a} -> {b}" for (a, b), n in sorted(changed.items()))
    said = f"keras-hub's converter for this folder rounds its tensors to another dtype ({what})"
    if target is None:
        return (f"{said}; written as it gives them (the values keras-hub's from_preset loads), not in the "
                "folder's dtype. Fix: pass dtype=... (--dtype) to cast the folder's values into that dtype "
                "instead, rounded once.")
    reader.round_once()
    return (f"{said}; with dtype={target} each value is cast once from the folder's dtype instead (keras-hub's "
            "from_preset(dtype=...) rounds twice: through its converter's dtype, then into the model's).")


def _model_for(src: str, fmt: str) -> Any:
    if fmt == "keras":
        return load_architecture(src)
    raise ModelRequiredError(
        f"{src!r} ({fmt}) stores arrays without the model's architecture, so which "
        "variable each array is (and whether it is trainable) is unknown. Fix: pass "
        "model=<a Keras model, e.g. built under shardckpt.lazy_init()> or on the command "
        "line --model package.module:function or --model architecture.keras."
    )


def _shard_fn(model: Any, layout: Any, mesh: Any) -> Any:
    """Returns `variable -> shard shape`, or None when no layout was asked for."""
    if layout is None and mesh is None:
        return None
    if layout is None:
        layout = auto_layout(model, mesh)
    target = resolve_layout(layout)
    return lambda variable: tuple(target(variable).sharding.shard_shape(tuple(variable.shape)))


def _match(reader: Reader, model: Any, report: ConvertReport, target: np.dtype | None, shard_of: Any) -> list[_Item]:
    """Pairs source keys with the model's weights (`restore.keys.match`, as `load_sharded`).

    Only weights are converted: other keys (optimizer state) are skipped.
    """
    dst_of: dict[int, str] = {}  # variable -> its key in the output state tree
    weights = state.collections(model, weights_only=True)
    state.check_unique_paths(weights)  # the output keys each variable by its path
    for name, variables in weights.items():
        for variable in variables:
            dst_of.setdefault(id(variable), f"{name}/{variable.path}")
    # The source's weights only: the optimizer's slots may share paths (Adafactor), unread here.
    source = [k for k in reader.keys() if not naming.is_optional_key(k, reader.format)]
    by_key = naming.keys_for(model, reader.format, source)
    found = naming.match(
        {k: v for k, v in by_key.items() if id(v) in dst_of}, reader, explicit=explicit_names(model)
    )
    found.raise_if_mismatched(reader.path, strict=True)
    report.skipped = found.skipped
    order = {key: i for i, key in enumerate(reader.keys())}
    indices = index_variables(model)
    items: list[_Item] = []
    for key, variable in sorted(found.pairs, key=lambda pair: order[pair[0]]):
        spec = reader.spec(key)
        stored = np.dtype(spec.dtype)
        out = target if target is not None and dtypes.is_float(stored) else stored
        if out != stored and id(variable) in indices:
            out = stored  # group indices: bfloat16 holds integers exactly only up to 256
            report.uncast.append(f"{key}: {stored}")
        shard = shard_of(variable) if shard_of is not None else tuple(spec.shape)
        items.append(_Item(key, dst_of[id(variable)], tuple(spec.shape), stored, out, shard))
    in_format = {id(v) for v in by_key.values()}
    done = {id(v) for _, v in found.pairs}
    for variable in [*model.trainable_variables, *model.non_trainable_variables]:
        if id(variable) in done or id(variable) in in_format:
            continue
        # The source format has no key for this variable at all (Keras' h5
        # never saves seed-generator states): write the value Keras' own path
        # (build, load_weights, save) would save, the variable's initial one.
        done.add(id(variable))
        value = _initial_value(variable)
        report.initialized.append(variable.path)
        shape = tuple(value.shape)
        items.append(_Item(variable.path, dst_of[id(variable)], shape, value.dtype, value.dtype, shape, value))
    return items


def _initial_value(variable: Any) -> np.ndarray:
    if is_unloaded(variable):
        value = original_initializer(variable)(tuple(variable.shape), variable.dtype)
    else:
        value = variable.value
    # Initializers may return another integer width (int32 for a uint32 seed state).
    return np.asarray(value).astype(np.dtype(variable.dtype), copy=False)


def _write(
    reader: Reader, items: list[_Item], dst: storage.Location, report: ConvertReport, max_inflight: int, force: bool,
    progress: bool | None,
) -> None:
    """Writes the step through the commit protocol (`storage.commit`): beside `dst` and renamed locally,
    in place with `commit_success.txt` written last in a bucket (an old `dst` deleted marker first)."""
    stage = commit.begin(dst, overwrite=force, marker=ondisk.COMMIT_MARKER, who="convert", fix=FORCE_FIX)
    try:
        writer = OrbaxStepWriter(stage.location.url, compression=report.compression,
                                 chunk_byte_size=orbax_writer.CHUNK_BYTES[report.compression])
        checksums = _stream(reader, items, writer, report, max_inflight, progress)
        # A `.keras` archive's or an Orbax step's asset files (an adapted lookup
        # layer's vocabulary) go along, as the "assets" item Keras' full saves have.
        files = stored_assets(reader)
        handlers = write_assets(stage.location.url, files, compression=report.compression) if files else {}
        stage.commit(writer.finish(custom_metadata=_custom_metadata(reader, report, checksums), final_dir=dst.url,
                                   item_handlers=handlers))
    except ValueError as e:
        stage.discard()
        error = storage.translate(e, dst, action="writing")
        if error is e:
            raise
        raise error from e
    except BaseException:
        stage.discard()
        raise


def _custom_metadata(reader: Reader, report: ConvertReport, checksums: dict[str, Any]) -> dict[str, Any]:
    return {
        integrity.METADATA_KEY: {
            "version": 1,
            "algorithm": integrity.ALGORITHM,
            "arrays": checksums,
            "source": {"path": storage.parse(reader.path).url, "format": reader.format},
            "compression": report.compression,
            "chunk_byte_size": orbax_writer.CHUNK_BYTES[report.compression],
        }
    }


def _stream(
    reader: Reader, items: list[_Item], writer: OrbaxStepWriter, report: ConvertReport, max_inflight: int, progress: bool | None
) -> dict[str, dict[str, Any]]:
    # Two batches alive at most (one filling, one committing), each possibly
    # held twice by TensorStore while it encodes: a quarter each.
    batch_bytes = max(1, max_inflight // 4)
    fetch = reader.view if isinstance(reader, MappedReader) else reader.read  # no copy where mapped
    total = sum(int(np.prod(i.shape, dtype=np.int64)) * i.stored.itemsize for i in items if i.value is None)
    crcs: dict[str, int] = {}
    show = sys.stderr.isatty() if progress is None else progress
    pending: Any = None
    txn = writer.transaction()
    staged = 0
    in_batch: list[Any] = []  # checksum and copy futures of the batch being filled
    overflows = dtypes.Overflows(next((i.target for i in items if i.target != i.stored), None))

    def checksum(key: str, piece: np.ndarray) -> None:
        crcs[key] = integrity.crc32(piece, crcs.get(key, 0))

    # CRC-32 runs on its own thread (zlib releases the GIL) while TensorStore
    # copies the same piece; one thread keeps each array's pieces in order.
    with ThreadPoolExecutor(1, thread_name_prefix="shardckpt-crc") as crc_thread, ByteProgress(
        total, f"converting {os.path.basename(reader.path)}", enabled=show
    ) as bar:
        plans = [boxes.write_boxes(item.shape, item.target.itemsize, item.shard, batch_bytes) for item in items]
        stores = writer.open_arrays(
            [(item.dst_key, item.shape, item.target, write_shape) for item, (write_shape, _) in zip(items, plans)]
        )
        for item, (_, item_boxes), store in zip(items, plans, stores, strict=True):
            for box in item_boxes:
                if item.value is not None:
                    piece = item.value[box] if box else item.value
                else:
                    piece = fetch(item.src_key, box)
                if item.target != item.stored:
                    with np.errstate(over="ignore"):  # counted here, said once after the write
                        cast = piece.astype(item.target)
                    if dtypes.narrows_range(item.stored, item.target):
                        overflows.add(item.src_key, dtypes.overflowed(piece, cast))
                    piece = cast
                if staged and staged + piece.nbytes > batch_bytes:
                    _drain(in_batch)  # the batch's pieces are copied and checksummed
                    pending = _commit(txn, pending, writer)
                    txn, staged = writer.transaction(), 0
                in_batch.append(crc_thread.submit(checksum, item.dst_key, piece))
                # Pieces are never changed once staged (views of the read-only
                # mapping, fresh reads or casts): TensorStore writes from them.
                in_batch.append(writer.write(store, txn, box, piece, reference=True).copy)
                staged += piece.nbytes
                if item.value is None:
                    report.bytes_read += piece.size * item.stored.itemsize
                    bar.advance(piece.size * item.stored.itemsize)
                del piece
            report.arrays += 1
        _drain(in_batch)
        pending = _commit(txn, pending, writer)
        pending.result()
        writer.release(writer.committed_files())
    said = overflows.message(f"convert {reader.path!r}")
    if said:
        _log.warning("%s", said)
    return {
        item.dst_key: {
            integrity.ALGORITHM: integrity.hex32(crcs.get(item.dst_key, 0)),
            "shape": list(item.shape),
            "dtype": str(item.target),
        }
        for item in items
    }


def _drain(futures: list[Any]) -> None:
    for future in futures:
        future.result()
    futures.clear()


def _commit(txn: Any, pending: Any, writer: OrbaxStepWriter) -> Any:
    """Waits for the previous commit, starts committing `txn`, then drops the previous one's pages."""
    done: list[str] = []
    if pending is not None:
        pending.result()
        done = writer.committed_files()  # listed between commits: every one is complete
    future = txn.commit_async()
    writer.release(done)  # while `txn` commits
    return future


