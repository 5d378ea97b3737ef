"""Several `OrbaxCheckpoint`s in one `fit`: each saves every step it should and resumes exactly.

Users keep a frequent local checkpoint and a per-epoch one in a bucket. The
two callbacks share one process (one Orbax, one signal table), so neither may
break the other's saves, and each folder alone must resume bit-identically to
a run never interrupted. The data repeats every epoch (32 rows, 4 batches of
8), so the per-epoch folder resumes with fresh batches and the frequent one
resumes mid-epoch through `batches()`.
"""

from __future__ import annotations

import gc
import logging
import signal
import weakref

import keras
import numpy as np
import pytest

from shardckpt import load_sharded
from shardckpt.conversion.info import inspect
from shardckpt.errors import ConfigurationError, StepExistsError
from shardckpt.formats.orbax import ondisk
from shardckpt.training import OrbaxCheckpoint
from tests._train_worker import sigterm_at
from tests.support import assert_training_state_equal, column_then_row_parallel, training_state
from tests.test_callback import _small_regressor_16
from tests.test_preemption import _Batches, _two_dense_adam_regressor
from tests.zoo import CountingIterator

STEPS, EPOCHS, ROWS = 4, 3, 32


def _run(frequent: str, per_epoch: str, also: str | None = None, *, seed: int = 3, resume: str = "", extra: list | None = None) -> tuple[keras.Model, list[OrbaxCheckpoint]]:
    """One fit with a save_freq=2 callback into `frequent` and per-epoch ones into `per_epoch` (and `also`).

    `resume` names the folder that resumes; the fit draws from the frequent
    one's `batches()` unless a per-epoch one resumes (a per-epoch step resumes
    with fresh batches: the data repeats each epoch).
    """
    keras.backend.clear_session()
    keras.distribution.set_distribution(column_then_row_parallel("hidden", "head"))
    model = _small_regressor_16(seed)
    ckpts = [OrbaxCheckpoint(frequent, save_freq=2, max_to_keep=None, data_iterator=CountingIterator(ROWS),
                             resume=resume == frequent)]
    ckpts += [OrbaxCheckpoint(d, max_to_keep=None, resume=resume == d) for d in (per_epoch, also) if d]
    callbacks = (extra or []) + ckpts  # (a SIGTERM sent first is seen at the same batch by every one)
    data = ckpts[0].batches() if resume in ("", frequent) else (batch for batch in CountingIterator(ROWS))
    model.fit(data, steps_per_epoch=STEPS, epochs=EPOCHS, callbacks=callbacks, verbose=0)
    for ckpt in ckpts:
        ckpt.wait_until_finished()
    return model, ckpts


def _steps(directory: str) -> list[int]:
    return sorted(ondisk.committed_steps(directory))


def test_local_and_bucket_callbacks_in_one_fit_each_save_and_resume_exactly(tmp_path, gcs_server):
    bucket = gcs_server.new_bucket()
    reference, (a, b, c) = _run(str(tmp_path / "ref_a"), f"{bucket}/ref_b", str(tmp_path / "ref_c"))
    expected = training_state(reference)
    shardings = {v.path: v.value.sharding for v in reference.trainable_variables}
    assert str(shardings["hidden/kernel"].spec) == "P(None, 'model')"
    assert _steps(a.directory) == [2, 4, 6, 8, 10, 12]
    assert _steps(b.directory) == _steps(c.directory) == [0, 1, 2]
    # The last step of each holds the final state.
    for step in (f"{a.directory}/12", f"{b.directory}/2", f"{c.directory}/2"):
        keras.backend.clear_session()  # (also clears the distribution)
        keras.distribution.set_distribution(column_then_row_parallel("hidden", "head"))
        again = _small_regressor_16(seed=42)
        again.optimizer.build(again.trainable_variables)
        again.evaluate(np.ones((8, 6), "float32"), np.ones((8, 1), "float32"), verbose=0)  # builds the metrics
        load_sharded(again, step, progress=False)
        assert_training_state_equal(again, expected)

    # Preempted after 7 batches (epoch 1, batch 3 of 4): each callback saves
    # the stopping point (the per-epoch ones as an unfinished epoch 1).
    frequent, per_epoch, local_epoch = str(tmp_path / "a"), f"{bucket}/b", str(tmp_path / "c")
    _, ckpts = _run(frequent, per_epoch, local_epoch, extra=[sigterm_at(7)])
    assert [ckpt.preempted_step for ckpt in ckpts] == [7, 1, 1]
    assert _steps(frequent) == [2, 4, 6, 7]
    assert _steps(per_epoch) == _steps(local_epoch) == [0, 1]

    # Each folder alone resumes to the unbroken run's state, beside a fresh callback that saves.
    resumed, (a2, b2) = _run(frequent, str(tmp_path / "fresh1"), resume=frequent, seed=42)
    assert a2.resumed.step == 7 and not a2.resumed.epoch_complete
    assert_training_state_equal(resumed, expected)
    assert all(v.value.sharding == shardings[v.path] for v in resumed.trainable_variables)
    # The preemption step 7 was a resume point only: step 8 superseded it (the unbroken run's steps).
    assert _steps(frequent) == [2, 4, 6, 8, 10, 12] and _steps(b2.directory) == [1, 2]
    for i, directory in enumerate((per_epoch, local_epoch)):
        resumed, (_, resumer) = _run(str(tmp_path / f"fresh_{i}"), directory, resume=directory, seed=42)
        assert resumer.resumed.step == 0 and resumer.resumed.epoch_complete, directory
        assert_training_state_equal(resumed, expected)
        assert all(v.value.sharding == shardings[v.path] for v in resumed.trainable_variables)
        assert _steps(directory) == [0, 1, 2]


