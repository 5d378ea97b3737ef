"""`shardckpt demo`: the guided tour, on 8 simulated CPU devices and nothing else.

Steps (each prints what it did, with figures):

1. build a small transformer language model with Keras, save `.weights.h5`;
2. convert it to an Orbax checkpoint (`shardckpt.convert`), verify it;
3. plan a tensor-parallel layout on a (1, 8) mesh (`shardckpt.auto_layout`);
4. build the model again under `lazy_init()` (no weight memory) and
   `load_sharded` the Orbax checkpoint straight into that layout, checking
   every value against the original bit for bit;
5. train two epochs with `OrbaxCheckpoint` (a checkpoint per epoch);
6. resume: a fresh lazy model gets the latest step with `restore_latest`,
   weights and optimizer state equal to the trained model's.

Run it with `shardckpt demo` (the CLI sets the 8 simulated devices before
JAX starts) or `python -m shardckpt.cli.demo`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

from shardckpt.cli.devices import simulate_cpu_devices
from shardckpt.formats.orbax.ondisk import committed_steps

VOCAB, SEQ, DIM, HEADS, BLOCKS = 2048, 32, 128, 4, 2


def build_transformer() -> Any:
    """A 2-block decoder-style transformer LM (~1.1M parameters), named layers."""
    import keras

    tokens = keras.Input((SEQ,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(VOCAB, DIM, name="embed")(tokens)
    # Symbolic positions (derived from the input): a constant here would bake
    # the embedding's initial output into the graph instead of using its weights.
    positions = keras.ops.zeros_like(tokens) + keras.ops.arange(SEQ, dtype="int32")
    x = x + keras.layers.Embedding(SEQ, DIM, name="pos_embed")(positions)
    for i in range(BLOCKS):
        h = keras.layers.LayerNormalization(name=f"b{i}_ln1")(x)
        h = keras.layers.MultiHeadAttention(HEADS, DIM // HEADS, name=f"b{i}_attn")(h, h, use_causal_mask=True)
        x = x + h
        h = keras.layers.LayerNormalization(name=f"b{i}_ln2")(x)
        h = keras.layers.Dense(4 * DIM, activation="gelu", name=f"b{i}_up")(h)
        x = x + keras.layers.Dense(DIM, name=f"b{i}_down")(h)
    x = keras.layers.LayerNormalization(name="ln_f")(x)
    logits = keras.layers.Dense(VOCAB, name="head")(x)
    return keras.Model(tokens, logits, name="tiny_lm")


def _data(n: int = 256) -> tuple[Any, Any]:
    import numpy as np

    rng = np.random.default_rng(0)
    # A learnable toy language: each next token is the previous one plus 1.
    start = rng.integers(0, VOCAB, size=(n, 1))
    seq = (start + np.arange(SEQ + 1)) % VOCAB
    return seq[:, :-1].astype("int32"), seq[:, 1:].astype("int32")


def run_demo(*, workdir: str | None = None, echo: Callable[[Any], None] | None = None) -> int:
    """Runs the tour; returns 0 when every check held.

    Args:
        workdir: Where to write the files (kept); default a temporary folder
            (removed afterwards).
        echo: Line printer (default: rich console).

    Returns:
        0 on success.

    Raises:
        RuntimeError: a check failed (the message names it).
    """
    simulate_cpu_devices(8)
    from absl import logging as absl_logging

    # Orbax logs routine notes (OCDBT merges skipped for JSON items) as warnings.
    absl_logging.set_verbosity(absl_logging.ERROR)
    if echo is None:
        from rich.console import Console

        echo = Console(highlight=False).print
    own = workdir is None
    work = tempfile.mkdtemp(prefix="shardckpt-demo-") if workdir is None else os.path.abspath(workdir)
    os.makedirs(work, exist_ok=True)
    try:
        return _tour(work, echo)
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)


def _tour(work: str, echo: Callable[[Any], None]) -> int:
    import jax
    import keras
    import numpy as np

    import shardckpt

    t_all = time.perf_counter()
    summary: list[tuple[str, float, str]] = []

    def step(title: str) -> float:
        echo(f"\n[bold cyan]{len(summary) + 1}. {title}[/bold cyan]")
        return time.perf_counter()

    def done(title: str, start: float, figure: str) -> None:
        summary.append((title, time.perf_counter() - start, figure))
        echo(f"   [green]ok[/green] {figure} ({time.perf_counter() - start:.1f} s)")

    devices = jax.devices()
    echo(f"[bold]shardckpt demo[/bold]: {len(devices)} {devices[0].platform.upper()} devices, files in {work}")
    keras.utils.set_random_seed(0)

    # 1. Build and save with Keras.
    t = step("Build a small transformer and save .weights.h5 with Keras")
    model = build_transformer()
    h5 = os.path.join(work, "tiny_lm.weights.h5")
    model.save_weights(h5)
    reference = {v.path: np.asarray(v.value) for v in model.weights}
    params = model.count_params()
    done("keras save_weights", t, f"{params:,} parameters, {os.path.getsize(h5) / 2**20:.1f} MiB .weights.h5")

    # 2. Convert (architecture from a lazily built model: no weight memory).
    t = step("Convert .weights.h5 -> Orbax (streaming, checksummed)")
    keras.backend.clear_session()
    with shardckpt.lazy_init():
        architecture = build_transformer()
    orbax_dir = os.path.join(work, "tiny_lm_orbax")
    report = shardckpt.convert(h5, orbax_dir, model=architecture, force=True, progress=False)
    echo(f"   {report}")
    checked = shardckpt.verify(orbax_dir)
    if not checked.ok:
        raise RuntimeError(f"verify found damage right after converting: {checked.damaged}")
    done("convert + verify", t, f"{report.arrays} arrays, {report.bytes_on_disk / 2**20:.1f} MiB, "
         f"{checked.checksummed} checksums verified")

    # 3. Plan a layout on a (1, 8) mesh.
    t = step("Plan a tensor-parallel layout on a (1, 8) mesh")
    mesh = keras.distribution.DeviceMesh((1, len(devices)), ["data", "model"])
    keras.backend.clear_session()
    with shardckpt.lazy_init():
        lazy = build_transformer()
    plan = shardckpt.auto_layout(lazy, mesh)
    distribution = plan.distribution()
    figure = (f"{plan.sharded_fraction():.0%} of parameter bytes split; "
              f"{plan.bytes_per_device():,} bytes/device of {params * 4:,}")
    done("plan layout", t, figure)

    # 4. Lazy build + sharded load, checked bit for bit.
    t = step("Lazy build under the layout, load_sharded the Orbax checkpoint")
    keras.distribution.set_distribution(distribution)
    keras.backend.clear_session()
    with shardckpt.lazy_init():
        model = build_transformer()
    loaded = shardckpt.load_sharded(model, orbax_dir, layout=plan)
    echo(f"   {loaded}")
    split = 0
    for v in model.weights:
        if not np.array_equal(np.asarray(v.value), reference[v.path]):
            raise RuntimeError(f"{v.path} differs from the saved weights after load_sharded")
        split += len(v.value.sharding.device_set) > 1 and not v.value.sharding.is_fully_replicated
    kernel = next(v for v in model.weights if v.path.endswith("b0_up/kernel"))
    done("lazy build + load_sharded", t, f"{loaded.arrays} arrays bit-exact, {split} split across devices "
         f"(b0_up/kernel: {kernel.value.sharding.spec})")

    # 5. Train two epochs with checkpoints.
    x, y = _data()
    ckpt_dir = os.path.join(work, "ckpts")
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    t = step("Train 2 epochs with shardckpt OrbaxCheckpoint")
    callback = shardckpt.OrbaxCheckpoint(ckpt_dir, monitor="loss", max_to_keep=2, metadata={"run": "demo"})
    history = model.fit(x, y, batch_size=32, epochs=2, callbacks=[callback], verbose=0)
    losses = [round(float(v), 3) for v in history.history["loss"]]
    steps = committed_steps(ckpt_dir)
    done("train 2 epochs", t, f"loss {losses[0]} -> {losses[-1]}, checkpoint steps {steps}")

    # 6. Resume into a fresh lazily built model.
    t = step("Resume: fresh lazy model, restore_latest")
    trained = {v.path: np.asarray(v.value) for v in model.weights}
    slots = {v.path: np.asarray(v.value) for v in model.optimizer.variables}
    loss_before = float(model.evaluate(x, y, batch_size=32, verbose=0))
    keras.backend.clear_session()
    # Resumed in the plan's sharding (clear_session also cleared the distribution).
    keras.distribution.set_distribution(distribution)
    with shardckpt.lazy_init():
        resumed = build_transformer()
    resumed.compile(optimizer=keras.optimizers.Adam(1e-3), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    info = shardckpt.restore_latest(resumed, ckpt_dir)
    for v in resumed.weights:
        if not np.array_equal(np.asarray(v.value), trained[v.path]):
            raise RuntimeError(f"{v.path} differs from the trained model after restore_latest")
    for v in resumed.optimizer.variables:
        if v.path in slots and not np.array_equal(np.asarray(v.value), slots[v.path]):
            raise RuntimeError(f"optimizer variable {v.path} differs after restore_latest")
    loss_after = float(resumed.evaluate(x, y, batch_size=32, verbose=0))
    done("resume", t, f"step {info.step}, next epoch {info.next_epoch}, weights + optimizer bit-exact, "
         f"loss {loss_before:.4f} == {loss_after:.4f}")
    keras.distribution.set_distribution(None)
    return _finish(summary, t_all, echo)


def _finish(summary: list[tuple[str, float, str]], start: float, echo: Callable[[Any], None]) -> int:
    from rich.table import Table

    table = Table(title="shardckpt demo summary")
    table.add_column("step")
    table.add_column("seconds", justify="right")
    table.add_column("result")
    for title, seconds, figure in summary:
        table.add_row(title, f"{seconds:.1f}", figure)
    echo("")
    echo(table)
    echo(f"[bold green]demo complete[/bold green] in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_demo())
