"""Fit variations a whole-epoch resume cannot continue exactly, and ones it can.

Each case fits twice into one directory (2 epochs, then `resume=True` to 4, the
second on a model built anew from the same seeds, as a new process would) and
compares with one uninterrupted 4-epoch fit. Where the resumed run trains other
batches, the resume must say so; other callbacks' counters resume with it; where
the data starts a new pass at the resumed epoch anyway, it must end bit-equal and
say nothing of the kind.
"""

from __future__ import annotations

import logging

import keras
import numpy as np
import pytest

from shardckpt.training import OrbaxCheckpoint
from shardckpt.training.data_passes import pass_offset

N, BATCH = 48, 8  # 6 batches in one pass


def _data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, 6)).astype("float32")
    return x, (x[:, :2].sum(axis=1, keepdims=True) > 0).astype("float32")


def _model() -> keras.Model:
    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, name="a"), keras.layers.Dropout(0.25, name="drop"),
                              keras.layers.Dense(1, name="b")], name="seq")
    model.compile(optimizer=keras.optimizers.Adam(1e-2, name="adam"), loss="mse", metrics=["mae"])
    return model


def _state(model: keras.Model) -> list[np.ndarray]:
    return [np.asarray(v.value) for v in model.trainable_variables + model.non_trainable_variables
            + model.optimizer.variables + model.metrics_variables]


def _stream():
    """An endless generator: a new permutation every pass, as users write them."""
    rng = np.random.default_rng(1)
    x, y = _data()
    while True:
        order = rng.permutation(N)
        for i in range(0, N, BATCH):
            yield x[order[i:i + BATCH]], y[order[i:i + BATCH]]


class _Reshuffling(keras.utils.PyDataset):
    """Reshuffles its own order at each epoch's end (Keras' documented PyDataset idiom)."""

    def __init__(self) -> None:
        super().__init__()
        self.x, self.y = _data()
        self.order = np.arange(N)
        self.rng = np.random.default_rng(3)

    def __len__(self) -> int:
        return N // BATCH

    def __getitem__(self, i):
        rows = self.order[i * BATCH:(i + 1) * BATCH]
        return self.x[rows], self.y[rows]

    def on_epoch_end(self) -> None:
        self.order = self.rng.permutation(N)


def _fit_inputs(kind: str) -> dict:
    x, y = _data()
    if kind == "arrays, steps_per_epoch=4 of 6 batches":
        return dict(x=x, y=y, batch_size=BATCH, steps_per_epoch=4, shuffle=True)
    if kind == "generator, steps_per_epoch=4":
        return dict(x=_stream(), steps_per_epoch=4)
    if kind == "PyDataset reshuffling in on_epoch_end":
        return dict(x=_Reshuffling())
    return dict(x=x, y=y, batch_size=BATCH, steps_per_epoch=3, shuffle=True)  # 2 epochs a pass


def _interrupted_and_resumed(tmp_path, caplog, kind: str, callbacks=list,
                             resumed_fit: dict | None = None) -> tuple[list, list, list[str]]:
    model = _model()
    model.fit(**_fit_inputs(kind), epochs=4, verbose=0, callbacks=callbacks())
    reference = _state(model)
    model = _model()
    first = OrbaxCheckpoint(str(tmp_path / "c"))
    model.fit(**_fit_inputs(kind), epochs=2, verbose=0, callbacks=[first, *callbacks()])
    first.wait_until_finished()
    model = _model()
    resumed = OrbaxCheckpoint(str(tmp_path / "c"), resume=True)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="shardckpt"):
        model.fit(**_fit_inputs(kind), epochs=4, verbose=0, callbacks=[resumed, *callbacks()], **(resumed_fit or {}))
    resumed.wait_until_finished()
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "waited" not in r.getMessage()]
    return reference, _state(model), lines


def _equal(a: list, b: list) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("kind, why", [
    ("arrays, steps_per_epoch=4 of 6 batches", "fewer than the 6 batches of one pass"),
    ("generator, steps_per_epoch=4", "input of no known length"),
    ("PyDataset reshuffling in on_epoch_end", "_Reshuffling, a PyDataset with its own on_epoch_end"),
])
def test_a_resume_whose_data_starts_over_where_the_unbroken_run_went_on_says_it_is_not_exact(tmp_path, caplog, kind, why):
    """Measured: each of these resumed runs ends with other weights than the unbroken one; the
    resume line said "exact" (or nothing) before, it must say "Not exact" and why."""
    reference, values, lines = _interrupted_and_resumed(tmp_path, caplog, kind)
    assert not _equal(reference, values), f"{kind}: the resumed fit trains other batches"
    said = [line for line in lines if "Not exact" in line]
    assert len(said) == 1 and why in said[0] and "OrbaxCheckpoint.batches()" in said[0], lines
    assert "(exact" not in said[0]


def test_steps_per_epoch_that_starts_a_new_pass_at_the_resumed_epoch_resumes_bit_equal_and_quietly(tmp_path, caplog):
    """3 of 6 batches per epoch: epoch 2 begins a new pass in both runs."""
    reference, values, lines = _interrupted_and_resumed(tmp_path, caplog, "arrays, steps_per_epoch=3 of 6 batches")
    assert _equal(reference, values)
    assert lines == []


