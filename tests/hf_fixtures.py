"""Small Hugging Face folders for every architecture shardckpt maps, from real keras-hub models.

Two writers, never a per-model table of names:

- keras-hub's own exporter (`export_backbone`) where it has one (Gemma,
  Llama3, Mistral, Qwen2, GPT-2, Gemma3); two keras-hub exporter gaps are
  patched as the Hugging Face files would have them (Qwen2's config lacks
  `use_sliding_window` / `sliding_window`, Gemma3 needs the post-norms real
  Gemma3 models have).
- For the rest (Llama without tied embeddings, Gemma2, Mixtral, Qwen3, Qwen2-MoE,
  Qwen3-MoE, Phi-3, BERT): the HF config below (as transformers writes it, tiny),
  and the weights of a keras-hub model built from it written under Hugging
  Face names by running keras-hub's converter in reverse through the same
  recorded remaps shardckpt reads with (`hf_remap.Tensor.write`). Stored
  shapes are solved from the Keras layers' structure by the same solver
  `shardckpt.export` uses (`shardckpt.exporting.hf_shapes`).
"""

from __future__ import annotations

import json
import os
from typing import Any

import ml_dtypes
import numpy as np

from shardckpt import lazy_init
from shardckpt.exporting.hf_shapes import stored_shapes
from shardckpt.formats.base import DTYPES, ArraySpec
from shardckpt.formats.hf_record import record
from shardckpt.presets import hf

V, H, L, FF = 64, 32, 2, 64  # vocab, hidden, layers, intermediate

_LLAMA_LIKE = {
    "vocab_size": V, "hidden_size": H, "num_hidden_layers": L, "intermediate_size": FF,
    "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}

CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **_LLAMA_LIKE},
    "gemma2": {
        "model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], "vocab_size": V, "hidden_size": H,
        "num_hidden_layers": L, "intermediate_size": FF // 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "query_pre_attn_scalar": 8, "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0, "sliding_window": 16, "rms_norm_eps": 1e-6,
    },
    "mixtral": {
        "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], **_LLAMA_LIKE,
        "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None, "output_router_logits": False,
    },
    "qwen3": {
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], **_LLAMA_LIKE, "head_dim": 8,
        "use_sliding_window": False, "sliding_window": None,
    },
    "qwen2_moe": {
        "model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"], **_LLAMA_LIKE,
        "moe_intermediate_size": 16, "shared_expert_intermediate_size": 32, "num_experts": 4,
        "num_experts_per_tok": 2, "norm_topk_prob": False, "decoder_sparse_step": 1, "use_sliding_window": False,
        "sliding_window": 4096, "output_router_logits": False, "router_aux_loss_coef": 0.001,
    },
    "qwen3_moe": {
        "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], **_LLAMA_LIKE, "head_dim": 8,
        "moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "sliding_window": None, "router_aux_loss_coef": 0.001,
    },
    "phi3": {
        "model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "vocab_size": V, "hidden_size": H,
        "num_hidden_layers": L, "intermediate_size": FF, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 64,
        "original_max_position_embeddings": 64, "rope_scaling": None, "tie_word_embeddings": False,
    },
    "bert": {
        "model_type": "bert", "architectures": ["BertModel"], "vocab_size": V, "hidden_size": H,
        "num_hidden_layers": L, "num_attention_heads": 4, "intermediate_size": FF, "max_position_embeddings": 32,
        "type_vocab_size": 2, "layer_norm_eps": 1e-12,
    },
}
"""Hugging Face configs (tiny) for the architectures keras-hub has no exporter for."""


def _exported(name: str) -> Any:
    import keras_hub

    m = keras_hub.models
    tiny = {"vocabulary_size": V, "num_layers": L, "hidden_dim": H, "intermediate_dim": FF}
    factories = {
        # Gemma's exporter writes one key/value head (keras-hub 0.32).
        "gemma": lambda **kw: m.GemmaBackbone(**tiny, num_query_heads=4, num_key_value_heads=1, head_dim=8, **kw),
        "llama3": lambda **kw: m.Llama3Backbone(**tiny, num_query_heads=4, num_key_value_heads=2, tie_word_embeddings=True, **kw),
        "mistral": lambda **kw: m.MistralBackbone(**tiny, num_query_heads=4, num_key_value_heads=2, **kw),
        "qwen2": lambda **kw: m.QwenBackbone(**tiny, num_query_heads=4, num_key_value_heads=2, **kw),
        "gpt2": lambda **kw: m.GPT2Backbone(
            vocabulary_size=V, num_layers=L, num_heads=4, hidden_dim=H, intermediate_dim=4 * H, max_sequence_length=32, **kw
        ),
        "gemma3": lambda **kw: m.Gemma3Backbone(
            **tiny, image_size=None, num_query_heads=4, num_key_value_heads=2, head_dim=8,
            use_post_ffw_norm=True, use_post_attention_norm=True, **kw,
        ),
    }
    return factories.get(name)


