#!/usr/bin/env python3
"""Chunking and compression of the checkpoints shardckpt writes: restore, save, disk.

The model is `tools/bench_restore.py`'s MLP stack (default 12 blocks x 2048:
~400M parameters, 1.6 GB float32). For each writer, chunk size and
compression, one fresh process writes the checkpoint (`--repeat` times in a
row, the median shown), then fresh processes restore it:

- writers: `convert` of a Keras `.weights.h5` without a layout (outer chunks
  are pieces of up to a quarter of the budget: a whole 64 MiB kernel), and
  `shardckpt.training.OrbaxCheckpoint` (weights only, synchronous) during a
  `fit` under `ModelParallel` (1, 8): outer chunks are the devices' shards
  (8 MiB kernels);
- chunk sizes: "shard" (one chunk per written block, Orbax's default) and
  chunks of at most 1, 4, 16, 64 MiB (Orbax's `chunk_byte_size`, which
  splits each block; a size at or above the block is the block);
- compression: none, zstd (Orbax's level 3 per chunk);
- restore: `load_sharded` into a lazily built model under `ModelParallel`
  (1, `--devices`) with the default budget (`--repeat` processes: median,
  min-max), and Keras' own `model.load_weights` of the same checkpoint into a
  normally built model (`--keras-repeat` processes) for reference.

Printed: save seconds (the writer's own work: `convert` with the lazy build;
the callback's blocking time of a synchronous save), bytes on disk, restore
seconds and CPU seconds, Keras' load seconds, each as a ratio to the
writer's current default.

Usage:
    python tools/bench_chunks.py [--blocks 12] [--dim 2048] [--repeat 3] [--devices 8]
                                 [--writers convert,callback] [--chunks shard,1,4,16,64]
    python tools/bench_chunks.py --smoke      # a tiny model: checks the script runs
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

import _bench as bench
from _bench import ROOT, cpu_seconds, du, emit, run_child, setup_jax
from bench_restore import FORMATS, model_options, prepare_h5

H5 = FORMATS["h5"]  # what prepare_h5 writes
WRITERS = ("convert", "callback")
COMPRESSIONS = ("none", "zstd")
SMOKE = {"blocks": 1, "dim": 64, "repeat": 1, "keras_repeat": 1, "chunks": "shard,1", "compressions": "zstd"}
MIB = 2**20


def chunk_bytes(label: str) -> int | None:
    """"shard" -> None (one chunk per written block); "4" -> 4 MiB."""
    return None if label == "shard" else int(float(label) * MIB)


def save(args: argparse.Namespace, writer: str, chunks: str, compression: str) -> dict:
    """Writes the checkpoint `--repeat` times; returns each write's seconds and the bytes on disk."""
    dst = os.path.join(args.workdir, f"{writer}-{chunks}-{compression}")
    shutil.rmtree(dst, ignore_errors=True)
    seconds: list[float] = []
    if writer == "convert":
        setup_jax(1)
        from bench_restore import build

        import shardckpt
        from shardckpt.conversion import converter
        from shardckpt.formats.orbax import writer as orbax_writer

        orbax_writer.CHUNK_BYTES[compression] = chunk_bytes(chunks)  # type: ignore[assignment]  # the size under test
        for _ in range(args.repeat):
            shutil.rmtree(dst, ignore_errors=True)
            os.sync()
            start = time.perf_counter()
            with shardckpt.lazy_init():
                model = build(args.blocks, args.dim)
            converter.convert(os.path.join(args.workdir, H5), dst, model=model, compression=compression,
                              progress=False)
            seconds.append(time.perf_counter() - start)
        step = dst
    else:
        setup_jax(args.devices)
        import keras
        import numpy as np
        from bench_restore import build, distribution

        from shardckpt.training import OrbaxCheckpoint

        keras.distribution.set_distribution(distribution())
        model = build(args.blocks, args.dim)
        model.load_weights(os.path.join(args.workdir, H5))
        model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
        callback = OrbaxCheckpoint(dst, save_freq="epoch", save_on_background=False, save_weights_only=True,
                                   max_to_keep=1, compression=compression == "zstd")
        # The chunk size under test, on the context the callback built for its saves.
        callback._contents.context.array.saving.storage_options.chunk_byte_size = chunk_bytes(chunks)
        x = np.zeros((8, args.dim), "float32")
        model.fit(x, x, epochs=args.repeat, batch_size=8, verbose=0, callbacks=[callback])
        callback.wait_until_finished()
        seconds = list(callback.save_blocking_s)
        steps = [d for d in os.listdir(dst) if d.isdigit()]
        step = os.path.join(dst, max(steps, key=int))
    return {"save_s": seconds, "disk_bytes": du(step)}


