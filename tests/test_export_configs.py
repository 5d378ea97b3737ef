"""`export(format="hf")` of keras-hub backbones built from their constructors, not from HF folders.

The grid (tests/export_grid.py) has three or more configs for each of the 14
architectures `export` maps: head counts and head dims apart from the
defaults, long and short position tables, tied and untied embeddings,
text-only Gemma 3, and values keras-hub's own importer leaves unread.
Each is exported and read back by keras-hub's own loader (its converter
reading config.json and the safetensors with numpy): the model it builds has
the backbone's arguments and every value bit-equal. Where keras-hub has no
importer (Phi-3), or its importer leaves a config key unread (GPT-2's
`n_inner`, BERT's `type_vocab_size`, `rms_norm_eps` for Llama and Gemma),
the weights are read by keras-hub's converter into a backbone of the same
arguments and the folder by shardckpt's `from_preset`; the config itself is
checked against transformers in tests/test_export_transformers.py.
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings

import export_grid as grid
import hf_fixtures as fx
import keras
import numpy as np
import pytest

import shardckpt

keras_hub = pytest.importorskip("keras_hub")

# Configs keras-hub's importer reads as another model; export says so once.
KERAS_HUB_MISREADS = {
    "gpt2-2x12-inner40-pos100": "n_inner",
    "bert-3x8-pos40-seg4": "type_vocab_size",
    "bert-2x8-pos12-seg1": "type_vocab_size",
    "llama3-4q4kv-eps1e-5": "rms_norm_eps",
    "llama2-2q1kv-eps1e-5": "rms_norm_eps",
    "gemma-2q1kv-hd32-eps1e-5": "rms_norm_eps",
    "qwen2moe-5e3-tied": "tie_word_embeddings",
}


def _unnumbered(path: str) -> str:
    # A second MoE model in one process gets `..._sparse_moe_block_2/...`
    # (Keras' name counter): compare the paths without the counters.
    return re.sub(r"_\d+(?=/)", "", path)


def _assert_read_back_bit_equal(back: keras.Model, values: dict[str, np.ndarray], name: str, cast: bool) -> None:
    assert [_unnumbered(v.path) for v in back.weights] == [_unnumbered(p) for p in values], name
    for v, want in zip(back.weights, values.values(), strict=True):
        if cast:  # keras-hub's Mistral converter rounds through float16
            want = want.astype(np.float16).astype(want.dtype)
        np.testing.assert_array_equal(np.asarray(v.value), want, err_msg=f"{name} {v.path}")


def _converter_into_twin(class_name: str, args: dict, folder: str) -> keras.Model:
    """keras-hub's converter reading the folder's safetensors into a backbone of `args`."""
    from keras_hub.src.utils.transformers.safetensor_utils import SafetensorLoader

    from shardckpt.presets import hf

    loader = hf.preset_loader(folder)
    twin = grid.build(class_name, args)
    hf.initialize_states(twin)
    with SafetensorLoader(folder) as tensors:
        loader.converter.convert_weights(twin, tensors, loader.config)
    return twin


@pytest.mark.slow
@pytest.mark.parametrize(("name", "class_name", "args"), grid.GRID, ids=[g[0] for g in grid.GRID])
def test_constructor_config_exports_and_reads_back_bit_equal(name, class_name, args, tmp_path):
    keras.backend.clear_session()
    model = grid.build(class_name, args)
    fx.randomize(model, seed=len(name))
    values = {v.path: np.asarray(v.value) for v in model.weights}
    folder = str(tmp_path / "hf")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shardckpt.export(model, folder)
    said = [str(w.message) for w in caught if "keras-hub's own from_preset" in str(w.message)]
    misread = KERAS_HUB_MISREADS.get(name)
    if misread is None:
        assert said == [], said
    else:
        assert len(said) == 1 and f"leaves {misread} unread" in said[0], said
    with open(f"{folder}/config.json") as f:
        config = json.load(f)
    cast = class_name == "MistralBackbone"
    if class_name == "Phi3Backbone" or misread is not None:
        if class_name != "Phi3Backbone":
            _assert_read_back_bit_equal(_converter_into_twin(class_name, args, folder), values, name, cast)
        keras.backend.clear_session()
        back = shardckpt.from_preset(folder)
        cast = False  # shardckpt reads the stored float32 values as they are
    else:
        back = fx.keras_hub_load(folder)
    built = back.get_config()
    assert {k: built.get(k, getattr(back, k, None)) for k in args} == args, config
    _assert_read_back_bit_equal(back, values, name, cast)


def test_grid_covers_every_mapped_architecture_three_times():
    from shardckpt.exporting.hf import converter_for

    seen: dict[str, int] = {}
    for _, class_name, args in grid.GRID:
        with shardckpt.lazy_init():
            model = grid.build(class_name, args)
        _, model_types = converter_for(model)
        from shardckpt.exporting.hf_config import hf_config

        model_type = hf_config(model, converter_for(model)[0], model_types)["model_type"]
        key = f"{class_name}:{model_type}"
        seen[key] = seen.get(key, 0) + 1
    assert len(seen) == 14, seen
    assert min(seen.values()) >= 3, seen


@pytest.mark.parametrize(("name", "class_name", "args", "argument"), grid.REFUSED, ids=[g[0] for g in grid.REFUSED])
def test_config_no_hugging_face_class_holds_is_refused_naming_the_argument(name, class_name, args, argument, tmp_path):
    from shardckpt.errors import UnsupportedModelError

    model = grid.build(class_name, args)
    fx.randomize(model)
    with pytest.raises(UnsupportedModelError, match=re.escape(argument)):
        shardckpt.export(model, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


PUBLISHED = os.environ.get("SHARDCKPT_PUBLISHED_CONFIGS", os.path.join(os.path.dirname(__file__), "published_configs.json"))


@pytest.mark.skipif(not os.path.exists(PUBLISHED), reason="published_configs.json not present")
def test_published_sizes_plan_hugging_face_tensors_of_their_checkpoints():
    """GPT-2 base and BERT base built lazily at full size (nothing allocated): the planned
    tensors are the published checkpoints' names and shapes."""
    from shardckpt.exporting import hf

    with open(PUBLISHED) as f:
        published = {k: v for k, v in json.load(f).items() if not k.startswith("_")}
    plans = {}
    for key, entry in published.items():
        if key not in ("gpt2-base", "bert-base"):
            continue
        model = grid.build(entry["class"], entry["args"])
        plans[key] = hf.plan(model)
        # Every parameter lands in exactly one stored element (plan checks coverage too).
        assert sum(math.prod(s.shape) for s in plans[key].specs.values()) == sum(
            math.prod(v.shape) for v in model.weights), key
    gpt2 = {k: s.shape for k, s in plans["gpt2-base"].specs.items()}
    assert gpt2["wte.weight"] == (50257, 768) and gpt2["wpe.weight"] == (1024, 768)
    assert gpt2["h.11.attn.c_attn.weight"] == (768, 2304) and gpt2["h.0.attn.c_proj.weight"] == (768, 768)
    assert gpt2["h.0.mlp.c_fc.weight"] == (768, 3072) and gpt2["h.0.mlp.c_proj.weight"] == (3072, 768)
    assert {k: plans["gpt2-base"].config[k] for k in ("n_embd", "n_head", "n_layer", "n_positions", "n_inner")} == {
        "n_embd": 768, "n_head": 12, "n_layer": 12, "n_positions": 1024, "n_inner": 3072}
    bert = {k: s.shape for k, s in plans["bert-base"].specs.items()}
    assert bert["embeddings.position_embeddings.weight"] == (512, 768)
    assert bert["embeddings.word_embeddings.weight"] == (30522, 768)
    assert bert["embeddings.token_type_embeddings.weight"] == (2, 768)
    assert bert["encoder.layer.0.attention.self.query.weight"] == (768, 768)
    assert bert["encoder.layer.11.intermediate.dense.weight"] == (3072, 768)
    assert plans["bert-base"].config["max_position_embeddings"] == 512
