"""Phi-3 (`model_type: phi3`), which keras-hub 0.32 has a backbone for but no converter.

A converter in keras-hub's own interface (`backbone_cls`,
`convert_backbone_config`, `convert_weights(backbone, loader, config)`), so
the same recording loader maps it. The name map is a table (`_LAYER_WEIGHTS`):
Phi-3 stores the query, key and value projections fused in `qkv_proj` and
the gate and up projections fused in `gate_up_proj`; each Keras kernel is a
row block of the fused weight, transposed (and split into heads), so each
reads only its own rows.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shardckpt import _keras_hub
from shardckpt.errors import UnsupportedModelError


def _backbone_cls() -> Any:
    return _keras_hub.phi3_backbone()


def __getattr__(name: str) -> Any:  # keras-hub is imported only when used
    if name == "backbone_cls":
        return _backbone_cls()
    raise AttributeError(name)


def convert_backbone_config(transformers_config: dict) -> dict:
    config = {
        "vocabulary_size": transformers_config["vocab_size"],
        "num_layers": transformers_config["num_hidden_layers"],
        "hidden_dim": transformers_config["hidden_size"],
        "intermediate_dim": transformers_config["intermediate_size"],
        "num_query_heads": transformers_config["num_attention_heads"],
        "num_key_value_heads": transformers_config["num_key_value_heads"],
        "layer_norm_epsilon": transformers_config["rms_norm_eps"],
        "max_sequence_length": transformers_config["max_position_embeddings"],
        "pretraining_sequence_length": transformers_config.get(
            "original_max_position_embeddings", transformers_config["max_position_embeddings"]
        ),
        "rope_max_wavelength": transformers_config.get("rope_theta", 10000.0),
    }
    scaling = transformers_config.get("rope_scaling")
    if scaling:
        kind = scaling.get("type", scaling.get("rope_type"))
        if kind not in ("su", "longrope"):
            raise UnsupportedModelError(
                f"Phi-3 rope_scaling of type {kind!r}: keras-hub's Phi3Backbone implements 'su' / 'longrope' "
                "scaling only. Fix: load a Phi-3 checkpoint whose config.json has rope_scaling of type 'su' or "
                f"'longrope', or none. Received: rope_scaling={scaling!r}"
            )
        config.update(
            rope_scaling_type="su",
            rope_scaling_short_factor=scaling["short_factor"],
            rope_scaling_long_factor=scaling["long_factor"],
        )
    return config


def _transpose(x: Any, shape: Any) -> Any:
    return np.transpose(x)


def _split_heads(x: Any, shape: Any) -> Any:
    return np.reshape(np.transpose(x), shape)


def _rows(start: int, stop: int) -> Any:
    """Rows [start, stop) of a fused (out, in) weight, as the Keras kernel's layout."""

    def hook(x: Any, shape: Any) -> Any:
        return np.reshape(np.transpose(x[start:stop]), shape)

    return hook


def convert_weights(backbone: Any, loader: Any, transformers_config: dict) -> None:
    loader.port_weight(backbone.get_layer("token_embedding").embeddings, "model.embed_tokens.weight")
    loader.port_weight(
        backbone.get_layer("token_embedding").reverse_embeddings, "lm_head.weight", hook_fn=_transpose
    )
    heads = transformers_config["num_attention_heads"]
    kv_heads = transformers_config["num_key_value_heads"]
    head_dim = transformers_config["hidden_size"] // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    inter = transformers_config["intermediate_size"]
    # (Keras attribute path in the decoder layer, HF name, hook) for each layer.
    _LAYER_WEIGHTS = [
        ("pre_attention_layernorm.scale", "input_layernorm.weight", None),
        ("post_attention_layernorm.scale", "post_attention_layernorm.weight", None),
        ("attention.query_dense.kernel", "self_attn.qkv_proj.weight", _rows(0, q)),
        ("attention.key_dense.kernel", "self_attn.qkv_proj.weight", _rows(q, q + kv)),
        ("attention.value_dense.kernel", "self_attn.qkv_proj.weight", _rows(q + kv, q + 2 * kv)),
        ("attention.output_dense.kernel", "self_attn.o_proj.weight", _split_heads),
        ("feedforward_gate_dense.kernel", "mlp.gate_up_proj.weight", _rows(0, inter)),
        ("feedforward_intermediate_dense.kernel", "mlp.gate_up_proj.weight", _rows(inter, 2 * inter)),
        ("feedforward_output_dense.kernel", "mlp.down_proj.weight", _transpose),
    ]
    for i in range(backbone.num_layers):
        layer = backbone.get_layer(f"transformer_layer_{i}")
        for attr, name, hook in _LAYER_WEIGHTS:
            variable = layer
            for part in attr.split("."):
                variable = getattr(variable, part)
            loader.port_weight(variable, f"model.layers.{i}.{name}", hook_fn=hook)
    loader.port_weight(backbone.get_layer("sequence_output_layernorm").scale, "model.norm.weight")