ARCHITECTURES = ["gemma", "llama3", "mistral", "qwen2", "gpt2", "gemma3", *CONFIGS]
KERAS_HUB_CASTS = {"mistral"}  # its converter casts every tensor to float16
NO_KERAS_HUB_CONVERTER = {"phi3"}  # keras-hub has the backbone, shardckpt the converter


def randomize(model: Any, seed: int = 0) -> None:
    """Distinct values for every variable (of a model built lazily or not)."""
    rng = np.random.default_rng(seed)
    for v in model.variables:  # seed-generator states too (they are not weights)
        dtype = np.dtype(v.dtype)
        if dtype.kind in "iu":
            v.assign(np.zeros(v.shape, dtype))
        else:
            v.assign(rng.standard_normal(v.shape).astype(np.float32).astype(dtype))


_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def write_safetensors(path: str, tensors: dict[str, np.ndarray]) -> None:
    """A `.safetensors` file (the format's header + raw bytes; bfloat16 included)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, arr in tensors.items():
        header[key] = {"dtype": _NAMES[arr.dtype], "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for arr in tensors.values():
            f.write(np.ascontiguousarray(arr).tobytes())


def make_folder(name: str, folder: str, *, dtype: str = "float32", shards: int = 1, seed: int = 0) -> Any:
    """Writes the Hugging Face folder of architecture `name`; returns the source backbone."""
    os.makedirs(folder, exist_ok=True)
    factory = _exported(name)
    if factory is not None:
        from keras_hub.src.utils.transformers.export.hf_exporter import export_backbone

        with lazy_init():  # no initializers: randomize gives every value
            source = factory(dtype=dtype)  # the exporter writes each variable's dtype
        randomize(source, seed)
        export_backbone(source, folder, include_lm_head=not getattr(source, "tie_word_embeddings", False))
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
        if config["model_type"] == "qwen2":  # keras-hub's exporter omits these
            config.update(use_sliding_window=False, sliding_window=4096)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config, f)
        return source
    config = CONFIGS[name]
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    loader = hf.preset_loader(folder, config)
    with lazy_init():
        source = loader.load_backbone(loader.check_backbone_class(), load_weights=False, dtype=None)
    randomize(source, seed)
    stored_dtype = DTYPES["BF16"] if dtype == "bfloat16" else np.dtype(dtype)
    shapes = stored_shapes(source, loader.converter, config)
    stored = {k: ArraySpec(shape=s, dtype=stored_dtype) for k, s in shapes.items()}
    recorded = record(source, loader.converter, folder, config, stored)
    tensors = {k: np.full(s.shape, np.nan, np.float32).astype(stored_dtype) for k, s in stored.items()}
    for variable, remap in recorded.assigned.values():
        remap.write(np.asarray(variable.value).astype(stored_dtype), tensors.__getitem__)
    for key, arr in tensors.items():
        assert not np.isnan(arr.astype(np.float32)).any(), f"{key}: not every element written"
    _save(folder, tensors, shards)
    return source


def keras_hub_load(folder: str, dtype: Any = None) -> Any:
    """keras-hub's `Backbone.from_preset(folder)` minus its random initializers:
    its loader's `load_backbone(load_weights=True)` steps with the build lazy,
    then its converter reading the safetensors with numpy and assigning."""
    from keras_hub.src.utils.transformers.safetensor_utils import SafetensorLoader

    loader = hf.preset_loader(folder)
    with lazy_init():
        backbone = loader.load_backbone(loader.check_backbone_class(), load_weights=False, dtype=dtype)
    hf.initialize_states(backbone)
    with SafetensorLoader(folder) as tensors:
        loader.converter.convert_weights(backbone, tensors, loader.config)
    return backbone


def _save(folder: str, tensors: dict[str, np.ndarray], shards: int) -> None:
    if shards == 1:
        write_safetensors(os.path.join(folder, "model.safetensors"), tensors)
        return
    keys = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = keys[i::shards]
        write_safetensors(os.path.join(folder, name), {k: tensors[k] for k in part})
        weight_map.update({k: name for k in part})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(a.nbytes for a in tensors.values())}, "weight_map": weight_map}, f)


def bf16(x: np.ndarray) -> np.ndarray:
    return x.astype(ml_dtypes.bfloat16)
