#!/usr/bin/env python3
"""Convert benchmark: `shardckpt.convert` vs Keras' own path, same machine, same run.

The model is `tools/bench_restore.py`'s MLP stack (default 12 blocks x 2048:
~400M parameters, a 1.6 GB float32 `.weights.h5`). Each cell runs in a fresh
process:

- shardckpt CLI: `shardckpt convert model.weights.h5 dst --model bench_convert:cli_model`
  through `shardckpt.cli.main.main` (the figure issue 27 defines: the CLI, its imports
  excluded), compression none;
- shardckpt: build the architecture under `lazy_init()`, `convert(h5, dst)`
  (once per compression: none, zstd); it drops what it wrote from the page
  cache as it goes (`OrbaxStepWriter.release`);
- keras: build the model (random init), `model.load_weights(h5)`, save the
  weights-only state tree with Orbax as Keras' OrbaxCheckpoint does
  (`ocp.save_checkpointables(dst, {"pytree": state})`);
- restore: `load_sharded` of each converted checkpoint into a lazily built
  model on 8 simulated CPU devices under ModelParallel (up kernels column-,
  down kernels row-sharded), and a concurrent TensorStore read of every array,
  both with the checkpoint's files read into the page cache first.

Printed: seconds, CPU seconds (user + system, all threads), peak anonymous memory over a bare `import shardckpt`
(sampled RssAnon), ratios to Keras' path, size on disk and restore seconds per
compression, and the convert figure beside its value in issue 27's table
(2026-11-23, and when the issue was filed) and its goal.

Usage:
    python tools/bench_convert.py [--blocks 12] [--dim 2048] [--workdir DIR] [--reuse] [--repeat 3]
    python tools/bench_convert.py --smoke      # a tiny model: checks the script runs
"""

from __future__ import annotations

import argparse
import os
import shutil
import time

import _bench as bench
from _bench import PeakSampler, cpu_seconds, du, emit, print_then_vs_now, rss_anon, run_child, setup_jax
from bench_restore import FORMATS, model_options, prepare_h5

H5 = FORMATS["h5"]  # what prepare_h5 writes
SMOKE = {"blocks": 1, "dim": 64, "repeat": 1}
# Issue 27's figures for `convert` (none) over Keras' build + load + save, 1.6 GB model, quiet machine.
CONVERT_THEN, CONVERT_ISSUE, CONVERT_GOAL = "4.2 s = 0.29x", "5.5-5.9 s = 0.42-0.44x", "<= 0.25x"


def cli_model():
    """The bench model for `shardckpt convert --model bench_convert:cli_model` (size from the environment)."""
    from bench_restore import build

    blocks, dim = map(int, os.environ["BENCH_CONVERT_SHAPE"].split("x"))
    return build(blocks, dim)


def cell(args: argparse.Namespace, mode: str, option: str) -> dict:
    setup_jax(8 if mode == "restore" else 1)
    from bench_restore import build, distribution

    import shardckpt

    src = os.path.join(args.workdir, H5)
    base = rss_anon()  # a bare `import shardckpt` (Keras, JAX, Orbax loaded)
    out: dict = {}
    if mode == "convert":
        dst = os.path.join(args.workdir, f"orbax-{option}")
        shutil.rmtree(dst, ignore_errors=True)
        from shardckpt.conversion.converter import convert

        with PeakSampler() as sampler:
            start, cpu = time.perf_counter(), cpu_seconds()
            with shardckpt.lazy_init():
                model = build(args.blocks, args.dim)
            report = convert(src, dst, model=model, compression=option, progress=False)
            out["seconds"] = time.perf_counter() - start
            out["cpu_s"] = cpu_seconds() - cpu
        out["disk_bytes"] = report.bytes_on_disk
    elif mode == "cli":
        from shardckpt.cli.main import main as cli  # imported before the clock starts

        dst = os.path.join(args.workdir, "orbax-cli")
        shutil.rmtree(dst, ignore_errors=True)
        os.environ["BENCH_CONVERT_SHAPE"] = f"{args.blocks}x{args.dim}"
        argv = ["convert", src, dst, "--model", "bench_convert:cli_model", "--compression", option, "--quiet"]
        with PeakSampler() as sampler:
            start, cpu = time.perf_counter(), cpu_seconds()
            code = cli(argv)
            out["seconds"] = time.perf_counter() - start
            out["cpu_s"] = cpu_seconds() - cpu
        assert code == 0, code
        out["disk_bytes"] = du(dst)
    elif mode == "keras":
        import jax
        import keras
        import orbax.checkpoint.experimental.v1 as ocp

        dst = os.path.join(args.workdir, "orbax-keras")
        shutil.rmtree(dst, ignore_errors=True)
        with PeakSampler() as sampler:
            start, cpu = time.perf_counter(), cpu_seconds()
            model = build(args.blocks, args.dim)
            model.load_weights(src)
            model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
            state = model.get_state_tree()
            weights = {k: state[k] for k in ("trainable_variables", "non_trainable_variables")}
            ocp.save_checkpointables(dst, {"pytree": weights})
            jax.effects_barrier()
            out["seconds"] = time.perf_counter() - start
            out["cpu_s"] = cpu_seconds() - cpu
        out["disk_bytes"] = du(dst)
    else:  # restore
        import jax
        import keras
        from bench_restore import plain_read, tensorstore_read

        path = os.path.join(args.workdir, f"orbax-{option}")
        # convert drops what it wrote from the page cache; read it in first,
        # as every bench_restore cell does, so both rows read from memory.
        plain_read(path)
        out["ts_read_s"], _ = tensorstore_read(path, memmap=True, warm=0)
        keras.distribution.set_distribution(distribution())
        with PeakSampler() as sampler:
            start, cpu = time.perf_counter(), cpu_seconds()
            with shardckpt.lazy_init():
                model = build(args.blocks, args.dim)
            shardckpt.load_sharded(model, path, progress=False)
            jax.block_until_ready([v.value for v in model.weights])
            out["seconds"] = time.perf_counter() - start
            out["cpu_s"] = cpu_seconds() - cpu
    out["peak_over_import_gb"] = (sampler.peak - base) / 1e9
    return out


