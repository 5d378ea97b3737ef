"""`restore_latest` of a run trained with `use_ema=True`: the step's raw weights, and a word on the averages.

Keras' `fit` ends with `optimizer.finalize_variable_values`, which puts the
moving averages into the weights after the last step was saved: the model
`fit` returns holds the averages, every step (Keras' own checkpoints too)
the weights as trained, which is what a resumed `fit` must continue from.
A restore outside `fit` therefore gives other weights than the model `fit`
returned; it must say so once, with the call that gives the averages.
"""

from __future__ import annotations

import logging

import jax
import keras
import numpy as np
import pytest

from shardckpt.training import OrbaxCheckpoint, restore_latest
from tests.support import column_then_row_parallel

X = np.random.default_rng(3).standard_normal((32, 8)).astype("float32")
Y = X[:, :2] * 2.0 - 1.0
SAID = "finalize_variable_values"


def _ema_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,), name="x")
    hidden = keras.layers.Dense(16, activation="relu", name="hidden")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(hidden), name="ema")
    model.compile(optimizer=keras.optimizers.Adam(0.05, use_ema=True), loss="mse")
    return model


def _kernels(model: keras.Model) -> list[np.ndarray]:
    return [np.asarray(v.value) for v in model.trainable_variables]


@pytest.fixture
def mesh():
    keras.backend.clear_session()
    keras.distribution.set_distribution(column_then_row_parallel("hidden", "head", (1, 8)))
    yield
    keras.distribution.set_distribution(None)


def _train(directory: str, *, weights_only: bool) -> keras.Model:
    model = _ema_model()
    model.fit(X, Y, batch_size=8, epochs=2, verbose=0, shuffle=False,
              callbacks=[OrbaxCheckpoint(directory, save_weights_only=weights_only)])
    return model


def test_restore_latest_of_an_ema_run_says_the_weights_are_raw_and_how_to_average(tmp_path, caplog, mesh):
    """Full-state step: the raw weights restored (not fit's averaged ones), in their planned shardings;
    one WARNING names finalize_variable_values; after that call the weights equal fit's, bit for bit."""
    trained = _train(str(tmp_path / "ck"), weights_only=False)
    fitted = _kernels(trained)
    restored = _ema_model()
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        restore_latest(restored, str(tmp_path / "ck"))
    said = [r for r in caplog.records if SAID in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    assert "use_ema=True" in said[0].getMessage()
    got = _kernels(restored)
    assert any(not np.array_equal(g, w) for g, w in zip(got, fitted)), "the step should hold the raw weights"
    assert restored.get_layer("hidden").kernel.value.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    assert restored.get_layer("head").kernel.value.sharding.spec == jax.sharding.PartitionSpec("model", None)
    restored.optimizer.finalize_variable_values(restored.trainable_variables)
    for g, w in zip(_kernels(restored), fitted):
        np.testing.assert_array_equal(g, w)


def test_a_weights_only_step_of_an_ema_run_says_nothing_about_averages(tmp_path, caplog, mesh):
    """A weights-only step holds no averages: the advice to finalize them would put the optimizer's
    unrestored averages into the weights, so it is not given."""
    _train(str(tmp_path / "ck"), weights_only=True)
    restored = _ema_model()
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        restore_latest(restored, str(tmp_path / "ck"), strict=False)
    assert not [r for r in caplog.records if SAID in r.getMessage()], [r.getMessage() for r in caplog.records]


def test_restore_latest_without_ema_says_nothing_about_averages(tmp_path, caplog, mesh):
    model = _ema_model()
    model.compile(optimizer="adam", loss="mse")
    model.fit(X, Y, batch_size=8, epochs=1, verbose=0, callbacks=[OrbaxCheckpoint(str(tmp_path / "ck"))])
    restored = _ema_model()
    restored.compile(optimizer="adam", loss="mse")
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        restore_latest(restored, str(tmp_path / "ck"))
    assert not [r for r in caplog.records if SAID in r.getMessage()]


def test_a_step_keras_wrote_without_optimizer_state_says_nothing_about_averages(tmp_path, caplog, mesh):
    """Keras' own callback, weights only (no shardckpt metadata to say so): the load reports
    the averages as kept (no optimizer state stored), so the advice to finalize them is not given either."""
    model = _ema_model()
    model.fit(X, Y, batch_size=8, epochs=1, verbose=0,
              callbacks=[keras.callbacks.OrbaxCheckpoint(str(tmp_path / "ck"), save_weights_only=True)])
    restored = _ema_model()
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        info = restore_latest(restored, str(tmp_path / "ck"), strict=False)
    averages = [v.path for v in restored.optimizer.variables if v.path.endswith("_average")]
    assert averages and set(averages) <= set(info.report.kept), info.report.kept
    assert not [r for r in caplog.records if SAID in r.getMessage()], [r.getMessage() for r in caplog.records]
