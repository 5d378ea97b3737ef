"""`OrbaxCheckpoint`'s options against Keras' own callback on the same run.

Each test runs `keras.callbacks.OrbaxCheckpoint` and ours on the same model,
data and arguments, and checks that ours saves what Keras' saves (the same
step numbers, the same state in them) where the README names no difference.
"""

from __future__ import annotations

import os

import keras
import numpy as np
import pytest

from shardckpt.errors import ConfigurationError, StepExistsError
from shardckpt.formats.orbax.ondisk import METADATA_ITEM, read_json_item
from shardckpt.training import OrbaxCheckpoint, restore_latest
from tests.support import assert_training_state_equal, training_state

SAMPLES, BATCH = 40, 10  # 4 batches per fit


def _regressor(steps_per_execution: int) -> keras.Model:
    keras.utils.set_random_seed(5)
    # Explicit names: every model of the test has the same variable paths.
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, name="a"), keras.layers.Dense(1, name="b")],
                             name="seq")
    model.compile(optimizer=keras.optimizers.Adam(name="adam"), loss="mse", steps_per_execution=steps_per_execution)
    return model


def _data() -> tuple[np.ndarray, np.ndarray]:
    """`SAMPLES` rows of inputs (6 features) and targets, the same in every test."""
    rng = np.random.default_rng(0)
    return (rng.standard_normal((SAMPLES, 6)).astype("float32"),
            rng.standard_normal((SAMPLES, 1)).astype("float32"))


def _steps(directory: str) -> list[int]:
    return sorted(int(n) for n in os.listdir(directory) if n.isdigit())


@pytest.mark.parametrize("steps_per_execution", [1, 2])
def test_an_integer_save_freq_counts_on_across_a_loop_of_fits_shorter_than_it(tmp_path, steps_per_execution):
    """Four fits of 4 batches with one callback and save_freq=6: Keras' callback keeps its count of
    batches since the last save across fits and saves at batches 6 and 12 (with
    steps_per_execution=2 too, its count moving 2 batches at a time). Ours saves the same steps,
    holding the same state; it used to start the count again at every fit and save nothing."""
    expected = [6, 12]
    x, y = _data()
    runs = {}
    for name, callback_class in (("keras", keras.callbacks.OrbaxCheckpoint), ("ours", OrbaxCheckpoint)):
        directory = str(tmp_path / name)
        callback = callback_class(directory, save_freq=6, max_to_keep=None)
        model = _regressor(steps_per_execution)
        for _ in range(4):
            model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, callbacks=[callback], verbose=0)
        callback.wait_until_finished()
        assert int(model.optimizer.iterations) == 16
        runs[name] = directory
    assert _steps(runs["keras"]) == expected
    assert _steps(runs["ours"]) == expected
    assert read_json_item(os.path.join(runs["ours"], str(expected[-1])), METADATA_ITEM)["total_batches"] == expected[-1]
    # The newest step of each holds the same state, bit for bit.
    from_keras, from_ours = _regressor(steps_per_execution), _regressor(steps_per_execution)
    assert restore_latest(from_keras, runs["keras"]).step == expected[-1]
    assert restore_latest(from_ours, runs["ours"]).step == expected[-1]
    assert_training_state_equal(from_ours, training_state(from_keras))


