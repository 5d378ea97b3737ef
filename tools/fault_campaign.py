"""Fault campaign: kills at random instants and at chosen file operations; every rerun exact.

Training trials run `tests/_train_worker.py` (a fork server: jax and keras
imported once) with `OrbaxCheckpoint(resume=True)`, `save_freq=2`,
`max_to_keep=2`, 3 epochs of 6 batches on 8 CPU devices, fed from numpy arrays
(fit shuffles; resume from the newest whole epoch) or from
`OrbaxCheckpoint.batches()` (resume mid-epoch):

- `sigkill`: SIGKILL at a uniformly random instant of the run;
- `delete`: SIGKILL right after a chosen entry of a chosen step's retention
  delete is removed (an audit hook in the child: `_train_worker.kill_at`);
- `sigterm`: SIGTERM at a random batch (the callback saves and stops fit).

Then `convert` (a `.keras` file -> an Orbax step) and `export` (a model ->
safetensors) children are SIGKILLed at a random instant of their writing (0-0.5 s
after their temporary folder appeared) and rerun.

Checked for every trial: after the kill, every integer-named step folder is
whole (nothing loads while incomplete) and `inspect` lists exactly those;
the rerun ends bit-equal to an uninterrupted run (every variable, its
sharding, the iterator position, the epoch logs); nothing half-written or
half-deleted is left (no `*.orbax-checkpoint-tmp*`, `*.shardckpt-deleting-*`,
`.<dst>.shardckpt-tmp-*`, `<dst>.shardckpt-partial`). Any failure stops the
campaign with a non-zero exit.

    python tools/fault_campaign.py                     # 20 / 5 / 10 / 5 / 5
    python tools/fault_campaign.py --sigkill 40 --seed 7
    python tools/fault_campaign.py --smoke             # 1 convert and 1 export kill (the suite runs it)

Prints one `RESULT {json}` line with the counts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.mp import FAST_COMPILE  # noqa: E402  (imports no jax)

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count=8 {FAST_COMPILE}").strip()
os.environ["KERAS_BACKEND"] = "jax"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

EPOCHS, STEPS, SAVE_FREQ = 3, 6, 2
DELETE_ENTRIES = ["_CHECKPOINT_METADATA", "commit_success.txt", "metrics", "shardckpt_metadata", "model_config",
                  "data_iterator", "_METADATA", "manifest.ocdbt", "pytree"]
"""Entries of a step after whose removal a `delete` trial kills (those the step has)."""
DELETED_STEPS = {"arrays": [2, 4, 6, 8, 10, 12, 14], "batches": [2, 4, 6, 8, 10, 12, 14]}
"""Steps retention deletes in an uninterrupted run of each input kind."""

_CONVERT = """
import sys, shardckpt
shardckpt.convert(sys.argv[1], sys.argv[2], max_inflight_bytes=256 * 1024, force=sys.argv[3:] == ["again"])
"""
_EXPORT = """
import sys, os
os.environ["KERAS_BACKEND"] = "jax"
import keras, numpy as np, shardckpt
model = keras.saving.load_model(sys.argv[1])
shardckpt.export(model, sys.argv[2], format="safetensors", max_inflight_bytes=256 * 1024,
                 overwrite=sys.argv[3:] == ["again"])
