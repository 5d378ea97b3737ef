"""Steps are ordered by number: a `fit` whose saves would sort at or below a committed step is
refused before it trains, instead of losing its steps to retention (as Keras' callback does)."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from shardckpt.conversion.info import inspect
from shardckpt.errors import StepExistsError
from shardckpt.training import OrbaxCheckpoint
from tests.test_preemption import _Batches, _two_dense_adam_regressor


def _fit(directory, save_freq, epochs: int, *, resume: bool = False) -> tuple[keras.Model, OrbaxCheckpoint]:
    ckpt = OrbaxCheckpoint(str(directory), save_freq=save_freq, resume=resume, data_iterator=_Batches())
    model = _two_dense_adam_regressor()
    model.fit(ckpt.batches(), steps_per_epoch=4, epochs=epochs, callbacks=[ckpt], verbose=0)
    return model, ckpt


def test_a_new_run_into_a_folder_with_a_higher_step_is_refused_before_it_trains(tmp_path):
    """Keras' callback, run twice into one folder (max_to_keep=1), keeps the first run's step 8
    and deletes each step of the second as it is written: here the second fit stops at once."""
    _fit(tmp_path, 4, epochs=2)
    assert inspect(str(tmp_path)).steps == [8]
    before = inspect(str(tmp_path)).metadata
    ckpt = OrbaxCheckpoint(str(tmp_path), save_freq=4, data_iterator=_Batches())
    model = _two_dense_adam_regressor()
    with pytest.raises(StepExistsError, match=r"holds committed step 8.*start at step 1") as raised:
        model.fit(ckpt.batches(), steps_per_epoch=4, epochs=1, callbacks=[ckpt], verbose=0)
    assert "Fix: pass resume=True to continue from step 8" in str(raised.value)
    assert int(model.optimizer.iterations) == 0  # not one batch trained
    assert inspect(str(tmp_path)).steps == [8] and inspect(str(tmp_path)).metadata == before


def test_resuming_batch_named_steps_with_save_freq_epoch_is_refused_and_names_the_old_save_freq(tmp_path):
    """Step 8 (batches) resumed with save_freq="epoch": the next saves would be steps 2 and 3."""
    _fit(tmp_path, 4, epochs=2)
    with pytest.raises(StepExistsError, match=r"named by epochs.*start at step 2") as raised:
        _fit(tmp_path, "epoch", epochs=4, resume=True)
    assert "Fix: save with the save_freq step 8 was saved with (4)" in str(raised.value)
    assert inspect(str(tmp_path)).steps == [8]


def test_steps_that_keep_rising_are_not_refused(tmp_path):
    """Epoch-named step 1 resumed with save_freq=4 goes on at step 12; a second fit of the same
    model and callback continues the batch count; both save as before."""
    _fit(tmp_path / "a", "epoch", epochs=2)
    model, ckpt = _fit(tmp_path / "a", 4, epochs=4, resume=True)
    assert ckpt.resumed.step == 1 and inspect(str(tmp_path / "a")).steps == [16]
    assert int(model.optimizer.iterations) == 16

    ckpt = OrbaxCheckpoint(str(tmp_path / "b"), save_freq=4, max_to_keep=None)
    model = _two_dense_adam_regressor()
    x, y = np.ones((32, 6), "float32"), np.ones((32, 1), "float32")
    model.fit(x, y, batch_size=8, epochs=1, callbacks=[ckpt], verbose=0)
    model.fit(x, y, batch_size=8, epochs=1, callbacks=[ckpt], verbose=0)
    assert inspect(str(tmp_path / "b")).steps == [4, 8] and int(model.optimizer.iterations) == 8
