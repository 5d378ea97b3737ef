"""`shardckpt.training.OrbaxCheckpoint` in-process: Keras compatibility, metadata,
iterator state, retention, background errors, `restore_latest`, bad input."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import jax
import keras
import numpy as np
import pytest

from shardckpt import errors, load_sharded
from shardckpt.conversion.info import inspect
from shardckpt.training import OrbaxCheckpoint, restore_latest
from tests._train_worker import AtBatch
from tests.support import assert_training_state_equal, column_then_row_parallel, training_state
from tests.zoo import CountingIterator, small_regressor

STEPS = 4
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _small_regressor_16(seed: int = 3) -> keras.Model:
    return small_regressor(seed, width=16)


def _fit(model, ckpt, it, epochs=2):
    model.fit(ckpt.batches(), steps_per_epoch=STEPS, epochs=epochs, callbacks=[ckpt], verbose=0)
    ckpt.wait_until_finished()


def test_keras_reads_the_checkpoint_and_load_sharded_reshards(tmp_path):
    """Keras' load_weights / load_model and load_sharded onto another mesh read it bit-exact."""
    keras.distribution.set_distribution(column_then_row_parallel("hidden", "head"))
    model = _small_regressor_16()
    it = CountingIterator()
    ckpt = OrbaxCheckpoint(str(tmp_path), data_iterator=it, max_to_keep=1, compression=True)
    _fit(model, ckpt, it)
    assert sorted(os.listdir(tmp_path)) == ["1"]
    layout = inspect(str(tmp_path)).metadata["layout"]
    assert layout["mesh_shape"] == [2, 4] and layout["mesh_axes"] == ["data", "model"]
    assert layout["variables"]["hidden/kernel"] == [None, "model"]
    trained = training_state(model)
    assert model.get_layer("hidden").kernel.value.sharding.spec == jax.sharding.PartitionSpec(None, "model")

    # Keras' own readers, same mesh.
    keras.backend.clear_session()
    other = _small_regressor_16(seed=99)
    other.optimizer.build(other.trainable_variables)
    other.load_weights(str(tmp_path))
    assert_training_state_equal(other, trained, [k for k in trained if not k.startswith("metrics")])
    keras.backend.clear_session()
    loaded = keras.saving.load_model(str(tmp_path))
    for v in loaded.trainable_variables:
        np.testing.assert_array_equal(np.asarray(v.value), trained[f"trainable_variables/{v.path}"], err_msg=v.path)

    # load_sharded onto a (1, 8) mesh: every shard moves.
    keras.backend.clear_session()  # (also clears the distribution)
    keras.distribution.set_distribution(column_then_row_parallel("hidden", "head", (1, 8)))
    moved = _small_regressor_16(seed=5)
    moved.optimizer.build(moved.trainable_variables)
    # Compiled metrics get variables at the first fit/evaluate; until then
    # their keys are ones the model lacks (strict refuses them).
    moved.evaluate(np.ones((8, 6), "float32"), np.ones((8, 1), "float32"), verbose=0)
    report = load_sharded(moved, str(tmp_path), progress=False)
    assert report.format == "orbax" and report.path.endswith(os.sep + "1")
    assert_training_state_equal(moved, trained)
    kernel = moved.get_layer("hidden").kernel.value
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    assert kernel.sharding.mesh.devices.shape == (1, 8)


