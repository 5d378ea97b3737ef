#!/usr/bin/env python3
"""Hugging Face folder benchmark: keras-hub's from_preset vs shardckpt, same run.

Writes a Llama-style Hugging Face folder (keras-hub's own exporter,
`export_backbone`: `config.json` + `model.safetensors`) of about 1.6 GB in
float32, and the same model in bfloat16, then loads each, in a fresh
process per cell, on 8 simulated CPU devices under `ModelParallel` with
keras-hub's own Llama layout map:

- keras-hub: `keras_hub.models.Backbone.from_preset(folder)` under the
  distribution (random init in each variable's sharding, then its converter
  reads every tensor with numpy, transposes/reshapes it and assigns it);
- shardckpt: `shardckpt.presets.hf.build(folder)` (lazy: no initializer)
  then `shardckpt.load_sharded(model, folder)` (each device's piece read
  from the bytes it comes from). This is what `shardckpt.from_preset` does.

For each it prints seconds to a ready model (build + load, values blocked
on), the peak anonymous memory (RssAnon, sampled) over the final state, and
what the process keeps after the load beyond the state ("kept after"), then
shardckpt's time as a fraction of keras-hub's. Both models' values are
compared bit for bit on one variable per kind as a correctness check.

Measured (--repeat 2, 2 shared cores, 8 simulated CPU devices, 411M
parameters): float32 folder keras-hub 28.7 s, shardckpt 3.6 s (0.13x), peak
over final 0.17 vs 0.00 GB, kept after 1.07 vs 0.01 GB; bfloat16 folder into
float32 variables keras-hub 32.8 s, shardckpt 4.3 s (0.13x), 0.28 vs 0.00 GB,
1.36 vs 0.01 GB. The machine is shared: rerun with --repeat 3 for figures to quote.

Usage:
    python tools/bench_hf.py [--repeat 1] [--workdir DIR] [--reuse]
    python tools/bench_hf.py --smoke      # a tiny model: checks the script runs
"""

from __future__ import annotations

import os
import time

import _bench as bench
from _bench import PeakSampler, emit, rss_anon, run_child, setup_jax

SIZES = {
    # ~394M parameters: 1.58 GB float32.
    "full": {"vocabulary_size": 16384, "num_layers": 8, "hidden_dim": 2048, "intermediate_dim": 5632,
             "num_query_heads": 16, "num_key_value_heads": 8},
    "smoke": {"vocabulary_size": 256, "num_layers": 2, "hidden_dim": 64, "intermediate_dim": 128,
              "num_query_heads": 8, "num_key_value_heads": 8},
}
DTYPES = ("float32", "bfloat16")


def prepare(args) -> dict:
    setup_jax(8)
    import keras_hub
    import numpy as np
    from keras_hub.src.utils.transformers.export.hf_exporter import export_backbone

    import shardckpt

    info = {}
    for dtype in DTYPES:
        with shardckpt.lazy_init():  # random values below; no initializers needed
            model = keras_hub.models.Llama3Backbone(**SIZES[args.size], tie_word_embeddings=True, dtype=dtype)
        rng = np.random.default_rng(0)
        for v in model.weights:
            v.assign((rng.standard_normal(v.shape, dtype=np.float32) * 0.02).astype(np.dtype(v.dtype)))
        export_backbone(model, os.path.join(args.workdir, dtype))
        info[dtype] = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in model.weights)
        info["params"] = int(model.count_params())
        del model
    return info


