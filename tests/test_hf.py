"""Hugging Face folders into keras-hub models: names, remaps, casts, shardings, reads.

Each architecture's folder (tests/hf_fixtures.py) is loaded by shardckpt
(`presets.hf.build` + `load_sharded`, under a ModelParallel distribution on
a (2, 4) mesh of 8 CPU devices) and by keras-hub's own
`Backbone.from_preset`: every variable must be bit-equal and in the sharding
the layout asks for, and one compiled forward pass bit-equal on both.
"""

from __future__ import annotations

import json
import logging
import os
import re

import hf_fixtures as fx
import jax
import keras
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy as stnp
from jax.sharding import PartitionSpec

import shardckpt
from shardckpt.cli.main import main
from shardckpt.errors import (
    CheckpointMismatchError,
    UnsupportedModelError,
)
from shardckpt.formats import detect_format, open_reader
from shardckpt.formats.base import strided
from shardckpt.formats.hf_remap import Strided, Unsupported
from shardckpt.presets import hf, load_preset

keras_hub = pytest.importorskip("keras_hub")


def _largest_dims_over_the_mesh(model: keras.Model) -> keras.distribution.ModelParallel:
    """Shards each matrix's largest dimension divisible by 4 over "model" and
    another one divisible by 2 over "data": remaps are read in 2-D boxes."""
    mesh = keras.distribution.DeviceMesh((2, 4), ["data", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    for v in model.weights:
        spec: list[str | None] = [None] * len(v.shape)
        if len(v.shape) >= 2:
            dims = sorted(range(len(v.shape)), key=lambda d: -v.shape[d])
            model_dim = next((d for d in dims if v.shape[d] % 4 == 0), None)
            if model_dim is not None:
                spec[model_dim] = "model"
            data_dim = next((d for d in dims if d != model_dim and v.shape[d] % 2 == 0), None)
            if data_dim is not None:
                spec[data_dim] = "data"
        layout_map["^" + re.escape(v.path) + "$"] = tuple(spec)
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="data")


def _inputs(model: keras.Model) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    out = {}
    for name in model.input:
        if name == "token_ids":
            out[name] = rng.integers(0, fx.V, size=(2, 8)).astype("int32")
        elif name == "padding_mask":
            out[name] = np.ones((2, 8), "int32")
        else:
            out[name] = np.zeros((2, 8), "int32")
    return out


def _expected_spec(dist: keras.distribution.ModelParallel, variable) -> PartitionSpec:
    return PartitionSpec(*dist.get_variable_layout(variable).axes)


@pytest.mark.parametrize("arch", fx.ARCHITECTURES)
def test_folder_loads_bit_equal_to_keras_hub_in_its_sharding(arch, tmp_path):
    folder = str(tmp_path / arch)
    source = fx.make_folder(arch, folder, shards=2 if arch == "mixtral" else 1)
    assert detect_format(folder) == "hf"
    keras.backend.clear_session()
    model = hf.build(folder)
    assert type(model).__name__ == type(source).__name__
    assert all(v._value is None for v in model.weights)  # built lazily
    dist = _largest_dims_over_the_mesh(model)
    keras.distribution.set_distribution(dist)
    report = shardckpt.load_sharded(model, folder)
    assert report.format == "hf" and report.arrays == len(model.weights), report
    assert not report.missing and not report.unexpected

    # keras-hub's own load (its converter reading with numpy and assigning),
    # on one device and with its random initializers skipped: they cost 5-11 s
    # per tiny model here and are all overwritten. A fresh session names
    # auto-named layers (mixtral_sparse_moe_block) as ours.
    keras.backend.clear_session()
    reference = fx.keras_hub_load(folder)
    assert [v.path for v in reference.weights] == [v.path for v in model.weights]
    if arch in fx.NO_KERAS_HUB_CONVERTER:
        reference = source  # keras-hub cannot load it: the model whose weights were written
    for ours, theirs, src in zip(model.weights, reference.weights, source.weights):
        assert ours.value.sharding.spec == _expected_spec(dist, ours), ours.path
        np.testing.assert_array_equal(np.asarray(ours.value), np.asarray(theirs.value), err_msg=ours.path)
        if arch not in fx.KERAS_HUB_CASTS:  # mistral: keras-hub rounds through float16
            np.testing.assert_array_equal(np.asarray(ours.value), np.asarray(src.value), err_msg=ours.path)
    # One compiled forward: ours as loaded, and keras-hub's values put in the
    # same shardings. Outputs bit-equal.
    forward = jax.jit(lambda tv, ntv, x: model.stateless_call(tv, ntv, x)[0])
    inputs = _inputs(model)

    def values(m, variables):
        return [jax.device_put(v.value, o.value.sharding) for v, o in zip(variables(m), variables(model))]

    outputs = [
        forward(values(m, lambda x: x.trainable_variables), values(m, lambda x: x.non_trainable_variables), inputs)
        for m in (model, reference)
    ]
    for a, b in zip(keras.tree.flatten(outputs[0]), keras.tree.flatten(outputs[1])):
        assert np.isfinite(np.asarray(a)).all()
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("model_dtype", ["float32", "bfloat16"])
def test_bfloat16_folder_casts_as_keras_hub(model_dtype, tmp_path):
    folder = str(tmp_path / "llama")
    fx.make_folder("llama", folder, dtype="bfloat16")
    with open(os.path.join(folder, "model.safetensors"), "rb") as f:
        assert b'"BF16"' in f.read(4096)
    keras.backend.clear_session()
    model = hf.build(folder, dtype=model_dtype)
    report = shardckpt.load_sharded(model, folder, layout=keras.distribution.DataParallel())
    reference = fx.keras_hub_load(folder, dtype=model_dtype)
    assert bool(report.casts) == (model_dtype == "float32")
    for ours, theirs in zip(model.weights, reference.weights):
        assert np.dtype(ours.dtype) == np.dtype(theirs.dtype) == np.dtype(model_dtype)
        np.testing.assert_array_equal(np.asarray(ours.value), np.asarray(theirs.value), err_msg=ours.path)


def _span(view: np.ndarray, base: np.ndarray) -> tuple[int, int]:
    lo, hi = np.lib.array_utils.byte_bounds(view)
    start = np.lib.array_utils.byte_bounds(base)[0]
    return lo - start, hi - start


def test_each_device_box_is_a_view_of_only_its_bytes(tmp_path):
    folder = str(tmp_path / "llama")
    fx.make_folder("llama", folder)
    keras.backend.clear_session()
    model = hf.build(folder)
    reader = open_reader(folder, model=model)
    try:
        # q_proj (heads*head_dim, hidden) is the kernel (hidden, heads, head_dim)
        # transposed and split: a box of 2 of its 4 heads is the stored rows of those heads.
        key = "transformer_layer_0/self_attention/query/kernel"
        assert reader.sources(key) == ["model.layers.0.self_attn.q_proj.weight"]
        stored = reader._tensors.view("model.layers.0.self_attn.q_proj.weight", (slice(None),) * 2)
        row = stored.shape[1] * stored.itemsize
        view = reader.view(key, (slice(0, fx.H), slice(2, 4), slice(0, 8)))
        assert np.shares_memory(view, stored)  # no copy: the memory map itself
        assert _span(view, stored) == (2 * 8 * row, 4 * 8 * row)
        np.testing.assert_array_equal(view, np.asarray(stored).T.reshape(fx.H, 4, 8)[:, 2:4])
        # The down projection's column block: only those stored rows.
        key = "transformer_layer_0/feedforward_output_dense/kernel"
        stored = reader._tensors.view("model.layers.0.mlp.down_proj.weight", (slice(None),) * 2)
        view = reader.view(key, (slice(0, fx.FF), slice(8, 16)))
        row = stored.shape[1] * stored.itemsize
        assert _span(view, stored)[0] == 8 * row and _span(view, stored)[1] <= 16 * row
    finally:
        reader.close()


def test_stacked_experts_read_only_their_source_tensors(tmp_path):
    folder = str(tmp_path / "qwen2_moe")
    source = fx.make_folder("qwen2_moe", folder)
    keras.backend.clear_session()
    model = hf.build(folder)
    reader = open_reader(folder, model=model)
    try:
        key = next(k for k in reader.keys() if k.endswith("experts/expert_feedforward_gate_dense"))  # noqa: SIM118
        assert len(reader.sources(key)) == 2 * 4  # gate and up of 4 experts, concatenated then stacked
        shape = reader.spec(key).shape
        touched = []
        stored = reader._tensors.read_strided  # the real read, recording which tensors it is asked for

        def recording(name, *args):
            touched.append(name)
            return stored(name, *args)

        reader._tensors.read_strided = recording
        box = (slice(2, 3), slice(0, shape[1]), slice(shape[2] // 2, shape[2]))  # expert 2's up half
        piece = reader.read(key, box)
        assert sorted(set(touched)) == ["model.layers.0.mlp.experts.2.up_proj.weight"]
        expected = np.asarray(next(v for v in source.weights if v.path == key).value)[box]
        np.testing.assert_array_equal(piece, expected)
    finally:
        reader.close()


def test_convert_cli_writes_orbax_from_a_hf_folder(tmp_path, capsys):
    folder = str(tmp_path / "qwen3")
    source = fx.make_folder("qwen3", folder)
    dst = str(tmp_path / "orbax")
    assert main(["convert", folder, dst, "--quiet"]) == 0  # the architecture from config.json
    out = capsys.readouterr().out
    assert "Converted 25 arrays" in out and "from hf" in out, out
    keras.backend.clear_session()
    model = hf.build(folder)
    shardckpt.load_sharded(model, dst, layout=keras.distribution.DataParallel())
    for ours, src in zip(model.weights, source.weights):
        np.testing.assert_array_equal(np.asarray(ours.value), np.asarray(src.value), err_msg=ours.path)


def test_convert_says_when_keras_hubs_converter_stores_another_dtype_and_rounds_once(tmp_path, caplog):
    """Mistral: keras-hub's converter rounds float32 tensors through float16. convert writes what
    keras-hub loads and says so (report and one warning); with dtype= each value is rounded once."""
    from shardckpt.formats.orbax.reader import OrbaxReader

    folder = str(tmp_path / "mistral")
    source = fx.make_folder("mistral", folder)  # float32 tensors
    with caplog.at_level("WARNING", logger="shardckpt"):
        report = shardckpt.convert(folder, str(tmp_path / "as_keras_hub"), progress=False)
    said = [r.getMessage() for r in caplog.records if "rounds its tensors" in r.getMessage()]
    assert len(said) == 1 and "21 of 21 arrays float32 -> float16" in said[0] and "dtype=" in said[0]
    assert report.rounding is not None and "21 of 21 arrays float32 -> float16" in report.rounding
    assert "dtype: keras-hub's converter" in str(report)
    stored = OrbaxReader(str(tmp_path / "as_keras_hub"))
    try:
        assert {stored.spec(k).dtype for k in stored.keys()} == {np.dtype("float16")}
    finally:
        stored.close()
    keras.backend.clear_session()
    model = hf.build(folder)
    shardckpt.load_sharded(model, str(tmp_path / "as_keras_hub"), layout=keras.distribution.DataParallel())
    keras_hub_values = fx.keras_hub_load(folder)  # keras-hub's own load: the same values
    for ours, theirs in zip(model.weights, keras_hub_values.weights):
        np.testing.assert_array_equal(np.asarray(ours.value), np.asarray(theirs.value), err_msg=ours.path)

    # dtype="bfloat16": float32 -> bfloat16 once, not float32 -> float16 -> bfloat16.
    caplog.clear()
    with caplog.at_level("WARNING", logger="shardckpt"):
        report = shardckpt.convert(folder, str(tmp_path / "bf16"), dtype="bfloat16", progress=False)
    assert len([r for r in caplog.records if "rounds its tensors" in r.getMessage()]) == 1
    assert "each value is cast once" in report.rounding and report.casts[0].endswith("float32 -> bfloat16")
    keras.backend.clear_session()
    model = hf.build(folder, dtype="bfloat16")
    shardckpt.load_sharded(model, str(tmp_path / "bf16"), layout=keras.distribution.DataParallel())
    twice = 0
    for ours, src in zip(model.weights, source.weights):
        value = np.asarray(src.value)
        np.testing.assert_array_equal(np.asarray(ours.value), value.astype(ml_dtypes.bfloat16), err_msg=ours.path)
        twice += int(np.sum(value.astype(np.float16).astype(ml_dtypes.bfloat16) != value.astype(ml_dtypes.bfloat16)))
    assert twice > 0  # (rounding twice would differ here)

    # A folder keras-hub converts without a cast: nothing said.
    fx.make_folder("qwen3", str(tmp_path / "qwen3"))
    caplog.clear()
    with caplog.at_level("WARNING", logger="shardckpt"):
        report = shardckpt.convert(str(tmp_path / "qwen3"), str(tmp_path / "q"), progress=False)
    assert report.rounding is None and "dtype:" not in str(report)
    assert not [r for r in caplog.records if "rounds its tensors" in r.getMessage()]


def test_folder_errors_are_typed(tmp_path):
    folder = str(tmp_path / "gemma")
    fx.make_folder("gemma", folder)
    raw = open_reader(folder)  # no model: the stored tensors under their own names (inspect, verify)
    assert raw.format == "hf" and "model.norm.weight" in raw.keys()
    raw.close()
    keras.backend.clear_session()
    model = hf.build(folder)
    # A tensor the converter needs is gone: named, nothing loaded.
    tensors = open_reader(os.path.join(folder, "model.safetensors"))
    kept = {k: np.asarray(tensors.read(k, tuple(slice(0, n) for n in tensors.spec(k).shape)))
            for k in tensors.keys() if k != "model.norm.weight"}  # noqa: SIM118
    tensors.close()
    fx.write_safetensors(os.path.join(folder, "model.safetensors"), kept)
    with pytest.raises(CheckpointMismatchError, match="model.norm.weight"):
        shardckpt.load_sharded(model, folder)
    assert all(v._value is None for v in model.weights)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**config, "model_type": "not_a_model"}, f)
    with pytest.raises(UnsupportedModelError, match="not_a_model"):
        hf.build(folder)


@pytest.mark.parametrize(
    "hook",
    [
        lambda x: np.reshape(np.transpose(x), (6, 2, 2)),
        lambda x: np.transpose(np.reshape(x, (2, 2, 6)), axes=(0, 2, 1)),
        lambda x: np.reshape(x[:, 2:4], (2, 2, 2))[::-1, 1],
        lambda x: np.stack([x.T, x.T[:, ::-1]], axis=1),
        lambda x: np.concatenate([np.transpose(x), np.transpose(x)], axis=-1).astype(np.float16),
        lambda x: np.expand_dims(x.T, 0).squeeze(0),
    ],
)
def test_remap_matches_numpy_on_every_box(hook):
    stored = np.arange(24, dtype=np.float32).reshape(4, 6)
    expected = hook(stored)
    remap = hook(Strided.stored("w", stored.dtype, stored.shape))
    assert remap.shape == expected.shape and remap.dtype == expected.dtype
    rng = np.random.default_rng(0)
    for _ in range(20):
        box = []
        for n in expected.shape:
            a = int(rng.integers(0, n))
            box.append(slice(a, int(rng.integers(a + 1, n + 1))))
        np.testing.assert_array_equal(remap.read(tuple(box), lambda key, *at: strided(stored.reshape(-1), *at)), expected[tuple(box)])


def test_remap_refuses_what_is_not_an_index_remap():
    t = Strided.stored("w", np.dtype(np.float32), (4, 6))
    with pytest.raises(Unsupported, match="reorders"):
        np.reshape(np.transpose(t), (3, 8))  # would need a copy: not a view of the stored tensor
    with pytest.raises(Unsupported):
        t * 2  # arithmetic on values
    with pytest.raises(Unsupported, match="advanced"):
        t[[0, 2]]


def test_bfloat16_values_round_trip_unchanged():
    x = np.array([1.5, -2.25, 3e-3], ml_dtypes.bfloat16)
    t = Strided.stored("w", x.dtype, x.shape)
    np.testing.assert_array_equal(t.read((slice(0, 3),), lambda k, *at: strided(x, *at)), x)



@pytest.mark.parametrize("arch", ["llama3", "qwen2_moe"])
def test_from_preset_of_a_folder_plans_and_loads_bit_equal(arch, tmp_path):
    """`shardckpt.from_preset(hf_folder)`: built lazily, planned by `auto_layout`
    on all 8 devices, every variable bit-equal to keras-hub's load and placed
    as the plan says."""
    folder = str(tmp_path / arch)
    fx.make_folder(arch, folder)
    keras.backend.clear_session()
    model = shardckpt.from_preset(folder, mesh=(1, 8))
    dist = keras.distribution.distribution()
    assert isinstance(dist, keras.distribution.ModelParallel)
    plan = shardckpt.auto_layout(model, dist.device_mesh)
    specs = {p.path: PartitionSpec(*p.axes) for p in plan.placements}
    assert any(axis == "model" for p in plan.placements for axis in p.axes)  # tensor-parallel
    keras.distribution.set_distribution(None)
    keras.backend.clear_session()
    reference = fx.keras_hub_load(folder)
    assert [v.path for v in reference.weights] == [v.path for v in model.weights]
    for ours, theirs in zip(model.weights, reference.weights):
        assert ours.value.sharding.spec == specs[ours.path], ours.path
        np.testing.assert_array_equal(np.asarray(ours.value), np.asarray(theirs.value), err_msg=ours.path)


def _other_llama(folder, **changes):
    """The folder's keras-hub backbone, rebuilt lazily with `changes` to its config."""
    built = hf.build(folder)
    # (keras-hub's get_config leaves tie_word_embeddings out.)
    config = {**built.get_config(), "tie_word_embeddings": built.tie_word_embeddings}
    keras.backend.clear_session()
    with shardckpt.lazy_init():
        return keras_hub.models.Llama3Backbone.from_config({**config, **changes})


@pytest.mark.parametrize("strict", [True, False])
def test_folder_into_a_model_of_another_width_names_each_variable_and_tensor(tmp_path, strict):
    folder = str(tmp_path / "llama")
    fx.make_folder("llama3", folder)
    model = _other_llama(folder, hidden_dim=64, num_query_heads=8, num_key_value_heads=4)
    with pytest.raises(CheckpointMismatchError) as info:
        shardckpt.load_sharded(model, folder, strict=strict)
    lines = info.value.mismatched
    assert any(
        line.startswith("transformer_layer_0/self_attention/query/kernel: expected shape (64, 8, 8), the folder's "
                        "Hugging Face tensor 'model.layers.0.self_attn.q_proj.weight' of shape (32, 32)")
        for line in lines
    ), lines
    assert any(line.startswith("token_embedding/embeddings: expected shape (64, 64)") for line in lines), lines
    fix = str(info.value).split("Fix: ", 1)[1]
    assert "the model differs from the folder's config.json" in fix and "hidden_dim=64 (the folder's: 32)" in fix
    assert all(v._value is None for v in model.weights)


def test_folder_with_fewer_layers_lists_every_missing_tensor(tmp_path):
    folder = str(tmp_path / "llama")
    fx.make_folder("llama3", folder)
    model = _other_llama(folder, num_layers=fx.L + 1)
    with pytest.raises(CheckpointMismatchError) as info:
        shardckpt.load_sharded(model, folder, strict=False)
    missing = info.value.missing
    names = ["input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    for name in names:
        assert sum(f"model.layers.{fx.L}.{name}.weight" in line for line in missing) == 1, (name, missing)
    assert len(missing) == len(names)
    fix = str(info.value).split("Fix: ", 1)[1]
    assert f"num_layers={fx.L + 1} (the folder's: {fx.L})" in fix
    assert "Re-download" not in fix and "re-download" not in fix


def test_folder_into_an_untied_model_names_the_config_difference(tmp_path):
    folder = str(tmp_path / "llama")
    fx.make_folder("llama3", folder)  # tied embeddings: no lm_head.weight
    model = _other_llama(folder, tie_word_embeddings=False)
    with pytest.raises(CheckpointMismatchError) as info:
        shardckpt.load_sharded(model, folder)
    assert info.value.missing == ["token_embedding/reverse_embeddings (Hugging Face tensor 'lm_head.weight')"]
    assert "tie_word_embeddings=False (the folder's: True)" in str(info.value).split("Fix: ", 1)[1]


def _add_tensors(folder: str, make) -> dict[str, np.ndarray]:
    """Rewrites the folder's `model.safetensors` with the tensors `make(tensors)` adds."""
    path = os.path.join(folder, "model.safetensors")
    tensors = stnp.load_file(path)
    tensors.update(make(tensors))
    fx.write_safetensors(path, tensors)
    return tensors


def _shardckpt_records(caplog, level):
    return [r.getMessage() for r in caplog.records if r.name == "shardckpt" and r.levelno == level]


def test_a_tied_folder_storing_another_lm_head_lists_it_and_warns_once(tmp_path, caplog):
    """A tied Llama 3 folder (tie_word_embeddings: true) that also stores an lm_head.weight of other values
    (an untied fine-tune saved with a stale config) and an old rotary buffer."""
    folder = str(tmp_path / "llama3")
    fx.make_folder("llama3", folder)
    _add_tensors(folder, lambda t: {
        "lm_head.weight": t["model.embed_tokens.weight"] * 2 + 1,
        "model.layers.0.self_attn.rotary_emb.inv_freq": np.arange(4, dtype=np.float32),
    })
    keras.backend.clear_session()
    with caplog.at_level(logging.INFO, logger="shardckpt"):
        model, report = load_preset(folder, mesh=(1, 8))
    assert report.unexpected == []
    assert report.skipped == ["lm_head.weight", "model.layers.0.self_attn.rotary_emb.inv_freq"]
    warned = _shardckpt_records(caplog, logging.WARNING)
    assert len(warned) == 1, warned
    assert "its logits use 'model.embed_tokens.weight'; the folder also stores 'lm_head.weight' with other values, " \
           "which is not loaded" in warned[0]
    assert 'Fix: if the folder was saved from an untied model, set "tie_word_embeddings": false' in warned[0]
    assert _shardckpt_records(caplog, logging.INFO)[-1].endswith(
        "2 stored array(s) skipped, the model has no such variables: lm_head.weight, "
        "model.layers.0.self_attn.rotary_emb.inv_freq.")
    keras.distribution.set_distribution(None)
    keras.backend.clear_session()
    reference = fx.keras_hub_load(folder)  # keras-hub: tied, lm_head.weight ignored
    for ours, theirs in zip(model.weights, reference.weights, strict=True):
        np.testing.assert_array_equal(np.asarray(ours.value), np.asarray(theirs.value), err_msg=ours.path)


def test_harmless_extras_of_a_folder_are_listed_and_not_warned(tmp_path, caplog):
    """An lm_head.weight equal to the tied embedding (torch checkpoints store both) and the head of
    another class (a sequence classifier's score.weight) change nothing in the backbone."""
    folder = str(tmp_path / "llama3")
    fx.make_folder("llama3", folder)
    _add_tensors(folder, lambda t: {
        "lm_head.weight": t["model.embed_tokens.weight"].copy(),
        "score.weight": np.ones((3, fx.H), np.float32),
    })
    model = hf.build(folder)
    with caplog.at_level(logging.INFO, logger="shardckpt"):
        report = shardckpt.load_sharded(model, folder, layout=keras.distribution.DataParallel())
    assert report.unexpected == [] and report.skipped == ["lm_head.weight", "score.weight"]
    assert report.arrays == len(model.weights)
    assert _shardckpt_records(caplog, logging.WARNING) == []
    assert len(_shardckpt_records(caplog, logging.INFO)) == 1


def test_a_folder_holding_more_layers_than_its_config_is_refused_when_strict(tmp_path, caplog):
    folder = str(tmp_path / "llama3")
    fx.make_folder("llama3", folder)
    extra = f"model.layers.{fx.L}.mlp.up_proj.weight"
    _add_tensors(folder, lambda t: {extra: t["model.layers.0.mlp.up_proj.weight"].copy()})
    model = hf.build(folder)
    with pytest.raises(CheckpointMismatchError) as info:
        shardckpt.load_sharded(model, folder, layout=keras.distribution.DataParallel())
    assert info.value.unexpected == [extra] and not info.value.missing
    assert "its config.json describes a smaller model than the safetensors hold" in str(info.value).split("Fix: ")[1]
    assert all(v._value is None for v in model.weights)  # nothing loaded
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        report = shardckpt.load_sharded(model, folder, layout=keras.distribution.DataParallel(), strict=False)
    assert report.unexpected == [extra] and report.skipped == []
    warned = _shardckpt_records(caplog, logging.WARNING)
    assert len(warned) == 1 and f"1 stored array(s) the model has no variable for were not loaded ({extra})" in warned[0]
