"""Backbone arguments Hugging Face configs carry beyond what keras-hub's converters read or exporters write.

keras-hub's `convert_<arch>.convert_backbone_config` reads only the keys
keras-hub's own exports need: GPT-2's `n_inner` (a feed-forward width other
than 4 x `n_embd`), BERT's `type_vocab_size`, Llama's and Gemma's
`rms_norm_eps`, Qwen2-MoE's `tie_word_embeddings` are real Hugging Face config fields that transformers reads,
and keras-hub builds the backbone's default instead. This table names, per
`model_type`, the Keras argument each such key holds. It serves both
directions: `export` writes the key from the backbone's argument, and
`from_preset` of a Hugging Face folder builds with the key's value where
the folder sets it (null or absent: keras-hub's reading stands).

Data only; an entry is checked by the export tests against the
architecture's transformers config class.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

CARRIED: dict[str, dict[str, str]] = {
    "gpt2": {"intermediate_dim": "n_inner"},
    "bert": {"num_segments": "type_vocab_size"},
    "llama": {"layer_norm_epsilon": "rms_norm_eps"},
    "gemma": {"layer_norm_epsilon": "rms_norm_eps"},
    "gemma2": {"layer_norm_epsilon": "rms_norm_eps"},
    "qwen2_moe": {"tie_word_embeddings": "tie_word_embeddings"},
    # keras-hub's converter reads these; its exporter leaves them out.
    "gemma3_text": {"attention_logit_soft_cap": "attn_logit_softcapping",
                    "final_logit_soft_cap": "final_logit_softcapping"},
}
"""`{model_type: {Keras argument: Hugging Face config key}}`."""


FIXED: dict[str, dict[str, Any]] = {
    # keras-hub's BERT layers use the tanh approximation of GELU (its importer
    # reads a checkpoint's exact "gelu" into them); transformers' name for it.
    "bert": {"hidden_act": "gelu_new"},
    # keras-hub's Phi-3 has no padding token; transformers' default (32000) lies
    # outside any smaller vocabulary and its embedding refuses it.
    "phi3": {"pad_token_id": None},
}
"""`{model_type: {Hugging Face config key: value}}`: what keras-hub's layers compute,
written so transformers computes the same; keras-hub's converters do not read these."""


def carried(model_type: Any) -> dict[str, str]:
    """The Keras arguments `model_type`'s configs carry beyond keras-hub's converter."""
    return dict(CARRIED.get(str(model_type), {}))


def read(config: Mapping[str, Any]) -> dict[str, Any]:
    """Keras arguments set by keys of `config` that keras-hub's converter leaves unread."""
    out: dict[str, Any] = {}
    for argument, key in carried(config.get("model_type")).items():
        value = config.get(key)
        if value is not None:
            out[argument] = value
    return out
