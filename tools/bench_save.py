"""Checkpoint saving during `fit`: Keras' OrbaxCheckpoint (sync, async) vs shardckpt's snapshot modes.

The same training run, each in a fresh process: without checkpoints, with
`keras.callbacks.OrbaxCheckpoint(save_on_background=False)`, with Keras'
default (async) callback, and with `shardckpt.training.OrbaxCheckpoint` in each
snapshot mode ("device": an on-device copy; "host": pieces copied off the
devices into pinned host memory within a budget; "auto": the mode chosen from
`device.memory_stats()`). Every run saves the full state (weights, Adam slots,
metrics) every `--save-every` batches.

"Blocking" is the time the training thread spends inside the callback at a
save batch. Before the clock starts, the batch's results are awaited, so the
figure is the checkpoint's own cost and not the step's compute, for every
callback alike. The end of `fit` (waiting for the last background save) is
counted in the total fit time, not in the per-save figures.

"Background write" is a shardckpt save's own time on its worker thread
(snapshot handed over -> step committed, with training going on beside it);
"plain write" writes the same bytes (the state, copied off the devices) to
the same directory as one file, sequentially, fsynced, in the same process
before and after the run (the mean of the two): their ratio says how close a
background save comes to the disk's speed. "direct write" writes the same
file past the page cache (`O_DIRECT` from an aligned buffer, fsynced: the
disk's direct speed; buffered where the file system refuses `O_DIRECT`),
right after each plain write: the other baseline, printed beside it. A background save shares the
machine with training, the plain write does not: "plain beside training"
writes the same file on a thread while the same model trains on (after the
run, in the same process; `BESIDE_WRITES` writes, their mean), the
like-for-like baseline, and "ratio beside" is the background write over it.
"D2H" is the state's bytes over the time to copy it into host memory
("pinned_host" where the devices have it), after one warm-up copy; a
host-mode snapshot cannot block for less than state / D2H.

"Peak above state" is the most memory the run held above what it held when
`fit` started (the model, its optimizer state and the compiled step): on
devices that report `memory_stats()` (GPU, TPU), the largest
`peak_bytes_in_use - bytes_in_use` over the devices; on CPU, where device
memory is host memory, the process's peak `RssAnon` (sampled every 5 ms)
minus its value at the start. The "none" row is training's own share.

    python tools/bench_save.py                     # 50M parameters, Adam, 8 CPU devices
    python tools/bench_save.py --params 5e6 --steps 12 --save-every 4   # quick
    python tools/bench_save.py --smoke             # seconds; what the test runs
    JAX_PLATFORMS=cuda python tools/bench_save.py  # on the GPU(s)
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import threading
import time
from typing import Any

import _bench as bench
from _bench import PeakSampler, print_then_vs_now, rss_anon, run_child, setup_jax

setup_jax(8)  # 8 simulated CPU devices, before JAX starts its backend

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

from shardckpt.storage.direct import DirectWriter  # noqa: E402
from shardckpt.training import OrbaxCheckpoint  # noqa: E402

# Issue 27's figures for the default callback's blocking per save over Keras' synchronous save
# (default size, CPU, quiet machine): 2026-11-23, when the issue was filed, the goal.
BLOCKING_THEN, BLOCKING_ISSUE, BLOCKING_GOAL = "0.056 s = 2.5%", "0.131 s = 5.4%", "<= 2%"


class Timed(keras.callbacks.Callback):
    """Forwards every hook to `inner` and times the ones at save batches."""

    def __init__(self, inner: keras.callbacks.Callback, save_every: int) -> None:
        super().__init__()
        self.inner, self.save_every = inner, save_every
        self.batches = 0
        self.save_s: list[float] = []
        self.train_end_s = 0.0

    def set_model(self, model):
        super().set_model(model)
        self.inner.set_model(model)

    def set_params(self, params):
        super().set_params(params)
        self.inner.set_params(params)

    def on_train_begin(self, logs=None):
        self.inner.on_train_begin(logs)

    def on_epoch_begin(self, epoch, logs=None):
        self.inner.on_epoch_begin(epoch, logs)

    def on_epoch_end(self, epoch, logs=None):
        self.inner.on_epoch_end(epoch, logs)

    def on_train_batch_begin(self, batch, logs=None):
        self.inner.on_train_batch_begin(batch, logs)

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1
        if self.batches % self.save_every:
            self.inner.on_train_batch_end(batch, logs)
            return
        jax.block_until_ready(logs)  # the step's own compute is not the callback's
        start = time.perf_counter()
        self.inner.on_train_batch_end(batch, logs)
        self.save_s.append(time.perf_counter() - start)

    def on_train_end(self, logs=None):
        start = time.perf_counter()
        self.inner.on_train_end(logs)
        self.train_end_s = time.perf_counter() - start


def build(n_params: float, width: int) -> keras.Model:
    layers = max(1, round(n_params / (width * width + width)))
    inputs = keras.Input((width,), name="x")
    h = inputs
    for i in range(layers):
        h = keras.layers.Dense(width, activation="relu" if i < layers - 1 else None, name=f"d{i}")(h)
    model = keras.Model(inputs, h, name="bench")
    model.compile(optimizer="adam", loss="mse")
    return model


def distribution(n_params: float, width: int) -> keras.distribution.ModelParallel:
    count = jax.device_count()
    shape = (2, count // 2) if count >= 2 and count % 2 == 0 else (1, count)
    mesh = keras.distribution.DeviceMesh(shape, ["data", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layers = max(1, round(n_params / (width * width + width)))
    for i in range(layers):
        # Megatron-style: column-sharded then row-sharded kernels.
        layout_map[f"d{i}/kernel"] = (None, "model") if i % 2 == 0 else ("model", None)
        layout_map[f"d{i}/bias"] = ("model",) if i % 2 == 0 else (None,)
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="data")


CALLBACKS = {
    "none": None,
    "keras_sync": lambda d, every: keras.callbacks.OrbaxCheckpoint(d, save_freq=every, save_on_background=False),
    "keras_async": lambda d, every: keras.callbacks.OrbaxCheckpoint(d, save_freq=every, save_on_background=True),
    "shardckpt_device": lambda d, every: OrbaxCheckpoint(d, save_freq=every, snapshot="device"),
    "shardckpt_host": lambda d, every: OrbaxCheckpoint(d, save_freq=every, snapshot="host"),
    "shardckpt_auto": lambda d, every: OrbaxCheckpoint(d, save_freq=every, snapshot="auto"),
}


def _device_in_use() -> dict[str, int] | None:
    stats = [d.memory_stats() for d in jax.local_devices()]
    if any(not s for s in stats):
        return None
    return {str(i): int(s.get("bytes_in_use", 0)) for i, s in enumerate(stats)}


def _state_values(model: keras.Model) -> list[jax.Array]:
    return [v.value for v in model.variables] + [v.value for v in model.optimizer.variables]


def device_to_host(values: list[jax.Array]) -> tuple[list[np.ndarray], float]:
    """The state copied into host memory, and the seconds of the copy (after a warm-up)."""

    def copy() -> list[Any]:
        kinds = {m.kind for m in next(iter(values[0].sharding.device_set)).addressable_memories()}
        if "pinned_host" in kinds:
            out = jax.device_put(values, [v.sharding.with_memory_kind("pinned_host") for v in values])
        else:
            out = [jax.device_get(v) for v in values]
        return jax.block_until_ready(out)

    copy()
    start = time.perf_counter()
    out = copy()
    seconds = time.perf_counter() - start
    return [np.asarray(v) for v in out], seconds


def plain_write(arrays: list[np.ndarray], directory: str) -> float:
    """Seconds to write `arrays`' bytes as one file in `directory`, sequentially, fsynced."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "plain_write.bin")
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for a in arrays:
            f.write(memoryview(np.ascontiguousarray(a)).cast("B"))
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    os.remove(path)
    return seconds


