"""Preemption: SIGTERM makes `OrbaxCheckpoint` save at the next step boundary,
wait for the commit and stop `fit` cleanly; a rerun ends bit-identical to an
uninterrupted run."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import time

import keras
import numpy as np
import pytest

from shardckpt.conversion.info import inspect
from shardckpt.training import OrbaxCheckpoint, restore_latest
from tests._train_worker import AtBatch, sigterm_at
from tests.test_resume_kill import (
    EPOCHS,
    STEPS,
    Server,
    _args,
    _compare,
    _load,
    _progress,
    _wait_for_line,
)


class _Batches:
    """Endless deterministic batches with get_state/set_state."""

    def __init__(self) -> None:
        self.x = np.random.default_rng(0).standard_normal((32, 6)).astype("float32")
        self.n = 0

    def __iter__(self):
        return self

    def __next__(self):
        i = (self.n * 8) % 32
        self.n += 1
        return self.x[i : i + 8], np.ones((8, 1), "float32")

    def get_state(self):
        return {"n": self.n}

    def set_state(self, state):
        self.n = state["n"]


def _two_dense_adam_regressor() -> keras.Model:
    keras.utils.set_random_seed(2)
    # Explicit names: every model of a test has the same variable paths.
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, name="a"), keras.layers.Dense(1, name="b")],
                             name="seq")
    model.compile(optimizer=keras.optimizers.Adam(name="adam"), loss="mse")
    return model


@pytest.mark.parametrize("save_freq, expected_step", [(4, 6), ("epoch", 1)])
def test_sigterm_saves_commits_and_stops_fit_in_process(tmp_path, save_freq, expected_step):
    """In this very process: fit stops after batch 6 of 12, step committed, handler restored."""
    previous = signal.getsignal(signal.SIGTERM)
    data = _Batches()
    ckpt = OrbaxCheckpoint(str(tmp_path), save_freq=save_freq, max_to_keep=3, data_iterator=data)
    sender = sigterm_at(6)  # before ckpt: the notice is there at ckpt's hook of batch 6
    model = _two_dense_adam_regressor()
    model.fit(ckpt.batches(), steps_per_epoch=4, epochs=3, callbacks=[sender, ckpt], verbose=0)
    assert sender.seen == 6, "fit must stop at the step boundary after the notice"
    assert ckpt.preempted_step == expected_step and ckpt.preemption_mode == "signal"
    assert model.history.epoch == [0, 1]
    assert signal.getsignal(signal.SIGTERM) is previous
    info = inspect(str(tmp_path))
    assert info.step == expected_step and info.incomplete == []
    assert info.metadata["total_batches"] == 6 and info.metadata["batch"] == 2
    assert info.metadata["epoch"] == 1 and info.metadata["epoch_complete"] is False
    if save_freq == 4:
        assert info.steps == [4, 6]
    # The committed step holds the state fit stopped with.
    stopped = [np.asarray(v.value) for v in model.trainable_variables + model.optimizer.variables]
    check = _two_dense_adam_regressor()
    restore_latest(check, str(tmp_path))
    for want, v in zip(stopped, check.trainable_variables + check.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(v.value), want, err_msg=v.path)

    # Resumed with resume=True, the run completes; with save_freq="epoch" the
    # mid-epoch step 1 is replaced by the full epoch's step 1.
    again = OrbaxCheckpoint(str(tmp_path), save_freq=save_freq, max_to_keep=3, resume=True,
                            data_iterator=_Batches())
    model2 = _two_dense_adam_regressor()
    model2.fit(again.batches(), steps_per_epoch=4, epochs=3, callbacks=[again], verbose=0)
    assert again.resumed.step == expected_step and again.preempted_step is None
    meta = inspect(str(tmp_path)).metadata
    assert meta["epoch"] == 2 and meta["epoch_complete"] is True and meta["total_batches"] == 12
    if save_freq == "epoch":
        assert inspect(str(tmp_path)).steps == [0, 1, 2]


def test_epoch_mode_keeps_the_last_whole_epoch_beside_a_preempted_one(tmp_path):
    """save_freq="epoch", max_to_keep=1 (Keras' default): a preemption save of
    epoch 1 keeps step 0 (epoch 0 whole) beside it. The resumed run deletes the
    partial step 1 before it saves the whole epoch 1 under the same number; a
    kill between the two finds step 0, not an empty folder."""
    ckpt = OrbaxCheckpoint(str(tmp_path), save_freq="epoch", data_iterator=_Batches())
    model = _two_dense_adam_regressor()
    model.fit(ckpt.batches(), steps_per_epoch=4, epochs=3, callbacks=[sigterm_at(6), ckpt], verbose=0)
    assert ckpt.preempted_step == 1
    assert inspect(str(tmp_path)).steps == [0, 1]
    assert inspect(str(tmp_path / "0")).metadata["epoch_complete"] is True

    # The window: the resumed run has deleted the partial step 1 and is killed
    # before the whole epoch 1 commits. What is left resumes from epoch 0's end.
    window = tmp_path / "window"
    shutil.copytree(tmp_path / "0", window / "0")
    info = restore_latest(_two_dense_adam_regressor(), str(window))
    assert info.step == 0 and info.epoch_complete and info.total_batches == 4

    again = OrbaxCheckpoint(str(tmp_path), save_freq="epoch", resume=True, data_iterator=_Batches())
    model2 = _two_dense_adam_regressor()
    model2.fit(again.batches(), steps_per_epoch=4, epochs=3, callbacks=[again], verbose=0)
    assert again.resumed.step == 1
    # Once whole epochs follow, max_to_keep=1 holds again.
    assert inspect(str(tmp_path)).steps == [2]


@pytest.mark.parametrize("stop", ["sigterm", "stop_training"])
def test_rerun_with_only_the_last_batch_left_ends_at_the_unbroken_runs_data_position(tmp_path, stop):
    """A step saved after batch 11 of 3x4 leaves only the last epoch's last batch.

    The resumed fit peeks two batches at its start and trains one; the data
    iterator must still end where the uninterrupted run's does (12 batches),
    so a following fit starts on the same batch, and the arrays are bit-equal.
    """
    ref_data = _Batches()
    ref = _two_dense_adam_regressor()
    ref.fit((b for b in ref_data), steps_per_epoch=4, epochs=3, verbose=0)  # Keras alone, uninterrupted
    assert ref_data.get_state() == {"n": 12}

    ckpt = OrbaxCheckpoint(str(tmp_path), save_freq=11, data_iterator=_Batches())
    stopper = sigterm_at(11) if stop == "sigterm" else AtBatch(11, lambda m: setattr(m, "stop_training", True))
    _two_dense_adam_regressor().fit(ckpt.batches(), steps_per_epoch=4, epochs=3, callbacks=[stopper, ckpt], verbose=0)
    assert ckpt.preempted_step == (11 if stop == "sigterm" else None)
    meta = inspect(str(tmp_path)).metadata
    assert (meta["total_batches"], meta["epoch"], meta["batch"], meta["epoch_complete"]) == (11, 2, 3, False)

    data = _Batches()
    again = OrbaxCheckpoint(str(tmp_path), save_freq=11, resume=True, data_iterator=data)
    model = _two_dense_adam_regressor()
    model.fit(again.batches(), steps_per_epoch=4, epochs=3, callbacks=[again], verbose=0)
    assert again.resumed.step == 11 and model.history.epoch == [2]
    assert data.get_state() == ref_data.get_state()
    for want, got in zip(ref.trainable_variables + ref.optimizer.variables,
                         model.trainable_variables + model.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(got.value), np.asarray(want.value), err_msg=got.path)


def test_epoch_mode_stop_training_mid_epoch_saves_a_partial_epoch_and_the_resume_is_exact(tmp_path, caplog):
    """save_freq="epoch": a callback that sets `stop_training` after batch 6 of 3x4 ends epoch 1
    after 2 of its 4 batches, and Keras still calls `on_epoch_end`. Step 1 must say so (a partial
    epoch, said once) rather than claim the epoch whole: a resume then trains the 6 batches left
    and ends bit-equal to the unbroken run, not 2 batches short."""
    caplog.set_level(logging.WARNING, logger="shardckpt")
    ref_data = _Batches()
    ref = _two_dense_adam_regressor()
    ref.fit((b for b in ref_data), steps_per_epoch=4, epochs=3, verbose=0)  # Keras alone, uninterrupted

    ckpt = OrbaxCheckpoint(str(tmp_path), save_freq="epoch", data_iterator=_Batches())
    stopper = AtBatch(6, lambda m: setattr(m, "stop_training", True))
    _two_dense_adam_regressor().fit(ckpt.batches(), steps_per_epoch=4, epochs=3, callbacks=[stopper, ckpt],
                                    verbose=0)
    info = inspect(str(tmp_path))
    assert info.steps == [0, 1]  # the last whole epoch is kept beside the partial one
    assert (info.metadata["total_batches"], info.metadata["epoch"], info.metadata["batch"],
            info.metadata["epoch_complete"]) == (6, 1, 2, False)
    said = [r.getMessage() for r in caplog.records if "saved as a partial epoch" in r.getMessage()]
    assert len(said) == 1 and "epoch 1 ended after 2 of its 4 batches" in said[0], said

    data = _Batches()
    again = OrbaxCheckpoint(str(tmp_path), save_freq="epoch", resume=True, data_iterator=data)
    model = _two_dense_adam_regressor()
    model.fit(again.batches(), steps_per_epoch=4, epochs=3, callbacks=[again], verbose=0)
    assert again.resumed.step == 1 and model.history.epoch == [1, 2]
    assert int(model.optimizer.iterations) == 12 and data.get_state() == ref_data.get_state()
    for want, got in zip(ref.trainable_variables + ref.optimizer.variables,
                         model.trainable_variables + model.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(got.value), np.asarray(want.value), err_msg=got.path)
    assert inspect(str(tmp_path)).metadata["epoch_complete"] is True


class _StopAtEpochEnd(keras.callbacks.Callback):
    """Stops fit at the end of `epoch`, as EarlyStopping and TerminateOnNaN do (in `on_epoch_end`)."""

    def __init__(self, epoch: int) -> None:
        super().__init__()
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch:
            self.model.stop_training = True


def _stop_after(n: int) -> AtBatch:
    return AtBatch(n, lambda m: setattr(m, "stop_training", True))


@pytest.mark.parametrize("stopper, where", [
    (lambda resumed: _StopAtEpochEnd(1), "before"),
    (lambda resumed: _stop_after(2 if resumed else 8), "before"),
    (lambda resumed: _stop_after(2 if resumed else 8), "after"),
], ids=["epoch_end_stop", "last_batch_stop_listed_before", "last_batch_stop_listed_after"])
def test_a_stop_at_the_end_of_a_resumed_epoch_is_kept(tmp_path, stopper, where):
    """The callback ends a resumed epoch early through `stop_training` and clears the flag at the
    epoch's end. Another callback's stop in that epoch (in `on_epoch_end`, or after its last batch,
    listed before or after the checkpoint) must still stop fit after epoch 1, as it does in the
    uninterrupted run: 8 batches, bit-equal."""
    ref_data = _Batches()
    ref = _two_dense_adam_regressor()
    ref.fit((b for b in ref_data), steps_per_epoch=4, epochs=3, callbacks=[stopper(False)], verbose=0)
    assert ref.history.epoch == [0, 1] and ref_data.get_state() == {"n": 8}

    ckpt = OrbaxCheckpoint(str(tmp_path), save_freq=2, data_iterator=_Batches())
    _two_dense_adam_regressor().fit(ckpt.batches(), steps_per_epoch=4, epochs=3, callbacks=[_stop_after(6), ckpt],
                                    verbose=0)
    assert inspect(str(tmp_path)).metadata["total_batches"] == 6

    data = _Batches()
    again = OrbaxCheckpoint(str(tmp_path), save_freq=2, resume=True, data_iterator=data)
    callbacks = [stopper(True), again] if where == "before" else [again, stopper(True)]
    model = _two_dense_adam_regressor()
    model.fit(again.batches(), steps_per_epoch=4, epochs=3, callbacks=callbacks, verbose=0)
    assert model.history.epoch == [1] and data.get_state() == ref_data.get_state()
    for want, got in zip(ref.trainable_variables + ref.optimizer.variables,
                         model.trainable_variables + model.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(got.value), np.asarray(want.value), err_msg=got.path)


def test_epoch_mode_stop_training_in_an_epoch_of_unknown_length_says_the_step_counts_it_whole(tmp_path, caplog):
    """Without steps_per_epoch no count tells a stopped epoch from a whole one (Keras knows none
    either): step 0 is saved as a whole epoch, as Keras would, and the callback says so once."""
    caplog.set_level(logging.WARNING, logger="shardckpt")
    ckpt = OrbaxCheckpoint(str(tmp_path), save_freq="epoch")
    stopper = AtBatch(2, lambda m: setattr(m, "stop_training", True))
    batches = (b for _, b in zip(range(4), _Batches()))  # 4 batches, length unknown to fit
    _two_dense_adam_regressor().fit(batches, epochs=1, callbacks=[stopper, ckpt], verbose=0)
    assert inspect(str(tmp_path)).metadata["epoch_complete"] is True
    said = [r.getMessage() for r in caplog.records if "model.stop_training was set" in r.getMessage()]
    assert len(said) == 1 and "steps_per_epoch=None" in said[0] and "Fix: pass steps_per_epoch" in said[0], said


def _regressor_two_batches_per_execution() -> keras.Model:
    model = _two_dense_adam_regressor()
    model.compile(optimizer=keras.optimizers.Adam(name="adam"), loss="mse", steps_per_execution=2)
    return model


@pytest.mark.parametrize("stop", ["sigterm", "stop_training"])
def test_with_steps_per_execution_a_resumed_run_saves_on_the_unbroken_runs_steps(tmp_path, stop):
    """steps_per_execution=2, save_freq=3: Keras sees batches in pairs and restarts its count at
    each save, so the unbroken run saves at 4, 8, 12 (not at multiples of 3). A run stopped after 6
    batches (a preemption save at 6, or none) and resumed must save at 8 and 12 again, bit-equal."""
    ref_dir = str(tmp_path / "ref")
    ref = _regressor_two_batches_per_execution()
    ckpt = OrbaxCheckpoint(ref_dir, save_freq=3, max_to_keep=None, data_iterator=_Batches())
    ref.fit(ckpt.batches(), steps_per_epoch=4, epochs=3, callbacks=[ckpt], verbose=0)
    assert inspect(ref_dir).steps == [4, 8, 12]

    stopper = sigterm_at(3) if stop == "sigterm" else AtBatch(3, lambda m: setattr(m, "stop_training", True))
    ckpt = OrbaxCheckpoint(str(tmp_path / "run"), save_freq=3, max_to_keep=None, data_iterator=_Batches())
    _regressor_two_batches_per_execution().fit(ckpt.batches(), steps_per_epoch=4, epochs=3,
                                              callbacks=[stopper, ckpt], verbose=0)  # (3 executions: 6 batches)
    first = [4, 6] if stop == "sigterm" else [4]
    assert inspect(str(tmp_path / "run")).steps == first
    again = OrbaxCheckpoint(str(tmp_path / "run"), save_freq=3, max_to_keep=None, resume=True,
                            data_iterator=_Batches())
    model = _regressor_two_batches_per_execution()
    model.fit(again.batches(), steps_per_epoch=4, epochs=3, callbacks=[again], verbose=0)
    # The preemption step 6 is a resume point only: step 8 supersedes it, even with max_to_keep=None.
    assert inspect(str(tmp_path / "run")).steps == [4, 8, 12]
    for want, got in zip(ref.trainable_variables + ref.optimizer.variables,
                         model.trainable_variables + model.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(got.value), np.asarray(want.value), err_msg=got.path)


def test_a_second_fit_with_gradient_accumulation_counts_on_from_the_batches_of_the_first(tmp_path):
    """With gradient_accumulation_steps=3, optimizer.iterations is 1 after 4 batches: a second fit of
    the same model must go on at batch 4 (steps 6, 8), not at 1 (refused: step 4 exists)."""
    model = _two_dense_adam_regressor()
    model.compile(optimizer=keras.optimizers.Adam(name="adam", gradient_accumulation_steps=3), loss="mse")
    data = _Batches()
    for _ in range(2):  # a new callback object each time: what it counts on from is the model's
        ckpt = OrbaxCheckpoint(str(tmp_path), save_freq=2, max_to_keep=None)
        model.fit((b for b in data), steps_per_epoch=4, epochs=1, callbacks=[ckpt], verbose=0)
    assert int(model.optimizer.iterations) == 2 and inspect(str(tmp_path)).steps == [2, 4, 6, 8]
    assert inspect(str(tmp_path)).metadata["total_batches"] == 8


def test_restore_latest_of_a_partial_epoch_says_fit_would_train_it_from_its_first_batch(tmp_path, caplog):
    """fit(initial_epoch=info.next_epoch) after it would train 14 batches where the run had 12; a
    step of whole epochs gets no warning."""
    caplog.set_level(logging.WARNING, logger="shardckpt")
    ckpt = OrbaxCheckpoint(str(tmp_path), save_freq="epoch", max_to_keep=None, data_iterator=_Batches())
    _two_dense_adam_regressor().fit(ckpt.batches(), steps_per_epoch=4, epochs=3,
                                    callbacks=[sigterm_at(6), ckpt], verbose=0)
    info = restore_latest(_two_dense_adam_regressor(), str(tmp_path), data_iterator=_Batches())
    assert (info.step, info.epoch_complete, info.next_epoch) == (1, False, 1)
    said = [r.getMessage() for r in caplog.records if "holds part of epoch" in r.getMessage()]
    assert said == ["step 1 holds part of epoch 1 (2 of 4 batches trained): fit(initial_epoch=1) would train "
                    "that epoch from its first batch again, with the data going on from where it stopped, and "
                    "end past the run it continues. Fix: continue it with OrbaxCheckpoint(directory, "
                    "resume=True) in fit (fed from ckpt.batches()), which finishes the epoch's remaining "
                    "batches."], said
    caplog.clear()
    shutil.rmtree(tmp_path / "1")  # step 0: epoch 0 whole
    assert restore_latest(_two_dense_adam_regressor(), str(tmp_path)).epoch_complete
    assert not [r for r in caplog.records if "holds part of epoch" in r.getMessage()]


def test_a_batches_generator_fed_to_a_second_fit_is_left_where_keras_left_it(tmp_path):
    """The end-of-fit rewind counts batches from the generator's first fit only:
    fed again (not supported for saves), the iterator is not moved back."""
    data = _Batches()
    ckpt = OrbaxCheckpoint(str(tmp_path), save_freq=100, data_iterator=data)
    batches = ckpt.batches()
    model = _two_dense_adam_regressor()
    model.fit(batches, steps_per_epoch=3, epochs=1, callbacks=[ckpt], verbose=0)
    assert data.get_state() == {"n": 3}
    model.fit(batches, steps_per_epoch=3, epochs=1, callbacks=[ckpt], verbose=0)
    assert data.get_state() == {"n": 6}


def test_sigterm_handler_is_only_installed_during_fit(tmp_path):
    seen = []

    def mine(signum, frame):
        seen.append(signum)

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        ckpt = OrbaxCheckpoint(str(tmp_path), save_freq="epoch")
        model = _two_dense_adam_regressor()
        model.fit(np.ones((8, 6), "float32"), np.ones((8, 1), "float32"), epochs=1, callbacks=[ckpt], verbose=0)
        assert signal.getsignal(signal.SIGTERM) is mine
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert seen == [signal.SIGTERM] and ckpt.preempted_step is None
        off = OrbaxCheckpoint(str(tmp_path / "off"), save_on_preemption=False)
        model.fit(np.ones((8, 6), "float32"), np.ones((8, 1), "float32"), epochs=1,
                  callbacks=[off, sigterm_at(1)], verbose=0)
        assert seen == [signal.SIGTERM] * 2 and off.preempted_step is None  # ours never ran
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(str(tmp_path_factory.mktemp("server") / "server.log"))
    yield srv
    srv.close()


@pytest.mark.parametrize("save_freq", [4, "epoch"], ids=["every_4_batches", "every_epoch"])
def test_sigterm_at_random_moments_then_rerun_is_bit_exact(server, tmp_path, save_freq):
    """5 SIGTERM trials per save mode (10 in all): clean exit, committed step, exact rerun."""
    cache = str(tmp_path / "jax_cache")
    ref = _args(tmp_path, "ref", save_freq, cache)
    pid = server.start(ref)
    assert server.wait(pid) == 0, "the uninterrupted run failed; see the server log"
    ref_arrays, ref_info = _load(ref["out"])

    rng = np.random.default_rng(3030 if save_freq == 4 else 3031)
    total = EPOCHS * STEPS
    stopped_early = mid_epoch = 0
    for trial in range(5):
        args = _args(tmp_path, f"t{trial}", save_freq, cache)
        pid = server.start(args)
        # The notice comes at least 6 batches before the end: a batch of this model takes a few
        # milliseconds, and the notice is sent up to 50 ms after the marker line.
        marker = f"b {int(rng.integers(1, total - 6))}"
        if _wait_for_line(args["progress"], marker, pid):
            time.sleep(rng.uniform(0.0, 0.05))
            os.kill(pid, signal.SIGTERM)
        assert server.wait(pid) == 0, f"trial {trial}: SIGTERM must end the run cleanly"
        _, info = _load(args["out"])
        batches = [int(line[2:]) for line in _progress(args["progress"]) if line.startswith("b ")]
        if info["preempted_step"] is not None:
            assert max(batches) < total, f"trial {trial}: fit went on after the notice"
            stopped_early += 1
            names = os.listdir(args["dir"])
            assert str(info["preempted_step"]) in names
            assert not [n for n in names if ".orbax-checkpoint-tmp" in n], "the save must be committed"
            meta = inspect(args["dir"]).metadata
            assert meta["total_batches"] == max(batches), f"trial {trial}: saved at the step it stopped"
            mid_epoch += not meta["epoch_complete"]

        pid = server.start(args)  # same directory: resumes
        assert server.wait(pid) == 0, f"trial {trial}: the rerun failed; see the server log"
        arrays, info = _load(args["out"])
        assert info["resumed_step"] is not None
        _compare(arrays, info, ref_arrays, ref_info, f"trial {trial} ({marker})")
    print(f"save_freq={save_freq}: stopped early {stopped_early}/5, mid-epoch {mid_epoch}")
    assert stopped_early >= 4, "most notices must stop the run before its end"
    assert mid_epoch >= 1, "at least one preemption save must fall in the middle of an epoch"


def _decaying() -> keras.callbacks.LearningRateScheduler:
    return keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr * 0.9)  # depends on the current rate


@pytest.mark.parametrize("where", ["before", "after"])
def test_a_schedule_of_the_current_rate_is_not_applied_twice_to_an_epoch_resumed_mid_way(tmp_path, where):
    """SIGTERM after batch 6 of 3x4: the step holds epoch 1's rate (0.01 * 0.9**2). The resumed fit
    calls on_epoch_begin(1) again; measured before the fix, the schedule stepped twice (final rate
    0.0006561 against 0.000729) and the weights differed. Now: rate and weights bit-equal."""
    ref_data = _Batches()
    ref = _two_dense_adam_regressor()
    ref.fit((b for b in ref_data), steps_per_epoch=4, epochs=3, callbacks=[_decaying()], verbose=0)

    def callbacks(ckpt, *extra):
        return [*extra, _decaying(), ckpt] if where == "before" else [*extra, ckpt, _decaying()]

    ckpt = OrbaxCheckpoint(str(tmp_path), save_freq="epoch", data_iterator=_Batches())
    _two_dense_adam_regressor().fit(ckpt.batches(), steps_per_epoch=4, epochs=3,
                                    callbacks=callbacks(ckpt, sigterm_at(6)), verbose=0)
    assert ckpt.preempted_step == 1

    again = OrbaxCheckpoint(str(tmp_path), save_freq="epoch", resume=True, data_iterator=_Batches())
    model = _two_dense_adam_regressor()
    model.fit(again.batches(), steps_per_epoch=4, epochs=3, callbacks=callbacks(again), verbose=0)
    assert again.resumed.step == 1 and not again.resumed.epoch_complete and model.history.epoch == [1, 2]
    assert np.asarray(model.optimizer.learning_rate) == np.asarray(ref.optimizer.learning_rate)
    for want, got in zip(ref.trainable_variables + ref.optimizer.variables,
                         model.trainable_variables + model.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(got.value), np.asarray(want.value), err_msg=got.path)


@pytest.mark.parametrize("at", [6, 8], ids=["mid_epoch", "after_the_epochs_last_batch"])
def test_reduce_lr_on_plateau_resumes_from_a_step_saved_after_a_batch(tmp_path, at):
    """save_freq=4, SIGTERM after batch `at` of 4x4, never improving (patience 1). A step saved
    after batch 8 precedes epoch 1's on_epoch_end: the resume runs it with the step's logs (the rate
    is halved there, as in the unbroken run); a step after batch 6 resumes epoch 1, whose
    on_epoch_end runs in the resumed fit. Rate, epochs and variables bit-equal."""
    def plateau():
        return keras.callbacks.ReduceLROnPlateau(monitor="loss", patience=1, factor=0.5, min_delta=1e9)

    ref = _two_dense_adam_regressor()
    ref.fit((b for b in _Batches()), steps_per_epoch=4, epochs=4, callbacks=[plateau()], verbose=0)
    ckpt = OrbaxCheckpoint(str(tmp_path), save_freq=4, data_iterator=_Batches())
    _two_dense_adam_regressor().fit(ckpt.batches(), steps_per_epoch=4, epochs=4,
                                    callbacks=[sigterm_at(at), ckpt, plateau()], verbose=0)
    again = OrbaxCheckpoint(str(tmp_path), save_freq=4, resume=True, data_iterator=_Batches())
    model = _two_dense_adam_regressor()
    model.fit(again.batches(), steps_per_epoch=4, epochs=4, callbacks=[again, plateau()], verbose=0)
    assert again.resumed.step == at and model.history.epoch == ([1, 2, 3] if at == 6 else [2, 3])
    assert np.asarray(model.optimizer.learning_rate) == np.asarray(ref.optimizer.learning_rate)
    for want, got in zip(ref.trainable_variables + ref.optimizer.variables,
                         model.trainable_variables + model.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(got.value), np.asarray(want.value), err_msg=got.path)


def test_a_resume_in_epoch_0_starts_there_even_when_fit_is_given_an_initial_epoch(tmp_path, caplog):
    """Keras starts at `model._initial_epoch or initial_epoch`: the resume's epoch 0 read as unset, so a
    run preempted in epoch 0 and resumed with fit(initial_epoch=1) trained epochs 2 and 3 only
    (measured: other weights) under an INFO line saying it continues at epoch 1. Now it trains from
    epoch 1's third batch, bit-equal, and the warning names the initial_epoch not used."""
    ref = _two_dense_adam_regressor()
    ckpt = OrbaxCheckpoint(str(tmp_path / "ref"), data_iterator=_Batches())
    ref.fit(ckpt.batches(), steps_per_epoch=4, epochs=3, callbacks=[ckpt], verbose=0)
    ckpt = OrbaxCheckpoint(str(tmp_path / "run"), data_iterator=_Batches())
    _two_dense_adam_regressor().fit(ckpt.batches(), steps_per_epoch=4, epochs=3, callbacks=[sigterm_at(2), ckpt],
                                    verbose=0)
    assert ckpt.preempted_step == 0
    again = OrbaxCheckpoint(str(tmp_path / "run"), resume=True, data_iterator=_Batches())
    model = _two_dense_adam_regressor()
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        epochs = model.fit(again.batches(), steps_per_epoch=4, epochs=3, initial_epoch=1, callbacks=[again],
                           verbose=0).epoch
    assert epochs == [0, 1, 2]
    for want, got in zip(ref.trainable_variables + ref.optimizer.variables,
                         model.trainable_variables + model.optimizer.variables, strict=True):
        np.testing.assert_array_equal(np.asarray(got.value), np.asarray(want.value), err_msg=got.path)
    said = [r.getMessage() for r in caplog.records if "initial_epoch" in r.getMessage()]
    assert len(said) == 1 and "fit(initial_epoch=1) is not used: the step sets it to 0" in said[0], said


def _ema_mixed_regressor() -> keras.Model:
    keras.utils.set_random_seed(2)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, name="a"), keras.layers.Dense(1, name="b")],
                             name="seq")
    optimizer = keras.optimizers.Adam(name="adam", use_ema=True, ema_overwrite_frequency=5, global_clipnorm=1.0)
    model.compile(optimizer=optimizer, loss="mse", steps_per_execution=3)
    return model