def test_a_sigterm_saves_in_every_callback_and_fit_leaves_the_handler_it_found(tmp_path):
    """Both callbacks see the notice (each saves the stopping step); the handler is put back."""
    before = signal.getsignal(signal.SIGTERM)
    _, (a, b) = _run(str(tmp_path / "a"), str(tmp_path / "b"), extra=[sigterm_at(5)])
    assert (a.preempted_step, b.preempted_step) == (5, 1)
    assert _steps(a.directory) == [2, 4, 5] and _steps(b.directory) == [0, 1]
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("frequent_first", [True, False], ids=["frequent_listed_first", "per_epoch_listed_first"])
def test_a_callback_beside_the_one_that_resumes_counts_on_from_its_step(tmp_path, frequent_first):
    """After a SIGTERM both callbacks saved (frequent: step 6; per-epoch: step 0 and a partial
    step 1). The rerun resumes the frequent folder only. The per-epoch callback, listed before or
    after it, must count on from step 6 (epoch 1, 2 of 4 batches), not from what it saw before the
    restore: its step 1 is replaced by the whole epoch 1 (8 batches), no false "stopped" warning,
    and the model ends bit-equal to the unbroken run."""
    ref_data = _Batches()
    ref = _two_dense_adam_regressor()
    ref.fit((b for b in ref_data), steps_per_epoch=4, epochs=3, verbose=0)
    frequent, per_epoch = str(tmp_path / "frequent"), str(tmp_path / "per_epoch")

    def callbacks(a: OrbaxCheckpoint, b: OrbaxCheckpoint) -> list[OrbaxCheckpoint]:
        return [a, b] if frequent_first else [b, a]

    a = OrbaxCheckpoint(frequent, save_freq=2, data_iterator=_Batches())
    b = OrbaxCheckpoint(per_epoch, max_to_keep=None)
    _two_dense_adam_regressor().fit(a.batches(), steps_per_epoch=4, epochs=3,
                                    callbacks=[sigterm_at(6), *callbacks(a, b)], verbose=0)
    assert (a.preempted_step, b.preempted_step) == (6, 1)
    assert inspect(per_epoch).metadata["epoch_complete"] is False

    data = _Batches()
    a = OrbaxCheckpoint(frequent, save_freq=2, resume=True, data_iterator=data)
    b = OrbaxCheckpoint(per_epoch, max_to_keep=None)
    model = _two_dense_adam_regressor()
    model.fit(a.batches(), steps_per_epoch=4, epochs=3, callbacks=callbacks(a, b), verbose=0)
    assert a.resumed.step == 6 and b.resumed is None and data.get_state() == ref_data.get_state()
    assert_training_state_equal(model, training_state(ref))
    assert _steps(per_epoch) == [0, 1, 2]
    for step in (0, 1, 2):
        meta = inspect(f"{per_epoch}/{step}").metadata
        assert (meta["epoch"], meta["epoch_complete"], meta["total_batches"]) == (step, True, 4 * (step + 1)), meta


