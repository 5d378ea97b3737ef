"""SIGTERM at seeded random batches with every input `fit` takes, then a real
resume: each resumed run ends bit-equal to an uninterrupted one.

Input kinds: numpy arrays (shuffled by fit from NumPy's global RNG, with a
`data_iterator` that fit never reads: issue 28's case), a `keras.utils.PyDataset`
(shuffled by fit from Python's `random`), a Python generator, and a grain
`DataLoader` fed through `OrbaxCheckpoint.batches()`. Only the last one lets the
callback resume in the middle of an epoch; the others must resume from the
newest whole-epoch step (or from the start), and say so.

Each trial is two `fit` calls in this process: one that a SIGTERM sent to this
very process (by a callback, at a seeded batch) stops through the callback's
signal handler and its committed save, then one with `resume=True` that reads
the directory back. One model object serves every run of a kind (its variables
reset to the built values, the global seeds set again, as a fresh process would
start; the first fit, which builds the metrics, happens before all of them),
so its train step compiles once: 40 trials in about a minute.
"""

from __future__ import annotations

import logging

import grain.python as gp
import keras
import numpy as np
import pytest

from shardckpt.training import OrbaxCheckpoint
from tests._train_worker import sigterm_at as sigterm_sender

EPOCHS, STEPS, BATCH = 3, 6, 8
N = STEPS * BATCH
TRIALS = 10
SAVE_FREQS = ["epoch", 2, 3, 4]  # 4 never lands on an epoch end before step 12


def _data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, 6)).astype("float32")
    return x, (x[:, :2].sum(axis=1, keepdims=True) > 0).astype("float32")


class _Untouched:
    """A data_iterator that fit never reads (issue 28: no warning, inexact)."""

    def __init__(self) -> None:
        self.n = 0

    def __next__(self):
        self.n += 1
        return self.n

    def get_state(self):
        return {"n": self.n}

    def set_state(self, state):
        self.n = state["n"]


class _Batches(keras.utils.PyDataset):
    def __init__(self) -> None:
        super().__init__()
        self.x, self.y = _data()

    def __len__(self) -> int:
        return STEPS

    def __getitem__(self, i):
        return self.x[i * BATCH : (i + 1) * BATCH], self.y[i * BATCH : (i + 1) * BATCH]


def _generator():
    x, y = _data()
    while True:  # every epoch the same pass, as users write them
        for i in range(STEPS):
            yield x[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH]


class _Records:
    def __init__(self) -> None:
        self.x, self.y = _data()

    def __len__(self) -> int:
        return N

    def __getitem__(self, i):
        return self.x[i], self.y[i]

    def __repr__(self) -> str:
        return f"_Records({N})"  # grain checks a restored state against repr(source)


def _grain_loader():
    sampler = gp.IndexSampler(num_records=N, shard_options=gp.NoSharding(), shuffle=True, num_epochs=None, seed=9)
    return iter(gp.DataLoader(data_source=_Records(), sampler=sampler,
                              operations=[gp.Batch(BATCH, drop_remainder=True)], worker_count=0))