def distribution():
    import keras
    import keras_hub

    mesh = keras.distribution.DeviceMesh((1, 8), ["batch", "model"])
    layout_map = keras_hub.models.Llama3Backbone.get_layout_map(mesh)
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def run(args) -> dict:
    setup_jax(8)
    import jax
    import keras
    import keras_hub
    import numpy as np

    import shardckpt
    from shardckpt.presets import hf
    from shardckpt.restore import hostmem

    folder = os.path.join(args.workdir, args.dtype)
    keras.distribution.set_distribution(distribution())
    jax.block_until_ready(jax.device_put(np.zeros(1, np.float32), jax.devices()[0]))  # runtime up
    hostmem.trim()
    base = rss_anon()
    out = {}
    with PeakSampler() as sampler:
        start = time.perf_counter()
        if args.mode == "keras-hub":
            model = keras_hub.models.Backbone.from_preset(folder)
        else:
            model = hf.build(folder)
            report = shardckpt.load_sharded(model, folder, progress=False)
            out["casts"] = len(report.casts)
        jax.block_until_ready([v.value for v in model.weights])
        out["ready_s"] = time.perf_counter() - start
    final = rss_anon()
    state = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in model.weights)
    out["state_gb"] = state / 1e9
    out["peak_over_final_gb"] = (sampler.peak - final) / 1e9
    out["kept_after_gb"] = (final - base - state) / 1e9
    q = model.get_layer("transformer_layer_0")._self_attention_layer._query_dense.kernel
    out["sharding"] = str(q.value.sharding.spec)
    # Fingerprints to compare the two loaders' values (bit patterns, not floats).
    out["fingerprint"] = [
        int(np.asarray(v.value).view(np.uint8 if np.dtype(v.dtype).itemsize == 1 else f"u{np.dtype(v.dtype).itemsize}").astype(np.uint64).sum() % (1 << 61))
        for v in model.weights[:6]
    ]
    out["devices"] = f"{len(jax.devices())} x {jax.devices()[0].device_kind}"
    return out


def _child(args, *extra) -> dict:
    return run_child(os.path.abspath(__file__), "--workdir", args.workdir, *(["--smoke"] if args.smoke else []), *extra)


def main() -> None:
    bench.main(__doc__, options=_options, children={"--_prepare": (0, prepare), "--_run": (2, _run)},
               run=_parent, smoke=_smoke, prefix="bench_hf_", reuse=True)


def _options(parser) -> None:
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="folders to load (float32,bfloat16)")
    parser.set_defaults(size="full")


def _smoke(args) -> None:
    args.size = "smoke"  # a tiny model
    if not args._run:
        args.dtypes = "float32"  # keras-hub's from_preset alone takes ~10 s per cell


def _run(args, mode: str, dtype: str) -> dict:
    args.mode, args.dtype = mode, dtype
    return run(args)


def _parent(args) -> None:
    if args.reuse and all(os.path.exists(os.path.join(args.workdir, d, "config.json")) for d in DTYPES):
        info = None
    else:
        info = _child(args, "--_prepare")
        print(f"model: Llama3-style, {info['params'] / 1e6:.0f}M parameters, "
              f"{info['float32'] / 1e9:.2f} GB float32 / {info['bfloat16'] / 1e9:.2f} GB bfloat16; "
              f"ModelParallel (1, 8) with keras-hub's Llama layout map; workdir {args.workdir}")
    rows = []
    for dtype in args.dtypes.split(","):
        for mode in ("keras-hub", "shardckpt"):
            runs = [_child(args, "--_run", mode, dtype) for _ in range(args.repeat)]
            rows.append((dtype, mode, min(runs, key=lambda r: r["ready_s"])))
    print(f"{'folder':>9} {'loader':>10} {'ready s':>8} {'peak over final GB':>19} {'kept after GB':>14} "
          f"{'vs keras-hub':>13}  sharding of a query kernel")
    ref = {d: r for d, m, r in rows if m == "keras-hub"}
    ok = True
    for dtype, mode, r in rows:
        vs = f"{r['ready_s'] / ref[dtype]['ready_s']:.2f}x" if mode != "keras-hub" else ""
        print(f"{dtype:>9} {mode:>10} {r['ready_s']:8.2f} {r['peak_over_final_gb']:19.2f} "
              f"{r['kept_after_gb']:14.2f} {vs:>13}  {r['sharding']}")
        if r["fingerprint"] != ref[dtype]["fingerprint"] or r["sharding"] != ref[dtype]["sharding"]:
            ok = False
    print("devices: " + ", ".join(sorted({r["devices"] for _, _, r in rows})))
    print("values and shardings: " + ("equal" if ok else "DIFFER"))
    emit({"rows": [{"dtype": d, "loader": m, **r} for d, m, r in rows], "equal": ok})
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
