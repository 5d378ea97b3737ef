#!/usr/bin/env python3
"""The restore benchmark on an accelerator machine: one command, nothing fetched there.

The accelerator machine (NOTES.md, "The accelerator machine") has JAX with
CUDA, tensorstore, h5py, safetensors and psutil but no Keras, and cannot
reach any registry. So:

1. here, on a machine with a network: `python3 tools/bench_gpu.py --download`
   fetches the missing wheels (Python 3.12, manylinux) into `.whl/` with the
   `pip download` line NOTES.md records (26 MB);
2. there: `python3 tools/bench_gpu.py` installs `.whl/*.whl` into a
   temporary folder (`pip install --no-index --no-deps --target`: nothing
   from a registry), then runs `tools/bench_restore.py` for every format
   (h5, Keras-written Orbax, safetensors, shardckpt-written Orbax with its
   crc32c), shardckpt against Keras, on the issue's 4.3 GB model
   (`--dim 4096 --blocks 8`) and then on one 3x larger (`--blocks 24`,
   12.9 GB: h5, safetensors and shardckpt-written Orbax, which fit the
   machine's disk beside each other), each load in a fresh process.

It prints bench_restore's tables (load seconds and GB/s, CPU seconds, build
seconds, peak host memory over the final state, peak device memory, the
ratio to Keras' load) for both sizes, and the time it took. With `$OUT` set,
the output and each run's JSON rows go to `$OUT/bench_gpu/`. Budget: both
sizes took about 140 s + 400 s on one H200 (file writing included); the
command stops a size that runs past `--limit` seconds.

`--smoke` runs the same command at bench_restore's `--smoke` size on
whatever devices the machine has (CPU here), installing nothing: the test
suite runs it so the script cannot rot.

Usage:
    python3 tools/bench_gpu.py --download           # here: wheels into .whl/
    python3 tools/bench_gpu.py [--workdir DIR]      # on the accelerator machine
    python3 tools/bench_gpu.py --smoke              # a tiny run on this machine's devices
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WHEELS = os.path.join(ROOT, ".whl")
BENCH = os.path.join(ROOT, "tools", "bench_restore.py")

DOWNLOAD = [
    "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
    "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_27_x86_64",
    "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64",
    "-d", ".whl", "keras==3.15.1", "namex", "optree==0.20.0", "orbax-checkpoint==0.12.8", "tensorstore==0.1.86", "isal",
]
"""NOTES.md's line: what the accelerator machine's image lacks, for its Python 3.12."""

SIZES = [
    # (name, bench_restore arguments): the model, then one 3x larger.
    ("4.3 GB", ["--dim", "4096", "--blocks", "8", "--formats", "h5,orbax,safetensors,orbax-crc32c"]),
    ("12.9 GB", ["--dim", "4096", "--blocks", "24", "--formats", "h5,safetensors,orbax-crc32c"]),
]
SMOKE_SIZES = [("smoke", ["--smoke", "--formats", "h5,orbax,safetensors,orbax-crc32c"])]


def download() -> int:
    """Fetches the wheels into `.whl/` (run where a registry can be reached)."""
    os.makedirs(WHEELS, exist_ok=True)
    print("$ " + " ".join(DOWNLOAD), flush=True)
    return subprocess.call([sys.executable, "-m", *DOWNLOAD], cwd=ROOT)


def install(site: str) -> None:
    """Installs `.whl/*.whl` into `site`, from those files alone."""
    wheels = sorted(glob.glob(os.path.join(WHEELS, "*.whl")))
    if not wheels:
        raise SystemExit(f"No wheels in {WHEELS}: run `python3 tools/bench_gpu.py --download` first, where pip can reach PyPI.")
    subprocess.check_call(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", site, *wheels]
    )


def environment(site: str | None, smoke: bool) -> dict[str, str]:
    env = dict(os.environ)
    paths = [p for p in (site, ROOT, env.get("PYTHONPATH")) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["KERAS_BACKEND"] = "jax"
    if not smoke:
        env.setdefault("JAX_PLATFORMS", "cuda")
    return env


def run_size(name: str, extra: list[str], env: dict[str, str], workdir: str, limit: float, out: str | None) -> dict:
    """One bench_restore run; its output is printed (and kept under `out`). Returns its rows and seconds."""
    folder = os.path.join(workdir, name.replace(" ", "_"))
    os.makedirs(folder, exist_ok=True)
    command = [sys.executable, BENCH, "--repeat", "1", "--workdir", folder, *extra]
    print(f"\n== {name}: {' '.join(command[1:])}", flush=True)
    start = time.perf_counter()
    try:
        done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=limit)
        text, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        text += f"\n{name}: stopped after {limit:.0f} s (--limit)\n"
        code = 124
    seconds = time.perf_counter() - start
    shown = [line for line in text.splitlines() if not line.startswith("RESULT ")]
    print("\n".join(shown), flush=True)
    print(f"{name}: {seconds:.0f} s, exit {code}", flush=True)
    results = [line[len("RESULT "):] for line in text.splitlines() if line.startswith("RESULT ")]
    result = json.loads(results[-1]) if results else {}
    if out:
        with open(os.path.join(out, f"{name.replace(' ', '_')}.txt"), "w") as f:
            f.write(text)
        with open(os.path.join(out, f"{name.replace(' ', '_')}.json"), "w") as f:
            json.dump(result, f, indent=1)
    shutil.rmtree(folder, ignore_errors=True)  # the next size needs the disk
    if code != 0:
        raise SystemExit(f"{name}: bench_restore exited {code}")
    rows = result.get("rows", [])
    for row in rows:  # what the table asks beside each load
        if row.get("load_s"):
            row["load_gb_per_s"] = row["state_gb"] / row["load_s"]
    return {"seconds": seconds, "rows": rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--download", action="store_true", help="fetch the wheels into .whl/ and stop")
    parser.add_argument("--smoke", action="store_true", help="bench_restore's smoke size, on this machine, no install")
    parser.add_argument("--workdir", default=None, help="where the checkpoints go (default: a temporary folder)")
    parser.add_argument("--limit", type=float, default=420.0, help="seconds one size may take")
    args = parser.parse_args()
    if args.download:
        return download()
    out = os.environ.get("OUT")
    if out:
        out = os.path.join(out, "bench_gpu")
        os.makedirs(out, exist_ok=True)
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench_gpu_")
    site = None
    try:
        if not args.smoke:
            site = os.path.join(workdir, "site")
            install(site)
        env = environment(site, args.smoke)
        start = time.perf_counter()
        sizes = {name: run_size(name, extra, env, workdir, args.limit, out) for name, extra in (SMOKE_SIZES if args.smoke else SIZES)}
        print(f"\nbench_gpu: {time.perf_counter() - start:.0f} s in all", flush=True)
        print("RESULT " + json.dumps({"sizes": sizes}), flush=True)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