def restore(args: argparse.Namespace, loader: str, name: str) -> dict:
    """One restore of the checkpoint `name` by `loader` ("shardckpt" or "keras")."""
    setup_jax(args.devices)
    import jax
    import keras
    from bench_restore import build, distribution

    import shardckpt
    from shardckpt.restore import hostmem

    path = os.path.join(args.workdir, name)
    keras.distribution.set_distribution(distribution())
    if loader == "keras":
        model = build(args.blocks, args.dim)
        model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
        jax.block_until_ready([v.value for v in model.weights])
        hostmem.trim()
    else:
        with shardckpt.lazy_init():
            model = build(args.blocks, args.dim)
    start, cpu = time.perf_counter(), cpu_seconds()
    if loader == "keras":
        model.load_weights(path)
    else:
        report = shardckpt.load_sharded(model, path, progress=False)
    jax.block_until_ready([v.value for v in model.weights])
    out = {"load_s": time.perf_counter() - start, "load_cpu_s": cpu_seconds() - cpu}
    if loader != "keras":
        out["budget"] = report.max_inflight_bytes
    kernel = next(v for v in model.weights if v.path.endswith("_down/kernel"))
    out["sharding"] = str(getattr(kernel.value.sharding, "spec", kernel.value.sharding))
    return out


def _child(args: argparse.Namespace, *extra: str) -> dict:
    return run_child(os.path.abspath(__file__), "--workdir", args.workdir, "--blocks", str(args.blocks),
                     "--dim", str(args.dim), "--repeat", str(args.repeat), "--devices", str(args.devices), *extra)


def _spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def main() -> None:
    bench.main(
        __doc__, options=_options, run=_parent, smoke=SMOKE, prefix="bench-chunks-", repeat=3,
        children={"--_prepare": (0, prepare_h5), "--_save": (3, save), "--_restore": (2, restore)},
    )


def _options(parser) -> None:
    model_options(parser)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--keras-repeat", type=int, default=1, help="Keras restores per configuration (0: none)")
    parser.add_argument("--writers", default=",".join(WRITERS))
    parser.add_argument("--chunks", default="shard,1,4,16,64", help="'shard' and/or inner chunk sizes in MiB")
    parser.add_argument("--compressions", default=",".join(COMPRESSIONS))


def _parent(args) -> None:
    rows = []
    info = _child(args, "--_prepare")
    print(f"model: {info['params'] / 1e6:.0f}M parameters, {info['params'] * 4 / 1e9:.2f} GB float32; "
          f"restore onto ModelParallel (1, {args.devices}); {os.cpu_count()} CPUs; "
          f"medians of {args.repeat} [min-max]", flush=True)
    for writer in args.writers.split(","):
        for chunks in args.chunks.split(","):
            for compression in args.compressions.split(","):
                name = f"{writer}-{chunks}-{compression}"
                row = {"writer": writer, "chunks": chunks, "compression": compression,
                       **_child(args, "--_save", writer, chunks, compression)}
                runs = [_child(args, "--_restore", "shardckpt", name) for _ in range(args.repeat)]
                row["restore_s"] = [r["load_s"] for r in runs]
                row["restore_cpu_s"] = [r["load_cpu_s"] for r in runs]
                row["budget"] = runs[0]["budget"]
                row["sharding"] = runs[0]["sharding"]
                row["keras_s"] = [_child(args, "--_restore", "keras", name)["load_s"]
                                  for _ in range(args.keras_repeat)]
                rows.append(row)
                print(f"{name}: save {_spread(row['save_s'])} s, {row['disk_bytes'] / 1e9:.3f} GB, "
                      f"restore {_spread(row['restore_s'])} s, keras {_spread(row['keras_s'])} s", flush=True)
                shutil.rmtree(os.path.join(args.workdir, name), ignore_errors=True)
    _print_table(rows)
    emit({"rows": rows})


def _print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    if ROOT not in sys.path:  # this checkout's default, as the children import it (`setup_jax`)
        sys.path.insert(0, ROOT)
    from shardckpt.formats.orbax.writer import CHUNK_BYTES

    # Ratios are to each writer's current default, uncompressed (both writers use CHUNK_BYTES).
    current = f"{CHUNK_BYTES['none'] / MIB:g}"
    base = {r["writer"]: r for r in rows if r["chunks"] == current and r["compression"] == "none"}
    med = statistics.median
    table = Table(title="chunking and compression of shardckpt's writers (median [min-max])")
    for col in ("writer", "chunks MiB", "compression", "save s", "on disk GB", "restore s", "restore CPU s",
                "Keras load s", "save / default", "disk / default", "restore / default"):
        table.add_column(col, justify="right")
    for r in rows:
        b = base.get(r["writer"])

        def ratio(key: str, r: dict = r, b: dict | None = b) -> str:
            if b is None:
                return ""
            mine = r[key] if key == "disk_bytes" else med(r[key])
            theirs = b[key] if key == "disk_bytes" else med(b[key])
            return f"{mine / theirs:.2f}x"

        table.add_row(r["writer"], r["chunks"], r["compression"], _spread(r["save_s"]),
                      f"{r['disk_bytes'] / 1e9:.3f}", _spread(r["restore_s"]), _spread(r["restore_cpu_s"]),
                      _spread(r["keras_s"]), ratio("save_s"), ratio("disk_bytes"), ratio("restore_s"))
    Console(width=200).print(table)
    print(f"restore budget: {rows[0]['budget'] / MIB:.0f} MiB (this host's default)" if rows else "")


if __name__ == "__main__":
    main()
