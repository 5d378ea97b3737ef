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


def _lora_llama() -> keras.Model:
    keras.backend.clear_session()
    backbone = keras_hub.models.Llama3Backbone(
        vocabulary_size=64, num_layers=1, num_query_heads=4, num_key_value_heads=2, hidden_dim=32, intermediate_dim=64)
    task = keras_hub.models.Llama3CausalLM(backbone=backbone, preprocessor=None)
    task.backbone.enable_lora(2)
    rng = np.random.default_rng(3)
    for v in task.weights:
        v.assign(rng.standard_normal(v.shape).astype("float32") * 0.1)
    return task


@pytest.mark.parametrize("fmt", ["orbax", "peft"])
def test_max_shard_size_is_refused_where_the_format_is_not_split(fmt, tmp_path):
    """It was ignored without a word by export (one Orbax step, one adapter file of any size), where
    `convert(to="orbax", max_shard_size=...)` refused it."""
    with pytest.raises(ValueError, match=rf"max_shard_size applies to .*Fix: drop it. Received: format='{fmt}'"):
        shardckpt.export(_lora_llama(), tmp_path / "out", format=fmt, max_shard_size="1KB")
    assert list(tmp_path.iterdir()) == []


def test_peft_adapter_into_a_bucket_is_one_file_read_back_bit_equal(bucket, tmp_path):
    """A bucket export passes the host budget on as the files' limit: not to a PEFT adapter, one file."""
    from shardckpt import storage

    task = _lora_llama()
    shardckpt.export(task, tmp_path / "local", format="peft")
    shardckpt.export(task, f"{bucket}/adapter", format="peft")
    names = sorted(storage.listdir(storage.parse(f"{bucket}/adapter")))
    assert names == sorted(os.listdir(tmp_path / "local")) == ["adapter_config.json", "adapter_model.safetensors"]
    for name in names:
        with open(tmp_path / "local" / name, "rb") as f:
            assert storage.read_bytes(storage.parse(f"{bucket}/adapter/{name}")) == f.read(), name


class _Unconfigurable(keras.Model):
    """A subclassed model whose constructor takes an object Keras cannot serialise, and no get_config."""

    def __init__(self, table: object, **kwargs):
        super().__init__(**kwargs)
        self.table = table
        self.dense = keras.layers.Dense(3)

    def call(self, x):
        return self.dense(x)


def test_a_model_without_a_config_is_refused_by_keras_hub_before_anything_is_written(tmp_path):
    """keras-hub's saver writes config.json after the weights: the export wrote every weight, then ended
    in Keras' bare NotImplementedError and left `<dst>.shardckpt-partial/` with the weights behind."""
    from shardckpt.errors import UnsupportedModelError

    keras.backend.clear_session()
    model = _Unconfigurable(table=object())
    model(np.zeros((1, 4), "float32"))
    with pytest.raises(UnsupportedModelError, match=r"_Unconfigurable .*config\.json.*Fix: .*format='safetensors'"):
        shardckpt.export(model, tmp_path / "kh", format="keras-hub")
    assert list(tmp_path.iterdir()) == []
    shardckpt.export(model, tmp_path / "st", format="safetensors")  # the fix: no config needed
    assert os.listdir(tmp_path / "st") == ["model.safetensors"]
