"""`restore_latest` of a step without optimizer state says so, whoever wrote the step.

Keras' own `OrbaxCheckpoint(save_weights_only=True)` writes no shardckpt
metadata, so "weights only" cannot be read from the step's metadata there; the
load's `report.kept` (optimizer and metric variables whose collection the step
holds none of) is what says the optimizer starts over.
"""

from __future__ import annotations

import logging

import jax
import keras
import numpy as np
import pytest

from shardckpt.training import OrbaxCheckpoint, restore_latest
from tests.support import column_then_row_parallel

X = np.random.default_rng(5).standard_normal((32, 8)).astype("float32")
Y = X[:, :2] * 0.5 + 1.0
SAID = "keep their current values"


def _model() -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,), name="x")
    hidden = keras.layers.Dense(16, activation="relu", name="hidden")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(hidden), name="wo")
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    return model


@pytest.fixture
def mesh():
    keras.backend.clear_session()
    keras.distribution.set_distribution(column_then_row_parallel("hidden", "head", (1, 8)))
    yield
    keras.distribution.set_distribution(None)


def _restore(directory: str, caplog) -> tuple[keras.Model, list[str]]:
    restored = _model()
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        restore_latest(restored, directory)
    return restored, [r.getMessage() for r in caplog.records if SAID in r.getMessage()]


def test_a_keras_written_weights_only_step_says_the_optimizer_starts_over(tmp_path, caplog, mesh):
    """Keras' callback, save_weights_only=True: the weights bit-equal in their planned shardings,
    the optimizer untouched (iterations 0), and one WARNING naming how many variables keep their values."""
    trained = _model()
    trained.fit(X, Y, batch_size=8, epochs=1, verbose=0, shuffle=False,
                callbacks=[keras.callbacks.OrbaxCheckpoint(str(tmp_path / "ck"), save_weights_only=True)])
    restored, said = _restore(str(tmp_path / "ck"), caplog)
    for got, want in zip(restored.trainable_variables, trained.trainable_variables):
        np.testing.assert_array_equal(np.asarray(got.value), np.asarray(want.value), err_msg=got.path)
    kernel = next(v for v in restored.trainable_variables if v.path == "hidden/kernel")
    assert kernel.value.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    assert int(restored.optimizer.iterations.value) == 0 < int(trained.optimizer.iterations.value)
    kept = len(restored.optimizer.variables) + len(restored.metrics_variables)
    assert len(said) == 1, said
    assert "holds no optimizer or metric state" in said[0] and f"restored; {kept} optimizer and metric" in said[0]
    assert "Fix: save with save_weights_only=False" in said[0]


def test_a_full_step_by_keras_or_shardckpt_says_nothing_of_a_fresh_optimizer(tmp_path, caplog, mesh):
    """Full-state steps (Keras' callback, shardckpt's) restore the optimizer too, without the warning."""
    for name, callback in [("keras", keras.callbacks.OrbaxCheckpoint), ("shardckpt", OrbaxCheckpoint)]:
        trained = _model()
        trained.fit(X, Y, batch_size=8, epochs=1, verbose=0, shuffle=False,
                    callbacks=[callback(str(tmp_path / name))])
        restored, said = _restore(str(tmp_path / name), caplog)
        assert int(restored.optimizer.iterations.value) == int(trained.optimizer.iterations.value) == 4, name
        assert said == [], (name, said)