@pytest.mark.parametrize("initial_epoch", [1, 2, 3])
def test_an_initial_epoch_given_with_resume_is_set_by_the_step_and_another_one_is_said(tmp_path, caplog, initial_epoch):
    """fit(initial_epoch=k, resume from the step of epoch 2): the step sets the epoch, so the run
    ends bit-equal to the unbroken one whatever k; k=2 (info.next_epoch) is what the step sets,
    quietly. Before, a k of 1 or 3 was dropped without a word."""
    reference, values, lines = _interrupted_and_resumed(tmp_path, caplog, "arrays, steps_per_epoch=3 of 6 batches",
                                                        resumed_fit={"initial_epoch": initial_epoch})
    assert _equal(reference, values)
    if initial_epoch == 2:
        assert lines == []
        return
    assert len(lines) == 1 and f"fit(initial_epoch={initial_epoch}) is not used: the step sets it to 2" in lines[0]
    assert "Fix: leave initial_epoch out" in lines[0] and "Not exact" not in lines[0], lines


def _patient(kind: str) -> list:
    if kind == "EarlyStopping":
        return [keras.callbacks.EarlyStopping(monitor="loss", patience=2, min_delta=1e9)]  # never improves
    return [keras.callbacks.ReduceLROnPlateau(monitor="loss", patience=1, factor=0.5, min_delta=1e9)]


@pytest.mark.parametrize("where", ["after", "before"])
@pytest.mark.parametrize("kind", ["EarlyStopping", "ReduceLROnPlateau"])
def test_early_stopping_and_reduce_lr_on_plateau_resume_with_their_counters(tmp_path, caplog, kind, where):
    """Never improving, resumed after epoch 2 of 4. Measured before their counters were saved:
    EarlyStopping (patience 2) stopped the unbroken run after epoch 3 and the resumed one trained
    all 4; ReduceLROnPlateau (patience 1) ended at lr 0.005 (listed after
    the checkpoint) or 0.0025 (before) against 0.00125. Now the step holds
    their counters (listed after the checkpoint, the epoch's on_epoch_end runs at the resume):
    epochs run, lr and every variable bit-equal, and no warning."""
    inputs = "arrays, steps_per_epoch=3 of 6 batches"

    def callbacks(ckpt):
        return [ckpt, *_patient(kind)] if where == "after" else [*_patient(kind), ckpt]

    model = _model()
    unbroken = model.fit(**_fit_inputs(inputs), epochs=4, verbose=0, callbacks=_patient(kind)).epoch
    reference, lr = _state(model), np.asarray(model.optimizer.learning_rate)
    first = OrbaxCheckpoint(str(tmp_path / "c"))
    _model().fit(**_fit_inputs(inputs), epochs=2, verbose=0, callbacks=callbacks(first))
    first.wait_until_finished()
    model = _model()
    resumed = OrbaxCheckpoint(str(tmp_path / "c"), resume=True)
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        epochs = model.fit(**_fit_inputs(inputs), epochs=4, verbose=0, callbacks=callbacks(resumed)).epoch
    resumed.wait_until_finished()
    assert unbroken == ([0, 1, 2] if kind == "EarlyStopping" else [0, 1, 2, 3])
    assert [0, 1, *epochs] == unbroken
    assert np.asarray(model.optimizer.learning_rate) == lr
    assert _equal(reference, _state(model))
    assert [r.getMessage() for r in caplog.records if "waited" not in r.getMessage()] == []


def test_early_stopping_restoring_best_weights_says_those_are_in_no_step(tmp_path, caplog):
    """Its counters come back; the weights it keeps cannot: one warning names best_weights."""
    def stopper():
        return [keras.callbacks.EarlyStopping(monitor="loss", patience=5, restore_best_weights=True)]

    _, _, lines = _interrupted_and_resumed(tmp_path, caplog, "arrays, steps_per_epoch=3 of 6 batches",
                                           callbacks=stopper)
    said = [line for line in lines if "EarlyStopping" in line]
    assert len(said) == 1 and "best_weights" in said[0] and "in no step" in said[0], lines


@pytest.mark.parametrize("epoch, steps, batches, per_execution, want", [
    (0, 4, 6, 1, 0), (1, 4, 6, 1, 4), (2, 4, 6, 1, 0), (3, 4, 6, 1, 4),  # 4, then the 2 left, then a new pass
    (2, 3, 6, 1, 0), (1, 3, 6, 1, 3), (5, None, 6, 1, 0), (1, 4, None, 1, None), (0, 4, None, 1, 0),
    (1, 3, 6, 2, 4), (2, 3, 6, 2, 0),  # executions of 2: an epoch of 3 steps runs 4 batches
])
def test_pass_offset_follows_kerass_epoch_iterator(epoch, steps, batches, per_execution, want):
    assert pass_offset(epoch, steps_per_epoch=steps, num_batches=batches, steps_per_execution=per_execution) == want


def test_counters_of_other_callbacks_than_the_steps_are_not_given_back_and_that_is_said(tmp_path, caplog):
    """Saved with EarlyStopping, resumed with ReduceLROnPlateau: the counters are matched by class
    and order, so none is given back, and one warning names both lists."""
    inputs = "arrays, steps_per_epoch=3 of 6 batches"
    first = OrbaxCheckpoint(str(tmp_path / "c"))
    _model().fit(**_fit_inputs(inputs), epochs=2, verbose=0, callbacks=[first, *_patient("EarlyStopping")])
    first.wait_until_finished()
    plateau = _patient("ReduceLROnPlateau")
    resumed = OrbaxCheckpoint(str(tmp_path / "c"), resume=True)
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        _model().fit(**_fit_inputs(inputs), epochs=3, verbose=0, callbacks=[resumed, *plateau])
    resumed.wait_until_finished()
    said = [r.getMessage() for r in caplog.records if "saved the counters" in r.getMessage()]
    assert len(said) == 1 and "['EarlyStopping']" in said[0] and "['ReduceLROnPlateau']" in said[0], said
