"""What the benchmarks in tools/ share: one `main`, JAX set-up, cells in fresh processes, memory, disk.

Memory is `RssAnon` from /proc/self/status: pages of memory-mapped checkpoint
files are reclaimable page cache and would inflate plain RSS.

Every bench has a `--smoke` size that `tests/test_bench_smoke.py` runs, so
the scripts cannot rot; smoke figures mean nothing. A smoke runs its cells
(`run_child`) one after another in one shared child process per script
(`share_children`), so a smoke pays one Python, JAX and Keras start-up
instead of one per cell; the real bench runs each cell in a fresh process.
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

TOOLS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TOOLS)
RESULT = "RESULT "  # a child's last line starting with this holds its JSON result
DONE = "CHILD-DONE "  # a shared child's line after each command: its exit status
SHARED_DEVICES = 8  # CPU devices of a shared child: the most any bench's cell asks for
_shared: dict[str, subprocess.Popen] = {}  # script -> its shared child (`share_children`)
_sharing = False

# The Llama 3 backbone that bench_preset and bench_export measure:
# option -> (keras-hub's LlamaBackbone argument, default, --smoke value).
LLAMA_SIZE = {
    "layers": ("num_layers", 6, 1),
    "hidden": ("hidden_dim", 2048, 64),
    "intermediate": ("intermediate_dim", 5632, 128),
    "heads": ("num_query_heads", 16, 8),
    "kv_heads": ("num_key_value_heads", 4, 2),
    "vocab": ("vocabulary_size", 32000, 128),
}
LLAMA_SMOKE = {name: smoke for name, (_, _, smoke) in LLAMA_SIZE.items()}


def llama_options(parser: argparse.ArgumentParser) -> None:
    """Adds the Llama size options (`LLAMA_SIZE`): --layers, --hidden, ..."""
    for name, (_, default, _) in LLAMA_SIZE.items():
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=default)


def llama_argv(args: argparse.Namespace) -> list[str]:
    """The Llama size options of `args`, as a child's command line."""
    return [word for name in LLAMA_SIZE for word in ("--" + name.replace("_", "-"), str(getattr(args, name)))]


def llama_config(args: argparse.Namespace) -> dict[str, int]:
    """keras-hub's `LlamaBackbone` arguments for the Llama size options of `args`."""
    return {argument: getattr(args, name) for name, (argument, _, _) in LLAMA_SIZE.items()}


def setup_jax(devices: int, *, cpu_only: bool = True) -> None:
    """Puts this checkout first on the path and asks for `devices` simulated CPU devices.

    Call before JAX starts its backend (before the first device use).
    `cpu_only=False` keeps accelerators visible (restore on a GPU).
    """
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    os.environ.setdefault("KERAS_BACKEND", "jax")
    from shardckpt.cli.devices import simulate_cpu_devices

    simulate_cpu_devices(devices, cpu_only=cpu_only)


