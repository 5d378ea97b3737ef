"""keras-hub preset folders: `load_sharded(model, preset_dir)` and `shardckpt.from_preset`."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys

import jax
import keras
import numpy as np
import pytest

import shardckpt
from shardckpt import budget, errors
from shardckpt.lazy import is_unloaded
from shardckpt.presets import kerashub, load_preset

keras_hub = pytest.importorskip("keras_hub")

LLAMA = dict(
    vocabulary_size=128, num_layers=2, num_query_heads=8, num_key_value_heads=2, hidden_dim=64, intermediate_dim=128
)
# GB, as keras-hub's max_shard_size takes it: ~54 KiB, so the 0.3 MiB backbone spans 7+ shards.
SHARD_GB = 5e-5


@pytest.fixture(scope="module")
def llama_presets(tmp_path_factory):
    """One tiny Llama backbone saved by keras-hub as a single-file and a sharded preset."""
    root = tmp_path_factory.mktemp("presets")
    keras.backend.clear_session()
    backbone = keras_hub.models.LlamaBackbone(**LLAMA)
    rng = np.random.default_rng(0)
    for v in backbone.weights:
        v.assign(rng.standard_normal(v.shape).astype("float32"))
    backbone.save_to_preset(str(root / "single"))
    backbone.save_to_preset(str(root / "sharded"), max_shard_size=SHARD_GB)
    assert os.path.isfile(root / "single" / "model.weights.h5")
    assert len([n for n in os.listdir(root / "sharded") if n.startswith("model_0")]) >= 3
    return root, {v.path: np.asarray(v.value) for v in backbone.weights}


def _keras_hub_values(folder, **kw):
    """What keras-hub's own from_preset loads (one device, no distribution)."""
    keras.backend.clear_session()
    model = keras_hub.models.Backbone.from_preset(str(folder), **kw)
    return {v.path: np.asarray(v.value) for v in model.weights}


def _llama_layout(mesh_shape=(1, 8)):
    mesh = keras.distribution.DeviceMesh(mesh_shape, ["batch", "model"])
    return keras_hub.models.LlamaBackbone.get_layout_map(mesh)


def _assert_loaded(model, want, distribution):
    assert {v.path for v in model.weights} == set(want)
    for v in model.weights:
        got = np.asarray(v.value)
        assert got.dtype == want[v.path].dtype, v.path
        np.testing.assert_array_equal(got, want[v.path], err_msg=v.path)
        expected = distribution.get_variable_layout(v).backend_layout
        assert v.value.sharding.is_equivalent_to(expected, v.ndim), (v.path, v.value.sharding, expected)


@pytest.mark.parametrize("form", ["single", "sharded"])
def test_from_preset_with_keras_hub_layout_map_is_bit_exact(llama_presets, form):
    root, saved = llama_presets
    want = _keras_hub_values(root / form)
    for path, value in saved.items():
        np.testing.assert_array_equal(want[path], value, err_msg=path)
    keras.backend.clear_session()
    layout_map = _llama_layout()
    model = shardckpt.from_preset(str(root / form), layout=layout_map)
    assert isinstance(model, keras_hub.models.LlamaBackbone)
    dist = keras.distribution.distribution()
    assert isinstance(dist, keras.distribution.ModelParallel)
    _assert_loaded(model, want, dist)
    q = model.get_layer("transformer_layer_0").weights[0]
    assert q.value.sharding.spec == jax.sharding.PartitionSpec("model", "batch", None), q.path
    # The loaded model computes what keras-hub's does.
    inputs = {"token_ids": np.arange(16).reshape(2, 8) % 128, "padding_mask": np.ones((2, 8), "int32")}
    keras.distribution.set_distribution(None)
    keras.backend.clear_session()
    reference = keras_hub.models.Backbone.from_preset(str(root / form))
    np.testing.assert_allclose(
        np.asarray(model(inputs)), np.asarray(reference(inputs)), rtol=1e-5, atol=1e-5
    )


def test_from_preset_casts_to_dtype_like_keras_hub(llama_presets):
    root, _ = llama_presets
    want = _keras_hub_values(root / "sharded", dtype="bfloat16")
    keras.backend.clear_session()
    model = shardckpt.from_preset(str(root / "sharded"), layout=_llama_layout((2, 4)), dtype="bfloat16")
    assert all(v.dtype == "bfloat16" for v in model.weights)
    _assert_loaded(model, want, keras.distribution.distribution())


