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

For each: seconds (the call, until its files are written), peak anonymous
memory (RssAnon, sampled) over what the process held before the call (the
loaded model's state), and bytes written (the folder's size; one process
writes all of it here). Then the ratios shardckpt / keras-hub.

Usage:
    python tools/bench_export.py [--layers 6] [--hidden 2048] [--workdir DIR]
    python tools/bench_export.py --smoke        # tiny, seconds (run by tests)
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import _bench as bench
from _bench import PeakSampler, du, emit, rss_anon, run_child, setup_jax

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
    hostmem.trim()
    base = rss_anon()
    with PeakSampler() as sampler:
        start = time.perf_counter()
        if args.cell == "shardckpt-hf":
            shardckpt.export(model, out)
        elif args.cell == "shardckpt-preset":
            shardckpt.export(model, out, format="keras-hub")
        elif args.cell == "keras-hub-hf":
            model.export_to_transformers(out)
        else:
            model.save_to_preset(out)
        seconds = time.perf_counter() - start
    written = du(out)
    shutil.rmtree(out, ignore_errors=True)
    emit({"seconds": seconds, "peak_over_state_gb": (sampler.peak - base) / 1e9, "written_gb": written / 1e9,
          "state_gb": state / 1e9})


def _child(args, *extra: str) -> dict:
    return run_child(os.path.abspath(__file__), "--workdir", args.workdir, *_size_args(args), *extra)


def _size_args(args) -> list[str]:
    return bench.llama_argv(args)


SMOKE = bench.LLAMA_SMOKE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.llama_options(parser)
    parser.add_argument("--workdir", default=None)
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
        rows = {cell: _child(args, "--_run", cell) for cell in CELLS}
        _print(rows)
        emit({"rows": rows})
    finally:
        if own:
            shutil.rmtree(args.workdir, ignore_errors=True)


def _print(rows) -> None:
    print(f"{'cell':<17} {'seconds':>8} {'peak over state GB':>19} {'written GB':>11} {'state GB':>9}")
    for cell, r in rows.items():
        print(f"{cell:<17} {r['seconds']:>8.2f} {r['peak_over_state_gb']:>19.3f} {r['written_gb']:>11.3f} "
              f"{r['state_gb']:>9.3f}")
    for kind in ("hf", "preset"):
        ours, hub = rows[f"shardckpt-{kind}"], rows[f"keras-hub-{kind}"]
        print(f"{kind}: shardckpt / keras-hub time = {ours['seconds'] / hub['seconds']:.2f}x; peak over state "
              f"{ours['peak_over_state_gb']:.3f} GB vs {hub['peak_over_state_gb']:.3f} GB")


if __name__ == "__main__":
    main()
