"""`shardckpt.export`: sharded models out as Hugging Face folders and keras-hub presets.

Every architecture `from_preset` reads from Hugging Face folders
(tests/hf_fixtures.py) is loaded onto a (2, 4) mesh, exported, and read
back by independent code: keras-hub's own Hugging Face loader (its
converter reading the safetensors with numpy; Phi-3, which keras-hub has no
converter for, by `from_preset`) and keras-hub's `Backbone.from_preset` for
the keras-hub presets (single-file; the sharded one through the same
loader's weight step, into the backbone it built). Values are compared bit
for bit. One module fixture per architecture builds, loads and exports once.
"""

from __future__ import annotations

import json
import os

import hf_fixtures as fx
import keras
import numpy as np
import pytest
from safetensors.numpy import load_file

import shardckpt

keras_hub = pytest.importorskip("keras_hub")

TINY_SHARDS = 20e3 / 1024**3  # GB, as keras-hub's max_shard_size: several files for a tiny model


def _safetensors(folder: str) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, name)))
    return out


@pytest.fixture(scope="module", params=fx.ARCHITECTURES)
def exported(request, tmp_path_factory):
    """One architecture: its HF folder, the model from_preset loads on (2, 4), three exports."""
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    fx.make_folder(arch, str(root / "src"), shards=2 if arch == "mixtral" else 1)
    keras.backend.clear_session()
    model = shardckpt.from_preset(str(root / "src"), mesh=(2, 4))
    assert any(len(v.value.sharding.device_set) == 8 and not v.value.sharding.is_fully_replicated for v in model.weights)
    reports = {
        "hf": shardckpt.export(model, root / "hf", max_shard_size="20KB" if arch == "mixtral" else None),
        "kh": shardckpt.export(model, root / "kh", format="keras-hub"),
        "khs": shardckpt.export(model, root / "khs", format="keras-hub", max_shard_size=TINY_SHARDS),
    }
    values = {v.path: np.asarray(v.value) for v in model.weights}
    keras.distribution.set_distribution(None)
    return arch, root, values, reports


def test_hf_export_reads_back_bit_equal_in_keras_hub(exported):
    arch, root, values, reports = exported
    assert reports["hf"].bytes_written == reports["hf"].bytes_total  # one process writes everything
    if arch == "mixtral":  # sharded: index + several files
        index = json.loads((root / "hf" / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 2
    keras.backend.clear_session()
    back = shardckpt.from_preset(str(root / "hf")) if arch in fx.NO_KERAS_HUB_CONVERTER else fx.keras_hub_load(str(root / "hf"))
    assert [v.path for v in back.weights] == list(values)
    for v in back.weights:
        want = values[v.path]
        if arch in fx.KERAS_HUB_CASTS:  # keras-hub's Mistral converter rounds through float16
            want = want.astype(np.float16).astype(want.dtype)
        np.testing.assert_array_equal(np.asarray(v.value), want, err_msg=v.path)


def _zero_then_load(backbone: keras.Model, folder: str) -> None:
    """keras-hub's own weight step of `from_preset` (single file or `model.weights.json` + shards),
    into a backbone whose values were zeroed first (so a load that skips a variable fails)."""
    from keras_hub.src.utils.preset_utils import get_preset_loader

    for v in backbone.weights:
        v.assign(np.zeros(v.shape, v.dtype))
    get_preset_loader(folder)._load_backbone_weights(backbone)


def test_keras_hub_export_reads_back_bit_equal_in_keras_hub(exported):
    """Single-file preset: `Backbone.from_preset`. Sharded preset (same configs): the backbone
    from_preset built, zeroed, then from_preset's weight step on the sharded folder."""
    arch, root, values, _ = exported
    single, sharded = root / "kh", root / "khs"
    assert (single / "model.weights.h5").exists() and not (sharded / "model.weights.h5").exists()
    assert len([n for n in os.listdir(sharded) if n.startswith("model_0")]) > 2
    index = json.loads((sharded / "model.weights.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert (sharded / "config.json").read_text() == (single / "config.json").read_text()
    one, other = (json.loads((folder / "metadata.json").read_text()) for folder in (single, sharded))
    assert one.pop("date_saved") and other.pop("date_saved") and one == other  # saved a second apart
    keras.backend.clear_session()
    if arch == "llama3":
        # keras-hub 0.32: Llama3Backbone.get_config() leaves out
        # tie_word_embeddings, so no untied Llama 3 preset reads back, its own
        # save_to_preset's included. Fails here once keras-hub fixes it.
        with pytest.raises(ValueError, match="token_embedding"):
            keras_hub.models.Backbone.from_preset(str(single))
        config = json.loads((single / "config.json").read_text())["config"]
        tied = not any(path.endswith("reverse_embeddings") for path in values)
        back = keras_hub.models.Llama3Backbone.from_config({**config, "tie_word_embeddings": tied})
        _zero_then_load(back, str(single))
    else:
        back = keras_hub.models.Backbone.from_preset(str(single))
    assert [v.path for v in back.weights] == list(values)
    for v in back.weights:
        np.testing.assert_array_equal(np.asarray(v.value), values[v.path], err_msg=f"{arch} {v.path}")
    _zero_then_load(back, str(sharded))
    for v in back.weights:
        np.testing.assert_array_equal(np.asarray(v.value), values[v.path], err_msg=f"{arch} sharded {v.path}")


def test_keras_hub_exporter_folder_round_trips_exactly(exported):
    """A folder written by keras-hub's own exporter, through from_preset and export: same folder."""
    arch, root, _, _ = exported
    if arch not in ("gemma", "llama3"):
        pytest.skip("keras-hub's exporter writes readable folders for Gemma and Llama 3 (NOTES)")
    src, out = _safetensors(str(root / "src")), _safetensors(str(root / "hf"))
    assert sorted(src) == sorted(out)
    for key in src:
        assert (out[key].shape, out[key].dtype) == (src[key].shape, src[key].dtype), key
        assert out[key].tobytes() == src[key].tobytes(), key
    ours, theirs = (json.loads((root / name / "config.json").read_text()) for name in ("hf", "src"))
    # Beyond keras-hub's exporter: `dtype` (what transformers 5 writes and reads first) and
    # `torch_dtype` always name the dtype the tensors are stored in; keras-hub's name the compute
    # dtype, or are absent.
    stored = {str(array.dtype) for array in out.values()}
    assert stored == {"float32"} and (ours.pop("dtype"), ours.pop("torch_dtype")) == ("float32", "float32")
    for key in ("dtype", "torch_dtype"):
        theirs.pop(key, None)
    assert ours == theirs