def direct_write(arrays: list[np.ndarray], directory: str) -> float:
    """Seconds to write `arrays`' bytes as one file in `directory` past the page cache (`O_DIRECT`), fsynced."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "direct_write.bin")
    start = time.perf_counter()
    DirectWriter().write(path, (memoryview(np.ascontiguousarray(a)).cast("B") for a in arrays))
    seconds = time.perf_counter() - start
    os.remove(path)
    return seconds


BESIDE_WRITES = 2
"""Plain writes timed beside training, one after the other (`plain_writes_beside_training`)."""


def plain_writes_beside_training(model: keras.Model, x: np.ndarray, y: np.ndarray, batch: int,
                                 arrays: list[np.ndarray], directory: str) -> list[float]:
    """Seconds of `BESIDE_WRITES` plain writes of `arrays` on a thread while `model` trains beside them.

    The writes start at the end of the first batch (the train step is
    compiled and running) and training stops at the first batch end after
    they are done, as a background save runs between batches.
    """
    seconds: list[float] = []
    done = threading.Event()
    failure: list[BaseException] = []

    def writes() -> None:
        try:
            for _ in range(BESIDE_WRITES):
                seconds.append(plain_write(arrays, directory))
        except BaseException as e:  # re-raised on the training thread below
            failure.append(e)
        finally:
            done.set()

    writer = threading.Thread(target=writes, name="plain-write-beside-training")

    class Beside(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if not writer.is_alive() and not done.is_set():
                writer.start()
            if done.is_set():
                self.model.stop_training = True

    model.fit(x, y, batch_size=batch, epochs=10_000, verbose=0, shuffle=False, callbacks=[Beside()])
    writer.join()
    if failure:
        raise failure[0]
    return seconds


def run(name: str, args) -> dict:
    """One callback's run, in this process."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.steps * args.batch, args.width)).astype("float32")
    y = rng.standard_normal((args.steps * args.batch, args.width)).astype("float32")
    keras.distribution.set_distribution(distribution(args.params, args.width))
    keras.utils.set_random_seed(0)
    model = build(args.params, args.width)
    # Compile the train step outside the timed run.
    model.fit(x[: args.batch], y[: args.batch], batch_size=args.batch, epochs=1, verbose=0)
    directory = os.path.join(args.workdir, name)
    callbacks = []
    timed = None
    make = CALLBACKS[name]
    if make is not None:
        timed = Timed(make(directory, args.save_every), args.save_every)
        callbacks.append(timed)
    host_state, d2h_s = device_to_host(_state_values(model))
    plain_s = [plain_write(host_state, directory)]
    direct_s = [direct_write(host_state, directory)]
    del host_state
    before_device = _device_in_use()
    before_rss = rss_anon()
    start = time.perf_counter()
    with PeakSampler() as sampler:
        model.fit(x, y, batch_size=args.batch, epochs=1, verbose=0, shuffle=False, callbacks=callbacks)
    total = time.perf_counter() - start
    if before_device is not None:
        peaks = [int(d.memory_stats().get("peak_bytes_in_use", 0)) for d in jax.local_devices()]
        peak_above = max(p - before_device[str(i)] for i, p in enumerate(peaks))
        peak_kind = "device"
    else:
        peak_above, peak_kind = sampler.peak - before_rss, "RssAnon"
    state_bytes = sum(v.nbytes for v in _state_values(model))
    shutil.rmtree(directory, ignore_errors=True)
    host_state, _ = device_to_host(_state_values(model))
    plain_s.append(plain_write(host_state, directory))
    direct_s.append(direct_write(host_state, directory))
    inner = timed.inner if timed else None
    beside_s = []
    if getattr(inner, "save_writes_s", None):  # only runs whose background writes are timed
        beside_s = plain_writes_beside_training(model, x, y, args.batch, host_state, directory)
    del host_state
    shutil.rmtree(directory, ignore_errors=True)
    return {
        "name": name,
        "fit_s": total,
        "saves": timed.save_s if timed else [],
        "train_end_s": timed.train_end_s if timed else 0.0,
        "state_mb": state_bytes / 2**20,
        "peak_above_mb": peak_above / 2**20,
        "peak_kind": peak_kind,
        "params": sum(int(np.prod(v.shape)) for v in model.trainable_variables),
        # shardckpt only: seconds a due save waited for the previous one, and the modes used.
        "waits": list(getattr(inner, "save_waits_s", [])),
        "writes": list(getattr(inner, "save_writes_s", [])),
        "plain_s": plain_s,
        "direct_s": direct_s,
        "plain_beside_s": beside_s,
        "d2h_gbs": state_bytes / d2h_s / 1e9,
        "modes": sorted(set(getattr(inner, "snapshot_modes", []))),
        "devices": f"{jax.device_count()} {jax.devices()[0].device_kind}",
    }


