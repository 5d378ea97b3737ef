"""Export into fake GCS and S3 buckets (tests/buckets.py): read back bit-equal from the bucket."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import shardckpt
from shardckpt import storage
from shardckpt.errors import DestinationExistsError

keras_hub = pytest.importorskip("keras_hub")


def test_export_into_a_bucket_reads_back_bit_equal(llama_folder, bucket):
    keras.backend.clear_session()
    model = shardckpt.from_preset(llama_folder, mesh=(2, 4))
    values = {v.path: np.asarray(v.value) for v in model.weights}
    # 8 KiB files: several objects, each uploaded whole.
    shardckpt.export(model, f"{bucket}/hf", max_shard_size="8KiB")
    report = shardckpt.export(model, f"{bucket}/kh", format="keras-hub", max_shard_size=8 * 1024 / 1024**3)
    assert report.path == f"{bucket}/kh" and report.bytes_written == report.bytes_total
    names = storage.listdir(storage.parse(f"{bucket}/hf"))
    assert "config.json" in names and "model.safetensors.index.json" in names
    assert len([n for n in names if n.endswith(".safetensors")]) > 2
    with pytest.raises(DestinationExistsError, match="overwrite=True"):
        shardckpt.export(model, f"{bucket}/hf")
    for folder in ("hf", "kh"):
        keras.distribution.set_distribution(None)
        keras.backend.clear_session()
        back = shardckpt.from_preset(f"{bucket}/{folder}", mesh=(2, 4))
        assert [v.path for v in back.weights] == list(values)
        for v in back.weights:
            np.testing.assert_array_equal(np.asarray(v.value), values[v.path], err_msg=f"{folder}: {v.path}")


def test_export_into_a_bucket_with_no_shard_size_reads_back(llama_folder, bucket):
    """A bucket export's files are at most the host budget by default: a model below it is one file,
    which must be `model.safetensors` (a lone `model-00001-of-00001.safetensors` has no index and
    no loader finds it)."""
    keras.backend.clear_session()
    model = shardckpt.from_preset(llama_folder, mesh=(2, 4))
    values = {v.path: np.asarray(v.value) for v in model.weights}
    shardckpt.export(model, f"{bucket}/hf")
    assert sorted(storage.listdir(storage.parse(f"{bucket}/hf"))) == ["config.json", "model.safetensors"]
    keras.distribution.set_distribution(None)
    keras.backend.clear_session()
    back = shardckpt.from_preset(f"{bucket}/hf", mesh=(2, 4))
    assert [v.path for v in back.weights] == list(values)
    for v in back.weights:
        np.testing.assert_array_equal(np.asarray(v.value), values[v.path], err_msg=v.path)
