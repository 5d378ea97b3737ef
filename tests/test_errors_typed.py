"""Failures that used to surface as bare built-ins, or as another error, raise the typed error
of `shardckpt.errors` that names the thing and the fix."""

from __future__ import annotations

import json
import os
import types

import keras
import numpy as np
import pytest

import shardckpt
from shardckpt import errors, storage
from shardckpt.cli import main
from shardckpt.exporting import hf_config
from shardckpt.training import resume_point
from shardckpt.training.iterators import IteratorTracker
from tests import hf_fixtures


class _CountingIterator:
    """An endless iterator of batches whose state is the number of batches drawn."""

    def __init__(self) -> None:
        self.drawn = 0

    def __iter__(self) -> _CountingIterator:
        return self

    def __next__(self) -> np.ndarray:
        self.drawn += 1
        return np.full((2, 4), self.drawn, "float32")

    def get_state(self) -> dict:
        return {"drawn": self.drawn}

    def set_state(self, state: dict) -> None:
        self.drawn = state["drawn"]


def test_position_after_batches_never_yielded_is_an_iterator_position_error():
    tracker = IteratorTracker(_CountingIterator())
    batches = tracker.batches()
    next(batches), next(batches)
    assert tracker.state_after(1) == {"drawn": 1}
    with pytest.raises(errors.IteratorPositionError, match=r"after 5 batches \(2 pulled\).*Fix: feed fit from") as e:
        tracker.state_after(5)
    assert isinstance(e.value, RuntimeError)


def _fit_one_epoch(directory: str) -> keras.Model:
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="d")])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((4, 4), "float32"), np.zeros((4, 2), "float32")
    model.fit(x, y, batch_size=2, epochs=1, verbose=0,
              callbacks=[shardckpt.OrbaxCheckpoint(directory, save_freq="epoch")])
    return model


def test_resume_with_the_iterator_restored_from_another_step_is_an_iterator_position_error(tmp_path):
    directory = str(tmp_path / "ckpt")
    model = _fit_one_epoch(directory)
    point = resume_point.choose(directory, mid_epoch=True)
    assert point is not None and point.step_dir is not None
    tracker = IteratorTracker(_CountingIterator())
    next(tracker.batches())  # batches() has started: it took its position from `elsewhere`
    elsewhere = str(tmp_path / "ckpt" / "7")
    with pytest.raises(errors.IteratorPositionError, match="Fix: do not write to the checkpoint directory") as e:
        resume_point.restore(model, point, tracker=tracker, data_iterator=tracker.iterator,
                             iterator_restored_from=elsewhere)
    assert elsewhere in str(e.value) and point.step_dir in str(e.value)
    assert isinstance(e.value, RuntimeError)


def test_phi3_rope_scaling_keras_hub_lacks_is_unsupported_model_naming_the_config(tmp_path):
    pytest.importorskip("keras_hub")
    from shardckpt.presets import hf

    folder = str(tmp_path / "phi3")
    hf_fixtures.make_folder("phi3", folder)
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["rope_scaling"] = {"type": "linear", "factor": 2.0}
    with open(path, "w") as f:
        json.dump(config, f)
    keras.backend.clear_session()
    with pytest.raises(errors.UnsupportedModelError, match="rope_scaling of type 'linear'") as e:
        hf.build(folder)
    assert repr(path) in str(e.value) and "Fix:" in str(e.value)


def test_a_bug_in_a_converter_is_raised_not_taken_for_a_rejected_config():
    def buggy(config):
        return {"hidden_dim": config["hidden_size"], "num_layers": undefined_name}  # noqa: F821 (the bug)

    def rejecting(config):
        raise KeyError("hidden_size")

    keras_args = {"hidden_dim": 8, "num_layers": 1}
    assert hf_config.inverse(types.SimpleNamespace(convert_backbone_config=rejecting), "toy", keras_args) is None
    with pytest.raises(NameError, match="undefined_name"):
        hf_config.inverse(types.SimpleNamespace(convert_backbone_config=buggy), "toy", keras_args)


def _preset_folder(tmp_path, where: str, request):
    """An empty folder named like a preset, local or in a fake GCS bucket: (its path, its Location)."""
    if where == "bucket":
        src = request.getfixturevalue("gcs_server").new_bucket() + "/preset"
    else:
        src = str(tmp_path / "preset")
        os.makedirs(src)
    return src, storage.parse(src)


@pytest.mark.parametrize("where", ["local", "bucket"])
def test_convert_to_hf_from_a_folder_with_a_damaged_config_names_the_file_not_the_model(tmp_path, where, request, capsys):
    src, folder = _preset_folder(tmp_path, where, request)
    storage.write_bytes(folder.join("config.json"), b'{"registered_name": "keras_hub>LlamaBackbone", ')
    storage.write_bytes(folder.join("model.weights.h5"), b"\x89HDF\r\n\x1a\n")
    assert main(["convert", src, str(tmp_path / "out"), "--to", "hf"]) == 1
    err = capsys.readouterr().err
    assert "config.json" in err and "Fix:" in err, err
    assert "--model" not in err, err
    with pytest.raises(errors.CorruptCheckpointError, match="config.json"):
        shardckpt.convert(src, str(tmp_path / "out"), to="hf")
@pytest.mark.parametrize("where", ["local", "bucket"])
def test_convert_to_hf_from_a_folder_with_a_config_of_no_kind_is_unknown_format_not_needs_model(tmp_path, where, request):
    src, folder = _preset_folder(tmp_path, where, request)
    storage.write_bytes(folder.join("config.json"), json.dumps({"hello": 1}).encode())
    storage.write_bytes(folder.join("model.weights.h5"), b"\x89HDF\r\n\x1a\n")
    with pytest.raises(errors.UnknownFormatError, match="registered_name") as e:
        shardckpt.convert(src, str(tmp_path / "out"), to="hf")
    assert "Fix:" in str(e.value)