def test_two_callbacks_that_both_resume_are_refused_before_either_trains(tmp_path):
    """Each would restore its own step into the same model, the later over the earlier."""
    a = OrbaxCheckpoint(str(tmp_path / "a"), save_freq=2, data_iterator=_Batches())
    b = OrbaxCheckpoint(str(tmp_path / "b"))
    _two_dense_adam_regressor().fit(a.batches(), steps_per_epoch=4, epochs=2, callbacks=[a, b], verbose=0)
    a = OrbaxCheckpoint(str(tmp_path / "a"), save_freq=2, resume=True, data_iterator=_Batches())
    b = OrbaxCheckpoint(str(tmp_path / "b"), resume=True)
    model = _two_dense_adam_regressor()
    with pytest.raises(ConfigurationError, match=r"Two OrbaxCheckpoint callbacks of this fit have resume=True") as e:
        model.fit(a.batches(), steps_per_epoch=4, epochs=3, callbacks=[a, b], verbose=0)
    assert str(tmp_path / "a") in str(e.value) and str(tmp_path / "b") in str(e.value)
    assert "Fix: resume=True on one of them only" in str(e.value)
    assert int(model.optimizer.iterations) == 8  # a's restore, and not one batch trained after it
    assert _steps(str(tmp_path / "a")) == [8] and _steps(str(tmp_path / "b")) == [1]



@pytest.mark.parametrize("refusal", ["two_resumes", "steps_below_committed", "restart_of_a_trained_model"])
def test_a_fit_one_callback_refuses_leaves_the_sigterm_handler_and_absl_as_it_found_them(tmp_path, refusal):
    """Keras calls no on_train_end after a hook raised. The callback listed before the one that
    refuses the fit (in its on_train_begin, or at the first on_epoch_begin) had started its watch
    and absl filter: they stayed, so the process's next SIGTERM, after fit, was taken for a notice
    ("saving at the next step boundary") and did not end it, and absl's "Skipping merge" lines
    stayed filtered. Every callback of the refused fit that started is stopped now."""
    data = np.ones((ROWS, 6), "float32"), np.ones((ROWS, 1), "float32")
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    model = _two_dense_adam_regressor()
    if refusal == "two_resumes":
        model.fit(*data, batch_size=8, epochs=1, callbacks=[OrbaxCheckpoint(a), OrbaxCheckpoint(b)], verbose=0)
        callbacks, error = [OrbaxCheckpoint(a, resume=True), OrbaxCheckpoint(b, resume=True)], ConfigurationError
        model = _two_dense_adam_regressor()
    elif refusal == "steps_below_committed":  # b holds step 8 of another run; this fit's saves start at 1
        _two_dense_adam_regressor().fit(*data, batch_size=8, epochs=2, callbacks=[OrbaxCheckpoint(b, save_freq=4)],
                                        verbose=0)
        callbacks, error = [OrbaxCheckpoint(a), OrbaxCheckpoint(b, save_freq=4)], StepExistsError
    else:  # b's only step is part of an epoch this model has trained past (a second fit of it)
        model.fit(*data, batch_size=8, epochs=1, callbacks=[OrbaxCheckpoint(b, save_freq=3)], verbose=0)
        callbacks, error = [OrbaxCheckpoint(a), OrbaxCheckpoint(b, save_freq=3, resume=True)], ConfigurationError
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(error):
        model.fit(*data, batch_size=8, epochs=1, callbacks=callbacks, verbose=0)
    assert signal.getsignal(signal.SIGTERM) is before
    assert logging.getLogger("absl").filters == []
    assert callbacks[0].checkpointer is not None and _steps(a) == ([0] if refusal == "two_resumes" else [])

def test_what_the_callbacks_of_a_fit_share_does_not_keep_the_model_alive(tmp_path):
    """The shared resume record is keyed weakly by the model; its value must not hold the model
    (through the callback) or a resumed model's device arrays would outlive it."""
    ckpt = OrbaxCheckpoint(str(tmp_path), save_freq=2, data_iterator=_Batches())
    _two_dense_adam_regressor().fit(ckpt.batches(), steps_per_epoch=4, epochs=1, callbacks=[ckpt], verbose=0)
    ckpt = OrbaxCheckpoint(str(tmp_path), save_freq=2, resume=True, data_iterator=_Batches())
    model = _two_dense_adam_regressor()
    model.fit(ckpt.batches(), steps_per_epoch=4, epochs=2, callbacks=[ckpt], verbose=0)
    assert ckpt.resumed.step == 4
    alive = weakref.ref(model)
    del model, ckpt
    gc.collect()
    assert alive() is None
