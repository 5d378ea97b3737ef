"""Retention around preemption steps and unusable monitor values.

A step saved on a preemption notice is a resume point only: it takes no place
of `max_to_keep`, is never one of the `keep_best` steps, and is deleted once a
newer step commits or the resumed fit ends without one. `keep_best` ranks only
steps whose monitored value is a finite number. Each test fits a real model
and checks the step folders left on disk and the step `restore_latest` picks.
"""

from __future__ import annotations

import math
import os
import warnings

import keras
import numpy as np
import pytest

from shardckpt.training import OrbaxCheckpoint, restore_latest
from tests._train_worker import AtBatch, sigterm_at
from tests.test_preemption import _Batches, _two_dense_adam_regressor


class _Score(keras.callbacks.Callback):
    """Puts a scripted `score` into the logs the callbacks after it see.

    Args:
        batches: Score at the end of the n-th batch of the fit (from 1); others get `default`.
        epochs: Score at the end of each epoch; None leaves it out of the logs.
        default: Score of the batches not in `batches` (None: left out).
    """

    def __init__(self, batches: dict[int, float] | None = None, epochs: dict[int, float | None] | None = None,
                 default: float | None = None) -> None:
        super().__init__()
        self.batches, self.epochs, self.default, self.seen = batches or {}, epochs or {}, default, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        score = self.batches.get(self.seen, self.default)
        if score is not None:
            logs["score"] = score

    def on_epoch_end(self, epoch, logs=None):
        if self.epochs.get(epoch) is not None:
            logs["score"] = self.epochs[epoch]


def _steps(directory) -> list[int]:
    return sorted(int(name) for name in os.listdir(directory) if name.isdigit())


def _values(model: keras.Model) -> list[np.ndarray]:
    return [np.asarray(v.value) for v in model.trainable_variables]


def test_save_best_only_keeps_the_best_step_beside_a_preemption_step_and_drops_that_after_the_resume(tmp_path):
    """save_freq=2, save_best_only, max_to_keep=1: best at batch 2, SIGTERM after batch 5.

    Was: the preemption step 5 took the one place of max_to_keep and deleted
    step 2; the resumed fit never improved, so step 5 was all that was left and
    restore_latest gave the preempted state instead of the best.
    """
    kwargs = dict(monitor="score", mode="min", save_best_only=True, save_freq=2, max_to_keep=1)
    ckpt = OrbaxCheckpoint(str(tmp_path), data_iterator=_Batches(), **kwargs)
    best: list[np.ndarray] = []
    model = _two_dense_adam_regressor()
    model.fit(ckpt.batches(), steps_per_epoch=4, epochs=3, verbose=0, callbacks=[
        _Score({2: 1.0, 4: 2.0}), AtBatch(2, lambda m: best.extend(_values(m))), sigterm_at(5), ckpt])
    assert ckpt.preempted_step == 5
    assert _steps(tmp_path) == [2, 5]
    assert restore_latest(_two_dense_adam_regressor(), str(tmp_path)).step == 5  # the resume point

    again = OrbaxCheckpoint(str(tmp_path), data_iterator=_Batches(), resume=True, **kwargs)
    model = _two_dense_adam_regressor()
    model.fit(again.batches(), steps_per_epoch=4, epochs=3, verbose=0, callbacks=[_Score(default=3.0), again])
    assert again.resumed.step == 5 and again.preempted_step is None
    assert _steps(tmp_path) == [2]
    check = _two_dense_adam_regressor()
    assert restore_latest(check, str(tmp_path)).step == 2
    for want, got in zip(best, _values(check)):
        np.testing.assert_array_equal(got, want)


def test_epoch_mode_save_best_only_drops_the_partial_preemption_step_when_the_resumed_run_never_improves(tmp_path):
    """save_freq="epoch", save_best_only, max_to_keep=1: epoch 0 is the best, SIGTERM in epoch 1.

    Was: the partial step 1 stayed after the resumed run (no epoch improved,
    so nothing replaced it) and restore_latest picked it over step 0.
    """
    kwargs = dict(monitor="score", mode="min", save_best_only=True, max_to_keep=1)
    scores = {0: 1.0, 1: 2.0, 2: 2.0}
    ckpt = OrbaxCheckpoint(str(tmp_path), data_iterator=_Batches(), **kwargs)
    model = _two_dense_adam_regressor()
    model.fit(ckpt.batches(), steps_per_epoch=4, epochs=3, verbose=0,
              callbacks=[_Score(epochs=scores), sigterm_at(6), ckpt])
    assert ckpt.preempted_step == 1
    assert _steps(tmp_path) == [0, 1]

    again = OrbaxCheckpoint(str(tmp_path), data_iterator=_Batches(), resume=True, **kwargs)
    model = _two_dense_adam_regressor()
    model.fit(again.batches(), steps_per_epoch=4, epochs=3, verbose=0, callbacks=[_Score(epochs=scores), again])
    assert again.resumed.step == 1
    assert _steps(tmp_path) == [0]
    info = restore_latest(_two_dense_adam_regressor(), str(tmp_path))
    assert info.step == 0 and info.epoch_complete


