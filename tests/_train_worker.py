"""Training subprocess for the kill-and-resume tests of `OrbaxCheckpoint`.

Two modes:

* `python _train_worker.py run '<json>'`: one training run.
* `python _train_worker.py serve`: a fork server. jax and keras are imported
  once (no device touched, so forking is safe); each JSON line on stdin forks
  a child that does one run. The server prints `pid N` when a child starts
  and `exit N CODE` when it ends (CODE -9: killed by SIGKILL). This saves an
  interpreter start per run, which matters for ten kill trials on two cores.

A run trains a small model on a (2, 4) mesh of 8 CPU devices with fixed seeds,
from a deterministic data iterator fed through `OrbaxCheckpoint.batches()`.
It appends "b <batches>" to `progress` after every batch ("s <step>" after a
save is dispatched), and when it finishes writes every variable's value to
`out` (.npz, no pickle) and a JSON with shardings and the iterator state.
"""

from __future__ import annotations

import json
import os
import signal
import sys

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # (The 2-process test imports this module after choosing 4 devices.)
    from tests.mp import FAST_COMPILE  # imports no jax

    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count=8 {FAST_COMPILE}"
    ).strip()
os.environ["KERAS_BACKEND"] = "jax"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import shardckpt.training  # noqa: E402

N_EXAMPLES = 96
BATCH = 16


class ShuffledIterator:
    """An endless iterator over a fixed data set, reshuffled per pass.

    Its whole position is `{"pass": p, "index": i}`, so `set_state` restores it
    exactly (as grain's iterators do).
    """

    def __init__(self, seed: int = 7) -> None:
        rng = np.random.default_rng(seed)
        self.x = rng.standard_normal((N_EXAMPLES, 12)).astype("float32")
        self.y = (self.x[:, :3].sum(axis=1, keepdims=True) > 0).astype("float32")
        self.seed = seed
        self.state = {"pass": 0, "index": 0}

    def _order(self, p: int) -> np.ndarray:
        return np.random.default_rng(self.seed * 1000 + p).permutation(N_EXAMPLES)

    def __iter__(self) -> ShuffledIterator:
        return self

    def __next__(self) -> tuple[np.ndarray, np.ndarray]:
        p, i = self.state["pass"], self.state["index"]
        if i + BATCH > N_EXAMPLES:
            p, i = p + 1, 0
        idx = self._order(p)[i : i + BATCH]
        self.state = {"pass": p, "index": i + BATCH}
        return self.x[idx], self.y[idx]

    def get_state(self) -> dict:
        return dict(self.state)

    def set_state(self, state: dict) -> None:
        self.state = {"pass": int(state["pass"]), "index": int(state["index"])}


class _Records:
    """A grain data source: record i is (x[i], y[i]) of `ShuffledIterator`'s data."""

    def __init__(self) -> None:
        data = ShuffledIterator()
        self.x, self.y = data.x, data.y

    def __len__(self) -> int:
        return N_EXAMPLES

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return self.x[i], self.y[i]

    def __repr__(self) -> str:
        # grain checks a restored state against repr(data_source).
        return f"_Records(n={N_EXAMPLES})"


def grain_loader_iterator():
    """A `grain.DataLoader` iterator (shuffling IndexSampler, endless, batched).

    Its `get_state()` returns bytes, which the checkpoint must keep exactly.
    Workers stay in-process (worker_count=0): the runs are forked children.
    """
    import grain.python as gp

    sampler = gp.IndexSampler(num_records=N_EXAMPLES, shard_options=gp.NoSharding(), shuffle=True,
                              num_epochs=None, seed=7)
    loader = gp.DataLoader(data_source=_Records(), sampler=sampler,
                           operations=[gp.Batch(BATCH, drop_remainder=True)], worker_count=0)
    return iter(loader)


def build_model() -> keras.Model:
    inputs = keras.Input((12,), name="x")
    h = keras.layers.Dense(32, activation="relu", name="up")(inputs)
    h = keras.layers.BatchNormalization(name="norm")(h)
    h = keras.layers.Dropout(0.25, name="drop")(h)
    outputs = keras.layers.Dense(1, name="down")(h)
    model = keras.Model(inputs, outputs, name="tiny")
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
    return model


