#!/usr/bin/env python3
"""Restore benchmark: shardckpt vs Keras' own loading, same machine, same run.

Builds an MLP stack (default ~400M parameters, 1.6 GB float32), writes it as
`.weights.h5` (Keras), a Keras-written Orbax checkpoint (Keras' OrbaxCheckpoint
callback, weights only) and `.safetensors`, then, each in a fresh process on 8
simulated CPU devices (with JAX_PLATFORMS unset on a GPU machine: its GPUs)
under `ModelParallel` (up kernels column-, down kernels row-sharded):

- read: a plain sequential read of the file(s) (page cache warm), and for
  Orbax a concurrent tensorstore read of every array (its decode floor), once
  with data files mapped as shardckpt reads them and once with read() as
  Orbax reads them (shown as "ts mapped / read()"), fastest of --repeat runs,
  each read in a process of its own;
- keras: build the sharded model normally (random init), `model.load_weights`;
- shardckpt: build under `lazy_init()`, `load_sharded`;
- shardckpt-built (h5 only): build normally like Keras, then `load_sharded`
  replaces the random values variable by variable (peak: model + in flight).

It prints build and load seconds, both as multiples of the plain read, the
load also as a multiple of a read of the file into fresh memory (`fresh_read`,
run after the load: every restore must fill memory it never touched), the
CPU seconds the load took (user + system, all threads: on a machine with
few cores, where loads are CPU-bound, this is the work each loader does; the
system part is mostly page faults on fresh memory), and the peak anonymous
memory of the load over the final state (sampled RssAnon
during the load alone, after the memory a normal build freed was given back
to the OS: a normal build's own transient memory is Keras'), and
what the process keeps after the load beyond the state itself ("kept after":
anonymous memory over the process's start minus the state's bytes; freed
memory the allocator did not give back counts, as it does for the OS). On a
GPU it also prints peak device memory from `jax` memory stats. Last, issue
27's figures beside this run's ("then vs now").

With --warm, each process touches and frees 2.5x the state's bytes just
before its timed section (`_bench.warm_memory`): on VMs that hand free
memory back to their host, pages touched for the first time since then cost
host faults, and --warm shows what loads cost on memory backed for good, as
on bare metal.

Usage:
    python tools/bench_restore.py [--blocks 12] [--dim 2048] [--workdir DIR]
    python tools/bench_restore.py --smoke      # a tiny model: checks the script runs
    python tools/bench_restore.py --checksums --repeat 5 [--compression zstd]

With --checksums, it measures instead what the per-chunk `crc32c` of
shardckpt's Orbax writers costs a restore: the `.weights.h5` is converted twice
with `shardckpt.convert` (`--compression`), once as shipped and once with the
checksum codec left out (patched out in the preparing process only), and
`load_sharded` restores each, alternating, --repeat times; it prints the
fastest and the median wall and CPU seconds of each and their ratios, and how
tensorstore decoded the chunks (its own counters): taken in place from the
mapped file ("zero-copy") or copied into a new buffer. A `crc32c` codec puts
every chunk on the copying path (README, "Damage").
"""

from __future__ import annotations

import os
import time

import _bench as bench
from _bench import PeakSampler, cpu_seconds, emit, print_then_vs_now, rss_anon, run_child, setup_jax, warm_memory

FORMATS = {"h5": "model.weights.h5", "orbax": "orbax", "safetensors": "model.safetensors"}
# --checksums: `convert` outputs with and without the per-chunk crc32c codec.
# "orbax-crc32c" is also shardckpt-written Orbax as shipped (`--formats ...,orbax-crc32c`).
CHECKSUM_FORMATS = {"orbax-crc32c": "converted_crc32c", "orbax-no-checksum": "converted_plain"}
FORMATS.update(CHECKSUM_FORMATS)
# Orbax floor reads: child mode -> result name ("<name>_s" wall, "<name>_cpu_s" CPU seconds).
FLOORS = {"floor-mapped": "ts_read", "floor-read": "ts_pread"}
SMOKE = {"blocks": 1, "dim": 64, "repeat": 1}
# Issue 27's table (1.6 GB model, 2 cores, quiet machine): figure -> (2026-11-23, when filed, goal).
ISSUE_27 = {
    "h5": ("0.6-1.9x", "1.6x (0.71 vs 0.45 s)", "<= 1.2x"),
    "orbax": ("0.93-0.97x", "0.89x", "<= 0.9x (holds)"),
    "ready": ("0.09-0.11x", "0.08x", "holds"),
}
# tensorstore's counters of the bytes its `bytes` codec decoded in place / by copying.
DECODE_METRICS = {"zero_copy_gb": "/tensorstore/internal/riegeli/contiguous_bytes",
                  "copied_gb": "/tensorstore/internal/riegeli/noncontiguous_bytes"}


