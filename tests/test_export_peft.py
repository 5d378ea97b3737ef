"""`export(model, format="peft")`: a keras-hub LoRA model's factors as a PEFT adapter folder.

Names and shapes as PEFT's `save_pretrained` writes them
(`base_model.model.<module>.lora_A.weight` (r, in), `lora_B` (out, r)),
`adapter_config.json` fields, values equal to the factors (Keras' EinsumDense
factors laid out per head: see `shardckpt.exporting.peft`), and PEFT itself
loading the adapter onto transformers' model of the base `hf` export and
reproducing the keras-hub LoRA model's logits.
"""

from __future__ import annotations

import json
import os
import re

import keras
import numpy as np
import pytest
from safetensors.numpy import load_file

import shardckpt
from shardckpt.errors import UnsupportedModelError

keras_hub = pytest.importorskip("keras_hub")

TOKENS = np.array([[2, 7, 11, 3, 5, 9, 4, 1], [2, 6, 8, 10, 12, 14, 3, 0]], dtype="int32")
RANK, ALPHA = 2, 6


def _randomize(variables, seed: int, scale: float = 0.05) -> None:
    rng = np.random.default_rng(seed)
    for v in variables:
        v.assign(rng.standard_normal(v.shape).astype("float32") * scale)


def _task(arch: str) -> keras.Model:
    if arch == "llama3":
        backbone = keras_hub.models.Llama3Backbone(
            vocabulary_size=64, num_layers=2, num_query_heads=4, num_key_value_heads=2, hidden_dim=32,
            intermediate_dim=64)
        task = keras_hub.models.Llama3CausalLM(backbone=backbone, preprocessor=None)
    else:
        backbone = keras_hub.models.GemmaBackbone(
            vocabulary_size=64, num_layers=2, num_query_heads=4, num_key_value_heads=1, hidden_dim=32,
            intermediate_dim=64, head_dim=8)
        task = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    _randomize(task.weights, 3)
    return task


def _lora(task: keras.Model) -> list:
    task.backbone.enable_lora(RANK)
    layers = [layer for layer in task._flatten_layers() if getattr(layer, "lora_enabled", False)]
    for layer in layers:
        layer.lora_alpha = ALPHA  # alpha != rank: the scale must carry over
    _randomize([f for layer in layers for f in (layer.lora_kernel_a, layer.lora_kernel_b)], 9, scale=0.2)
    return layers


def _keras_logits(task: keras.Model) -> np.ndarray:
    return np.asarray(task.predict({"token_ids": TOKENS, "padding_mask": np.ones_like(TOKENS)}, verbose=0))