def layout() -> keras.distribution.ModelParallel:
    mesh = keras.distribution.DeviceMesh((2, 4), ["data", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["up/kernel"] = (None, "model")
    layout_map["up/bias"] = ("model",)
    layout_map["down/kernel"] = ("model", None)
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="data")


def groups(model: keras.Model) -> dict[str, list]:
    """The model's variables by state-tree group (the keys of an OrbaxCheckpoint step)."""
    return {
        "trainable_variables": model.trainable_variables,
        "non_trainable_variables": model.non_trainable_variables,
        "optimizer_variables": model.optimizer.variables,
        "metrics_variables": model.metrics_variables,
    }


def fresh_model(seed: int) -> tuple[keras.Model, keras.distribution.ModelParallel]:
    """A new session, `layout()` for a multi-process run (each process feeds its own numpy batches), a model."""
    keras.backend.clear_session()
    distribution = layout()
    distribution.auto_shard_dataset = False
    keras.distribution.set_distribution(distribution)
    keras.utils.set_random_seed(seed)
    return build_model(), distribution


class AtBatch(keras.callbacks.Callback):
    """Calls `action(model)` at the end of batch `n` of a fit (counted from 1 across epochs)."""

    def __init__(self, n: int, action) -> None:
        super().__init__()
        self.n, self.seen, self.action = n, 0, action

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.n:
            self.action(self.model)


def sigterm_at(n: int) -> AtBatch:
    """Sends this process a SIGTERM at the end of batch `n` (from 1)."""
    return AtBatch(n, lambda model: os.kill(os.getpid(), signal.SIGTERM))


class Progress(keras.callbacks.Callback):
    def __init__(self, path: str, ckpt: shardckpt.training.OrbaxCheckpoint) -> None:
        super().__init__()
        self.file = open(path, "a", buffering=1)
        self.ckpt = ckpt
        self.batches = 0
        self.saves = 0

    def _note_saves(self) -> None:
        while self.saves < len(self.ckpt.save_blocking_s):
            self.saves += 1
            self.file.write(f"s {self.saves}\n")

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1
        self._note_saves()
        self.file.write(f"b {self.batches}\n")

    def on_epoch_end(self, epoch, logs=None):
        self._note_saves()


_REMOVALS = ("os.remove", "os.rmdir")
LOG_LINES: list[str] = []
"""What shardckpt logged in this run (INFO and up), written to the `out` JSON as "log"."""


def kill_at(fault: dict) -> None:
    """SIGKILLs this process at a chosen file operation (an audit hook: a real kill, mid-operation).

    `fault` keys:

    * `on`: "rmtree" (a folder's removal starts: Orbax's in-place delete,
      shardckpt's delete after its rename, a clean-up) or "rename" (a commit
      rename of Orbax's, or shardckpt's rename out of the committed set).
    * `match`: a regular expression searched in the folder's path (for
      "rename": its source path).
    * `nth`: the matching operation to act on (1: the first).
    * `after`: for "rmtree", the name of the file or folder whose removal
      completes before the kill; None: the kill comes before the first
      removal. For "rename": "before" (default) or "after" the rename.

    The kill itself happens at the next file operation's audit event, so the
    named removal (or the rename) has completed and nothing after it has.
    """
    import re

    pattern = re.compile(fault["match"])
    if fault["on"] == "bucket":
        _kill_at_bucket_call(fault, pattern)
        return
    state = {"seen": 0, "armed": False, "fire": False}

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def hook(event: str, event_args: tuple) -> None:
        if state["fire"] and (event in _REMOVALS or event in ("os.rename", "shutil.rmtree", "open")):
            die()
        if fault["on"] == "rmtree":
            if event == "shutil.rmtree" and not state["armed"] and pattern.search(os.fspath(event_args[0])):
                state["seen"] += 1
                if state["seen"] == fault.get("nth", 1):
                    state["armed"] = True
                    if fault.get("after") is None:
                        die()
            elif state["armed"] and event in _REMOVALS and os.path.basename(os.fspath(event_args[0])) == fault["after"]:
                state["fire"] = True
        elif event == "os.rename" and pattern.search(os.fspath(event_args[0])):
            state["seen"] += 1
            if state["seen"] == fault.get("nth", 1):
                if fault.get("after", "before") == "before":
                    die()
                state["fire"] = True

    sys.addaudithook(hook)


def _kill_at_bucket_call(fault: dict, pattern) -> None:
    """`kill_at` for buckets: object stores have no file operations to audit.

    `fault["call"]` names a `shardckpt.storage` function ("write_bytes",
    "delete_object", "delete_tree"); the process is killed "before" or
    "after" (`fault["when"]`) its `nth` call on a location whose URL matches.
    """
    from shardckpt import storage

    original = getattr(storage, fault["call"])
    seen = [0]

    def wrapped(location, *rest, **kwargs):
        hit = bool(pattern.search(location.url))
        if hit:
            seen[0] += 1
        fire = hit and seen[0] == fault.get("nth", 1)
        if fire and fault.get("when", "after") == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        result = original(location, *rest, **kwargs)
        if fire:
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    setattr(storage, fault["call"], wrapped)


def run(args: dict) -> None:
    """One training run; see the module docstring for `args` keys."""
    if args.get("fault"):
        kill_at(args["fault"])
    import logging

    class _Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            LOG_LINES.append(record.getMessage())

    logging.getLogger("shardckpt").addHandler(_Lines(logging.INFO))
    logging.getLogger("shardckpt").setLevel(logging.INFO)
    if args.get("cache"):
        jax.config.update("jax_compilation_cache_dir", args["cache"])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    keras.utils.set_random_seed(1234)
    keras.distribution.set_distribution(layout())
    model = build_model()
    data = grain_loader_iterator() if args.get("data") == "grain" else ShuffledIterator()
    arrays = args.get("data") == "arrays"  # fit shuffles numpy arrays itself: no mid-epoch resume
    ckpt = shardckpt.training.OrbaxCheckpoint(
        args["dir"],
        save_freq=args.get("save_freq", "epoch"),
        max_to_keep=args.get("max_to_keep", 2),
        data_iterator=data,
        metadata={"trial": args.get("trial", -1)},
        resume=True,
    )
    callbacks = [ckpt]
    if args.get("progress"):
        callbacks.append(Progress(args["progress"], ckpt))
    if arrays:
        x, y = data.x[: args.get("steps", 6) * BATCH], data.y[: args.get("steps", 6) * BATCH]
        model.fit(x, y, batch_size=BATCH, epochs=args.get("epochs", 4), callbacks=callbacks, verbose=0)
    else:
        model.fit(
            ckpt.batches(),
            steps_per_epoch=args.get("steps", 6),
            epochs=args.get("epochs", 4),
            callbacks=callbacks,
            verbose=0,
        )
    ckpt.wait_until_finished()
    dump(model, data, ckpt, args["out"])


def dump(model: keras.Model, data: ShuffledIterator, ckpt, out: str) -> None:
    arrays, shardings = {}, {}
    groups = {
        "trainable_variables": model.trainable_variables,
        "non_trainable_variables": model.non_trainable_variables,
        "optimizer_variables": model.optimizer.variables,
        "metrics_variables": model.metrics_variables,
    }
    for group, variables in groups.items():
        for v in variables:
            key = f"{group}/{v.path}"
            arrays[key] = np.asarray(v.value)
            shardings[key] = str(v.value.sharding.spec)
    np.savez(out + ".npz", **arrays)
    resumed = ckpt.resumed
    with open(out + ".json", "w") as f:
        json.dump(
            {
                "shardings": shardings,
                "iterator": shardckpt.training.iterators.encode_state(data.get_state()),
                "resumed_step": None if resumed is None else resumed.step,
                "resumed_epoch_complete": None if resumed is None else resumed.epoch_complete,
                "preempted_step": ckpt.preempted_step,
                "log": LOG_LINES,
                # Epoch-end logs of the epochs this fit ran (metrics restored
                # mid-epoch must give the same numbers as the unbroken run).
                "history": {str(e): {k: float(v[i]) for k, v in model.history.history.items()}
                            for i, e in enumerate(model.history.epoch)},
            },
            f,
        )


def serve() -> None:
    exited = None  # the last child, exited and not reaped yet
    for line in sys.stdin:
        if not line.strip():
            continue
        if exited is not None:
            os.waitpid(exited, 0)
            exited = None
        args = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                run(args)
            except BaseException:  # report, then leave without running parent cleanup
                import traceback

                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        print(f"pid {pid}", flush=True)
        # Waited for without reaping (WNOWAIT): the child stays a zombie until the next command,
        # so the test's `os.kill(pid, ...)`, sent after a delay that may outlast the run, hits it
        # and nothing else. Reaped at once, its pid went back to the pool (pid_max is 32768 here,
        # and XLA makes threads by the thousand): the kill then reached whatever took the number,
        # a thread of a pytest worker among them, whose whole process a kill of a thread id ends.
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        killed = info.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
        print(f"exit {pid} {-info.si_status if killed else info.si_status}", flush=True)
        exited = pid
    if exited is not None:
        os.waitpid(exited, 0)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve()
    else:
        run(json.loads(sys.argv[2]))