def main() -> None:
    bench.main(
        __doc__, options=_options, run=_parent, prefix="bench_save_", repeat=None,
        children={"--child": (None, lambda args, name: run(name, args))},
        smoke={"params": 2e4, "width": 64, "steps": 4, "save_every": 2, "batch": 8},
    )


def _options(parser) -> None:
    parser.add_argument("--params", type=float, default=50e6)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--only", default=",".join(CALLBACKS), help="comma-separated runs")
    parser.add_argument("--json", default=None, help="also write every run's figures to this file (JSON)")


def _parent(args) -> None:
    # A fresh process per callback: no allocator or page-cache state carries over.
    results = [
        run_child(os.path.abspath(__file__), "--child", name, "--params", str(args.params), "--width",
                  str(args.width), "--steps", str(args.steps), "--save-every", str(args.save_every),
                  "--batch", str(args.batch), "--workdir", args.workdir)
        for name in args.only.split(",")
    ]
    report(results, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "workdir"}, "results": results}, f, indent=1)


def report(results: list[dict], args) -> None:
    r0 = results[0]
    print(f"\n{r0['params'] / 1e6:.2f}M parameters, {r0['state_mb']:.1f} MiB of state (weights + Adam), "
          f"{r0['devices']} devices, {args.steps} steps, a save every {args.save_every} batches; "
          f"peak above state from {r0['peak_kind']}")
    by_name = {r["name"]: r for r in results}
    sync, keras_async = by_name.get("keras_sync"), by_name.get("keras_async")
    sync_mean = statistics.mean(sync["saves"]) if sync and sync["saves"] else float("nan")
    print(f"{'callback':<17} {'mode':<7} {'saves':>5} {'block/save':>11} {'max':>8} {'vs keras sync':>14} "
          f"{'peak above state':>17} {'end wait':>9} {'fit total':>10} {'vs keras async':>15} {'bg write':>9} "
          f"{'plain write':>11} {'direct write':>12} {'ratio':>6} {'D2H':>10} {'block/(state/D2H)':>17} {'plain beside training':>21} "
          f"{'ratio beside':>12}")
    for r in results:
        saves = r["saves"]
        mean = statistics.mean(saves) if saves else 0.0
        vs_async = r["fit_s"] / keras_async["fit_s"] if keras_async else float("nan")
        # Background write per save over the plain write of the same bytes; the host-mode floor.
        write = statistics.mean(r["writes"]) if r["writes"] else float("nan")
        plain = statistics.mean(r["plain_s"])
        direct = statistics.mean(r["direct_s"])
        beside = statistics.mean(r["plain_beside_s"]) if r["plain_beside_s"] else float("nan")
        link = r["state_mb"] * 2**20 / (r["d2h_gbs"] * 1e9)
        print(f"{r['name']:<17} {','.join(r['modes']) or '-':<7} {len(saves):>5} {mean:>9.3f} s "
              f"{max(saves or [0]):>6.3f} s {mean / sync_mean:>13.1%} {r['peak_above_mb']:>13.1f} MiB "
              f"{r['train_end_s']:>7.2f} s {r['fit_s']:>8.2f} s {vs_async:>14.2f}x {write:>7.3f} s "
              f"{plain:>9.3f} s {direct:>10.3f} s {write / plain:>5.2f}x {r['d2h_gbs']:>5.1f} GB/s {mean / link:>16.1f}x "
              f"{beside:>19.3f} s {write / beside:>11.2f}x")
    auto = by_name.get("shardckpt_auto")
    if auto and auto["saves"] and sync:
        mean = statistics.mean(auto["saves"])
        print_then_vs_now([(
            f"blocking per save, shardckpt default (auto = {','.join(auto['modes'])}) vs keras sync",
            BLOCKING_THEN, BLOCKING_ISSUE, f"{mean:.3f} s = {mean / sync_mean:.1%}", BLOCKING_GOAL,
        )])
    for r in results:
        if r["writes"]:
            print(f"  {r['name']}: background writes " + ", ".join(f"{w:.3f}" for w in r["writes"])
                  + " s; plain writes (before, after) " + ", ".join(f"{p:.3f}" for p in r["plain_s"])
                  + " s; direct writes (before, after) " + ", ".join(f"{p:.3f}" for p in r["direct_s"])
                  + f" s (background write over it {statistics.mean(r['writes']) / statistics.mean(r['direct_s']):.2f}x)"
                  + " s; beside training " + ", ".join(f"{p:.3f}" for p in r["plain_beside_s"]) + " s")
    for r in results:
        if r["saves"]:
            waits = f"; of which waiting for the previous save: {', '.join(f'{w:.3f}' for w in r['waits'])}" if r["waits"] else ""
            print(f"  {r['name']}: per-save blocking " + ", ".join(f"{s:.3f}" for s in r["saves"]) + waits)


if __name__ == "__main__":
    main()