@pytest.mark.parametrize("arch", ["llama3", "gemma"])
def test_peft_adapter_names_shapes_config_and_values(arch, tmp_path):
    task = _task(arch)
    shardckpt.export(task, tmp_path / "base")  # the base model, before LoRA
    layers = _lora(task)
    shardckpt.export(task, tmp_path / "merged")  # the LoRA model merged
    report = shardckpt.export(task, tmp_path / "adapter", format="peft")
    assert sorted(os.listdir(tmp_path / "adapter")) == ["adapter_config.json", "adapter_model.safetensors"]
    tensors = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    with open(tmp_path / "adapter" / "adapter_config.json") as f:
        config = json.load(f)
    heads, kv = task.backbone.num_query_heads, task.backbone.num_key_value_heads
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert config["target_modules"] == ["q_proj", "v_proj"]
    # PEFT's rank per module: Keras' rank once per head; alpha keeps PEFT's scale alpha/r equal to Keras'.
    assert config["r"] == heads * RANK and config["lora_alpha"] == heads * ALPHA
    assert config["rank_pattern"] == ({"v_proj": kv * RANK} if kv != heads else {})
    assert config["alpha_pattern"] == ({"v_proj": kv * ALPHA} if kv != heads else {})
    assert config["lora_dropout"] == 0.0 and config["bias"] == "none" and config["fan_in_fan_out"] is False
    hidden, head_dim = task.backbone.hidden_dim, task.backbone.hidden_dim // heads if arch == "llama3" else 8
    want = {}
    for i in range(task.backbone.num_layers):
        for proj, n in (("q_proj", heads), ("v_proj", kv)):
            stem = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            want[f"{stem}.lora_A.weight"] = (n * RANK, hidden)
            want[f"{stem}.lora_B.weight"] = (n * head_dim, n * RANK)
    assert {k: v.shape for k, v in tensors.items()} == want
    assert report.arrays == len(want)

    base = load_file(str(tmp_path / "base" / "model.safetensors"))
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    checked = 0
    for layer in layers:
        a, b = np.asarray(layer.lora_kernel_a), np.asarray(layer.lora_kernel_b)
        n = a.shape[1] if arch == "llama3" else a.shape[0]
        proj = "q_proj" if n == heads and "query" in layer.name else "v_proj"
        i = int(re.search(r"(?:layer|block)_(\d+)/", layer.path).group(1))
        stem = f"base_model.model.model.layers.{i}.self_attn.{proj}"
        got_a, got_b = tensors[f"{stem}.lora_A.weight"], tensors[f"{stem}.lora_B.weight"]
        # Llama kernels are (hidden, heads, head_dim), Gemma's (heads, hidden, head_dim): A' rows are (head, j).
        heads_first = a.transpose(1, 2, 0) if arch == "llama3" else a.transpose(0, 2, 1)
        np.testing.assert_array_equal(got_a, heads_first.reshape(n * RANK, hidden))
        for h in range(n):
            block = np.zeros_like(got_b)
            block[h * head_dim:(h + 1) * head_dim, h * RANK:(h + 1) * RANK] = b.T
            mask = np.zeros(got_b.shape, bool)
            mask[h * head_dim:(h + 1) * head_dim, h * RANK:(h + 1) * RANK] = True
            np.testing.assert_array_equal(got_b[mask], block[mask])
        diag = np.zeros(got_b.shape, bool)
        for h in range(n):
            diag[h * head_dim:(h + 1) * head_dim, h * RANK:(h + 1) * RANK] = True
        assert not got_b[~diag].any()  # off the block diagonal: zeros
        # PEFT's delta B' @ A' * lora_alpha / r is Keras' merged minus base, in Hugging Face's layout.
        key = f"model.layers.{i}.self_attn.{proj}.weight"
        r = config["rank_pattern"].get(proj, config["r"])
        alpha = config["alpha_pattern"].get(proj, config["lora_alpha"])
        np.testing.assert_allclose(got_b @ got_a * (alpha / r), merged[key] - base[key], atol=2e-6, rtol=0)
        checked += 1
    assert checked == 2 * task.backbone.num_layers