def test_metadata_and_iterator_state_round_trip(tmp_path):
    """The metadata item and the iterator position are saved and read back exactly."""
    model = _small_regressor_16()
    it = CountingIterator()
    seen = []

    def user_metadata(epoch, logs):
        seen.append(epoch)
        return {"run": "exp-7", "epoch_seen": epoch, "loss_seen": logs["loss"]}

    ckpt = OrbaxCheckpoint(str(tmp_path), save_freq=3, metadata=user_metadata, data_iterator=it, max_to_keep=None)
    record = _RecordAt(6)
    seen_n: list[int] = []  # the live position after each batch
    live = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: seen_n.append(it.n))
    # A read-ahead of 3 batches between the iterator and fit (as an input
    # pipeline or an accelerator's prefetch has): the live position at a save
    # is ahead of the batches trained on.
    model.fit(_read_ahead(ckpt.batches(), 3), steps_per_epoch=STEPS, epochs=2, callbacks=[ckpt, record, live],
              verbose=0)
    ckpt.wait_until_finished()
    info = inspect(str(tmp_path))
    assert info.steps == [3, 6] and info.step == 6
    assert info.incomplete == []
    assert {"pytree", "model_config", "shardckpt_metadata", "data_iterator"} <= set(info.items)
    meta = info.metadata
    assert meta["step"] == 6 and meta["epoch"] == 1 and meta["batch"] == 2
    assert meta["epoch_complete"] is False and meta["total_batches"] == 6 and meta["steps_per_epoch"] == STEPS
    assert meta["user"] == {"run": "exp-7", "epoch_seen": 1, "loss_seen": meta["logs"]["loss"]}
    assert seen == [0, 1]
    assert meta["versions"]["keras"] == keras.__version__ and meta["versions"]["jax"] == jax.__version__
    assert meta["layout"]["variables"]["hidden/kernel"] is None  # one device, no mesh
    assert meta["layout"]["mesh_shape"] is None
    # Keras pulled batches ahead of training; the saved position is after
    # exactly the 6 batches trained, not after what was prefetched. When fit
    # ends, the live iterator is put back after the 8 batches trained.
    assert seen_n[5] >= 6 + 3
    assert it.n == 8
    assert info.iterator_state == [{"n": 6}]
    assert info.total_bytes == sum(a.nbytes for a in info.arrays)
    kernel = next(a for a in info.arrays if a.key == "trainable_variables/hidden/kernel")
    assert (kernel.shape, kernel.dtype, kernel.nbytes) == ((6, 16), "float32", 6 * 16 * 4)
    assert "user metadata" in str(info)

    # restore_latest outside fit: model, optimizer, metrics and iterator.
    keras.backend.clear_session()
    fresh = _small_regressor_16(seed=11)
    fresh_it = CountingIterator()
    fresh.fit(fresh_it.x[:8], fresh_it.y[:8], epochs=1, verbose=0)  # builds the metrics variables
    restored = restore_latest(fresh, str(tmp_path), data_iterator=fresh_it)
    assert restored.step == 6 and restored.next_epoch == 1 and fresh_it.n == 6
    assert_training_state_equal(fresh, record.state)


def test_restore_latest_takes_a_host_memory_budget_smaller_than_one_variable(tmp_path):
    """`restore_latest(max_inflight_bytes=...)` is the budget its load runs with (the report says
    so, "given"), and a budget below the size of one variable still restores every variable,
    optimizer slots included, bit-equal in its sharding, onto another mesh."""
    width = 512  # hidden kernel (6, 512) float32: 12 KiB, as each of its two Adam slots
    keras.distribution.set_distribution(column_then_row_parallel("hidden", "head"))
    model = small_regressor(3, width=width)
    it = CountingIterator()
    _fit(model, OrbaxCheckpoint(str(tmp_path), data_iterator=it), it)
    trained = training_state(model)

    keras.backend.clear_session()
    keras.distribution.set_distribution(column_then_row_parallel("hidden", "head", (1, 8)))
    fresh = small_regressor(11, width=width)
    fresh.optimizer.build(fresh.trainable_variables)
    fresh.evaluate(it.x[:8], it.y[:8], verbose=0)  # builds the metrics variables
    variables = [*fresh.variables, *fresh.optimizer.variables]
    placed = {v.path: v.value.sharding for v in variables}
    budget_bytes = 4096
    assert budget_bytes < 6 * width * 4
    with pytest.raises(ValueError, match="max_inflight_bytes must be a positive number of bytes"):
        restore_latest(fresh, str(tmp_path), max_inflight_bytes=0)
    info = restore_latest(fresh, str(tmp_path), max_inflight_bytes=budget_bytes)
    assert info.report.max_inflight_bytes == budget_bytes and info.report.budget_rule == "given"
    assert info.report.bytes_read >= 3 * 6 * width * 4  # the kernel and its slots, each over the budget
    assert_training_state_equal(fresh, trained)
    for v in variables:
        assert v.value.sharding == placed[v.path], v.path
    kernel = fresh.get_layer("hidden").kernel.value.sharding
    assert kernel.spec == jax.sharding.PartitionSpec(None, "model") and kernel.mesh.devices.shape == (1, 8)


