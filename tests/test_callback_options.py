"""`OrbaxCheckpoint`'s arguments as attributes, their checks, and the collaborators that keep them.

The callback keeps each group of its arguments in one object (retention,
schedule, snapshot, contents, data position, resume, preemption); the
arguments stay attributes of their own names, readable and assignable as on
Keras' callback, and a value assigned between fits is the one the next fit uses.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from shardckpt.formats.orbax.ondisk import METADATA_ITEM, read_json_item
from shardckpt.training import OrbaxCheckpoint
from shardckpt.training.counting import BatchCount
from shardckpt.training.resume import ResumeInfo
from shardckpt.training.schedule import SaveSchedule
from tests.zoo import CountingIterator, small_regressor


def _steps(directory) -> list[int]:
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def test_every_argument_reads_back_as_the_attribute_of_its_name(tmp_path):
    it = CountingIterator()

    def user(epoch, logs):
        return {"epoch": epoch}

    given = dict(monitor="loss", verbose=1, save_best_only=True, save_freq=3, max_to_keep=4,
                 save_on_background=False, save_weights_only=True, keep_best=2, keep_period=5,
                 metadata=user, data_iterator=it, resume=True, compression=True, save_on_preemption=False,
                 snapshot="host", snapshot_budget_bytes=1 << 20, on_process_count_change="restart_iterators")
    ckpt = OrbaxCheckpoint(str(tmp_path), mode="max", initial_value_threshold=0.5, **given)
    for name, value in given.items():
        assert getattr(ckpt, name) is value, name
    assert (ckpt.directory, ckpt.mode, ckpt.best) == (str(tmp_path), "max", 0.5)
    # What fit reports, before any fit.
    assert (ckpt.resumed, ckpt.preempted_step, ckpt.preemption_mode, ckpt.snapshot_mode_used) == (
        None, None, "off", None)
    assert ckpt.snapshot_modes == ckpt.save_blocking_s == ckpt.save_waits_s == ckpt.save_writes_s == []
    assert ckpt.checkpointer is None


def test_arguments_assigned_between_fits_are_the_next_fits(tmp_path):
    """Assigned after construction, as Keras' callback allows, they hold at the next fit."""
    model = small_regressor(3, width=8)
    ckpt = OrbaxCheckpoint(str(tmp_path), monitor="loss", metadata={"run": "a"})
    ckpt.save_freq, ckpt.max_to_keep, ckpt.metadata = 2, 2, {"run": "b"}
    x, y = np.ones((24, 6), "float32"), np.ones((24, 1), "float32")
    model.fit(x, y, batch_size=4, epochs=1, callbacks=[ckpt], verbose=0)
    ckpt.wait_until_finished()
    # Saves at batches 2, 4, 6; the latest two kept.
    assert _steps(tmp_path) == [4, 6]
    assert read_json_item(str(tmp_path / "6"), METADATA_ITEM)["user"] == {"run": "b"}
    assert len(ckpt.save_blocking_s) == 3 and ckpt.snapshot_modes == [ckpt.snapshot_mode_used] * 3


@pytest.mark.parametrize("kwargs, error, message", [
    ({"save_freq": "batch"}, ValueError,
     "Unrecognized save_freq: batch. Expected save_freq are 'epoch' or integer values "
     "(or 'auto': the smallest interval whose saves finish in the background)"),
    ({"save_freq": 0}, ValueError, "Unrecognized save_freq: 0."),
    ({"max_to_keep": 0}, ValueError, "max_to_keep must be a positive integer or None. Received: max_to_keep=0"),
    ({"keep_best": True}, ValueError, "keep_best must be a positive integer or None. Received: keep_best=True"),
    ({"keep_period": -1}, ValueError, "keep_period must be a positive integer or None. Received: keep_period=-1"),
    ({"snapshot": "disk"}, ValueError,
     "snapshot must be one of ('auto', 'device', 'host'). Received: snapshot='disk'"),
    ({"snapshot_budget_bytes": 0}, ValueError,
     "snapshot_budget_bytes must be a positive integer. Received: 0"),
    ({"metadata": ["x"]}, TypeError,
     "metadata must be a JSON dict or a callable (epoch, logs) -> dict. Received: metadata=['x']"),
    ({"on_process_count_change": "ignore"}, ValueError,
     "on_process_count_change must be one of ('error', 'restart_iterators'). "
     "Received: on_process_count_change='ignore'"),
    ({"data_iterator": iter([1])}, TypeError, "get_state"),
])
def test_bad_arguments_keep_their_messages(tmp_path, kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        OrbaxCheckpoint(str(tmp_path), **kwargs)


def _resumed(step: int, *, epoch_complete: bool) -> ResumeInfo:
    return ResumeInfo(step=step, path="", epoch=1, batch=2, epoch_complete=epoch_complete, total_batches=6,
                      metadata={}, iterator_state=None, report=None)


def test_save_schedule_names_steps_and_replaces_a_resumed_partial_epoch():
    count = BatchCount(steps_per_epoch=4, total=6, epoch=1, in_epoch=2)
    per_epoch, every_3 = SaveSchedule(save_freq="epoch"), SaveSchedule(save_freq=3)
    assert (per_epoch.step_now(count), every_3.step_now(count)) == (1, 6)
    assert [every_3.due_after_batch(count, 1, writer_busy=lambda: True) for _ in range(6)] == [
        False, False, True, False, False, True]

    # A partial epoch 1 resumed by epoch: its save of epoch 1 deletes that step first, once.
    per_epoch.begin()
    per_epoch.resumed(_resumed(1, epoch_complete=False))
    assert not per_epoch.holds(1)  # a preemption now must save: the step on disk is the partial one
    assert per_epoch.claim(1) and per_epoch.holds(1) and not per_epoch.claim(1)
    # By batches, a step name is never reused: nothing is replaced.
    every_3.begin()
    every_3.resumed(_resumed(6, epoch_complete=False))
    assert every_3.holds(6) and not every_3.claim(6)


def test_save_schedule_auto_waits_for_the_write_in_flight():
    schedule = SaveSchedule(save_freq="auto")
    schedule.begin_auto()
    count = BatchCount()
    assert not schedule.due_after_batch(count, 1, writer_busy=lambda: True)
    assert schedule.due_after_batch(count, 1, writer_busy=lambda: False)
    assert schedule.saved(None) is None  # nothing measured before the first write
    assert SaveSchedule(save_freq=2).saved(1.0) is None  # only "auto" derives an interval