class _Harness:
    """One model for every run of an input kind; each run starts as a fresh process would."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        keras.utils.set_random_seed(5)
        self.model = keras.Sequential(
            [keras.Input((6,)), keras.layers.Dense(8, name="a"), keras.layers.Dropout(0.25, name="drop"),
             keras.layers.Dense(1, name="b")], name="seq")
        self.model.compile(optimizer=keras.optimizers.Adam(1e-2, name="adam"), loss="mse", metrics=["mae"])
        self.model.optimizer.build(self.model.trainable_variables)
        # A process's first fit builds the metrics from one batch it draws
        # (one shuffle) before on_train_begin; every run here is a later fit.
        self.model.fit(*_data(), batch_size=BATCH, epochs=1, verbose=0)
        self.initial = [np.asarray(v.value) for v in self._state()]

    def _state(self) -> list:
        m = self.model
        return m.trainable_variables + m.non_trainable_variables + m.optimizer.variables

    def run(self, directory: str, *, save_freq, resume: bool, sigterm_at: int | None = None,
            sender_first: bool = True) -> tuple[OrbaxCheckpoint, dict[str, np.ndarray]]:
        keras.utils.set_random_seed(77)  # what a fresh process of the job does first
        for variable, value in zip(self._state(), self.initial):
            variable.assign(value)
        kind = self.kind
        iterator = _Untouched() if kind == "arrays" else _grain_loader() if kind == "grain" else None
        ckpt = OrbaxCheckpoint(directory, save_freq=save_freq, resume=resume, data_iterator=iterator)
        callbacks: list = [ckpt]
        if sigterm_at is not None:
            sender = sigterm_sender(sigterm_at)
            callbacks = [sender, ckpt] if sender_first else [ckpt, sender]
        fit = self.model.fit
        if kind == "arrays":
            fit(*_data(), batch_size=BATCH, epochs=EPOCHS, shuffle=True, callbacks=callbacks, verbose=0)
        elif kind == "pydataset":
            fit(_Batches(), epochs=EPOCHS, shuffle=True, callbacks=callbacks, verbose=0)
        elif kind == "generator":
            fit(_generator(), steps_per_epoch=STEPS, epochs=EPOCHS, callbacks=callbacks, verbose=0)
        else:
            fit(ckpt.batches(), steps_per_epoch=STEPS, epochs=EPOCHS, callbacks=callbacks, verbose=0)
        ckpt.wait_until_finished()
        values = {f"{i}:{v.path}": np.asarray(v.value) for i, v in enumerate(self._state())}
        values.update({f"metric:{v.path}": np.asarray(v.value) for v in self.model.metrics_variables})
        return ckpt, values


@pytest.mark.parametrize("kind", ["arrays", "pydataset", "generator", "grain"])
def test_sigterm_at_random_batches_then_resume_is_bit_exact(tmp_path, caplog, kind):
    """10 trials: SIGTERM, committed save, fit stops; the resumed run equals the uninterrupted one."""
    harness = _Harness(kind)
    _, reference = harness.run(str(tmp_path / "ref"), save_freq="epoch", resume=False)
    rng = np.random.default_rng(["arrays", "pydataset", "generator", "grain"].index(kind) + 280)
    mid_epoch_resumes = whole_epoch_resumes = 0
    for trial in range(TRIALS):
        save_freq = SAVE_FREQS[int(rng.integers(len(SAVE_FREQS)))]
        at = int(rng.integers(1, EPOCHS * STEPS - 1))
        directory = str(tmp_path / f"t{trial}")
        label = f"{kind} trial {trial} (save_freq={save_freq}, SIGTERM after batch {at})"
        stopped, _ = harness.run(directory, save_freq=save_freq, resume=False, sigterm_at=at,
                                 sender_first=bool(rng.integers(2)))
        assert stopped.preempted_step is not None, f"{label}: the notice must stop fit"
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="shardckpt"):
            resumed, values = harness.run(directory, save_freq=save_freq, resume=True)
        assert sorted(values) == sorted(reference)
        for key, want in reference.items():
            np.testing.assert_array_equal(values[key], want, err_msg=f"{label}: {key}")
        lines = [r.getMessage() for r in caplog.records if "resum" in r.getMessage().lower()]
        assert len(lines) == 1, f"{label}: one line says where the run resumed: {lines}"
        info = resumed.resumed
        if info is not None and not info.epoch_complete:
            mid_epoch_resumes += 1
        else:
            whole_epoch_resumes += 1
    if kind == "grain":
        assert mid_epoch_resumes >= 3, "batches() resumes in the middle of an epoch"
    else:
        assert mid_epoch_resumes == 0, "only batches() may resume mid-epoch"
    print(f"{kind}: {mid_epoch_resumes} mid-epoch, {whole_epoch_resumes} whole-epoch or fresh resumes")
