"""Layers whose state is derived from their variables (an adapted Normalization) after every restore.

Keras' `load_weights` ends each layer's load with its `finalize_state()`;
every shardckpt restore must too, or an adapted `Normalization` computes with
the mean and variance it was built with.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from keras import layers

import shardckpt
from shardckpt.training import OrbaxCheckpoint, restore_latest
from tests.support import assert_training_state_equal, column_then_row_parallel, training_state
from tests.zoo import CountingIterator, save_as

STEPS = 4
# Far from Normalization's initial mean 0 / variance 1: a layer left unfinalized is visibly wrong.
ADAPT_DATA = np.random.default_rng(7).normal(5.0, 3.0, (64, 6)).astype("float32")
X = CountingIterator().x[:16]


def _normalized_regressor(seed: int | None, *, adapt: bool = True) -> keras.Model:
    """x (6) -> Normalization "norm" (adapted to `ADAPT_DATA`) -> Dense "hidden" (16) -> Dense "head" (1),
    compiled unless `seed` is None (under `lazy_init`: Keras' global seed and optimizer would be
    variables made in its stateless scope)."""
    if seed is not None:
        keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,), name="x")
    norm = layers.Normalization(name="norm")
    hidden = layers.Dense(16, activation="relu", name="hidden")(norm(inputs))
    model = keras.Model(inputs, layers.Dense(1, name="head")(hidden), name="normalized")
    if seed is not None:
        model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    if adapt:
        norm.adapt(ADAPT_DATA)
    return model


def _on_mesh() -> None:
    keras.backend.clear_session()  # (also clears the distribution)
    keras.distribution.set_distribution(column_then_row_parallel("hidden", "head", (1, 8)))


def _outputs(model: keras.Model) -> np.ndarray:
    return np.asarray(model(X))


@pytest.mark.parametrize("lazy", [True, False], ids=["lazy", "built"])
@pytest.mark.parametrize("fmt", ["h5", "keras", "orbax"])
def test_adapted_normalization_computes_as_saved(tmp_path, fmt, lazy):
    """h5 (Keras' save_weights), .keras and an Orbax checkpoint (`shardckpt.convert` of the h5),
    loaded onto the 8-device mesh: outputs bit-equal to the saved model's and to Keras' load_weights."""
    _on_mesh()
    src = _normalized_regressor(seed=1)
    want = _outputs(src)
    path = save_as(src, tmp_path, "keras" if fmt == "keras" else "h5")
    if fmt == "orbax":
        shardckpt.convert(path, str(tmp_path / "orbax"), model=src)
        path = str(tmp_path / "orbax")

    _on_mesh()
    if lazy:
        with shardckpt.lazy_init():
            model = _normalized_regressor(seed=None, adapt=False)
    else:
        model = _normalized_regressor(seed=2, adapt=False)
    shardckpt.load_sharded(model, path)
    np.testing.assert_array_equal(_outputs(model), want)
    if fmt != "orbax":
        _on_mesh()
        by_keras = _normalized_regressor(seed=2, adapt=False)
        by_keras.load_weights(path)
        np.testing.assert_array_equal(_outputs(by_keras), want)


def test_restore_latest_and_a_resumed_fit_recompute_the_normalization(tmp_path):
    """`restore_latest` and OrbaxCheckpoint's resume: outputs and training bit-equal to one long fit."""
    _on_mesh()
    ref = _normalized_regressor(seed=3)
    ref_ckpt = OrbaxCheckpoint(str(tmp_path / "ref"), data_iterator=CountingIterator())
    ref.fit(ref_ckpt.batches(), steps_per_epoch=STEPS, epochs=2, callbacks=[ref_ckpt], verbose=0)
    ref_ckpt.wait_until_finished()
    expected, want = training_state(ref), _outputs(ref)

    # restore_latest outside fit, into a model never adapted.
    _on_mesh()
    fresh = _normalized_regressor(seed=4, adapt=False)
    fresh.evaluate(X, np.ones((16, 1), "float32"), verbose=0)  # builds the metrics variables
    fresh.optimizer.build(fresh.trainable_variables)
    restore_latest(fresh, str(tmp_path / "ref"))
    np.testing.assert_array_equal(_outputs(fresh), want)

    # One epoch, then a fit that resumes it: its second epoch trains through the restored normalization.
    _on_mesh()
    part = _normalized_regressor(seed=3)
    ckpt = OrbaxCheckpoint(str(tmp_path / "run"), data_iterator=CountingIterator())
    part.fit(ckpt.batches(), steps_per_epoch=STEPS, epochs=1, callbacks=[ckpt], verbose=0)
    ckpt.wait_until_finished()
    _on_mesh()
    again = _normalized_regressor(seed=5, adapt=False)
    ckpt2 = OrbaxCheckpoint(str(tmp_path / "run"), data_iterator=CountingIterator(), resume=True)
    again.fit(ckpt2.batches(), steps_per_epoch=STEPS, epochs=2, callbacks=[ckpt2], verbose=0)
    ckpt2.wait_until_finished()
    assert ckpt2.resumed is not None and ckpt2.resumed.epoch_complete
    assert again.history.epoch == [1]
    assert_training_state_equal(again, expected)
    np.testing.assert_array_equal(_outputs(again), want)