def test_from_preset_on_every_device_plans_with_auto_layout(llama_presets):
    """mesh=(1, 8): all 8 devices on the "model" axis, planned by shardckpt.auto_layout."""
    root, saved = llama_presets
    keras.backend.clear_session()
    model = shardckpt.from_preset(str(root / "single"), mesh=(1, 8))
    dist = keras.distribution.distribution()
    assert dist.device_mesh.shape == (1, 8) and dist.device_mesh.axis_names == ["data", "model"]
    _assert_loaded(model, saved, dist)
    sharded = [v for v in model.weights if any(a is not None for a in v.value.sharding.spec)]
    assert len(sharded) >= len(model.weights) // 2
    mesh = keras.distribution.DeviceMesh((1, 8), ["data", "model"])
    plan = shardckpt.auto_layout(model, mesh)
    for v in model.weights:
        assert v.value.sharding.is_equivalent_to(plan.sharding_for(v), v.ndim), v.path


def _lazy_under(layout_map, build):
    """`build()` under `lazy_init`, with `layout_map`'s ModelParallel distribution set; returns it and the distribution."""
    keras.backend.clear_session()
    dist = keras.distribution.ModelParallel(layout_map=layout_map)
    keras.distribution.set_distribution(dist)
    with shardckpt.lazy_init():
        return build(), dist


def test_from_preset_loads_within_the_budget_given(llama_presets):
    """`max_inflight_bytes` reaches the load (its report's budget, "given"); None leaves
    load_sharded's default. A budget below every variable still loads each, alone."""
    root, saved = llama_presets
    model, report = load_preset(str(root / "sharded"), mesh=(2, 4), max_inflight_bytes=3 * 2**20)
    assert report.max_inflight_bytes == 3 * 2**20 and report.budget_rule == "given"
    assert report.arrays == len(saved) and not report.missing
    _assert_loaded(model, saved, keras.distribution.distribution())
    keras.distribution.set_distribution(None)
    keras.backend.clear_session()
    _, report = load_preset(str(root / "single"), mesh=(2, 4))
    assert report.max_inflight_bytes == budget.resolve(None, accelerators=0)  # CPU devices: no accelerator
    assert report.budget_rule == budget.describe_default(0)
    keras.distribution.set_distribution(None)
    keras.backend.clear_session()
    model = shardckpt.from_preset(str(root / "single"), mesh=(2, 4), max_inflight_bytes=64)
    _assert_loaded(model, saved, keras.distribution.distribution())


def test_load_sharded_reads_a_preset_folder_into_a_lazy_backbone(llama_presets):
    root, saved = llama_presets
    backbone, dist = _lazy_under(_llama_layout(), lambda: keras_hub.models.LlamaBackbone(**LLAMA))
    report = shardckpt.load_sharded(backbone, str(root / "sharded"))
    assert report.format == "preset" and report.arrays == len(saved)
    _assert_loaded(backbone, saved, dist)


@pytest.fixture(scope="module")
def classifier_preset(tmp_path_factory):
    """A tiny BERT text classifier saved by keras-hub: backbone + task.json + task.weights.h5."""
    folder = tmp_path_factory.mktemp("task") / "bert"
    keras.backend.clear_session()
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=128, num_layers=2, num_heads=8, hidden_dim=64, intermediate_dim=128, max_sequence_length=16
    )
    task = keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=4, preprocessor=None)
    rng = np.random.default_rng(1)
    for v in task.weights:
        v.assign(rng.standard_normal(v.shape).astype("float32"))
    task.save_to_preset(str(folder))
    assert {"task.json", "task.weights.h5", "model.weights.h5"} <= set(os.listdir(folder))
    return folder, {v.path: np.asarray(v.value) for v in task.weights}


