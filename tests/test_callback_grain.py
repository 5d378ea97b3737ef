"""grain pipelines as `OrbaxCheckpoint(data_iterator=...)`: every state grain
returns (bytes from a `DataLoader`, dicts from `MapDataset` / `IterDataset`
iterators) is stored and restored exactly."""

from __future__ import annotations

import grain
import grain.python as gp
import keras
import numpy as np
import pytest

from shardckpt import errors
from shardckpt.conversion.info import inspect
from shardckpt.training import OrbaxCheckpoint, restore_latest
from shardckpt.training.iterators import decode_state, encode_state

N, BATCH, STEPS = 64, 8, 4


class Records:
    """A grain data source of (x, y) records."""

    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        self.x = rng.standard_normal((N, 6)).astype("float32")
        self.y = rng.standard_normal((N, 1)).astype("float32")

    def __len__(self) -> int:
        return N

    def __getitem__(self, i):
        return self.x[i], self.y[i]

    def __repr__(self) -> str:
        return "Records(64)"  # grain validates a restored state against repr(source)


def data_loader():
    sampler = gp.IndexSampler(num_records=N, shard_options=gp.NoSharding(), shuffle=True, num_epochs=None, seed=3)
    return iter(gp.DataLoader(data_source=Records(), sampler=sampler,
                              operations=[gp.Batch(BATCH, drop_remainder=True)], worker_count=0))


def map_dataset():
    return iter(grain.MapDataset.source(Records()).shuffle(seed=4).repeat(None).batch(BATCH))


def iter_dataset():
    ds = grain.MapDataset.source(Records()).shuffle(seed=5).repeat(None).to_iter_dataset()
    return iter(ds.map(lambda r: (r[0] * 2, r[1])).batch(BATCH))


PIPELINES = {"DataLoader": data_loader, "MapDataset": map_dataset, "IterDataset": iter_dataset}


def test_state_codec_round_trips_every_grain_state_exactly():
    states = [
        data_loader().get_state(),  # bytes
        map_dataset().get_state(),
        {"nested": {"a": [1, 2.5, None, True], "b": b"\x00\xff raw"}, "t": (1, (2, "x"))},
        {3: "int key", (1, 2): "tuple key"},
        {"__shardckpt_bytes_b64__": "a user's key that looks like a tag"},
        [np.int64(7), np.float32(0.5)],
    ]
    assert isinstance(states[0], bytes)
    import json

    for state in states:
        back = decode_state(json.loads(json.dumps(encode_state(state))))
        assert back == state and type(back) is type(state)
    assert type(decode_state(encode_state(np.int64(7)))) is int
    with pytest.raises(errors.IteratorStateError, match=r"set at state\['bad'\]"):
        encode_state({"bad": {1, 2}})


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_grain_iterator_state_is_saved_and_restored_exactly(tmp_path, name):
    make = PIPELINES[name]
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    it = make()
    ckpt = OrbaxCheckpoint(str(tmp_path), save_freq=3, data_iterator=it)
    model.fit(ckpt.batches(), steps_per_epoch=STEPS, epochs=2, verbose=0, callbacks=[ckpt])
    ckpt.wait_until_finished()
    assert inspect(str(tmp_path)).steps == [6]  # max_to_keep=1

    # The position after exactly 6 batches, whatever Keras pulled ahead.
    expected = make()
    for _ in range(6):
        next(expected)
    fresh = make()
    info = restore_latest(model, str(tmp_path), data_iterator=fresh)
    assert info.step == 6
    assert info.iterator_state == expected.get_state()
    assert type(info.iterator_state) is type(expected.get_state())
    assert fresh.get_state() == expected.get_state()
    for _ in range(3):  # and the batches that follow are the same
        got, want = next(fresh), next(expected)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