def test_ema_loss_scale_and_steps_per_execution_resume_mid_epoch_bit_equal(tmp_path):
    """Audit (exact before this test, kept so): use_ema with ema_overwrite_frequency=5 (weights
    overwritten every 5 updates and at fit's end), global_clipnorm, mixed_float16 (a
    LossScaleOptimizer whose scale halves on overflow), steps_per_execution=3 with save_freq=4,
    preempted after 9 of 12 batches: the EMA copies, the scale and its counter are optimizer
    variables of the step, and the resumed run ends bit-equal to the unbroken one."""
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        ref = _ema_mixed_regressor()
        ckpt = OrbaxCheckpoint(str(tmp_path / "ref"), save_freq=4, data_iterator=_Batches())
        ref.fit(ckpt.batches(), steps_per_epoch=6, epochs=2, callbacks=[ckpt], verbose=0)
        ckpt = OrbaxCheckpoint(str(tmp_path / "run"), save_freq=4, data_iterator=_Batches())
        _ema_mixed_regressor().fit(ckpt.batches(), steps_per_epoch=6, epochs=2, callbacks=[sigterm_at(3), ckpt],
                                   verbose=0)  # (3 executions: 9 batches)
        assert ckpt.preempted_step == 9
        again = OrbaxCheckpoint(str(tmp_path / "run"), save_freq=4, resume=True, data_iterator=_Batches())
        model = _ema_mixed_regressor()
        model.fit(again.batches(), steps_per_epoch=6, epochs=2, callbacks=[again], verbose=0)
    finally:
        keras.mixed_precision.set_global_policy(previous)
    names = [v.path for v in ref.optimizer.variables]
    assert any("average" in n for n in names) and "loss_scale_optimizer/dynamic_scale" in names, names
    scale = next(v for v in ref.optimizer.variables if v.path.endswith("dynamic_scale"))
    assert float(scale.value) != 2.0**15, "the scale moved in the run (overflow steps skipped)"
    for want, got in zip(ref.variables + ref.optimizer.variables, model.variables + model.optimizer.variables,
                         strict=True):
        np.testing.assert_array_equal(np.asarray(got.value), np.asarray(want.value), err_msg=got.path)


