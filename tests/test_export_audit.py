"""Audit of the way out: what `export` writes, against what the libraries users read with expect."""

from __future__ import annotations

import os

import hf_fixtures as fx
import keras
import numpy as np
import pytest

import shardckpt
from shardckpt.formats.base import ArraySpec
from shardckpt.formats.safetensors_writer import plan_files

keras_hub = pytest.importorskip("keras_hub")


def test_a_limit_the_model_fits_in_writes_model_safetensors_that_keras_hub_reads(llama_folder, tmp_path):
    """huggingface_hub names a single shard `model.safetensors` with no index; a lone
    `model-00001-of-00001.safetensors` (no index) is a folder neither transformers nor keras-hub loads."""
    keras.backend.clear_session()
    model = shardckpt.from_preset(llama_folder, mesh=(2, 4))
    values = {v.path: np.asarray(v.value) for v in model.weights}
    shardckpt.export(model, tmp_path / "hf", max_shard_size="1GB")
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "model.safetensors"]
    keras.distribution.set_distribution(None)
    keras.backend.clear_session()
    back = fx.keras_hub_load(str(tmp_path / "hf"))
    assert [v.path for v in back.weights] == list(values)
    for v in back.weights:
        np.testing.assert_array_equal(np.asarray(v.value), values[v.path], err_msg=v.path)


def test_a_lone_tensor_over_the_limit_is_model_safetensors_as_huggingface_hub_names_it():
    from huggingface_hub import split_state_dict_into_shards_factory

    specs = {"w": ArraySpec(shape=(64, 64), dtype=np.dtype("float32"))}  # 16 KiB, limit 1 KiB
    hub = split_state_dict_into_shards_factory(
        {"w": np.zeros((64, 64), "float32")}, get_storage_size=lambda t: t.nbytes,
        filename_pattern="model{suffix}.safetensors", max_shard_size=1024,
    )
    assert not hub.is_sharded and list(hub.filename_to_tensors) == ["model.safetensors"]
    assert plan_files(specs, 1024) == {"model.safetensors": ["w"]}
    two = {**specs, "b": ArraySpec(shape=(64,), dtype=np.dtype("float32"))}
    assert list(plan_files(two, 1024)) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