def test_keep_best_never_ranks_a_preemption_step_and_it_goes_once_a_newer_step_commits(tmp_path):
    """keep_best=1, max_to_keep=1, save_freq=4; the preemption step 5 has the lowest score.

    Was: step 5 was kept as the best for good (beside step 12); the best
    scheduled step 4 was deleted by the preemption save.
    """
    kwargs = dict(monitor="score", mode="min", save_freq=4, max_to_keep=1, keep_best=1)
    ckpt = OrbaxCheckpoint(str(tmp_path), data_iterator=_Batches(), **kwargs)
    model = _two_dense_adam_regressor()
    model.fit(ckpt.batches(), steps_per_epoch=4, epochs=3, verbose=0,
              callbacks=[_Score({4: 2.0, 5: 0.1}), sigterm_at(5), ckpt])
    assert ckpt.preempted_step == 5
    assert _steps(tmp_path) == [4, 5]

    again = OrbaxCheckpoint(str(tmp_path), data_iterator=_Batches(), resume=True, **kwargs)
    model = _two_dense_adam_regressor()
    model.fit(again.batches(), steps_per_epoch=4, epochs=3, verbose=0, callbacks=[_Score(default=3.0), again])
    assert again.resumed.step == 5
    assert _steps(tmp_path) == [4, 12]  # the best scheduled step and the latest
    assert restore_latest(_two_dense_adam_regressor(), str(tmp_path)).step == 12


def test_keep_best_does_not_keep_steps_whose_monitor_is_nan_or_missing_and_warns_once(tmp_path):
    """keep_best=3, max_to_keep=1; epoch scores 1.0, NaN, (missing), NaN.

    Was: fewer than three steps had a score, so Orbax's BestN kept the
    NaN / missing ones as "best" too (steps 0, 2, 3 left), and a NaN score
    was not warned about (only a missing one).
    """
    ckpt = OrbaxCheckpoint(str(tmp_path), monitor="score", mode="min", max_to_keep=1, keep_best=3)
    model = _two_dense_adam_regressor()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit((b for b in _Batches()), steps_per_epoch=4, epochs=4, verbose=0,
                  callbacks=[_Score(epochs={0: 1.0, 1: math.nan, 2: None, 3: math.nan}), ckpt])
        ckpt.wait_until_finished()
    assert _steps(tmp_path) == [0, 3]
    assert restore_latest(_two_dense_adam_regressor(), str(tmp_path)).step == 3
    said = [str(w.message) for w in caught if "score" in str(w.message)]
    assert len(said) == 1 and said[0].startswith("score is nan at this save: keep_best=3 ranks steps by it")


@pytest.mark.parametrize("max_to_keep", [None, 2])
def test_a_preemption_step_is_deleted_when_a_newer_step_commits_whatever_max_to_keep(tmp_path, max_to_keep):
    """save_freq=4, SIGTERM after batch 9: the resumed run's step 12 supersedes step 9.

    With max_to_keep=None every scheduled step stays (Keras' meaning), but the
    preemption step is only a resume point; with 2 it takes no place of the two.
    Was: [4, 8, 9, 12] and [9, 12] (step 8 deleted by the preemption save).
    """
    ckpt = OrbaxCheckpoint(str(tmp_path), save_freq=4, max_to_keep=max_to_keep, data_iterator=_Batches())
    _two_dense_adam_regressor().fit(ckpt.batches(), steps_per_epoch=4, epochs=3, verbose=0,
                                    callbacks=[sigterm_at(9), ckpt])
    assert ckpt.preempted_step == 9
    assert _steps(tmp_path) == [4, 8, 9]
    again = OrbaxCheckpoint(str(tmp_path), save_freq=4, max_to_keep=max_to_keep, resume=True,
                            data_iterator=_Batches())
    _two_dense_adam_regressor().fit(again.batches(), steps_per_epoch=4, epochs=3, verbose=0, callbacks=[again])
    assert again.resumed.step == 9
    assert _steps(tmp_path) == ([4, 8, 12] if max_to_keep is None else [8, 12])
    assert restore_latest(_two_dense_adam_regressor(), str(tmp_path)).step == 12
