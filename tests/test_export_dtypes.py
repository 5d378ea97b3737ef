"""`dtype=` of export and convert: floats only, overflow said once by name, config.json's dtype.

- A non-float `dtype` (int8) is refused by every format of `export` and every
  target of `convert`, before anything is written (it truncated every weight).
- A cast into float16 that turns finite values into inf names the variables
  on the "shardckpt" logger, once per export or conversion; numpy's anonymous
  RuntimeWarning is not raised. So does a cast into float8_e4m3fn, which has
  no inf and turns them into NaN.
- The Hugging Face `config.json`'s `dtype` and `torch_dtype` name the dtype the
  tensors are stored in: transformers loads that dtype by default.
"""

from __future__ import annotations

import json
import logging
import warnings

import keras
import numpy as np
import pytest
from safetensors.numpy import load_file

import shardckpt
from shardckpt.errors import DtypeMismatchError

BIG = 1e6  # beyond float16's 65504


def _mlp() -> keras.Model:
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="up"), keras.layers.Dense(2, name="down")])
    model.layers[0].kernel.assign(np.array([[BIG, 1.0, 2.0]] * 2 + [[0.5, -BIG, 3.0]] * 2, "float32"))
    return model


@pytest.mark.parametrize("fmt", ["hf", "keras-hub", "safetensors", "orbax", "peft"])
def test_export_refuses_a_non_float_dtype_before_writing(fmt, tmp_path):
    with pytest.raises(DtypeMismatchError, match=r"floating-point dtype.*Received: dtype='int8'"):
        shardckpt.export(_mlp(), tmp_path / "out", format=fmt, dtype="int8")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("to", ["hf", "keras-hub", "safetensors", "orbax"])
def test_convert_refuses_a_non_float_dtype_before_writing(to, tmp_path):
    src = tmp_path / "mlp.keras"
    _mlp().save(src)
    with pytest.raises(DtypeMismatchError, match=r"Received: dtype='int8'"):
        shardckpt.convert(src, tmp_path / "out", to=to, dtype="int8")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlp.keras"]


def _overflow_records(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "shardckpt" and "into inf" in r.getMessage()]


@pytest.mark.parametrize("fmt", ["safetensors", "orbax", "keras-hub"])
def test_a_float16_export_that_overflows_names_the_variable_once(fmt, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="shardckpt")
    model = _mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's anonymous "overflow encountered in cast" would fail here
        shardckpt.export(model, tmp_path / "out", format=fmt, dtype="float16")
    said = _overflow_records(caplog)
    assert len(said) == 1, said
    assert "turned 4 finite value(s) into inf" in said[0] and "in 1 variable(s):" in said[0]
    assert f"{model.layers[0].kernel.path!r} (4)" in said[0] and "dtype='bfloat16'" in said[0]
    if fmt == "safetensors":
        stored = load_file(str(tmp_path / "out" / "model.safetensors"))[model.layers[0].kernel.path]
        assert stored.dtype == np.float16 and np.isinf(stored).sum() == 4


@pytest.mark.parametrize("fmt", ["safetensors", "orbax", "keras-hub"])
def test_a_float8_e4m3fn_export_that_turns_values_into_nan_names_the_variable_once(fmt, tmp_path, caplog):
    """float8_e4m3fn has no inf: ml_dtypes and XLA cast a value beyond its 448 (BIG) into NaN, which a
    count of infs missed, so the export said nothing."""
    caplog.set_level(logging.WARNING, logger="shardckpt")
    model = _mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shardckpt.export(model, tmp_path / "out", format=fmt, dtype="float8_e4m3fn")
    said = [r.getMessage() for r in caplog.records if r.name == "shardckpt" and "casting to" in r.getMessage()]
    assert len(said) == 1, said
    assert "turned 4 finite value(s) into NaN (float8_e4m3fn has no inf; beyond +-448)" in said[0]
    assert f"{model.layers[0].kernel.path!r} (4)" in said[0] and "in 1 variable(s):" in said[0]
    if fmt == "safetensors":
        from safetensors import safe_open

        torch = pytest.importorskip("torch")  # safetensors reads float8 into torch, not numpy
        with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
            stored = f.get_tensor(model.layers[0].kernel.path)
        assert stored.dtype == torch.float8_e4m3fn and int(stored.float().isnan().sum()) == 4


def _convert_mlp(tmp_path, dtype: str):
    """`convert` of `_mlp()` saved as `.keras` into Orbax in `dtype`, in small batches; numpy's own
    cast warnings are errors (shardckpt says what a cast did, once)."""
    src = tmp_path / "mlp.keras"
    _mlp().save(src)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return shardckpt.convert(src, tmp_path / "out", dtype=dtype, max_inflight_bytes=64)


def test_convert_to_orbax_float8_e4m3fn_nan_names_the_array_once(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="shardckpt")
    _convert_mlp(tmp_path, "float8_e4m3fn")
    said = [r.getMessage() for r in caplog.records if r.name == "shardckpt" and "casting to" in r.getMessage()]
    assert len(said) == 1, said
    assert "turned 4 finite value(s) into NaN" in said[0] and "in 1 variable(s):" in said[0]