def main(
    doc: str | None,
    *,
    options: Callable[[argparse.ArgumentParser], None],
    children: dict[str, tuple[int | None, Callable[..., Any]]],
    run: Callable[[argparse.Namespace], None],
    smoke: dict[str, Any] | Callable[[argparse.Namespace], None],
    prefix: str,
    repeat: int | None = 1,
    reuse: bool = False,
    argv: Sequence[str] | None = None,
) -> None:
    """The `main` every bench shares: its options, `--workdir`, `--smoke`, child commands, a workdir.

    Args:
        doc: The bench's module docstring (its `--help`).
        options: Adds the bench's own options to the parser.
        children: Hidden flags of the child commands a bench runs in fresh
            processes (`run_child`): `"--_run": (nargs, function)`, nargs 0
            for a plain flag. The function gets `args` and the flag's values;
            what it returns (unless None) is `emit`ted.
        run: The bench itself (the parent), given `args.workdir`.
        smoke: Values of the `--smoke` size (or a function that sets them).
        prefix: Of the temporary workdir made when `--workdir` is not given
            (removed at the end).
        repeat: The default of `--repeat` (runs per cell; None: no such option).
        reuse: Offer `--reuse` (the files already in `--workdir` are used).
        argv: The arguments (None: `sys.argv`).
    """
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    options(parser)
    if repeat is not None:
        parser.add_argument("--repeat", type=int, default=repeat, help="runs per cell; the best is shown")
    if reuse:
        parser.add_argument("--reuse", action="store_true", help="reuse the files already in --workdir")
    parser.add_argument("--workdir", default=None, help="where files go (default: a temporary folder, removed after)")
    parser.add_argument("--smoke", action="store_true", help="a tiny size that checks the script (tests run it)")
    for flag, (nargs, _) in children.items():
        if nargs == 0:
            parser.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
        else:
            parser.add_argument(flag, nargs=nargs, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        share_children()
        if callable(smoke):
            smoke(args)
        else:
            vars(args).update(smoke)
    for flag, (_, function) in children.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is None or value is False:
            continue
        values = [] if value is True else value if isinstance(value, list) else [value]
        result = function(args, *values)
        if result is not None:
            emit(result)
        return
    own = args.workdir is None
    args.workdir = args.workdir or tempfile.mkdtemp(prefix=prefix)
    os.makedirs(args.workdir, exist_ok=True)
    try:
        run(args)
    finally:
        close_children()  # before the workdir goes: a shared child may hold its files open
        if own:
            shutil.rmtree(args.workdir, ignore_errors=True)


def emit(result: dict[str, Any]) -> None:
    """Prints a child's result for `run_child`."""
    print(RESULT + json.dumps(result), flush=True)


def run_child(script: str, *args: str) -> dict[str, Any]:
    """Runs `python script *args` in a fresh process and returns what it `emit`ted.

    Dirty pages of earlier cells are flushed first, so that no cell pays for
    another's writeback. After `share_children`, the command runs in the
    script's shared child instead.

    Raises:
        SystemExit: the child failed (its output's tail is shown).
    """
    os.sync()
    if _sharing:
        status, out, err = _run_shared(script, args)
    else:
        proc = subprocess.run([sys.executable, script, *args], capture_output=True, text=True)
        status, out, err = proc.returncode, proc.stdout, proc.stderr
    if status != 0:
        raise SystemExit(f"child {args} failed:\n{out[-3000:]}\n{err[-3000:]}")
    lines = [line for line in out.splitlines() if line.startswith(RESULT)]
    if not lines:
        raise SystemExit(f"child {args} printed no result:\n{out[-3000:]}")
    return json.loads(lines[-1][len(RESULT):])


def share_children() -> None:
    """From now on `run_child` runs every command of a script in one child process (`--smoke`).

    Each command still runs through the script's own `main` with its own
    arguments, after Keras' global state is reset, so every cell's code runs;
    the child has `SHARED_DEVICES` CPU devices (a cell that asks for fewer
    runs on device 0 of them). Figures of shared cells are not comparable.
    """
    global _sharing
    if not _sharing:
        _sharing = True
        atexit.register(close_children)


def close_children() -> None:
    """Ends the shared children (end of input makes each return)."""
    while _shared:
        _, proc = _shared.popitem()
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait()


def _run_shared(script: str, args: Sequence[str]) -> tuple[int, str, str]:
    proc = _shared.get(script)
    if proc is None:
        env = dict(os.environ)  # as set now: a bench may have set endpoints for its children
        flags = env.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={SHARED_DEVICES}".strip()
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", script], env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        _shared[script] = proc
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps(list(args)) + "\n")
    proc.stdin.flush()
    out = []
    for line in proc.stdout:
        if line.startswith(DONE):
            return int(line[len(DONE):]), "".join(out), ""
        out.append(line)
    del _shared[script]
    return proc.wait() or 1, "".join(out), "the shared child ended (its stderr is above)"


def _serve(script: str) -> None:
    """The shared child: runs `script`'s `main` once per line of JSON arguments on stdin."""
    spec = importlib.util.spec_from_file_location("bench_child", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for line in sys.stdin:
        if "keras" in sys.modules:  # no distribution, names or graphs left by the previous cell
            keras = sys.modules["keras"]
            keras.distribution.set_distribution(None)
            keras.backend.clear_session()
        sys.argv = [script, *json.loads(line)]
        try:
            module.main()
            status = 0
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
            if e.code is not None and not isinstance(e.code, int):
                print(e.code, flush=True)
        except Exception:
            traceback.print_exc(file=sys.stdout)
            status = 1
        print(f"{DONE}{status}", flush=True)


def du(path: str) -> int:
    """Bytes of all files under `path` (or of the file `path`)."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def cpu_seconds() -> float:
    """User + system CPU seconds of this process so far, all threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def rss_anon() -> int:
    """Anonymous resident bytes of this process (0 where /proc is missing)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class PeakSampler:
    """Samples `rss_anon()` every `interval` seconds in a thread; `.peak` is the max."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.peak = rss_anon()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_anon())
            time.sleep(self.interval)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_anon())


def warm_memory(nbytes: int) -> None:
    """Touches and frees `nbytes` of anonymous memory.

    Some VMs (this project's Firecracker sandboxes) back guest memory lazily
    and take freed pages back within seconds; a page touched for the first
    time since then costs a host fault. Touching 1.6 GB took 0.2-0.3 s
    right after another process freed memory and 2.8 s a few seconds later,
    so a timed load's result depended on how long the process had been idle.
    Calling this just before each timed section gives every loader the same
    (warm) memory, as on a machine whose memory is backed for good.
    """
    import numpy as np

    block = np.ones(nbytes, np.uint8)  # np.ones writes every page
    del block


THEN = "2026-11-23"
"""The date of the figures every bench prints its own beside (issue 27's table)."""


def print_then_vs_now(rows: Sequence[tuple[str, str, str, str, str]]) -> None:
    """Prints each figure of this run beside its earlier values and its goal.

    Args:
        rows: `(figure, 2026-11-23 value, value when issue 27 was filed,
            this run's value, goal)`, as text; the earlier values are the
            issue's (2 cores, quiet machine, 1.6 GB model), so they compare
            with a run at the bench's default size.
    """
    header = ("figure", THEN, "issue 27 (11-24)", "this run", "goal")
    widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
    print("\nthen vs now:")
    for row in (header, *rows):
        print("  " + "  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)))


if __name__ == "__main__" and sys.argv[1:2] == ["--serve"]:
    _serve(sys.argv[2])