def _read_ahead(batches, n: int):
    """Yields `batches`, always holding the next `n` already pulled."""
    import collections

    buffer = collections.deque()
    for batch in batches:
        buffer.append(batch)
        if len(buffer) > n:
            yield buffer.popleft()
    yield from buffer


class _RecordAt(keras.callbacks.Callback):
    """Copies the whole model state after batch number `n` (counted from 1)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n, self.seen, self.state = n, 0, None

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.n:
            self.state = training_state(self.model)


def test_resume_in_process_continues_the_epoch(tmp_path):
    """A second fit in the same directory resumes mid-epoch and ends like one long fit."""
    keras.distribution.set_distribution(column_then_row_parallel("hidden", "head"))
    ref = _small_regressor_16()
    ref_it = CountingIterator()
    ref_ckpt = OrbaxCheckpoint(str(tmp_path / "ref"), save_freq=3, data_iterator=ref_it)
    _fit(ref, ref_ckpt, ref_it, epochs=3)
    expected = training_state(ref)

    keras.backend.clear_session()
    keras.distribution.set_distribution(column_then_row_parallel("hidden", "head"))
    part = _small_regressor_16()
    it = CountingIterator()
    ckpt = OrbaxCheckpoint(str(tmp_path / "run"), save_freq=3, data_iterator=it)
    # Stop after 7 batches: the last save is step 6 (epoch 1, batch 2 of 4).
    part.fit(ckpt.batches(), steps_per_epoch=STEPS, epochs=2, callbacks=[ckpt, AtBatch(7, _stop)], verbose=0)
    ckpt.wait_until_finished()

    keras.backend.clear_session()
    keras.distribution.set_distribution(column_then_row_parallel("hidden", "head"))
    again = _small_regressor_16(seed=42)  # a different init: every value must come from the step
    it2 = CountingIterator()
    ckpt2 = OrbaxCheckpoint(str(tmp_path / "run"), save_freq=3, data_iterator=it2, resume=True)
    again.fit(ckpt2.batches(), steps_per_epoch=STEPS, epochs=3, callbacks=[ckpt2], verbose=0)
    ckpt2.wait_until_finished()
    assert ckpt2.resumed.step == 6 and not ckpt2.resumed.epoch_complete
    assert again.history.epoch == [1, 2]
    assert_training_state_equal(again, expected)
    for v in again.trainable_variables:
        ref_var = next(r for r in ref.trainable_variables if r.path == v.path)
        assert v.value.sharding == ref_var.value.sharding, v.path
    assert it2.get_state() == ref_it.get_state()


def _stop(model: keras.Model) -> None:
    model.stop_training = True


def test_retention_keeps_latest_best_and_periodic_steps(tmp_path):
    """max_to_keep=2 plus keep_best=1 plus keep_period=4: the best step is never aged out."""
    model = _small_regressor_16()
    x = np.random.default_rng(1).standard_normal((32, 6)).astype("float32")
    y = np.random.default_rng(2).standard_normal((32, 1)).astype("float32")
    # mode="max" on the loss makes the first, worst epoch the "best" one:
    # the oldest step, which LatestN alone would delete.
    ckpt = OrbaxCheckpoint(str(tmp_path), monitor="loss", mode="max", max_to_keep=2, keep_best=1, keep_period=4)
    model.fit(x, y, batch_size=8, epochs=7, callbacks=[ckpt], verbose=0, shuffle=False)
    ckpt.wait_until_finished()
    losses = model.history.history["loss"]
    best = int(np.argmax(losses))
    expected = sorted({5, 6, best} | {s for s in range(7) if s % 4 == 0})
    assert sorted(int(n) for n in os.listdir(tmp_path) if n.isdigit()) == expected
    assert not [n for n in os.listdir(tmp_path) if "tmp" in n]


def test_retention_without_max_to_keep_keeps_everything(tmp_path):
    model = _small_regressor_16()
    x, y = np.ones((16, 6), "float32"), np.ones((16, 1), "float32")
    ckpt = OrbaxCheckpoint(str(tmp_path), keep_best=1, monitor="loss", max_to_keep=None)
    model.fit(x, y, batch_size=8, epochs=3, callbacks=[ckpt], verbose=0)
    ckpt.wait_until_finished()
    assert sorted(os.listdir(tmp_path)) == ["0", "1", "2"]


def test_background_save_error_reaches_the_user(tmp_path):
    """A failed background write is raised as BackgroundSaveError, never swallowed.

    Runs in a subprocess (`_error_worker.py`): after a failed step-folder
    creation Orbax leaves threads waiting 300 s for a signal, which would hold
    up the exit of the test process; the worker leaves with `os._exit`.
    """
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tests", "_error_worker.py"), str(tmp_path)],
        capture_output=True, text=True, timeout=180, env=env, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in ("fails_at_last_save", "fails_before_next_save"):
        got = results[name]
        assert got["error"] == "BackgroundSaveError", (name, got)
        assert got["step"] == 2 and "step 2" in got["message"], (name, got)
        assert got["original"] == "NotADirectoryError", (name, got)
        # Steps before the failure were committed and stay restorable.
        assert got["kept_steps"] == [0, 1], (name, got)
    # The failure surfaced where documented: at the end of training, or at
    # the next save (epoch 3's), which then never started.
    assert results["fails_at_last_save"]["saves_started"] == 3
    assert results["fails_before_next_save"]["saves_started"] == 3


def test_drop_in_positional_arguments_and_bad_input(tmp_path, caplog):
    """Keras' positional signature works; bad arguments get typed, named errors."""
    ckpt = OrbaxCheckpoint(str(tmp_path), "loss", 0, False, "min", 2, None, 1, False, True)
    assert (ckpt.monitor, ckpt.save_freq, ckpt.max_to_keep, ckpt.save_on_background, ckpt.save_weights_only) == (
        "loss", 2, 1, False, True)
    model = _small_regressor_16()
    model.fit(np.ones((16, 6), "float32"), np.ones((16, 1), "float32"), batch_size=8, epochs=2,
              callbacks=[ckpt], verbose=0)
    ckpt.wait_until_finished()
    info = inspect(str(tmp_path))
    assert info.steps == [4] and "model_config" not in info.items
    # save_weights_only: no optimizer or metric arrays, as in Keras' callback.
    assert {a.key.split("/")[0] for a in info.arrays} == {"trainable_variables"}
    assert len(info.arrays) == len(model.trainable_variables)

    # Resuming from a weights-only step restores the weights: not exact, and it says so once.
    caplog.set_level(logging.WARNING, logger="shardckpt")
    saved = {v.path: np.asarray(v.value) for v in model.trainable_variables}
    keras.backend.clear_session()
    again = _small_regressor_16(seed=8)
    resumed = OrbaxCheckpoint(str(tmp_path), "loss", 0, False, "min", 2, None, 1, False, True, resume=True)
    again.fit(np.ones((16, 6), "float32"), np.ones((16, 1), "float32"), batch_size=8, epochs=2,
              callbacks=[resumed, _RecordAt(1)], verbose=0)
    assert resumed.resumed.step == 4 and again.history.epoch == []  # all epochs were done
    for v in again.trainable_variables:
        np.testing.assert_array_equal(np.asarray(v.value), saved[v.path], err_msg=v.path)
    said = [r.getMessage() for r in caplog.records if "save_weights_only=True" in r.getMessage()]
    kept = len(again.optimizer.variables) + len(again.metrics_variables)
    assert len(said) == 1 and f"restored; {kept} optimizer and metric variables" in said[0], said
    assert "iteration" in said[0] and "Fix: save with save_weights_only=False" in said[0]

    with pytest.raises(ValueError, match="save_freq"):
        OrbaxCheckpoint(str(tmp_path), save_freq="batch")
    with pytest.raises(ValueError, match="max_to_keep"):
        OrbaxCheckpoint(str(tmp_path), max_to_keep=0)
    with pytest.raises(TypeError, match="get_state"):
        OrbaxCheckpoint(str(tmp_path), data_iterator=iter([1, 2]))
    with pytest.raises(TypeError, match="metadata"):
        OrbaxCheckpoint(str(tmp_path), metadata=["not", "a", "dict"])
    with pytest.raises(ValueError, match="data_iterator"):
        OrbaxCheckpoint(str(tmp_path)).batches()
    with pytest.raises(errors.CheckpointNotFoundError):
        restore_latest(model, str(tmp_path / "empty"))
