#!/usr/bin/env python3
"""Preset benchmark: keras-hub's `Backbone.from_preset` vs `shardckpt.from_preset`.

Builds a keras-hub Llama backbone (default ~400M parameters, 1.6 GB float32),
saves it with keras-hub's `save_to_preset` once as one `model.weights.h5` and
once sharded (`max_shard_size`, default 0.25 GB: `model.weights.json` +
`model_0000N.weights.h5`), then loads each preset in a fresh process on 8
simulated CPU devices under `ModelParallel` with keras-hub's own Llama layout
map (`LlamaBackbone.get_layout_map`, an 8-way "model" axis):

- keras-hub: `set_distribution(ModelParallel(layout_map))`, then
  `keras_hub.models.Backbone.from_preset(dir)` (builds with random init on
  the devices, then `load_weights` reads each full tensor before placing it);
- shardckpt: `shardckpt.from_preset(dir, layout=layout_map)` (same layout:
  builds under `lazy_init()`, each device reads its piece);
- shardckpt-auto: `shardckpt.from_preset(dir)`, its default (`auto_layout` on
  all devices, the mesh chosen for the model: `mesh="auto"`).

For each it prints seconds to a ready model (from the call until every
variable's value is ready), peak anonymous memory (sampled RssAnon) over the
final state, and what the process keeps after beyond the state itself
(anonymous memory over the process's start, minus the bytes of every
device's shards), and the ratios shardckpt / keras-hub.

Measured (full size, 401.6M parameters, 7 shard files; 2 cores shared with
other jobs, load average ~7, so seconds are contended): keras-hub 121.4 s
(single) / 81.8 s (sharded), peak +5.1 GB over the final state; shardckpt with
the same layout map 5.2 s / 5.6 s, peak +0.001 / +0.004 GB (0.04x / 0.07x).

Usage:
    python tools/bench_preset.py [--layers 6] [--hidden 2048] [--workdir DIR]
    python tools/bench_preset.py --smoke        # tiny, seconds (run by tests)
"""

from __future__ import annotations

import os
import time

import _bench as bench
from _bench import PeakSampler, emit, rss_anon, run_child, setup_jax

FORMS = ("single", "sharded")
MODES = ("keras-hub", "shardckpt", "shardckpt-auto")


def config(args) -> dict:
    return bench.llama_config(args)


def prepare(args) -> None:
    setup_jax(8)
    import keras_hub
    import numpy as np

    backbone = keras_hub.models.LlamaBackbone(**config(args))
    rng = np.random.default_rng(0)
    for v in backbone.weights:  # distinct values (initializers give ones / zeros to norms)
        v.assign(rng.standard_normal(v.shape, dtype=np.float32) * 0.02)
    backbone.save_to_preset(os.path.join(args.workdir, "single"))
    backbone.save_to_preset(os.path.join(args.workdir, "sharded"), max_shard_size=args.shard_gb)
    shards = [n for n in os.listdir(os.path.join(args.workdir, "sharded")) if n.startswith("model_0")]
    emit({"params": int(backbone.count_params()), "shards": len(shards)})


def layout_map():
    import keras
    import keras_hub

    mesh = keras.distribution.DeviceMesh((1, 8), ["batch", "model"])
    return keras_hub.models.LlamaBackbone.get_layout_map(mesh)


def run(args) -> None:
    setup_jax(8)
    import jax
    import keras
    import keras_hub

    import shardckpt
    from shardckpt.restore import hostmem

    folder = os.path.join(args.workdir, args.form)
    lm = layout_map()
    hostmem.trim()
    base = rss_anon()
    with PeakSampler() as sampler:
        start = time.perf_counter()
        if args.mode == "keras-hub":
            keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=lm))
            model = keras_hub.models.Backbone.from_preset(folder)
        elif args.mode == "shardckpt":
            model = shardckpt.from_preset(folder, layout=lm)
        else:
            model = shardckpt.from_preset(folder)
        jax.block_until_ready([v.value for v in model.weights])
        seconds = time.perf_counter() - start
    hostmem.trim()  # what a loader freed but glibc kept is not "kept" by intent; count what stays
    final = rss_anon()
    state = sum(s.data.nbytes for v in model.weights for s in v.value.addressable_shards)
    embedding = model.get_layer("token_embedding").embeddings
    out = {
        "seconds": seconds,
        "peak_over_final_gb": (sampler.peak - final) / 1e9,
        "kept_after_gb": (final - base - state) / 1e9,
        "state_gb": state / 1e9,
        "embedding_sharding": str(embedding.value.sharding.spec),
    }
    emit(out)


def _child(args, *extra: str) -> dict:
    return run_child(os.path.abspath(__file__), "--workdir", args.workdir, *_size_args(args), *extra)


def _size_args(args) -> list[str]:
    return [*bench.llama_argv(args), "--shard-gb", str(args.shard_gb)]


SMOKE = {**bench.LLAMA_SMOKE, "shard_gb": 5e-5}


def main() -> None:
    bench.main(__doc__, options=_options, children={"--_prepare": (0, prepare), "--_run": (2, _run)},
               run=_parent, smoke=SMOKE, prefix="bench_preset_", reuse=True)


def _options(parser) -> None:
    bench.llama_options(parser)
    parser.add_argument("--shard-gb", type=float, default=0.25, help="max_shard_size of the sharded preset (GB)")


def _run(args, mode: str, form: str) -> None:
    args.mode, args.form = mode, form
    run(args)


def _parent(args) -> None:
    if args.reuse and os.path.isdir(os.path.join(args.workdir, "sharded")):
        info = {"params": None, "shards": None}
    else:
        info = _child(args, "--_prepare")
    if info["params"]:
        print(f"model: Llama backbone, {info['params'] / 1e6:.1f}M parameters, "
              f"{info['params'] * 4 / 1e9:.3f} GB float32; sharded preset: {info['shards']} shard files")
    rows = []
    for form in FORMS:
        for mode in MODES:
            runs = [_child(args, "--_run", mode, form) for _ in range(args.repeat)]
            rows.append((form, mode, min(runs, key=lambda r: r["seconds"])))
    _print(rows)


def _print(rows) -> None:
    print(f"{'preset':<8} {'loader':<15} {'seconds':>8} {'peak over final GB':>19} {'kept after GB':>14} "
          f"{'state GB':>9}  embedding sharding")
    for form, mode, r in rows:
        print(f"{form:<8} {mode:<15} {r['seconds']:>8.2f} {r['peak_over_final_gb']:>19.3f} "
              f"{r['kept_after_gb']:>14.3f} {r['state_gb']:>9.3f}  {r['embedding_sharding']}")
    by = {(f, m): r for f, m, r in rows}
    for form in FORMS:
        hub, ours = by[(form, "keras-hub")], by[(form, "shardckpt")]
        print(f"{form}: shardckpt / keras-hub time = {ours['seconds'] / hub['seconds']:.2f}x; "
              f"peak over final {ours['peak_over_final_gb']:.3f} GB vs {hub['peak_over_final_gb']:.3f} GB")


if __name__ == "__main__":
    main()
