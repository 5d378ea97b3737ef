"""`export(task, format="hf")` writes the task's head under its Hugging Face class's names.

BERT classification (`BertTextClassifier` -> `BertForSequenceClassification`:
`bert.` + the backbone's tensors, `classifier.weight/bias`, `id2label`) and
an untied causal LM (`lm_head.weight`), each read by transformers itself
(CPU torch, test-only), logits within 1e-4 of keras-hub's; a task whose
head has no mapping is refused, naming its variables, before anything is
written.
"""

from __future__ import annotations

import json
import os

import keras
import numpy as np
import pytest
from safetensors.numpy import load_file

import shardckpt
from shardckpt.errors import UnsupportedModelError

keras_hub = pytest.importorskip("keras_hub")

TOKENS = np.array([[2, 7, 11, 3, 5, 9, 4, 1], [2, 6, 8, 10, 12, 14, 3, 0]], dtype="int32")


def _randomize(model: keras.Model, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for v in model.weights:
        v.assign(rng.standard_normal(v.shape).astype("float32") * 0.05)


def _bert_classifier(num_classes: int = 3) -> keras.Model:
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=50, num_layers=2, num_heads=2, hidden_dim=32, intermediate_dim=64, max_sequence_length=32,
    )
    task = keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=num_classes, preprocessor=None)
    _randomize(task, 3)
    return task


def _bert_inputs() -> dict[str, np.ndarray]:
    return {"token_ids": TOKENS, "segment_ids": np.zeros_like(TOKENS), "padding_mask": np.ones_like(TOKENS)}


def test_bert_classifier_exports_its_head_as_bert_for_sequence_classification(tmp_path):
    task = _bert_classifier(num_classes=3)
    shardckpt.export(task, tmp_path / "hf")
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    np.testing.assert_array_equal(tensors["classifier.weight"], np.asarray(task.output_dense.kernel).T)
    np.testing.assert_array_equal(tensors["classifier.bias"], np.asarray(task.output_dense.bias))
    others = sorted(set(tensors) - {"classifier.weight", "classifier.bias"})
    assert others and all(k.startswith("bert.") for k in others), others
    # Every variable of the task is stored once: backbone tensors and the head.
    assert sum(t.size for t in tensors.values()) == sum(int(np.prod(v.shape)) for v in task.weights)
    with open(tmp_path / "hf" / "config.json") as f:
        config = json.load(f)
    assert config["architectures"] == ["BertForSequenceClassification"]
    assert config["id2label"] == {"0": "LABEL_0", "1": "LABEL_1", "2": "LABEL_2"}
    assert config["label2id"] == {"LABEL_0": 0, "LABEL_1": 1, "LABEL_2": 2}

    # keras-hub's own loader reads the backbone back from the prefixed names, bit-equal.
    back = keras_hub.models.BertBackbone.from_preset(str(tmp_path / "hf"))
    for v, want in zip(back.weights, task.backbone.weights, strict=True):
        np.testing.assert_array_equal(np.asarray(v.value), np.asarray(want.value), err_msg=v.path)


def test_transformers_reads_the_bert_classifier_logits(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    task = _bert_classifier(num_classes=4)
    want = np.asarray(task.predict(_bert_inputs(), verbose=0))
    shardckpt.export(task, tmp_path / "hf")
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(
        str(tmp_path / "hf"), attn_implementation="eager").eval()
    assert type(hf).__name__ == "BertForSequenceClassification" and hf.config.num_labels == 4
    with torch.no_grad():
        got = hf(input_ids=torch.tensor(TOKENS, dtype=torch.long),
                 token_type_ids=torch.zeros(TOKENS.shape, dtype=torch.long),
                 attention_mask=torch.ones(TOKENS.shape, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def _llama_causal_lm(tie: bool) -> keras.Model:
    backbone = keras_hub.models.Llama3Backbone(
        vocabulary_size=64, num_layers=2, num_query_heads=4, num_key_value_heads=2, hidden_dim=32,
        intermediate_dim=64, tie_word_embeddings=tie,
    )
    task = keras_hub.models.Llama3CausalLM(backbone=backbone, preprocessor=None)
    _randomize(task, 4)
    return task


def test_untied_causal_lm_exports_lm_head_and_transformers_reads_its_logits(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    task = _llama_causal_lm(tie=False)
    shardckpt.export(task, tmp_path / "hf")
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    np.testing.assert_array_equal(tensors["lm_head.weight"], np.asarray(task.backbone.token_embedding.reverse_embeddings).T)
    with open(tmp_path / "hf" / "config.json") as f:
        assert json.load(f)["architectures"] == ["LlamaForCausalLM"]
    want = np.asarray(task.predict({"token_ids": TOKENS, "padding_mask": np.ones_like(TOKENS)}, verbose=0))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), attn_implementation="eager").eval()
    with torch.no_grad():
        got = hf(input_ids=torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_task_with_an_unmapped_head_is_refused_naming_its_variables(tmp_path):
    backbone = keras_hub.models.RobertaBackbone(
        vocabulary_size=50, num_layers=1, num_heads=2, hidden_dim=16, intermediate_dim=32, max_sequence_length=16,
    )
    task = keras_hub.models.RobertaTextClassifier(backbone=backbone, num_classes=2, preprocessor=None)
    with pytest.raises(UnsupportedModelError, match=r"RobertaTextClassifier.*logits/kernel.*export model\.backbone"):
        shardckpt.export(task, tmp_path / "hf")
    assert os.listdir(tmp_path) == []  # not even a partial folder
