#!/usr/bin/env python3
"""Restore from buckets: the bench_restore model from local disk, fake GCS and fake S3.

Builds the MLP stack of `tools/bench_restore.py` (default ~400M parameters,
1.6 GB float32), saves it with Keras (`.weights.h5`) and with the
`safetensors` package, and converts it with `shardckpt.convert` into one
Orbax step. Each of the three is kept on local disk and copied into a bucket
of fake-gcs-server and one of moto's S3 server (both started here, each in
its own process on 127.0.0.1; moto holds its objects in memory: ~3x the
state at full size). Then, each in a fresh process on 8 simulated CPU
devices under the same `ModelParallel` as bench_restore, it builds the model
under `lazy_init()` and runs `load_sharded` from each copy: seconds, CPU
seconds, and peak anonymous memory of the load over the final state (RssAnon
sampled during the load; the servers' memory is theirs, in their own
processes). h5 and safetensors files in buckets are read by byte ranges
(`shardckpt.storage.ranged`), never downloaded whole.

The fake servers run on this machine, so the figures show shardckpt's own
cost of reading through TensorStore's gcs / s3 drivers (HTTP, no disk
mapping, each piece fetched as byte ranges), not a cloud's bandwidth.

Then the save rows (`_bench_bucket_save`): `OrbaxCheckpoint`'s bucket save
from 1 and from 2 `jax.distributed` processes into each server, per process:
seconds, blocking per save, peak memory over the state against the host's
in-flight budget, bytes written, and the restore of that step (seconds, bytes
read).

Usage:
    python tools/bench_storage.py [--blocks 12] [--dim 2048] [--repeat 1] [--smoke]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import _bench as bench
import _bench_bucket_save as bucket_save
from _bench import ROOT, PeakSampler, cpu_seconds, emit, rss_anon, run_child

if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # tests.buckets starts the fake servers


def prepare(args) -> None:
    """Child: writes the h5 and converts it to local disk and both buckets."""
    import bench_restore

    bench_restore._setup_jax(8)
    import numpy as np

    import shardckpt

    model = bench_restore.build(args.blocks, args.dim)
    rng = np.random.default_rng(0)
    for v in model.weights:
        v.assign(rng.standard_normal(v.shape, dtype=np.float32) * 0.02)
    h5 = os.path.join(args.workdir, "model.weights.h5")
    model.save_weights(h5)
    from safetensors.numpy import save_file

    files = {"h5": h5, "safetensors": os.path.join(args.workdir, "model.safetensors")}
    save_file({v.path: np.asarray(v.value) for v in model.weights}, files["safetensors"])
    from shardckpt import storage

    seconds = {}
    for name, (fmt, dst) in json.loads(args.targets).items():
        start = time.perf_counter()
        if fmt == "orbax":
            shardckpt.convert(h5, dst, model=model, progress=False)
        elif dst != files[fmt]:  # a file: uploaded as it is (one object write)
            with open(files[fmt], "rb") as f:
                storage.write_bytes(storage.parse(dst), f.read())
        seconds[name] = time.perf_counter() - start
    emit({"params": int(model.count_params()), "convert_s": seconds})


def run(args) -> None:
    """Child: lazily builds the model and loads it from `args.source`."""
    import bench_restore

    bench_restore._setup_jax(8)
    import jax
    import keras
    import numpy as np

    import shardckpt
    from shardckpt.restore import hostmem

    keras.distribution.set_distribution(bench_restore.distribution())
    with shardckpt.lazy_init():
        model = bench_restore.build(args.blocks, args.dim)
    jax.block_until_ready(jax.device_put(np.zeros(1, np.float32), jax.devices()[0]))
    hostmem.trim()
    with PeakSampler() as sampler:
        start, cpu = time.perf_counter(), cpu_seconds()
        report = shardckpt.load_sharded(model, args.source, progress=False)
        jax.block_until_ready([v.value for v in model.weights])
        load_s, load_cpu = time.perf_counter() - start, cpu_seconds() - cpu
    final = rss_anon()
    kernel = next(v for v in model.weights if v.path.endswith("_down/kernel"))
    out = {
        "load_s": load_s,
        "load_cpu_s": load_cpu,
        "bytes_read": report.bytes_read,
        "state_gb": sum(int(np.prod(v.shape)) * 4 for v in model.weights) / 1e9,
        "peak_over_final_gb": (sampler.peak - final) / 1e9,
        "sharding": str(getattr(kernel.value.sharding, "spec", kernel.value.sharding)),
        # A spot check that every copy holds the same values.
        "checksum": float(np.asarray(kernel.value, np.float64).sum()),
    }
    emit(out)


def _child(args, *extra: str) -> dict:
    return run_child(os.path.abspath(__file__), "--workdir", args.workdir,
                     "--blocks", str(args.blocks), "--dim", str(args.dim), *extra)


def _start_servers(stack):
    """Starts fake-gcs-server and moto's S3 server, each a process of its own."""
    from tests import buckets

    gcs, gcs_server = buckets.start_gcs()  # the wrapper runs the Go binary as a subprocess
    stack.append(gcs_server.stop)
    port = buckets._free_port()
    # moto in its own process, so that the 1.6 GB it holds is not the loader's.
    moto = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    stack.append(lambda: (moto.terminate(), moto.wait(timeout=30)))
    endpoint = f"http://127.0.0.1:{port}"
    s3 = buckets.FakeServer("s3", endpoint, {
        "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
    })
    deadline = time.monotonic() + 30
    while True:
        try:
            url_s3 = s3.new_bucket()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    return {"gs": (gcs, gcs.new_bucket()), "s3": (s3, url_s3)}


