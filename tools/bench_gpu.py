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

Before the sizes it runs `tools/bench_transfer.py` (the ways a piece can
reach the device), and between them issue 35's save run (`tools/bench_save.py
--params 2e8 --steps 60 --save-every 30`: Keras' callback sync and async
against shardckpt's "auto" and "host"), so one call on a lent machine takes
the figures of both GPU issues.

It prints bench_restore's tables (load seconds and GB/s, CPU seconds, build
seconds, peak host memory over the final state, peak device memory, the
ratio to Keras' load) for both sizes, bench_save's table and the transfer
probe's, and the time it took. With `$OUT` set, the output and each run's
JSON go to `$OUT/bench_gpu/`. Timings on one H200 (2026-11-26, file writing
included): transfer probe about 30 s, 4.3 GB 190 s, saves 120 s, 12.9 GB
(h5 only) 160 s; the whole run stays within `--budget` seconds (default 540),
each step within what is left, the rest skipped with a line saying so.

The wheels: `.whl/*.whl` are installed; `.whl/fallback/*.whl` (Orbax's own
dependencies) only for the modules the image lacks.

`--smoke` runs the same command at bench_restore's `--smoke` size on
whatever devices the machine has (CPU here), installing nothing: the test
suite runs it so the script cannot rot.

Usage:
    python3 tools/bench_gpu.py --download           # here: wheels into .whl/
    python3 tools/bench_gpu.py [--workdir DIR]      # on the accelerator machine
    # with the device tool (it copies the session's main checkout, so commit or
    # copy there first):  run(command="python3 tools/bench_gpu.py",
    #                         carry=[".whl"], timeout_s=570)
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

FALLBACK = {
    # module -> wheel name: Orbax's dependencies, installed only where the image lacks them.
    "etils": "etils", "msgpack": "msgpack", "prometheus_client": "prometheus_client", "yaml": "pyyaml",
    "aiofiles": "aiofiles", "google.protobuf": "protobuf", "humanize": "humanize", "simplejson": "simplejson",
    "uvloop": "uvloop", "packaging": "packaging", "typing_extensions": "typing_extensions", "fsspec": "fsspec",
    "importlib_resources": "importlib_resources", "zipp": "zipp",
}

SIZES = [
    # (name, bench_restore arguments, seconds it may take): the model, then one 3x larger.
    ("4.3 GB", ["--dim", "4096", "--blocks", "8", "--formats", "h5,orbax,safetensors,orbax-crc32c"], 220.0),
    ("12.9 GB", ["--dim", "4096", "--blocks", "24", "--formats", "h5,safetensors"], 240.0),
]
SMOKE_SIZES = [("smoke", ["--smoke", "--formats", "h5,orbax,safetensors,orbax-crc32c"], 300.0)]
SAVE = ["--params", "2e8", "--steps", "60", "--save-every", "30", "--only",
        "keras_sync,keras_async,shardckpt_auto,shardckpt_host"]
SMOKE_SAVE = ["--smoke", "--only", "keras_sync,shardckpt_auto"]  # the wiring only: test_bench_save runs the rest
TRANSFER = ["--mb", "4096", "--arrays", "16"]


def download() -> int:
    """Fetches the wheels into `.whl/` and `.whl/fallback/` (run where a registry can be reached)."""
    os.makedirs(WHEELS, exist_ok=True)
    print("$ " + " ".join(DOWNLOAD), flush=True)
    code = subprocess.call([sys.executable, "-m", *DOWNLOAD], cwd=ROOT)
    fallback = [*DOWNLOAD[: DOWNLOAD.index("-d")], "-d", os.path.join(".whl", "fallback"), *sorted(set(FALLBACK.values()))]
    print("$ " + " ".join(fallback), flush=True)
    return code or subprocess.call([sys.executable, "-m", *fallback], cwd=ROOT)


def install(site: str) -> None:
    """Installs `.whl/*.whl` into `site`, from those files alone."""
    wheels = sorted(glob.glob(os.path.join(WHEELS, "*.whl")))
    if not wheels:
        raise SystemExit(f"No wheels in {WHEELS}: run `python3 tools/bench_gpu.py --download` first, where pip can reach PyPI.")
    subprocess.check_call(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", site, *wheels]
    )
    env = environment(site, smoke=False)
    for module, wheel in FALLBACK.items():
        if subprocess.call([sys.executable, "-c", f"import {module}"], env=env, stderr=subprocess.DEVNULL) == 0:
            continue
        found = sorted(glob.glob(os.path.join(WHEELS, "fallback", f"{wheel}-*.whl")))
        if not found:
            raise SystemExit(f"The image lacks {module} and .whl/fallback has no {wheel} wheel: run "
                             "`python3 tools/bench_gpu.py --download` again.")
        print(f"installing {os.path.basename(found[-1])} (the image lacks {module})", flush=True)
        subprocess.check_call(
            [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", site, found[-1]]
        )


def environment(site: str | None, smoke: bool) -> dict[str, str]:
    env = dict(os.environ)
    paths = [p for p in (site, ROOT, env.get("PYTHONPATH")) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["KERAS_BACKEND"] = "jax"
    if not smoke:
        env.setdefault("JAX_PLATFORMS", "cuda")
    return env


def run_step(name: str, command: list[str], env: dict[str, str], limit: float, out: str | None) -> dict:
    """One tool run in a fresh process, stopped after `limit` seconds; its output is printed
    (and kept under `out`). Returns its RESULT (empty if none), exit code and seconds."""
    print(f"\n== {name}: {' '.join(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c for c in command[1:])} "
          f"(at most {limit:.0f} s)", flush=True)
    start = time.perf_counter()
    try:
        done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=limit)
        text, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        text += f"\n{name}: stopped after {limit:.0f} s\n"
        code = 124
    seconds = time.perf_counter() - start
    shown = [line for line in text.splitlines()
             if not line.startswith("RESULT ") and "UserWarning" not in line and not line.startswith("WARNING:absl")]
    print("\n".join(shown), flush=True)
    print(f"{name}: {seconds:.0f} s, exit {code}", flush=True)
    results = [line[len("RESULT "):] for line in text.splitlines() if line.startswith("RESULT ")]
    result = json.loads(results[-1]) if results else {}
    if out:
        stem = name.replace(" ", "_")
        with open(os.path.join(out, f"{stem}.txt"), "w") as f:
            f.write(text)
        with open(os.path.join(out, f"{stem}.json"), "w") as f:
            json.dump(result, f, indent=1)
    return {"seconds": seconds, "exit": code, "result": result}


def restore_rows(result: dict) -> list[dict]:
    """bench_restore's rows, each load with its GB/s (what the issue's table asks beside it)."""
    rows = result.get("rows", []) if isinstance(result, dict) else []
    for row in rows:
        if row.get("load_s"):
            row["load_gb_per_s"] = row["state_gb"] / row["load_s"]
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--download", action="store_true", help="fetch the wheels into .whl/ and stop")
    parser.add_argument("--smoke", action="store_true", help="every step at its --smoke size, on this machine, "
                        "no install")
    parser.add_argument("--workdir", default=None, help="where the checkpoints go (default: a temporary folder)")
    parser.add_argument("--budget", type=float, default=540.0, help="seconds the whole run may take")
    args = parser.parse_args()
    if args.download:
        return download()
    out = os.environ.get("OUT")
    if out:
        out = os.path.join(out, "bench_gpu")
        os.makedirs(out, exist_ok=True)
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench_gpu_")
    start = time.perf_counter()
    failed = []
    try:
        site = None
        if not args.smoke:
            site = os.path.join(workdir, "site")
            install(site)
        env = environment(site, args.smoke)
        smoke = ["--smoke"] if args.smoke else []
        save_json = os.path.join(out or workdir, "save.json")
        python = sys.executable
        steps: list[tuple[str, list[str], float]] = [
            ("transfer", [python, os.path.join(ROOT, "tools", "bench_transfer.py"), *(smoke or TRANSFER)], 60.0)]
        sizes = SMOKE_SIZES if args.smoke else SIZES
        for i, (name, extra, limit) in enumerate(sizes):
            folder = os.path.join(workdir, name.replace(" ", "_"))
            steps.append((name, [python, BENCH, "--repeat", "1", "--workdir", folder, *extra], limit))
            if i == 0:  # the saves after the first size: both issues' figures before the long one
                steps.append(("saves every 30", [python, os.path.join(ROOT, "tools", "bench_save.py"),
                                                 *(SMOKE_SAVE if args.smoke else SAVE), "--workdir",
                                                 os.path.join(workdir, "save"), "--json", save_json],
                              300.0 if args.smoke else 150.0))
        done: dict[str, dict] = {}
        for name, command, limit in steps:
            left = args.budget - (time.perf_counter() - start)
            if left < 30:
                print(f"\n== {name}: skipped ({left:.0f} s of --budget left)", flush=True)
                continue
            done[name] = run_step(name, command, env, min(limit, left), out)
            if done[name]["exit"] != 0:
                failed.append(name)
            for folder in (os.path.join(workdir, name.replace(" ", "_")), os.path.join(workdir, "save")):
                shutil.rmtree(folder, ignore_errors=True)  # the next step needs the disk
        if "saves every 30" in done and os.path.exists(save_json):  # bench_save's figures: in a file
            with open(save_json) as f:
                done["saves every 30"]["result"] = json.load(f)
        sizes_done = {name: {"seconds": done[name]["seconds"], "rows": restore_rows(done[name]["result"])}
                      for name, _, _ in sizes if name in done}
        print(f"\nbench_gpu: {time.perf_counter() - start:.0f} s in all" +
              (f"; failed: {', '.join(failed)}" if failed else ""), flush=True)
        print("RESULT " + json.dumps({
            "sizes": sizes_done,
            "save": done.get("saves every 30", {}).get("result", {}),
            "transfer": done.get("transfer", {}).get("result", []),
            "failed": failed,
        }), flush=True)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
