"""Checkpoint saving during `fit`: Keras' OrbaxCheckpoint (sync, async) vs shardckpt.

One process, one model, one mesh, the same training run four times: without
checkpoints, with `keras.callbacks.OrbaxCheckpoint(save_on_background=False)`,
with Keras' default (async) callback, and with `shardckpt.training.OrbaxCheckpoint`.
Every run saves the full state (weights, Adam slots, metrics) every
`--save-every` batches.

"Blocking" is the time the training thread spends inside the callback at a
save batch. Before the clock starts, the batch's results are awaited, so the
figure is the checkpoint's own cost and not the step's compute, for every
callback alike. The end of `fit` (waiting for the last background save) is
counted in the total fit time, not in the per-save figures.

    python tools/bench_save.py                     # 50M parameters, Adam, 8 CPU devices
    python tools/bench_save.py --params 5e6 --steps 12 --save-every 4   # quick
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

from _bench import setup_jax

setup_jax(8)  # 8 simulated CPU devices, before JAX starts its backend

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from shardckpt.training import OrbaxCheckpoint  # noqa: E402

WIDTH = 2048


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


def build(n_params: float) -> keras.Model:
    layers = max(1, round(n_params / (WIDTH * WIDTH + WIDTH)))
    inputs = keras.Input((WIDTH,), name="x")
    h = inputs
    for i in range(layers):
        h = keras.layers.Dense(WIDTH, activation="relu" if i < layers - 1 else None, name=f"d{i}")(h)
    model = keras.Model(inputs, h, name="bench")
    model.compile(optimizer="adam", loss="mse")
    return model


def distribution(n_params: float) -> keras.distribution.ModelParallel:
    mesh = keras.distribution.DeviceMesh((2, 4), ["data", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layers = max(1, round(n_params / (WIDTH * WIDTH + WIDTH)))
    for i in range(layers):
        # Megatron-style: column-sharded then row-sharded kernels.
        layout_map[f"d{i}/kernel"] = (None, "model") if i % 2 == 0 else ("model", None)
        layout_map[f"d{i}/bias"] = ("model",) if i % 2 == 0 else (None,)
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="data")


def run(name: str, make_callback, args, x, y, root: str) -> dict:
    keras.backend.clear_session()
    keras.distribution.set_distribution(distribution(args.params))
    keras.utils.set_random_seed(0)
    model = build(args.params)
    # Compile the train step outside the timed run.
    model.fit(x[: args.batch], y[: args.batch], batch_size=args.batch, epochs=1, verbose=0)
    directory = os.path.join(root, name)
    callbacks = []
    timed = None
    if make_callback is not None:
        timed = Timed(make_callback(directory), args.save_every)
        callbacks.append(timed)
    start = time.perf_counter()
    model.fit(x, y, batch_size=args.batch, epochs=1, verbose=0, shuffle=False, callbacks=callbacks)
    total = time.perf_counter() - start
    state_bytes = sum(v.value.nbytes for v in model.variables) + sum(v.value.nbytes for v in model.optimizer.variables)
    shutil.rmtree(directory, ignore_errors=True)
    return {
        "name": name,
        "fit_s": total,
        "saves": timed.save_s if timed else [],
        "train_end_s": timed.train_end_s if timed else 0.0,
        "state_mb": state_bytes / 2**20,
        "params": sum(int(np.prod(v.shape)) for v in model.trainable_variables),
        # shardckpt only: seconds a due save waited for the previous one.
        "waits": list(getattr(timed.inner, "save_waits_s", []) if timed else []),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=50e6)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temp folder)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.steps * args.batch, WIDTH)).astype("float32")
    y = rng.standard_normal((args.steps * args.batch, WIDTH)).astype("float32")
    root = args.dir or tempfile.mkdtemp(prefix="bench_save_")
    every = args.save_every
    runs = [
        ("none", None),
        ("keras_sync", lambda d: keras.callbacks.OrbaxCheckpoint(d, save_freq=every, save_on_background=False)),
        ("keras_async", lambda d: keras.callbacks.OrbaxCheckpoint(d, save_freq=every, save_on_background=True)),
        ("shardckpt", lambda d: OrbaxCheckpoint(d, save_freq=every, max_to_keep=1)),
        # Same, with Keras' zstd compression: shows what the default saves.
        ("shardckpt_zstd", lambda d: OrbaxCheckpoint(d, save_freq=every, max_to_keep=1, compression=True)),
    ]
    results = [run(name, make, args, x, y, root) for name, make in runs]
    shutil.rmtree(root, ignore_errors=True)
    r0 = results[0]
    print(f"\n{r0['params'] / 1e6:.1f}M parameters, {r0['state_mb']:.0f} MiB of state (weights + Adam), "
          f"{jax.device_count()} {jax.devices()[0].platform} devices, mesh (2, 4), "
          f"{args.steps} steps, a save every {every} batches")
    sync = next(r for r in results if r["name"] == "keras_sync")
    keras_async = next(r for r in results if r["name"] == "keras_async")
    sync_mean = statistics.mean(sync["saves"]) if sync["saves"] else float("nan")
    print(f"{'callback':<14} {'saves':>5} {'block/save mean':>16} {'max':>8} {'vs keras sync':>14} "
          f"{'end wait':>9} {'fit total':>10} {'vs keras async':>15}")
    for r in results:
        saves = r["saves"]
        mean = statistics.mean(saves) if saves else 0.0
        print(f"{r['name']:<14} {len(saves):>5} {mean:>14.3f} s {max(saves or [0]):>6.3f} s "
              f"{mean / sync_mean:>13.1%} {r['train_end_s']:>7.2f} s {r['fit_s']:>8.2f} s "
              f"{r['fit_s'] / keras_async['fit_s']:>14.2f}x")
    for r in results:
        if r["saves"]:
            waits = f"; of which waiting for the previous save: {', '.join(f'{w:.3f}' for w in r['waits'])}" if r["waits"] else ""
            print(f"  {r['name']}: per-save blocking " + ", ".join(f"{s:.3f}" for s in r["saves"]) + waits)


if __name__ == "__main__":
    main()