def _setup_jax(devices: int) -> None:
    # Accelerators stay visible: on a GPU machine the bench restores onto its GPUs.
    setup_jax(devices, cpu_only=False)


def build(blocks: int, dim: int):
    import keras

    x = inputs = keras.Input((dim,))
    for i in range(blocks):
        h = keras.layers.Dense(4 * dim, activation="gelu", name=f"b{i}_up")(x)
        x = x + keras.layers.Dense(dim, name=f"b{i}_down")(h)
    return keras.Model(inputs, x, name="mlp")


def distribution():
    import jax
    import keras

    n = len(jax.devices())
    mesh = keras.distribution.DeviceMesh((1, n), ["data", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[r"b\d+_up/kernel"] = (None, "model")
    layout_map[r"b\d+_up/bias"] = ("model",)
    layout_map[r"b\d+_down/kernel"] = ("model", None)
    return keras.distribution.ModelParallel(layout_map=layout_map)


def model_options(parser) -> None:
    """--blocks and --dim of `build`'s model (bench_convert and bench_chunks measure it too)."""
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--dim", type=int, default=2048)


def random_model(args):
    """`build(args.blocks, args.dim)` with seeded N(0, 0.02) weights."""
    import numpy as np

    model = build(args.blocks, args.dim)
    rng = np.random.default_rng(0)
    for v in model.weights:
        v.assign(rng.standard_normal(v.shape, dtype=np.float32) * 0.02)
    return model


def prepare_h5(args) -> dict:
    """Child of bench_convert and bench_chunks: `random_model` saved by Keras as `--workdir`/model.weights.h5."""
    setup_jax(1)
    model = random_model(args)
    model.save_weights(os.path.join(args.workdir, FORMATS["h5"]))
    return {"params": int(model.count_params())}


def prepare(args) -> None:
    _setup_jax(8)
    import keras
    import numpy as np
    import safetensors.numpy as stnp

    model = random_model(args)
    model.save_weights(os.path.join(args.workdir, FORMATS["h5"]))
    stnp.save_file(
        {v.path: np.asarray(v.value) for v in model.weights},
        os.path.join(args.workdir, FORMATS["safetensors"]),
    )
    formats = args.formats.split(",")
    if "orbax" in formats and not args.checksums:
        model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
        callback = keras.callbacks.OrbaxCheckpoint(
            os.path.join(args.workdir, FORMATS["orbax"]), save_freq="epoch", save_weights_only=True
        )
        x = np.zeros((8, args.dim), "float32")
        model.fit(x, x, epochs=1, batch_size=8, verbose=0, callbacks=[callback])
        callback.wait_until_finished()
    if args.checksums:
        _convert_both(args)
    elif "orbax-crc32c" in formats:
        _convert_both(args, only=("orbax-crc32c",))
    emit({"params": int(model.count_params())})


def _convert_both(args, only: tuple[str, ...] = tuple(CHECKSUM_FORMATS)) -> None:
    """The h5 converted by `shardckpt.convert` with and without the per-chunk crc32c."""
    import shutil

    import shardckpt
    from shardckpt import _orbax

    src = os.path.join(args.workdir, FORMATS["h5"])
    for fmt, name in CHECKSUM_FORMATS.items():
        if fmt not in only:
            continue
        dst = os.path.join(args.workdir, name)
        if os.path.exists(dst):
            shutil.rmtree(dst)
        with shardckpt.lazy_init():
            arch = build(args.blocks, args.dim)
        original = _orbax.add_chunk_checksums
        if fmt == "orbax-no-checksum":
            _orbax.add_chunk_checksums = lambda spec: spec  # the same writer, without the codec
        try:
            shardckpt.convert(src, dst, model=arch, compression=args.compression, progress=False)
        finally:
            _orbax.add_chunk_checksums = original


def _state_bytes(args) -> int:
    return (args.dim * 4 * args.dim * 2 + 5 * args.dim) * args.blocks * 4


def _file_bytes(path: str) -> list[str]:
    if os.path.isdir(path):
        return [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]
    return [path]


def fresh_read(path: str) -> float:
    """Seconds to read the file(s) into fresh memory, as a restore's final buffers are.

    `plain_read` reuses one buffer; a restore must fill memory it has never
    touched (the state it returns), and each first touch of a page costs a
    fault. This reads each file into a new buffer made as `load_sharded`
    makes its own (`shardckpt.dtypes.aligned_empty`: an anonymous map of 4 KiB
    pages, populated by the map call).
    """
    import numpy as np

    from shardckpt.dtypes import aligned_empty

    files = _file_bytes(path)
    start = time.perf_counter()
    kept = []
    for f in files:
        size = os.path.getsize(f)
        if not size:
            continue
        buffer = aligned_empty((size,), np.uint8)
        with open(f, "rb", buffering=0) as fh:
            done = 0
            while done < size:
                done += fh.readinto(buffer[done : done + (64 << 20)])
        kept.append(buffer)
    seconds = time.perf_counter() - start
    del kept
    return seconds


def plain_read(path: str) -> float:
    buf = bytearray(64 << 20)
    files = _file_bytes(path)
    for f in files:  # warm the page cache, as both loaders see it warm
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass
    start = time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass
    return time.perf_counter() - start


def tensorstore_read(path: str, memmap: bool, warm: int) -> tuple[float, float]:
    """Concurrent tensorstore read of every array of the Orbax step: the decode floor.

    memmap=True reads data files as shardckpt does (mapped), False as Orbax does
    (read() into buffers). The chunk cache is the one `load_sharded` uses.
    Returns wall and CPU seconds.
    """
    _setup_jax(8)
    from shardckpt.budget import chunk_cache_bytes, default_max_inflight_bytes
    from shardckpt.formats import OrbaxReader

    reader = OrbaxReader(path, cache_bytes=chunk_cache_bytes(default_max_inflight_bytes()), memmap=memmap)
    stores = [reader._store(k) for k in reader.keys()]
    if warm:
        warm_memory(warm)
    start, cpu = time.perf_counter(), cpu_seconds()
    futures = [s.read() for s in stores]
    for f in futures:
        f.result()
    return time.perf_counter() - start, cpu_seconds() - cpu


def decoded_bytes() -> dict[str, float]:
    """GB tensorstore's zarr `bytes` codec has decoded in this process so far, per path (`DECODE_METRICS`)."""
    import tensorstore as ts

    found = {m["name"]: m["values"] for m in ts.experimental_collect_matching_metrics("/tensorstore/internal/riegeli/")}
    return {key: sum(v.get("value", 0) for v in found.get(name, [])) / 1e9 for key, name in DECODE_METRICS.items()}


def run(args) -> None:
    _setup_jax(8)
    import jax
    import keras
    import numpy as np

    import shardckpt
    from shardckpt.lazy import is_unloaded
    from shardckpt.restore import hostmem

    path = os.path.join(args.workdir, FORMATS[args.format])
    out = {"read_s": plain_read(path)}
    # Memory every timed section may touch: the state, what a loader holds
    # besides it (Keras: about as much again), and slack.
    warm = int(2.5 * _state_bytes(args)) if args.warm else 0
    if args.mode in FLOORS:
        # One read per process: memory the first read freed would be warm for
        # the second one (it made the mapped read 20% faster).
        name = FLOORS[args.mode]
        out[f"{name}_s"], out[f"{name}_cpu_s"] = tensorstore_read(
            path, memmap=args.mode == "floor-mapped", warm=warm)
        emit(out)
        return
    keras.distribution.set_distribution(distribution())
    base = rss_anon()
    with PeakSampler() as build_sampler:
        start = time.perf_counter()
        if args.mode in ("keras", "shardckpt-built"):
            model = build(args.blocks, args.dim)
            if args.format.startswith("orbax") and args.mode == "keras":
                model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
        else:
            with shardckpt.lazy_init():
                model = build(args.blocks, args.dim)
            # The accelerator's first use (its runtime's setup) goes to build
            # for every loader: Keras' build allocates on it. On an H100 it
            # had made the lazy load 1-2 s slower than the built one.
            jax.block_until_ready(jax.device_put(np.zeros(1, np.float32), jax.devices()[0]))
        jax.block_until_ready([v.value for v in model.weights if not is_unloaded(v)])
        out["build_s"] = time.perf_counter() - start
    # glibc keeps what the build freed (random init's temporaries: 0.4 GB of
    # the 1.6 GB model); hand it back first so no loader's peak counts it.
    hostmem.trim()
    built = rss_anon()
    if warm:
        warm_memory(warm)
    # The load's own sampler: a normal build's transient memory (random init)
    # is Keras', not the loader's.
    decoded = decoded_bytes()
    with PeakSampler() as sampler:
        start, cpu = time.perf_counter(), cpu_seconds()
        if args.mode == "keras":
            if args.format == "safetensors":
                out["load_s"] = None  # Keras has no safetensors loader
            else:
                model.load_weights(path)
        else:
            shardckpt.load_sharded(model, path, progress=False)
        jax.block_until_ready([v.value for v in model.weights])
        if out.get("load_s", 0) is not None:
            out["load_s"] = time.perf_counter() - start
            out["load_cpu_s"] = cpu_seconds() - cpu
    final = rss_anon()
    out["fresh_read_s"] = fresh_read(path)  # after the load: the memory it gets is as fresh as the load's was
    out["state_gb"] = sum(int(np.prod(v.shape)) * 4 for v in model.weights) / 1e9
    out["final_over_base_gb"] = (final - base) / 1e9
    out["peak_over_final_gb"] = (sampler.peak - final) / 1e9
    out["build_peak_over_built_gb"] = (build_sampler.peak - built) / 1e9
    if jax.devices()[0].platform != "cpu":
        stats = jax.devices()[0].memory_stats() or {}
        out["device_peak_gb"] = stats.get("peak_bytes_in_use", 0) / 1e9
    # Correctness spot check: one sharded kernel against the file.
    kernel = next(v for v in model.weights if v.path.endswith("_down/kernel"))
    out["sharding"] = str(getattr(kernel.value.sharding, "spec", kernel.value.sharding))
    out["devices"] = f"{len(jax.devices())} x {jax.devices()[0].device_kind}"
    out.update({k: v - decoded[k] for k, v in decoded_bytes().items()})  # nothing since the load decoded
    emit(out)


def _child(args, *extra) -> dict:
    return run_child(os.path.abspath(__file__), "--workdir", args.workdir, "--blocks", str(args.blocks),
                     "--dim", str(args.dim), "--compression", args.compression, "--formats", args.formats,
                     *(["--warm"] if args.warm else []), *(["--checksums"] if args.checksums else []), *extra)


def main() -> None:
    bench.main(__doc__, options=_options, children={"--_prepare": (0, prepare), "--_run": (2, _run_child)},
               run=_parent, smoke=SMOKE, prefix="bench_restore_", reuse=True)


def _options(parser) -> None:
    model_options(parser)
    parser.add_argument("--formats", default="h5,orbax,safetensors")
    parser.add_argument("--warm", action="store_true",
                        help="touch and free memory before each timed section (see _bench.warm_memory)")
    parser.add_argument("--checksums", action="store_true",
                        help="restore of convert's output with vs without the per-chunk crc32c")
    parser.add_argument("--compression", default="none", choices=("none", "zstd"),
                        help="--checksums: compression of both converted checkpoints")


def _run_child(args, mode: str, fmt: str) -> None:
    args.mode, args.format = mode, fmt
    run(args)


def _parent(args) -> None:
    wanted = [FORMATS[f] for f in (CHECKSUM_FORMATS if args.checksums else args.formats.split(","))]
    if args.reuse and all(os.path.exists(os.path.join(args.workdir, f)) for f in wanted):
        info = {"params": _state_bytes(args) // 4}
    else:
        info = _child(args, "--_prepare")
    print(f"model: {info['params'] / 1e6:.0f}M parameters, {info['params'] * 4 / 1e9:.2f} GB float32; "
          f"ModelParallel (1, all devices); workdir {args.workdir}")
    if args.checksums:
        _checksum_cost(args)
        return
    rows = []
    for fmt in args.formats.split(","):
        for mode in ("keras", "shardckpt", "shardckpt-built"):
            if mode == "keras" and fmt == "safetensors" or mode == "shardckpt-built" and fmt != "h5":
                continue
            best = None
            for _ in range(args.repeat):
                r = _child(args, "--_run", mode, fmt)
                if best is None or (r["load_s"] or 0) < (best["load_s"] or 0):
                    best = r
            rows.append((fmt, mode, best))
        if fmt == "orbax":
            floor = {}
            for mode, name in FLOORS.items():
                best = min((_child(args, "--_run", mode, fmt) for _ in range(args.repeat)),
                           key=lambda r: r[f"{name}_s"])
                floor.update({k: best[k] for k in (f"{name}_s", f"{name}_cpu_s")})
            for f, _, r in rows:
                if f == fmt:
                    r.update(floor)
    _print_table(rows)
    _print_then_vs_now(rows)
    print("devices: " + ", ".join(sorted({r["devices"] for _, _, r in rows if "devices" in r})))
    emit({"rows": [{"format": fmt, "loader": mode, **r} for fmt, mode, r in rows]})


def _checksum_cost(args) -> None:
    """Alternating restores of the two converted checkpoints; fastest, median and ratios."""
    import statistics

    times: dict[str, list[float]] = {fmt: [] for fmt in CHECKSUM_FORMATS}
    cpu: dict[str, list[float]] = {fmt: [] for fmt in CHECKSUM_FORMATS}
    decoded: dict[str, dict[str, float]] = {}
    for _ in range(args.repeat):
        for fmt in CHECKSUM_FORMATS:
            r = _child(args, "--_run", "shardckpt", fmt)
            times[fmt].append(r["load_s"])
            cpu[fmt].append(r["load_cpu_s"])
            decoded[fmt] = {k: r[k] for k in DECODE_METRICS}
    median = statistics.median
    for fmt in ("orbax-no-checksum", "orbax-crc32c"):
        t, d = times[fmt], decoded[fmt]
        print(f"{fmt} ({args.compression}): load s fastest {min(t):.3f}, median {median(t):.3f} "
              f"[{', '.join(f'{x:.3f}' for x in t)}]; CPU s median {median(cpu[fmt]):.3f} "
              f"[{', '.join(f'{x:.3f}' for x in cpu[fmt])}]; chunks decoded zero-copy "
              f"{d['zero_copy_gb'] * 1e3:.1f} MB, copied {d['copied_gb'] * 1e3:.1f} MB")
    plain, crc = times["orbax-no-checksum"], times["orbax-crc32c"]
    plain_cpu, crc_cpu = cpu["orbax-no-checksum"], cpu["orbax-crc32c"]
    print(f"crc32c / none: load s fastest {min(crc) / min(plain):.3f}x, median {median(crc) / median(plain):.3f}x; "
          f"CPU s median {median(crc_cpu) / median(plain_cpu):.3f}x (acceptance: at most 1.05x)")
    emit({"checksums": {"compression": args.compression, "load_s": times, "load_cpu_s": cpu, "decoded": decoded}})


def _print_then_vs_now(rows) -> None:
    """Issue 27's restore figures beside this run's (`print_then_vs_now`)."""
    by = {(fmt, mode): r for fmt, mode, r in rows}
    out = []

    def add(figure: str, key: str, now: str) -> None:
        then, filed, goal = ISSUE_27[key]
        out.append((figure, then, filed, now, goal))

    h5, orbax, keras_h5 = by.get(("h5", "shardckpt")), by.get(("orbax", "shardckpt")), by.get(("h5", "keras"))
    if h5:
        add("h5 restore (lazy) / read of the file", "h5",
            f"{h5['load_s'] / h5['read_s']:.2f}x ({h5['load_s']:.2f} vs {h5['read_s']:.2f} s); "
            f"{h5['load_s'] / h5['fresh_read_s']:.2f}x of a read into fresh memory ({h5['fresh_read_s']:.2f} s)")
    if orbax:
        add("Keras-written Orbax restore / tensorstore read()", "orbax",
            f"{orbax['load_s'] / orbax['ts_pread_s']:.2f}x ({orbax['load_s']:.2f} vs {orbax['ts_pread_s']:.2f} s; "
            f"mapped ts {orbax['load_s'] / orbax['ts_read_s']:.2f}x)")
    if h5 and keras_h5:
        ours, theirs = h5["build_s"] + h5["load_s"], keras_h5["build_s"] + keras_h5["load_s"]
        add("time to a ready model vs Keras (h5)", "ready", f"{ours / theirs:.2f}x ({ours:.2f} vs {theirs:.2f} s)")
    if out:
        print_then_vs_now(out)


def _print_table(rows) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="restore: shardckpt vs Keras (same run)")
    for col in ("format", "loader", "read s", "fresh read s", "build s", "load s", "load GB/s", "load CPU s",
                "load/read", "load/fresh read", "(build+load)/read", "peak over final GB", "kept after GB",
                "peak device GB", "vs Keras load"):
        table.add_column(col, justify="right")
    keras_load = {fmt: r["load_s"] for fmt, mode, r in rows if mode == "keras"}
    for fmt, mode, r in rows:
        floor = r["read_s"]
        extra = ""
        if fmt == "orbax":
            extra = f" (ts {r['ts_read_s']:.2f} / {r['ts_pread_s']:.2f})"
        load = r["load_s"]
        ratio_floor = load / floor if load else float("nan")
        vs = f"{load / keras_load[fmt]:.2f}x" if fmt in keras_load and mode != "keras" else ""
        table.add_row(
            fmt, mode, f"{floor:.2f}{extra}", f"{r['fresh_read_s']:.2f}", f"{r['build_s']:.2f}", f"{load:.2f}",
            f"{r['state_gb'] / load:.2f}" if load else "",
            f"{r['load_cpu_s']:.2f}" if load else "",
            f"{ratio_floor:.2f}x", f"{load / r['fresh_read_s']:.2f}x" if load else "",
            f"{(r['build_s'] + load) / floor:.1f}x",
            f"{r['peak_over_final_gb']:.2f}", f"{r['final_over_base_gb'] - r['state_gb']:.2f}",
            f"{r['device_peak_gb']:.2f}" if "device_peak_gb" in r else "", vs,
        )
    Console(width=220).print(table)
    for fmt, mode, r in rows:
        if fmt == "orbax" and mode == "shardckpt":
            print(f"orbax: shardckpt load / concurrent tensorstore read = {r['load_s'] / r['ts_read_s']:.2f}x "
                  f"with mapped files ({r['ts_read_s']:.2f} s), {r['load_s'] / r['ts_pread_s']:.2f}x "
                  f"with read() as Orbax reads ({r['ts_pread_s']:.2f} s); CPU seconds: "
                  f"{r['load_cpu_s']:.2f} against {r['ts_read_cpu_s']:.2f} / {r['ts_pread_cpu_s']:.2f}")
        if "device_peak_gb" in r:
            print(f"{fmt} {mode}: peak device memory {r['device_peak_gb']:.2f} GB (state {r['state_gb']:.2f} GB)")


if __name__ == "__main__":
    main()