@pytest.mark.parametrize("fmt", ["safetensors", "keras-hub", "orbax"])
def test_export_report_lists_each_cast_variable(fmt, tmp_path):
    """`ExportReport.casts` names every variable `dtype=` casts (as `ConvertReport.casts`), and none without it."""
    model = _mlp()
    report = shardckpt.export(model, tmp_path / "cast", format=fmt, dtype="bfloat16")
    assert sorted(report.casts) == sorted(f"{v.path}: float32 -> bfloat16" for v in model.weights)
    assert "\n  cast: " in str(report)
    assert shardckpt.export(model, tmp_path / "own", format=fmt).casts == []


def test_a_float16_export_within_range_says_nothing(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="shardckpt")
    model = _mlp()
    model.layers[0].kernel.assign(np.full((4, 3), 65504.0, "float32"))
    shardckpt.export(model, tmp_path / "out", format="safetensors", dtype="float16")
    assert _overflow_records(caplog) == []


def test_convert_to_orbax_float16_overflow_names_the_array_once(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="shardckpt")
    report = _convert_mlp(tmp_path, "float16")
    said = _overflow_records(caplog)
    assert len(said) == 1, said
    kernel = next(c for c in report.casts if "float32 -> float16" in c and "dense" in c).split(":")[0]
    assert f"{kernel!r} (4)" in said[0] and "in 1 variable(s):" in said[0]


keras_hub = pytest.importorskip("keras_hub")
ARGS = dict(vocabulary_size=61, num_layers=1, num_query_heads=4, num_key_value_heads=2, hidden_dim=32,
            intermediate_dim=40)


@pytest.mark.parametrize(("policy", "dtype", "stored"), [
    ("mixed_bfloat16", None, "float32"),   # float32 weights, bfloat16 compute: config said bfloat16
    ("float32", "bfloat16", "bfloat16"),   # cast on export: config said float32
    ("float32", None, "float32"),
])
def test_hf_config_dtype_is_the_stored_dtype(policy, dtype, stored, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    backbone = keras_hub.models.Llama3Backbone(**ARGS, dtype=policy)
    shardckpt.export(backbone, tmp_path / "hf", dtype=dtype)
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert {str(t.dtype) for t in tensors.values()} == {stored}
    with open(tmp_path / "hf" / "config.json") as f:
        config = json.load(f)
    assert config["dtype"] == stored and config["torch_dtype"] == stored
    loaded = transformers.AutoModel.from_pretrained(tmp_path / "hf")  # transformers' default: the config's dtype
    assert loaded.dtype == getattr(torch, stored)
    got = loaded.embed_tokens.weight.detach().float().numpy()
    np.testing.assert_array_equal(got, tensors["model.embed_tokens.weight"].astype(np.float32))


def test_hf_export_of_mixed_float_dtypes_names_the_most_bytes_dtype_and_warns_once(tmp_path, caplog):
    """A hand-made mix (one bfloat16 norm in a float32 Llama): each tensor is stored in its own dtype,
    config.json names the dtype of the most bytes (float32), one warning names both, and transformers
    loads the folder in float32, the bfloat16 norm widened exactly."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    caplog.set_level(logging.WARNING, logger="shardckpt")
    policies = keras.dtype_policies.DTypePolicyMap(default_policy="float32")
    policies["sequence_output_layernorm"] = "bfloat16"
    backbone = keras_hub.models.Llama3Backbone(**ARGS, dtype=policies)
    norm = backbone.get_layer("sequence_output_layernorm").scale
    assert norm.dtype == "bfloat16"
    norm.assign(np.linspace(0.5, 2.0, norm.shape[0]).astype("float32"))
    report = shardckpt.export(backbone, tmp_path / "hf")
    assert report.casts == []
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert str(tensors["model.norm.weight"].dtype) == "bfloat16"
    assert {str(t.dtype) for k, t in tensors.items() if k != "model.norm.weight"} == {"float32"}
    with open(tmp_path / "hf" / "config.json") as f:
        config = json.load(f)
    assert config["dtype"] == "float32" and config["torch_dtype"] == "float32"
    said = [r.getMessage() for r in caplog.records if r.name == "shardckpt" and "config.json says" in r.getMessage()]
    assert said == ["Llama3Backbone: its tensors are stored in bfloat16, float32; config.json says dtype=float32 "
                    "(the most bytes), which transformers casts every weight to by default. Fix: export with "
                    "dtype=... to store one dtype."]
    loaded = transformers.AutoModel.from_pretrained(tmp_path / "hf")
    assert loaded.dtype == torch.float32 and loaded.norm.weight.dtype == torch.float32
    np.testing.assert_array_equal(loaded.norm.weight.detach().numpy(), tensors["model.norm.weight"].astype(np.float32))
    np.testing.assert_array_equal(loaded.embed_tokens.weight.detach().numpy(), tensors["model.embed_tokens.weight"])