@pytest.mark.parametrize("arch", ["llama3", "gemma"])
def test_peft_loads_the_adapter_and_reproduces_the_keras_lora_logits(arch, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    task = _task(arch)
    shardckpt.export(task, tmp_path / "base")
    _lora(task)
    shardckpt.export(task, tmp_path / "adapter", format="peft")
    want = _keras_logits(task)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), attn_implementation="eager")
    with torch.no_grad():
        plain = model(input_ids=torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()
    assert np.abs(plain - want).max() > 1e-3  # the adapter changes the logits: the test can fail
    adapted = peft.PeftModel.from_pretrained(model, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        got = adapted(input_ids=torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_peft_refuses_a_model_without_lora(tmp_path):
    task = _task("llama3")
    with pytest.raises(UnsupportedModelError, match="no LoRA-enabled layer.*enable_lora"):
        shardckpt.export(task, tmp_path / "adapter", format="peft")
    assert os.listdir(tmp_path) == []


def lora_on_mesh(src: str) -> keras.Model:
    """The tiny Llama folder on a (2, 4) mesh, LoRA enabled, factors set from a seed (every process alike)."""
    model = shardckpt.from_preset(src, mesh=(2, 4))
    keras.utils.set_random_seed(0)  # enable_lora draws A: the same draw in every process
    model.enable_lora(RANK)
    rng = np.random.default_rng(21)
    for layer in model._flatten_layers():
        if getattr(layer, "lora_enabled", False):
            for f in (layer.lora_kernel_a, layer.lora_kernel_b):
                f.assign(rng.standard_normal(f.shape).astype("float32"))
    return model


@pytest.mark.multiprocess
def test_two_processes_export_the_adapter_byte_for_byte_as_one(tmp_path):
    import hf_fixtures as fx

    from tests.mp import run_pair

    fx.make_folder("llama", str(tmp_path / "src"))
    model = lora_on_mesh(str(tmp_path / "src"))
    sharded = [layer.lora_kernel_a for layer in model._flatten_layers() if getattr(layer, "lora_enabled", False)]
    assert any(len(f.value.sharding.device_set) == 8 for f in sharded)
    one = shardckpt.export(model, tmp_path / "one_adapter", format="peft")
    keras.distribution.set_distribution(None)

    run_pair("_export_peft_worker.py", str(tmp_path), timeout=300)

    for name in ("adapter_config.json", "adapter_model.safetensors"):
        a, b = (tmp_path / "one_adapter" / name).read_bytes(), (tmp_path / "mp_adapter" / name).read_bytes()
        assert a == b, f"mp_adapter/{name} differs from the 1-process export"
    results = [json.loads((tmp_path / f"result{i}.json").read_text()) for i in range(2)]
    assert all(r["total"] == one.bytes_total for r in results)
    # The processes together write what one process writes (B' off its block diagonal is the file's hole).
    assert sum(r["written"] for r in results) == one.bytes_written < one.bytes_total
    assert all(r["written"] > 0 for r in results), results


def test_fit_trained_biases_go_to_the_adapter_as_peft_lora_only_biases(tmp_path):
    """Keras' enable_lora leaves query/value biases trainable and fit trains them: bias="lora_only"."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    keras.utils.set_random_seed(0)
    task = keras_hub.models.QwenCausalLM(backbone=keras_hub.models.QwenBackbone(
        vocabulary_size=61, num_layers=2, num_query_heads=4, num_key_value_heads=2, hidden_dim=32,
        intermediate_dim=40), preprocessor=None)
    shardckpt.export(task, tmp_path / "base")
    task.backbone.enable_lora(RANK)
    trained = sorted(v.path for v in task.trainable_weights if "lora" not in v.path)
    assert len(trained) == 4 and all(p.endswith(("query/bias", "value/bias")) for p in trained)
    ids = np.random.default_rng(0).integers(1, 61, size=(8, 10)).astype("int32")
    x = {"token_ids": ids, "padding_mask": np.ones_like(ids)}
    task.compile(optimizer=keras.optimizers.Adam(1e-2),
                 loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    task.fit(x, np.roll(ids, -1, axis=1), epochs=3, verbose=0)
    want = np.asarray(task(x), np.float32)
    shardckpt.export(task, tmp_path / "adapter", format="peft")
    with open(tmp_path / "adapter" / "adapter_config.json") as f:
        config = json.load(f)
    assert config["bias"] == "lora_only" and config["modules_to_save"] is None
    tensors = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    biases = sorted(k for k in tensors if k.endswith("bias"))
    assert biases == [f"base_model.model.model.layers.{i}.self_attn.{p}_proj.base_layer.bias"
                      for i in range(2) for p in ("q", "v")]
    layer = task.backbone.transformer_layers[0]._self_attention_layer
    np.testing.assert_array_equal(
        tensors["base_model.model.model.layers.0.self_attn.q_proj.base_layer.bias"],
        np.asarray(layer._query_dense.bias).reshape(-1))
    base = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), attn_implementation="eager")
    adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        got = adapted(input_ids=torch.from_numpy(ids.astype(np.int64))).logits.numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_a_trained_task_head_goes_to_modules_to_save(tmp_path):
    """A BertTextClassifier's head stays trainable after backbone.enable_lora: modules_to_save=["classifier"]."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    backbone = keras_hub.models.BertBackbone(vocabulary_size=61, num_layers=2, num_heads=2, hidden_dim=32,
                                             intermediate_dim=64, max_sequence_length=32)
    task = keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=3, preprocessor=None)
    _randomize(task.weights, 3, scale=0.1)
    shardckpt.export(task, tmp_path / "base")
    layers = _lora(task)
    _randomize(task.output_dense.weights + [v.bias for v in layers], 5, scale=0.5)  # as fine-tuning changes them
    x = {"token_ids": TOKENS, "segment_ids": np.zeros_like(TOKENS), "padding_mask": np.ones_like(TOKENS)}
    want = np.asarray(task(x), np.float32)
    shardckpt.export(task, tmp_path / "adapter", format="peft")
    with open(tmp_path / "adapter" / "adapter_config.json") as f:
        config = json.load(f)
    assert config["modules_to_save"] == ["classifier"] and config["bias"] == "lora_only"
    tensors = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    np.testing.assert_array_equal(tensors["base_model.model.classifier.weight"],
                                  np.asarray(task.output_dense.kernel).T)
    base = transformers.AutoModelForSequenceClassification.from_pretrained(
        str(tmp_path / "base"), attn_implementation="eager")
    adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        got = adapted(input_ids=torch.from_numpy(TOKENS.astype(np.int64)),
                      token_type_ids=torch.zeros(TOKENS.shape, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_a_trained_lora_kernel_is_refused_by_name(tmp_path):
    task = _task("llama3")
    layers = _lora(task)
    layers[0]._kernel.trainable = True  # trained beside its factors: no adapter holds that
    with pytest.raises(UnsupportedModelError, match=re.escape(layers[0]._kernel.path) + r".*format='hf'"):
        shardckpt.export(task, tmp_path / "adapter", format="peft")
    assert not (tmp_path / "adapter").exists()


def test_a_variable_changed_while_frozen_is_left_out_until_its_layer_is_made_trainable(tmp_path):
    """Frozen variables are never compared with a base: the final norm (frozen by enable_lora) changed
    while frozen is not in the adapter; made trainable, it goes to modules_to_save, and PEFT reproduces
    the keras-hub logits."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    task = _task("llama3")
    shardckpt.export(task, tmp_path / "base")
    _lora(task)
    norm = task.backbone.get_layer("sequence_output_layernorm")
    assert not norm.trainable  # enable_lora froze it
    norm.scale.assign(np.linspace(0.5, 2.0, norm.scale.shape[0]).astype("float32"))  # changed while frozen
    shardckpt.export(task, tmp_path / "frozen", format="peft")
    with open(tmp_path / "frozen" / "adapter_config.json") as f:
        assert json.load(f)["modules_to_save"] is None
    assert not any("norm" in k for k in load_file(str(tmp_path / "frozen" / "adapter_model.safetensors")))

    norm.trainable = True  # the README's way to put it in the adapter
    shardckpt.export(task, tmp_path / "adapter", format="peft")
    with open(tmp_path / "adapter" / "adapter_config.json") as f:
        config = json.load(f)
    tensors = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert config["modules_to_save"] == ["model.norm"], config["modules_to_save"]
    np.testing.assert_array_equal(tensors["base_model.model.model.norm.weight"], np.asarray(norm.scale))
    want = _keras_logits(task)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), attn_implementation="eager")
    adapted = peft.PeftModel.from_pretrained(model, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        got = adapted(input_ids=torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
