#!/usr/bin/env python3
"""Export benchmark: `shardckpt.export` vs keras-hub's `export_to_transformers` and `save_to_preset`.

Builds a keras-hub Llama 3 backbone (default ~400M parameters, 1.6 GB
float32, untied embeddings) and saves it once as a keras-hub preset. Each
cell then runs in a fresh process on 8 simulated CPU devices: the preset is
loaded sharded (`shardckpt.from_preset`, keras-hub's Llama layout map, an
8-way "model" axis) and exported once:

- shardckpt-hf: `shardckpt.export(model, dir)` (Hugging Face folder);
- keras-hub-hf: `model.export_to_transformers(dir)` (keras-hub's exporter:
  every tensor to host numpy, then one safetensors file);
- shardckpt-preset: `shardckpt.export(model, dir, format="keras-hub")`;
- keras-hub-preset: `model.save_to_preset(dir)` (Keras' `save_weights`).

For each: seconds (the call, until its files are written; shardckpt's
include its `fsync`s, keras-hub's writers leave their pages dirty), "synced"
seconds (the call plus an `os.sync()` after it: the time until the export
is on disk, for both alike), CPU
seconds (user + system, all threads), peak anonymous memory (RssAnon,
sampled) over what the process held before the call (the loaded model's
state), and bytes written (the folder's size; one process writes all of it
here). Cells run `--repeat` rounds (default 3), each round every cell once
in turn, so that a busy spell of a shared machine hits all of them; the
median of each is shown, with the best. Then shardckpt / keras-hub for
both formats beside the targets (time at most 0.5x, peak at most 0.3 GB
over the state), and the load average before and after.

With --warm, each process touches and frees 3x the model's bytes just
before its timed call (`_bench.warm_memory`): on VMs that hand free memory
back to their host, a page touched for the first time since costs a host
fault, page cache pages included; --warm shows what exports cost on memory
backed for good, as on bare metal.

Usage:
    python tools/bench_export.py [--layers 6] [--hidden 2048] [--repeat 3] [--warm] [--workdir DIR]
    python tools/bench_export.py --smoke        # tiny, seconds (run by tests)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import _bench as bench
from _bench import PeakSampler, cpu_seconds, du, emit, rss_anon, run_child, setup_jax, warm_memory

CELLS = ("shardckpt-hf", "keras-hub-hf", "shardckpt-preset", "keras-hub-preset")


def config(args) -> dict:
    return {**bench.llama_config(args), "tie_word_embeddings": False}


def prepare(args) -> None:
    setup_jax(8)
    import keras_hub
    import numpy as np

    backbone = keras_hub.models.Llama3Backbone(**config(args))
    rng = np.random.default_rng(0)
    for v in backbone.weights:  # distinct values (initializers give ones to norms)
        v.assign(rng.standard_normal(v.shape, dtype=np.float32) * 0.02)
    backbone.save_to_preset(os.path.join(args.workdir, "preset"))
    emit({"params": int(backbone.count_params())})


def run(args) -> None:
    setup_jax(8)
    import jax
    import keras
    import keras_hub

    import shardckpt
    from shardckpt.restore import hostmem

    mesh = keras.distribution.DeviceMesh((1, 8), ["batch", "model"])
    model = shardckpt.from_preset(os.path.join(args.workdir, "preset"),
                                  layout=keras_hub.models.Llama3Backbone.get_layout_map(mesh))
    jax.block_until_ready([v.value for v in model.weights])
    out = os.path.join(args.workdir, args.cell)
    shutil.rmtree(out, ignore_errors=True)
    state = sum(s.data.nbytes for v in model.weights for s in v.value.addressable_shards)
    if args.warm:
        warm_memory(3 * sum(v.value.nbytes for v in model.weights))
    hostmem.trim()
    base = rss_anon()
    with PeakSampler() as sampler:
        start, cpu = time.perf_counter(), cpu_seconds()
        if args.cell == "shardckpt-hf":
            shardckpt.export(model, out)
        elif args.cell == "shardckpt-preset":
            shardckpt.export(model, out, format="keras-hub")
        elif args.cell == "keras-hub-hf":
            model.export_to_transformers(out)
        else:
            model.save_to_preset(out)
        seconds, cpu = time.perf_counter() - start, cpu_seconds() - cpu
        os.sync()  # what the call left dirty reaches the disk: the time to a durable export
        synced = time.perf_counter() - start
    written = du(out)
    shutil.rmtree(out, ignore_errors=True)
    emit({"seconds": seconds, "synced_seconds": synced, "cpu_seconds": cpu, "peak_over_state_gb": (sampler.peak - base) / 1e9, "written_gb": written / 1e9,
          "state_gb": state / 1e9})


def _child(args, *extra: str) -> dict:
    warm = ["--warm"] if args.warm else []
    return run_child(os.path.abspath(__file__), "--workdir", args.workdir, *_size_args(args), *warm, *extra)


def _size_args(args) -> list[str]:
    return bench.llama_argv(args)


SMOKE = {**bench.LLAMA_SMOKE, "repeat": 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.llama_options(parser)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--repeat", type=int, default=3, help="rounds of all cells; medians and bests are shown")
    parser.add_argument("--warm", action="store_true", help="touch and free memory before each timed call")
    parser.add_argument("--smoke", action="store_true", help="a tiny model: checks the bench runs")
    parser.add_argument("--_prepare", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--_run", metavar="CELL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        bench.share_children()
        for key, value in SMOKE.items():
            setattr(args, key, value)
    if args._prepare:
        return prepare(args)
    if args._run:
        args.cell = args._run
        return run(args)

    own = args.workdir is None
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="bench_export_")
    try:
        info = _child(args, "--_prepare")
        print(f"model: Llama 3 backbone, {info['params'] / 1e6:.1f}M parameters, "
              f"{info['params'] * 4 / 1e9:.3f} GB float32, on 8 CPU devices (keras-hub's layout map)")
        load = os.getloadavg()
        runs: dict[str, list[dict]] = {cell: [] for cell in CELLS}
        for _ in range(args.repeat):
            for cell in CELLS:
                runs[cell].append(_child(args, "--_run", cell))
        rows = {cell: _summary(r) for cell, r in runs.items()}
        _print(rows, args.repeat, args.warm, load, os.getloadavg())
        emit({"rows": rows, "runs": runs, "load": [load, os.getloadavg()]})
    finally:
        if own:
            shutil.rmtree(args.workdir, ignore_errors=True)


def _summary(runs: list[dict]) -> dict:
    out = dict(runs[0])
    for key in ("seconds", "synced_seconds", "cpu_seconds", "peak_over_state_gb"):
        values = sorted(r[key] for r in runs)
        out[key] = statistics.median(values)
        out[f"best_{key}"] = values[0]
    out["peak_over_state_gb"] = max(r["peak_over_state_gb"] for r in runs)  # the worst peak counts
    return out


TIME_TARGET, PEAK_TARGET_GB = 0.5, 0.3


def _print(rows, repeat, warm, before, after) -> None:
    print(f"{repeat} rounds{' (--warm)' if warm else ''}; load average before {before[0]:.1f}/{before[1]:.1f}/"
          f"{before[2]:.1f}, after {after[0]:.1f}/{after[1]:.1f}/{after[2]:.1f} (1/5/15 min, {os.cpu_count()} cores)")
    print(f"{'cell':<17} {'seconds':>8} {'best':>6} {'synced':>7} {'CPU s':>6} {'best':>6} {'peak over state GB':>19} "
          f"{'written GB':>11} {'state GB':>9}")
    for cell, r in rows.items():
        print(f"{cell:<17} {r['seconds']:>8.2f} {r['best_seconds']:>6.2f} {r['synced_seconds']:>7.2f} {r['cpu_seconds']:>6.2f} "
              f"{r['best_cpu_seconds']:>6.2f} {r['peak_over_state_gb']:>19.3f} {r['written_gb']:>11.3f} "
              f"{r['state_gb']:>9.3f}")
    print(f"targets: shardckpt / keras-hub time <= {TIME_TARGET}x, peak over state <= {PEAK_TARGET_GB} GB")
    for kind, hub in (("hf", "export_to_transformers"), ("preset", "save_to_preset")):
        ours, theirs = rows[f"shardckpt-{kind}"], rows[f"keras-hub-{kind}"]
        ratio = ours["seconds"] / theirs["seconds"]
        best = ours["best_seconds"] / theirs["best_seconds"]
        cpu = ours["cpu_seconds"] / max(1e-9, theirs["cpu_seconds"])
        synced = ours["synced_seconds"] / theirs["synced_seconds"]
        met = ratio <= TIME_TARGET and ours["peak_over_state_gb"] <= PEAK_TARGET_GB
        print(f"{kind:<7} vs {hub:<23}: time {ratio:.2f}x (medians; bests {best:.2f}x), to disk {synced:.2f}x, "
              f"CPU {cpu:.2f}x, peak "
              f"{ours['peak_over_state_gb']:.3f} GB vs {theirs['peak_over_state_gb']:.3f} GB: "
              f"{'met' if met else 'MISSED'}")


if __name__ == "__main__":
    main()
