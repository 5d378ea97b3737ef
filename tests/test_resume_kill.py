"""SIGKILL a training run at random moments, resume it, compare bit for bit.

Each trial starts a run of `_train_worker.py` (forked from one warm server
process, to pay the jax/keras import once), kills it with SIGKILL after a
random number of batches or just after a background save was dispatched,
reruns it in the same directory with `resume=True`, and compares every
variable (model, optimizer, metrics, seed generator), its sharding, and the
data iterator's final position with a run that was never interrupted.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

WORKER = os.path.join(os.path.dirname(__file__), "_train_worker.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EPOCHS, STEPS = 3, 6
TIMEOUT = 120


class Server:
    """The fork server: one warm interpreter, one child run at a time."""

    def __init__(self, log_path: str) -> None:
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("XLA_FLAGS", None)  # the worker sets its own 8 devices
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, WORKER, "serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.log, text=True, env=env, cwd=ROOT,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    def _expect(self, prefix: str) -> list[str]:
        deadline = time.monotonic() + TIMEOUT
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"worker server gave no {prefix!r} line in {TIMEOUT} s") from None
            if line.startswith(prefix + " "):
                return line.split()[1:]

    def start(self, args: dict) -> int:
        self.proc.stdin.write(json.dumps(args) + "\n")
        self.proc.stdin.flush()
        return int(self._expect("pid")[0])

    def wait(self, pid: int) -> int:
        got_pid, code = self._expect("exit")
        assert int(got_pid) == pid
        return int(code)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        self.log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    srv = Server(str(log))
    yield srv
    srv.close()


def _progress(path: str) -> list[str]:
    try:
        with open(path) as f:
            return f.read().split("\n")
    except FileNotFoundError:
        return []


def _wait_for_line(path: str, line: str, pid: int) -> bool:
    """Waits until the child wrote `line`; False if it did not in time."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        if line in _progress(path):
            return True
        time.sleep(0.002)
    return False


def _args(tmp, name: str, save_freq, cache: str) -> dict:
    return {
        "dir": str(tmp / f"{name}_ckpt"),
        "out": str(tmp / f"{name}_out"),
        "progress": str(tmp / f"{name}.progress"),
        "save_freq": save_freq,
        "epochs": EPOCHS,
        "steps": STEPS,
        "max_to_keep": 2,
        "cache": cache,
    }


def _load(out: str) -> tuple[dict[str, np.ndarray], dict]:
    with np.load(out + ".npz") as z:
        arrays = {k: z[k] for k in z.files}
    with open(out + ".json") as f:
        return arrays, json.load(f)


def _compare(arrays, info, ref_arrays, ref_info, label: str) -> None:
    """Every variable, its dtype and sharding, the iterator position and logs."""
    assert sorted(arrays) == sorted(ref_arrays)
    for key, expected in ref_arrays.items():
        np.testing.assert_array_equal(arrays[key], expected, err_msg=f"{label}: {key}")
        assert arrays[key].dtype == expected.dtype, key
    assert info["shardings"] == ref_info["shardings"]
    assert info["iterator"] == ref_info["iterator"], f"{label}: iterator position"
    assert info["history"], f"{label}: the resumed run trained no epoch"
    for epoch, logs in info["history"].items():
        assert logs == ref_info["history"][epoch], f"{label}: epoch {epoch} logs"
    # The stored layout is the one asked for (not replicated by accident).
    assert info["shardings"]["trainable_variables/up/kernel"] == "P(None, 'model')"


def _kill_trials(server, tmp_path, save_freq, trials: int, seed: int, data: str | None = None) -> dict:
    """Runs the reference, then `trials` SIGKILL-and-resume runs; returns counts."""
    cache = str(tmp_path / "jax_cache")
    ref = dict(_args(tmp_path, "ref", save_freq, cache), data=data)
    pid = server.start(ref)
    assert server.wait(pid) == 0, "the uninterrupted run failed; see the server log"
    ref_arrays, ref_info = _load(ref["out"])
    assert ref_info["resumed_step"] is None

    rng = np.random.default_rng(seed)
    total = EPOCHS * STEPS
    counts = {"killed": 0, "during_save": 0, "mid_epoch": 0}
    for trial in range(trials):
        args = dict(_args(tmp_path, f"t{trial}", save_freq, cache), data=data)
        pid = server.start(args)
        if trial % 2 == 0:
            # Right after a save was dispatched: the write is still running.
            saves = total // save_freq if save_freq != "epoch" else EPOCHS
            marker = f"s {int(rng.integers(1, saves))}"
            delay = rng.uniform(0.0, 0.03)
        else:
            marker = f"b {int(rng.integers(1, total))}"
            delay = rng.uniform(0.0, 0.05)
        if _wait_for_line(args["progress"], marker, pid):
            time.sleep(delay)
            os.kill(pid, signal.SIGKILL)
        code = server.wait(pid)
        if code == -signal.SIGKILL:
            counts["killed"] += 1
            names = os.listdir(args["dir"]) if os.path.isdir(args["dir"]) else []
            counts["during_save"] += any(".orbax-checkpoint-tmp" in n for n in names)

        pid = server.start(args)  # same directory: resumes
        assert server.wait(pid) == 0, f"trial {trial}: the resumed run failed; see the server log"
        arrays, info = _load(args["out"])
        # Half-written steps of the killed run were removed, none was restored.
        assert not [n for n in os.listdir(args["dir"]) if ".orbax-checkpoint-tmp" in n]
        if info["resumed_step"] is not None and not info["resumed_epoch_complete"]:
            counts["mid_epoch"] += 1
        _compare(arrays, info, ref_arrays, ref_info, f"trial {trial} ({marker})")
    return counts


@pytest.mark.parametrize("save_freq", [4, "epoch"], ids=["mid_epoch_every_4_batches", "every_epoch"])
def test_sigkill_and_resume_is_bit_exact(server, tmp_path, save_freq):
    """5 SIGKILL trials per save mode (10 in all), each resumed to the end."""
    counts = _kill_trials(server, tmp_path, save_freq, 5, 2026 if save_freq == 4 else 2027)
    print(f"save_freq={save_freq}: {counts}")
    assert counts["killed"] >= 4, "most trials must really be killed"
    assert counts["during_save"] >= 1, "at least one kill must land during a background save"
    if save_freq == 4:
        assert counts["mid_epoch"] >= 1, "at least one resume must start in the middle of an epoch"


def test_sigkill_and_resume_grain_dataloader_is_bit_exact(server, tmp_path):
    """A grain.DataLoader pipeline (IndexSampler, bytes state): 3 SIGKILL trials."""
    counts = _kill_trials(server, tmp_path, 4, 3, 2028, data="grain")
    print(f"grain DataLoader: {counts}")
    assert counts["killed"] >= 2, "most trials must really be killed"
    assert counts["mid_epoch"] >= 1, "at least one resume must start in the middle of an epoch"