def test_resume_refuses_to_start_over_a_model_that_trained_past_the_steps_it_would_delete(tmp_path):
    """resume=True with only partial-epoch steps and arrays as input starts from the beginning and
    deletes those steps, to write them again: exact for the fresh model of a rerun. A second fit of
    the same model in this process has trained past them: it used to delete step 4 (with
    max_to_keep=None), say "training starts from the beginning (exact)", go on from its current
    weights and never write step 4 again. It is refused before anything is deleted or trained; the
    fix it names (resume=False) goes on from the model as it is and keeps every step."""
    x, y = _data()
    directory = str(tmp_path / "c")
    ckpt = OrbaxCheckpoint(directory, save_freq=3, max_to_keep=None, resume=True)
    model = _regressor(1)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, callbacks=[ckpt], verbose=0)
    ckpt.wait_until_finished()
    assert _steps(directory) == [3]
    before = training_state(model)
    with pytest.raises(ConfigurationError, match=r"step 3 in .* is not continued") as raised:
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, callbacks=[ckpt], verbose=0)
    message = str(raised.value)
    assert "this model has trained 4 batches already, as far as steps [3] were saved" in message
    assert "Fix: set resume=False on the callback" in message
    assert _steps(directory) == [3]
    assert int(model.optimizer.iterations) == 4
    assert_training_state_equal(model, before)

    ckpt.resume = False
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, callbacks=[ckpt], verbose=0)
    ckpt.wait_until_finished()
    assert _steps(directory) == [3, 6] and int(model.optimizer.iterations) == 8
    assert read_json_item(os.path.join(directory, "6"), METADATA_ITEM)["total_batches"] == 6


def test_a_further_per_epoch_fit_of_a_trained_model_is_told_to_number_its_epochs_on(tmp_path):
    """save_freq="epoch" names steps by epoch: a second fit(epochs=1) of the same model would save
    step 0 again (Keras' callback trains the epoch, then fails with StepAlreadyExistsError), and is
    refused before it trains. resume=True, the fix the refusal used to name alone, restores step 0
    and trains nothing in a fit(epochs=1); the fix for a fit in a loop is Keras' own, initial_epoch,
    which the refusal now names, and which saves step 1 beside step 0."""
    x, y = _data()
    directory = str(tmp_path / "c")
    ckpt = OrbaxCheckpoint(directory, monitor="loss", max_to_keep=None)
    model = _regressor(1)
    model.fit(x, y, batch_size=BATCH, epochs=1, callbacks=[ckpt], verbose=0)
    with pytest.raises(StepExistsError, match=r"holds committed step 0.*start at step 0") as raised:
        model.fit(x, y, batch_size=BATCH, epochs=1, callbacks=[ckpt], verbose=0)
    assert "Fix: for a further fit of this model after the epochs it trained, number its epochs on: " \
           "fit(initial_epoch=1, epochs=1 + more), as Keras does; or pass resume=True" in str(raised.value)
    assert int(model.optimizer.iterations) == 4
    model.fit(x, y, batch_size=BATCH, initial_epoch=1, epochs=2, callbacks=[ckpt], verbose=0)
    ckpt.wait_until_finished()
    assert _steps(directory) == [0, 1] and int(model.optimizer.iterations) == 8


def test_a_loop_of_fits_numbering_its_epochs_on_with_initial_epoch_saves_every_epoch_as_keras(tmp_path):
    """fit(initial_epoch=i, epochs=i + 1) three times with one callback, save_freq="epoch": Keras'
    callback saves steps 0, 1, 2. Ours used to refuse the second fit with StepExistsError ("saves
    start at step 0"): it took the first epoch from the model's resume marker, not from fit's
    initial_epoch. It saves the same steps now, the newest bit-equal to Keras'."""
    x, y = _data()
    runs = {}
    for name, callback_class in (("keras", keras.callbacks.OrbaxCheckpoint), ("ours", OrbaxCheckpoint)):
        directory = str(tmp_path / name)
        callback = callback_class(directory, monitor="loss", max_to_keep=None)
        model = _regressor(1)
        for i in range(3):
            model.fit(x, y, batch_size=BATCH, initial_epoch=i, epochs=i + 1, shuffle=False, callbacks=[callback],
                      verbose=0)
            assert model.history.epoch == [i]
        callback.wait_until_finished()
        runs[name] = directory
    assert _steps(runs["keras"]) == _steps(runs["ours"]) == [0, 1, 2]
    assert read_json_item(os.path.join(runs["ours"], "2"), METADATA_ITEM)["epoch"] == 2
    from_keras, from_ours = _regressor(1), _regressor(1)
    assert restore_latest(from_keras, runs["keras"]).step == 2
    assert restore_latest(from_ours, runs["ours"]).step == 2
    assert_training_state_equal(from_ours, training_state(from_keras))