def main() -> None:
    bench.main(__doc__, options=_options,
               children={"--_prepare": (None, _prepare), "--_run": (None, _run), "--_save": (3, bucket_save.child)},
               run=_parent, smoke={"blocks": 1, "dim": 64}, prefix="bench_storage_")


def _options(parser) -> None:
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--dim", type=int, default=2048)


def _prepare(args, targets: str) -> None:
    args.targets = targets
    prepare(args)


def _run(args, source: str) -> None:
    args.source = source
    run(args)


def _parent(args) -> None:
    stack: list = []
    try:
        servers = _start_servers(stack)
        for server, _ in servers.values():
            os.environ.update(server.env)  # the children's endpoints and test credentials
        files = {"orbax": "orbax", "h5": "model.weights.h5", "safetensors": "model.safetensors"}
        sources = {}
        for fmt, name in files.items():
            sources[f"{fmt} local disk"] = (fmt, os.path.join(args.workdir, name))
            for scheme, (_, url) in servers.items():
                sources[f"{fmt} fake {'GCS' if scheme == 'gs' else 'S3'}"] = (fmt, f"{url}/{name}")
        info = _child(args, "--_prepare", json.dumps(sources))
        print(f"model: {info['params']:,} parameters, {info['params'] * 4 / 1e9:.3f} GB float32; "
              f"ModelParallel (1, 8 CPU devices); workdir {args.workdir}")
        rows = []
        for name, (_, source) in sources.items():
            runs = [_child(args, "--_run", source) for _ in range(args.repeat)]
            rows.append((name, source, info["convert_s"][name], min(runs, key=lambda r: r["load_s"])))
        save_rows = bucket_save.rows(os.path.abspath(__file__), args, {k: url for k, (_, url) in servers.items()})
    finally:
        for stop in reversed(stack):
            stop()
    _print(rows)
    bucket_save.show(save_rows)
    emit({"rows": [dict(r, source=name, convert_s=c) for name, _, c, r in rows], "save_rows": save_rows})


def _print(rows) -> None:
    # "vs local": against the same format's load from local disk.
    local = {name.split()[0]: r["load_s"] for name, _, _, r in rows if name.endswith("local disk")}
    print(f"{'source':<23} {'write s':>7} {'load s':>7} {'load CPU s':>10} {'vs local':>8} "
          f"{'peak over final GB':>18}  sharding")
    for name, _, convert_s, r in rows:
        print(f"{name:<23} {convert_s:>7.2f} {r['load_s']:>7.2f} {r['load_cpu_s']:>10.2f} "
              f"{r['load_s'] / local[name.split()[0]]:>7.2f}x {r['peak_over_final_gb']:>18.3f}  {r['sharding']}")
    sums = {r["checksum"] for _, _, _, r in rows}
    print(f"state {rows[0][3]['state_gb']:.3f} GB; same values from every source: {len(sums) == 1}")
    if len(sums) != 1:
        raise SystemExit("the sources disagree")


if __name__ == "__main__":
    main()