def _child(args: argparse.Namespace, *extra: str) -> dict:
    return run_child(os.path.abspath(__file__), "--workdir", args.workdir,
                     "--blocks", str(args.blocks), "--dim", str(args.dim), *extra)


def _best(args: argparse.Namespace, *extra: str) -> dict:
    """The fastest of `--repeat` runs of one cell (the machine is noisy)."""
    runs = [_child(args, *extra) for _ in range(args.repeat)]
    return min(runs, key=lambda r: r["seconds"])


def main() -> None:
    bench.main(__doc__, options=_options, children={"--_prepare": (0, prepare_h5), "--_cell": (2, cell)},
               run=_parent, smoke=SMOKE, prefix="bench-convert-", reuse=True)


def _options(parser) -> None:
    model_options(parser)


def _parent(args) -> None:
    if not (args.reuse and os.path.exists(os.path.join(args.workdir, H5))):
        info = _child(args, "--_prepare")
        print(f"model: {info['params']:,} parameters")
    size = os.path.getsize(os.path.join(args.workdir, H5))
    print(f".weights.h5: {size / 1e9:.2f} GB  ({os.cpu_count()} CPUs)")
    keras_row = _best(args, "--_cell", "keras", "-")
    cli_row = _best(args, "--_cell", "cli", "none")
    rows = {c: _best(args, "--_cell", "convert", c) for c in ("none", "zstd")}
    restores = {c: _best(args, "--_cell", "restore", c) for c in ("none", "zstd")}
    print(f"\n{'path':<28}{'seconds':>9}{'CPU s':>8}{'x keras':>9}{'peak anon GB':>14}{'on disk GB':>12}")
    print(f"{'keras build+load+save':<28}{keras_row['seconds']:>9.2f}{keras_row['cpu_s']:>8.2f}{1.0:>9.2f}"
          f"{keras_row['peak_over_import_gb']:>14.2f}{keras_row['disk_bytes'] / 1e9:>12.2f}")
    for label, row in [("shardckpt convert CLI none", cli_row), *((f"convert() {c}", r) for c, r in rows.items())]:
        print(f"{label:<28}{row['seconds']:>9.2f}{row['cpu_s']:>8.2f}"
              f"{row['seconds'] / keras_row['seconds']:>9.2f}"
              f"{row['peak_over_import_gb']:>14.2f}{row['disk_bytes'] / 1e9:>12.2f}")
    print(f"\n{'restore (load_sharded, 1x8)':<28}{'seconds':>9}{'CPU s':>8}{'ts read s':>11}{'peak anon GB':>14}"
          f"{'on disk GB':>12}")
    for c, row in restores.items():
        print(f"{'compression ' + c:<28}{row['seconds']:>9.2f}{row['cpu_s']:>8.2f}{row['ts_read_s']:>11.2f}"
              f"{row['peak_over_import_gb']:>14.2f}{rows[c]['disk_bytes'] / 1e9:>12.2f}")
    print_then_vs_now([(
        "CLI convert none (import excluded) vs keras build+load+save", CONVERT_THEN, CONVERT_ISSUE,
        f"{cli_row['seconds']:.2f} s = {cli_row['seconds'] / keras_row['seconds']:.2f}x", CONVERT_GOAL,
    )])
    emit({"keras": keras_row, "cli": cli_row, "convert": rows, "restore": restores, "h5_bytes": size})


if __name__ == "__main__":
    main()
