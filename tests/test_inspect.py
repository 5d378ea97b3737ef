"""`shardckpt.inspect`: arrays, steps, half-written steps, metadata, other formats."""

from __future__ import annotations

import json
import os
import shutil

import keras
import numpy as np
import pytest

from shardckpt import cli, errors
from shardckpt.conversion.info import inspect
from shardckpt.training import OrbaxCheckpoint


def _dense_pair_with_bfloat16_head(compile: bool = True) -> keras.Model:
    inputs = keras.Input((5,), name="x")
    h = keras.layers.Dense(7, name="a")(inputs)
    outputs = keras.layers.Dense(2, name="b", dtype="bfloat16")(h)
    model = keras.Model(inputs, outputs)
    if compile:
        model.compile(optimizer="sgd", loss="mse")
    return model


def test_inspect_orbax_root_step_and_half_written_steps(tmp_path, capsys):
    model = _dense_pair_with_bfloat16_head()
    ckpt = OrbaxCheckpoint(str(tmp_path), metadata={"note": "hello"}, max_to_keep=None)
    model.fit(np.ones((8, 5), "float32"), np.ones((8, 2), "float32"), epochs=2, verbose=0, callbacks=[ckpt])
    ckpt.wait_until_finished()
    # A killed save leaves a temporary folder: listed, never described.
    shutil.copytree(tmp_path / "1", tmp_path / "2.orbax-checkpoint-tmp-123")

    info = inspect(str(tmp_path))
    assert (info.format, info.step, info.steps) == ("orbax", 1, [0, 1])
    assert info.incomplete == ["2.orbax-checkpoint-tmp-123"]
    assert info.path == str(tmp_path / "1")
    assert info.metadata["user"] == {"note": "hello"} and info.metadata["epoch"] == 1
    assert info.iterator_state is None
    arrays = {a.key: a for a in info.arrays}
    assert (arrays["trainable_variables/a/kernel"].shape, arrays["trainable_variables/a/kernel"].dtype) == ((5, 7), "float32")
    b = arrays["trainable_variables/b/kernel"]
    assert (b.shape, b.nbytes) == ((7, 2), 7 * 2 * np.dtype(b.dtype).itemsize)
    assert "optimizer_variables/sgd/iteration" in arrays
    assert inspect(str(tmp_path / "0")).step == 0
    summary = info.summary()
    assert summary[:3] == [
        "steps: [0, 1] (showing 1)",
        "half-written (ignored): ['2.orbax-checkpoint-tmp-123']",
        f"items: {', '.join(info.items)}",
    ]
    assert summary[3].startswith("epoch 1 batch ") and "(epoch complete: True)" in summary[3]
    assert summary[4] == "user metadata: {'note': 'hello'}"
    # The rest as JSON, but for the values over LONGEST_VALUE characters (the host RNG's state).
    assert summary[5].startswith('metadata: {"format": "shardckpt.training/1", "step": 1, ') and len(summary) == 6
    assert '"versions": {"keras": ' in summary[5] and ' characters; --json shows it whole)' in summary[5]
    assert str(info).splitlines()[1 : 1 + len(summary)] == [f"  {line}" for line in summary]
    # The CLI prints the same lines above its table.
    assert cli.main(["inspect", str(tmp_path)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[1 : 1 + len(summary)] == summary

    with pytest.raises(errors.IncompleteCheckpointError):
        inspect(str(tmp_path / "2.orbax-checkpoint-tmp-123"))
    only_tmp = tmp_path.parent / (tmp_path.name + "_only_tmp")
    os.makedirs(only_tmp / "5.orbax-checkpoint-tmp-9")
    with pytest.raises(errors.IncompleteCheckpointError):
        inspect(str(only_tmp))


def test_inspect_weights_h5_and_missing_path(tmp_path):
    model = _dense_pair_with_bfloat16_head(compile=False)  # no optimizer: the file holds the layer weights only
    path = str(tmp_path / "m.weights.h5")
    model.save_weights(path)
    info = inspect(path)
    assert info.format == "h5" and info.steps == [] and info.metadata is None
    shapes = sorted(a.shape for a in info.arrays)
    assert shapes == sorted(tuple(w.shape) for w in model.weights)
    assert info.total_bytes == sum(int(np.prod(w.shape)) * np.dtype(w.dtype).itemsize for w in model.weights)
    with pytest.raises(errors.CheckpointNotFoundError):
        inspect(str(tmp_path / "nothing_here"))


def test_long_metadata_values_are_cut_in_the_text_and_whole_in_json(tmp_path, capsys):
    """A config pasted into the user metadata: `inspect` prints the first characters of a value
    over 400 (`info.LONGEST_VALUE`) and its length, each shorter value as before; `--json` and
    `info.metadata` keep it whole."""
    model = _dense_pair_with_bfloat16_head()
    config, table = "x" * 5000, list(range(2000))
    ckpt = OrbaxCheckpoint(str(tmp_path), metadata={"run": "exp-7", "config": config, "nested": {"table": table},
                                                    "edge": "y" * 398})
    model.fit(np.ones((8, 5), "float32"), np.ones((8, 2), "float32"), epochs=1, verbose=0, callbacks=[ckpt])
    ckpt.wait_until_finished()
    info = inspect(str(tmp_path))
    assert info.metadata["user"]["config"] == config and info.metadata["user"]["nested"] == {"table": table}
    user = next(line for line in info.summary() if line.startswith("user metadata: "))
    short_table = repr({"table": table})[:200]
    assert user == (
        f"user metadata: {{'run': 'exp-7', 'config': '{'x' * 199}... (5,002 characters; --json shows it whole), "
        f"'nested': {short_table}... ({len(repr({'table': table})):,} characters; --json shows it whole), "
        f"'edge': '{'y' * 398}'}}"
    )
    assert all(len(line) < 2000 for line in info.summary())
    assert cli.main(["inspect", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert user in printed.splitlines() and config not in printed
    assert cli.main(["inspect", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["metadata"]["user"] == info.metadata["user"]