def _bert_layout():
    mesh = keras.distribution.DeviceMesh((2, 4), ["data", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*token_embedding/embeddings"] = ("model", None)
    layout_map[".*intermediate_dense/kernel"] = (None, "model")
    layout_map["logits/kernel"] = ("model", None)
    return layout_map


def test_from_preset_builds_and_loads_a_task_with_its_task_weights(classifier_preset):
    folder, saved = classifier_preset
    keras.backend.clear_session()
    reference = keras_hub.models.TextClassifier.from_preset(str(folder))
    want = {v.path: np.asarray(v.value) for v in reference.weights}
    assert set(want) == set(saved)
    np.testing.assert_array_equal(want["logits/kernel"], saved["logits/kernel"])
    keras.backend.clear_session()
    task = shardckpt.from_preset(str(folder), layout=_bert_layout(), cls=keras_hub.models.TextClassifier)
    assert isinstance(task, keras_hub.models.BertTextClassifier)
    _assert_loaded(task, want, keras.distribution.distribution())
    assert task.get_layer("logits").kernel.value.sharding.spec == jax.sharding.PartitionSpec("model", None)
    assert task.optimizer is not None  # compiled with keras-hub's defaults, as its from_preset does


def test_load_sharded_on_a_task_preset_reads_task_weights_only_for_a_task(classifier_preset):
    folder, saved = classifier_preset
    task, dist = _lazy_under(
        _bert_layout(), lambda: keras_hub.models.TextClassifier.from_preset(str(folder), load_weights=False, compile=False)
    )
    report = shardckpt.load_sharded(task, str(folder))
    assert report.arrays == len(saved)
    _assert_loaded(task, saved, dist)
    # The backbone alone: the task's file is not read, nothing is unexpected.
    with shardckpt.lazy_init():
        backbone = keras_hub.models.Backbone.from_preset(str(folder), load_weights=False)
    report = shardckpt.load_sharded(backbone, str(folder))
    assert report.unexpected == [] and report.arrays == len(backbone.weights)
    assert not any(k.startswith("task/") for k in report.skipped)


def test_a_task_preset_without_task_weights_warns_once_naming_the_initialised_head(classifier_preset, tmp_path, caplog):
    """The task's own layers get their initializers' values (keras-hub's behaviour): said, once."""
    folder, saved = classifier_preset
    bare = tmp_path / "bert"
    shutil.copytree(folder, bare)
    os.remove(bare / "task.weights.h5")
    keras.backend.clear_session()
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        task, report = load_preset(str(bare), layout=_bert_layout(), cls=keras_hub.models.TextClassifier)
    said = [r.getMessage() for r in caplog.records if r.name == "shardckpt" and r.levelno >= logging.WARNING]
    assert len(said) == 1, said
    assert "the preset has no task.weights.h5" in said[0]
    assert "the task's own 2 variable(s) got their initializers' values, not trained ones: logits/kernel, logits/bias." in said[0]
    assert "Fix: fine-tune the task before using it" in said[0]
    assert [m.split(" (key")[0] for m in report.missing] == ["logits/kernel", "logits/bias"]
    for v in task.backbone.weights:  # the backbone is the preset's
        np.testing.assert_array_equal(np.asarray(v.value), saved[v.path], err_msg=v.path)
    assert not np.array_equal(np.asarray(task.get_layer("logits").kernel.value), saved["logits/kernel"])

    # With its task weights: nothing at WARNING.
    keras.backend.clear_session()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        shardckpt.from_preset(str(folder), layout=_bert_layout(), cls=keras_hub.models.TextClassifier)
    assert not [r for r in caplog.records if r.name == "shardckpt"]


@pytest.fixture(scope="module")
def causal_lm_preset(tmp_path_factory):
    """A tiny Llama 3 causal LM saved by keras-hub's own `save_to_preset` (its head is the tied embedding)."""
    folder = tmp_path_factory.mktemp("causal") / "llama3"
    keras.backend.clear_session()
    backbone = keras_hub.models.Llama3Backbone(**LLAMA)
    task = keras_hub.models.Llama3CausalLM(backbone=backbone, preprocessor=None)
    rng = np.random.default_rng(2)
    for v in task.weights:
        v.assign(rng.standard_normal(v.shape).astype("float32"))
    task.save_to_preset(str(folder))
    return folder


def test_from_preset_loads_a_causal_lm_that_compiles_and_generates(causal_lm_preset):
    """cls=CausalLM on (1, 8): keras-hub's deferred compile makes a sampler whose seed state the plan
    never saw (it was refused as an unplanned variable); it is replicated, the weights stay as planned."""
    folder = causal_lm_preset
    keras.backend.clear_session()
    reference = keras_hub.models.CausalLM.from_preset(str(folder))
    want = {v.path: np.asarray(v.value) for v in reference.weights}
    prompt = {"token_ids": np.array([[5, 17, 3, 0, 0, 0], [9, 2, 0, 0, 0, 0]], "int32")}
    prompt["padding_mask"] = prompt["token_ids"] != 0
    reference.compile(sampler="greedy")
    reference_greedy = reference.generate(prompt, stop_token_ids=None)
    keras.backend.clear_session()

    model = shardckpt.from_preset(str(folder), mesh=(1, 8), cls=keras_hub.models.CausalLM)
    assert isinstance(model, keras_hub.models.Llama3CausalLM)
    dist = keras.distribution.distribution()
    assert dist.device_mesh.shape == (1, 8)
    plan = dist.plan.bind(model)
    assert {v.path for v in model.weights} == set(want)
    for v in model.weights:
        got = np.asarray(v.value)
        assert got.dtype == want[v.path].dtype, v.path
        np.testing.assert_array_equal(got, want[v.path], err_msg=v.path)
        assert v.value.sharding.is_equivalent_to(plan.sharding_for(v), v.ndim), (v.path, v.value.sharding)
    assert sum(any(a is not None for a in v.value.sharding.spec) for v in model.weights) >= len(model.weights) // 2
    # The sampler keras-hub's compile made after the load: its seed state on every device, whole.
    state = model.sampler.seed_generator.state
    assert state.value.sharding.is_fully_replicated and len(state.value.sharding.device_set) == 8
    assert model.optimizer is not None

    sampled = model.generate(prompt, stop_token_ids=None)  # keras-hub's default sampler (top-k), drawing from that state
    assert sampled["token_ids"].shape == (2, 6)
    np.testing.assert_array_equal(sampled["token_ids"][:, :2], prompt["token_ids"][:, :2])
    model.compile(sampler="greedy")
    greedy = model.generate(prompt, stop_token_ids=None)
    np.testing.assert_array_equal(greedy["token_ids"], reference_greedy["token_ids"])
    np.testing.assert_array_equal(greedy["padding_mask"], reference_greedy["padding_mask"])


def test_missing_shard_of_a_sharded_preset_loads_nothing(llama_presets, tmp_path):
    root, _ = llama_presets
    folder = tmp_path / "broken"
    os.mkdir(folder)
    for name in os.listdir(root / "sharded"):
        if name != "model_00002.weights.h5":
            os.link(root / "sharded" / name, folder / name)
    keras.backend.clear_session()
    with pytest.raises(errors.CheckpointNotFoundError, match="model_00002.weights.h5"):
        shardckpt.from_preset(str(folder), layout=_llama_layout())
    # The index is checked whole before any array is read: a lazily built model
    # loading from the folder is left with no variable loaded.
    keras.backend.clear_session()
    model = kerashub.build(str(folder))
    with pytest.raises(errors.CheckpointNotFoundError, match=r"Shard 'model_00002.weights.h5' .* does not exist"):
        shardckpt.load_sharded(model, str(folder))
    assert model.weights and all(is_unloaded(v) for v in model.weights)


def test_without_keras_hub_a_keras_hub_preset_names_the_install(llama_presets, monkeypatch):
    root, _ = llama_presets
    monkeypatch.setitem(sys.modules, "keras_hub", None)  # what an environment without it gives
    with pytest.raises(errors.MissingDependencyError, match="pip install keras-hub") as e:
        shardckpt.from_preset(str(root / "single"), layout=_llama_layout())
    assert isinstance(e.value, ImportError)


def test_unrecognised_config_and_missing_folder(tmp_path):
    with pytest.raises(errors.CheckpointNotFoundError, match="no_such_preset"):
        shardckpt.from_preset(str(tmp_path / "no_such_preset"))
    (tmp_path / "config.json").write_text(json.dumps({"hello": 1}))
    with pytest.raises(errors.UnknownFormatError, match="registered_name"):
        shardckpt.from_preset(str(tmp_path))