"""


class Campaign:
    def __init__(self, work: str, seed: int, *, kinds: tuple[str, ...] = ("arrays", "batches"),
                 warm_reference: bool = True, cache: str | None = None) -> None:
        self.work = work
        self.rng = np.random.default_rng(seed)
        self._server: Any = None
        self.cache = cache or os.path.join(work, "jax_cache")
        self.refs: dict[str, tuple] = {}
        self.durations: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.n = 0
        self.kinds = kinds
        self.warm_reference = warm_reference

    def kind(self) -> str:
        return self.kinds[self.n % len(self.kinds)]

    @property
    def server(self) -> Any:
        """The fork server of training runs, started by the first training trial."""
        if self._server is None:
            from tests.test_resume_kill import Server

            self._server = Server(os.path.join(self.work, "server.log"))
        return self._server

    def count(self, key: str, by: int = 1) -> None:
        self.counts[key] = self.counts.get(key, 0) + by

    # ---- training -------------------------------------------------------------

    def args(self, data: str, name: str) -> dict:
        base = os.path.join(self.work, name)
        return {"dir": base + "_ckpt", "out": base + "_out", "progress": base + ".progress", "save_freq": SAVE_FREQ,
                "epochs": EPOCHS, "steps": STEPS, "max_to_keep": 2, "cache": self.cache,
                "data": None if data == "batches" else data}

    def reference(self, data: str) -> tuple:
        from tests.test_resume_kill import _load

        if data not in self.refs:
            args = self.args(data, f"ref_{data}")
            start = time.perf_counter()
            code = self.server.wait(self.server.start(args))
            self.durations[data] = time.perf_counter() - start
            if code != 0:
                raise SystemExit(f"the uninterrupted {data} run failed; see {self.server.log.name}")
            self.refs[data] = _load(args["out"])
            if not self.warm_reference:
                return self.refs[data]
            # a second one, warm: the duration random kills are drawn over
            args = self.args(data, f"ref2_{data}")
            start = time.perf_counter()
            self.server.wait(self.server.start(args))
            self.durations[data] = time.perf_counter() - start
        return self.refs[data]

    def check_no_partial_step(self, root: str) -> None:
        import shardckpt
        from shardckpt.formats.orbax import ondisk

        if not os.path.isdir(root):
            return
        names = sorted(int(n) for n in os.listdir(root) if n.isdigit())
        for step in names:
            missing = ondisk.missing_part(os.path.join(root, str(step)))
            if missing:
                raise AssertionError(f"{root}/{step} is there but lacks {missing}: it would load while incomplete")
        if names and shardckpt.inspect(root).steps != names:
            raise AssertionError(f"inspect lists {shardckpt.inspect(root).steps}, the folders are {names}")

    def rerun_exact(self, data: str, args: dict, label: str) -> dict:
        from shardckpt.formats.orbax import ondisk
        from tests.test_resume_kill import _compare, _load

        left = ondisk.leftovers(args["dir"]) if os.path.isdir(args["dir"]) else []
        self.count("leftovers_after_kill", len(left))
        rerun = dict(args, fault=None)
        rerun.pop("sigterm_at", None)
        if self.server.wait(self.server.start(rerun)) != 0:
            raise AssertionError(f"{label}: the rerun failed; see {self.server.log.name}")
        arrays, info = _load(args["out"])
        ref_arrays, ref_info = self.reference(data)
        if not info["history"] and info["resumed_step"] == EPOCHS * STEPS:
            # The kill came after the last save: the rerun trains nothing (and says so). Its
            # weights must be the finished run's; fit's peek at the input moves the iterator.
            if not any("already complete" in line for line in info["log"]):
                raise AssertionError(f"{label}: the rerun trained nothing and did not say the run was complete")
            for key, expected in ref_arrays.items():
                np.testing.assert_array_equal(arrays[key], expected, err_msg=f"{label}: {key}")
            if info["shardings"] != ref_info["shardings"]:
                raise AssertionError(f"{label}: shardings differ")
            self.count("rerun_found_run_complete")
        else:
            _compare(arrays, info, ref_arrays, ref_info, label)
        if ondisk.leftovers(args["dir"]):
            raise AssertionError(f"{label}: left behind after the rerun: {ondisk.leftovers(args['dir'])}")
        for name, _ in left:
            if sum(f"removed {name} from" in line for line in info["log"]) != 1:
                raise AssertionError(f"{label}: no one log line for removing {name}: {info['log']}")
        self.count("exact")
        return info

    def sigkill(self) -> None:
        data = self.kind()
        self.reference(data)
        args = self.args(data, f"t{self.n}")
        self.n += 1
        delay = float(self.rng.uniform(0.0, self.durations[data]))
        pid = self.server.start(args)
        time.sleep(delay)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        code = self.server.wait(pid)
        self.count("sigkill_landed" if code == -signal.SIGKILL else "sigkill_after_end")
        self.check_no_partial_step(args["dir"])
        self.rerun_exact(data, args, f"SIGKILL at {delay:.2f} s ({data})")

    def delete(self) -> None:
        data = self.kind()
        self.reference(data)
        args = self.args(data, f"t{self.n}")
        self.n += 1
        step = int(self.rng.choice(DELETED_STEPS[data]))
        entry = str(self.rng.choice(DELETE_ENTRIES))
        args["fault"] = {"on": "rmtree", "match": rf"/{step}(\.shardckpt-deleting-[0-9a-f]+)?$", "after": entry}
        code = self.server.wait(self.server.start(args))
        if code != -signal.SIGKILL:
            raise AssertionError(f"the kill after {entry} of step {step}'s delete never fired (exit {code})")
        self.count("delete_killed")
        self.check_no_partial_step(args["dir"])
        self.rerun_exact(data, args, f"kill in the delete of step {step} after {entry} ({data})")

    def sigterm(self) -> None:
        from tests.test_resume_kill import _wait_for_line

        data = self.kind()
        self.reference(data)
        args = self.args(data, f"t{self.n}")
        self.n += 1
        batch = int(self.rng.integers(1, EPOCHS * STEPS - 1))
        pid = self.server.start(args)
        if _wait_for_line(args["progress"], f"b {batch}", pid):
            time.sleep(float(self.rng.uniform(0.0, 0.05)))
            os.kill(pid, signal.SIGTERM)
        if self.server.wait(pid) != 0:
            raise AssertionError("a SIGTERM must end the run cleanly")
        self.count("sigterm")
        self.check_no_partial_step(args["dir"])
        self.rerun_exact(data, args, f"SIGTERM after batch {batch} ({data})")

    # ---- convert and export ---------------------------------------------------

    def _source(self) -> tuple[str, dict[str, np.ndarray]]:
        src = os.path.join(self.work, "wide.keras")
        if not os.path.exists(src):
            import keras

            inputs = keras.Input((512,))
            model = keras.Model(inputs, keras.layers.Dense(2048, name="wide")(inputs))
            model.layers[1].kernel.assign(np.random.default_rng(0).standard_normal((512, 2048), dtype=np.float32))
            model.save(src)
        import keras

        model = keras.saving.load_model(src)
        return src, {v.path: np.asarray(v.value) for v in model.weights}

    def _child(self, code: str, *argv: str, kill_after: float | None, kill_once: str | None = None) -> tuple[int, str]:
        """Runs a child; SIGKILLs it `kill_after` seconds after its start, or (`kill_once`) at a random
        instant 0-0.5 s after a name starting with that path appeared: it is writing by then (a kill
        during the child's imports would test nothing)."""
        env = dict(os.environ, PYTHONPATH=ROOT)
        proc = subprocess.Popen([sys.executable, "-c", code, *argv], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        if kill_once is not None:
            parent, prefix = os.path.split(kill_once)
            while proc.poll() is None and not any(n.startswith(prefix) for n in os.listdir(parent)):
                time.sleep(0.005)
            kill_after = float(self.rng.uniform(0.0, 0.5))
        if kill_after is not None:
            try:
                proc.wait(timeout=kill_after)
            except subprocess.TimeoutExpired:
                proc.kill()
        _, err = proc.communicate(timeout=300)
        if proc.returncode not in (0, -signal.SIGKILL):
            raise AssertionError(f"child failed:\n{err[-2000:]}")
        return proc.returncode, err

    def convert(self) -> None:
        import keras

        import shardckpt
        from shardckpt.formats.orbax import ondisk

        src, weights = self._source()
        parent = os.path.join(self.work, f"convert{self.n}")
        self.n += 1
        os.makedirs(parent)
        dst = os.path.join(parent, "out")
        killed = self._child(_CONVERT, src, dst, kill_after=None, kill_once=os.path.join(parent, ".out."))[0] != 0
        self.count("convert_killed" if killed else "convert_finished_before_kill")
        if os.path.exists(dst):  # the kill came after the commit rename: whole
            shardckpt.inspect(dst)
        elif killed:
            self.count("convert_left_no_destination")
        temps = [n for n in os.listdir(parent) if ondisk.CONVERT_TMP_MARK in n]
        self.count("convert_temporaries_after_kill", len(temps))
        _, err = self._child(_CONVERT, src, dst, "again", kill_after=None)  # the next successful run
        for name in temps:
            if err.count(f"removed {os.path.join(parent, name)}:") != 1:
                raise AssertionError(f"convert: no one line for removing {name}:\n{err[-2000:]}")
        left = [n for n in os.listdir(parent) if n != "out"]
        if left:
            raise AssertionError(f"convert left {left} beside its destination after a successful rerun")
        model = keras.saving.load_model(src)
        shardckpt.load_sharded(model, dst)
        for v in model.weights:
            np.testing.assert_array_equal(np.asarray(v.value), weights[v.path])
        self.count("exact")

    def export(self) -> None:
        src, weights = self._source()
        parent = os.path.join(self.work, f"export{self.n}")
        self.n += 1
        os.makedirs(parent)
        dst = os.path.join(parent, "out")
        killed = self._child(_EXPORT, src, dst, kill_after=None, kill_once=dst + ".shardckpt-partial")[0] != 0
        self.count("export_killed" if killed else "export_finished_before_kill")
        if os.path.exists(dst):  # the kill came after the commit rename: whole
            self._same_values(dst, weights)
        elif killed:
            self.count("export_left_no_destination")
        partial = os.path.exists(dst + ".shardckpt-partial")
        self.count("export_partial_after_kill", partial)
        _, err = self._child(_EXPORT, src, dst, "again", kill_after=None)  # the next successful run
        if partial and err.count(f"removed {dst}.shardckpt-partial") != 1:
            raise AssertionError(f"export: no one line for removing the partial folder:\n{err[-2000:]}")
        left = [n for n in os.listdir(parent) if n != "out"]
        if left:
            raise AssertionError(f"export left {left} beside its destination after a successful rerun")
        self._same_values(dst, weights)
        self.count("exact")

    @staticmethod
    def _same_values(dst: str, weights: dict[str, np.ndarray]) -> None:
        from safetensors.numpy import load_file

        stored = load_file(os.path.join(dst, "model.safetensors"))
        if sorted(stored) != sorted(weights):
            raise AssertionError(f"export: keys {sorted(stored)}, the model has {sorted(weights)}")
        for key, value in weights.items():
            np.testing.assert_array_equal(stored[key], value, err_msg=f"export: {key}")

    def close(self) -> None:
        if self._server is not None:
            self._server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sigkill", type=int, default=20)
    parser.add_argument("--delete", type=int, default=5)
    parser.add_argument("--sigterm", type=int, default=10)
    parser.add_argument("--convert", type=int, default=5)
    parser.add_argument("--export", type=int, default=5)
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--smoke", action="store_true",
                        help="1 convert and 1 export kill (the suite runs it)")
    parser.add_argument("--work", default=None, help="folder for the runs (default: a temporary one)")
    parser.add_argument("--cache", default=None, help="a JAX compilation cache folder to share (default: in --work)")
    opts = parser.parse_args()
    if opts.smoke:
        opts.convert = opts.export = 1
        # tests/test_fault_injection.py kills training runs (deletes, commits, clean-ups) with the
        # same worker and checks; test_resume_kill / test_preemption kill and SIGTERM at random.
        opts.sigkill = opts.delete = opts.sigterm = 0
    work = opts.work or tempfile.mkdtemp(prefix="fault_campaign_")
    os.makedirs(work, exist_ok=True)
    campaign = Campaign(work, opts.seed, kinds=("arrays",) if opts.smoke else ("arrays", "batches"),
                        warm_reference=not opts.smoke, cache=opts.cache)
    start = time.perf_counter()
    try:
        for kind in ("sigkill", "delete", "sigterm", "convert", "export"):
            for i in range(getattr(opts, kind)):
                getattr(campaign, kind)()
                print(f"{kind} {i + 1}/{getattr(opts, kind)} exact", flush=True)
    finally:
        campaign.close()
    trials = opts.sigkill + opts.delete + opts.sigterm + opts.convert + opts.export
    result = {"trials": trials, "seconds": round(time.perf_counter() - start, 1), **dict(sorted(campaign.counts.items()))}
    if result.get("exact") != trials:
        raise SystemExit(f"not every trial was exact: {result}")
    print("RESULT " + json.dumps(result), flush=True)
    if opts.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