_AFTER_A_RAISED_FIT = """
import os, signal, sys
import numpy as np, keras, shardckpt
from tests._train_worker import AtBatch, sigterm_at

class Boom(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 1:
            raise RuntimeError("a user's callback failed")

model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
model.compile("adam", "mse")
x, y = np.ones((32, 4), "float32"), np.ones((32, 2), "float32")
try:  # a SIGTERM notice, then the fit raises before it saves: its watch is never stopped
    model.fit(x, y, batch_size=4, verbose=0,
              callbacks=[sigterm_at(2), Boom(), shardckpt.OrbaxCheckpoint(sys.argv[1] + "/a", save_freq=100)])
except RuntimeError:
    pass
ckpt = shardckpt.OrbaxCheckpoint(sys.argv[1] + "/b", save_freq=100)
model.fit(x, y, batch_size=4, verbose=0, callbacks=[sigterm_at(3), ckpt])
print("preempted", ckpt.preempted_step)
"""


def test_a_sigterm_after_a_fit_that_raised_past_its_notice_saves_rather_than_ending_the_process(tmp_path):
    # The first fit's watch stayed installed with its notice set, so the next fit's first SIGTERM
    # was taken for a second notice and ended the process (exit -15; a pytest worker in CI).
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu", KERAS_BACKEND="jax")
    done = subprocess.run([sys.executable, "-c", _AFTER_A_RAISED_FIT, str(tmp_path)], env=env, cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "preempted 5"  # saved at the notice: 2 + 3 batches trained
