"""keras-hub backbones built straight from their constructors, for the export grid.

Three or more configs per architecture `export(format="hf")` maps, each
differing from the defaults and from the shapes of the Hugging Face fixtures
(tests/hf_fixtures.py): head counts and head dims that do not divide the
defaults, position tables longer or shorter than the hidden width, tied and
untied embeddings, text-only Gemma 3, and values (GPT-2's feed-forward width,
BERT's segment count, norm epsilons) keras-hub's own importer does not read.
`REFUSED` lists configs no Hugging Face config can hold, with the argument
the refusal must name.
Tiny widths: building, exporting and reading back all of them stays within
seconds each.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

V = 61  # vocabulary: odd, so no table divides evenly by a head or device count


def _decoder(**kw: Any) -> dict[str, Any]:
    return {"vocabulary_size": V, "num_layers": 2, **kw}


# (id, keras_hub.models class name, constructor arguments)
GRID: list[tuple[str, str, dict[str, Any]]] = [
    # GPT-2: heads of 4 (8 heads), 12 (2 heads, n_inner != 4 x n_embd), 8 (3 heads, 3 layers).
    ("gpt2-8x4-pos48", "GPT2Backbone", {"vocabulary_size": V, "num_layers": 2, "num_heads": 8, "hidden_dim": 32,
                                         "intermediate_dim": 128, "max_sequence_length": 48}),
    ("gpt2-2x12-inner40-pos100", "GPT2Backbone", {"vocabulary_size": V, "num_layers": 1, "num_heads": 2,
                                                    "hidden_dim": 24, "intermediate_dim": 40, "max_sequence_length": 100}),
    ("gpt2-3x8-pos17", "GPT2Backbone", {"vocabulary_size": V, "num_layers": 3, "num_heads": 3, "hidden_dim": 24,
                                         "intermediate_dim": 96, "max_sequence_length": 17}),
    # BERT: position tables of 128, 40 and 7; 4 and 1 segment types.
    ("bert-8x4-pos128", "BertBackbone", {"vocabulary_size": V, "num_layers": 2, "num_heads": 8, "hidden_dim": 32,
                                          "intermediate_dim": 64, "max_sequence_length": 128}),
    ("bert-3x8-pos40-seg4", "BertBackbone", {"vocabulary_size": V, "num_layers": 1, "num_heads": 3, "hidden_dim": 24,
                                              "intermediate_dim": 50, "max_sequence_length": 40, "num_segments": 4}),
    ("bert-2x8-pos12-seg1", "BertBackbone", {"vocabulary_size": V, "num_layers": 2, "num_heads": 2, "hidden_dim": 16,
                                             "intermediate_dim": 16, "max_sequence_length": 12, "num_segments": 1}),
    # Llama 3 and Llama 2 (LlamaBackbone: keras-hub's Llama 2 class, Hugging Face `llama`).
    ("llama3-6q2kv-untied", "Llama3Backbone", _decoder(num_query_heads=6, num_key_value_heads=2, hidden_dim=48,
                                                         intermediate_dim=40)),
    ("llama3-3q1kv-tied-rope5e5", "Llama3Backbone", _decoder(num_query_heads=3, num_key_value_heads=1, hidden_dim=24,
                                                               intermediate_dim=40, tie_word_embeddings=True,
                                                               rope_max_wavelength=500000)),
    ("llama3-4q4kv-eps1e-5", "Llama3Backbone", _decoder(num_query_heads=4, num_key_value_heads=4, hidden_dim=32,
                                                          intermediate_dim=24, layer_norm_epsilon=1e-5)),
    ("llama2-6q2kv", "LlamaBackbone", _decoder(num_query_heads=6, num_key_value_heads=2, hidden_dim=48,
                                                intermediate_dim=40)),
    ("llama2-3q3kv-tied", "LlamaBackbone", _decoder(num_query_heads=3, num_key_value_heads=3, hidden_dim=24,
                                                     intermediate_dim=40, tie_word_embeddings=True)),
    ("llama2-2q1kv-eps1e-5", "LlamaBackbone", _decoder(num_query_heads=2, num_key_value_heads=1, hidden_dim=32,
                                                        intermediate_dim=24, layer_norm_epsilon=1e-5)),
    # Mistral: head_dim apart from hidden / heads, a sliding window, another rope base.
    ("mistral-6q2kv-window16", "MistralBackbone", _decoder(num_query_heads=6, num_key_value_heads=2, hidden_dim=48,
                                                             intermediate_dim=40, sliding_window=16)),
    ("mistral-4q2kv-hd12", "MistralBackbone", _decoder(num_query_heads=4, num_key_value_heads=2, hidden_dim=32,
                                                        intermediate_dim=40, head_dim=12)),
    ("mistral-3q3kv-rope1e6-eps1e-5", "MistralBackbone", _decoder(num_query_heads=3, num_key_value_heads=3,
                                                                   hidden_dim=24, intermediate_dim=40,
                                                                   rope_max_wavelength=1000000, layer_norm_epsilon=1e-5)),
    # Mixtral: 3, 4, 5 experts, top 1 to 3.
    ("mixtral-4e2-6q2kv", "MixtralBackbone", _decoder(num_query_heads=6, num_key_value_heads=2, hidden_dim=48,
                                                        intermediate_dim=24, num_experts=4, top_k=2)),
    ("mixtral-3e1", "MixtralBackbone", _decoder(num_query_heads=4, num_key_value_heads=1, hidden_dim=32,
                                                 intermediate_dim=16, num_experts=3, top_k=1)),
    ("mixtral-5e3-window8", "MixtralBackbone", _decoder(num_query_heads=2, num_key_value_heads=2, hidden_dim=24,
                                                         intermediate_dim=16, num_experts=5, top_k=3, sliding_window=8)),
    # Qwen 2: tied and untied, a sliding window.
    ("qwen2-6q2kv-tied", "QwenBackbone", _decoder(num_query_heads=6, num_key_value_heads=2, hidden_dim=48,
                                                   intermediate_dim=40)),
    ("qwen2-3q1kv-untied", "QwenBackbone", _decoder(num_query_heads=3, num_key_value_heads=1, hidden_dim=24,
                                                     intermediate_dim=40, tie_word_embeddings=False)),
    ("qwen2-4q4kv-rope1e6-eps1e-5", "QwenBackbone", _decoder(num_query_heads=4, num_key_value_heads=4, hidden_dim=32,
                                                              intermediate_dim=24, layer_norm_epsilon=1e-5,
                                                              rope_max_wavelength=1000000)),
    # Qwen 3: head_dim apart from hidden / heads.
    ("qwen3-4q2kv-hd16-tied", "Qwen3Backbone", _decoder(num_query_heads=4, num_key_value_heads=2, head_dim=16,
                                                         hidden_dim=32, intermediate_dim=40)),
    ("qwen3-6q3kv-hd4-untied", "Qwen3Backbone", _decoder(num_query_heads=6, num_key_value_heads=3, head_dim=4,
                                                          hidden_dim=24, intermediate_dim=40, tie_word_embeddings=False)),
    ("qwen3-2q1kv-hd12-eps1e-5", "Qwen3Backbone", _decoder(num_query_heads=2, num_key_value_heads=1, head_dim=12,
                                                            hidden_dim=32, intermediate_dim=24, layer_norm_epsilon=1e-5)),
    # Qwen 2 MoE.
    ("qwen2moe-4e2", "QwenMoeBackbone", _decoder(num_query_heads=6, num_key_value_heads=2, hidden_dim=48,
                                                  intermediate_dim=40, moe_intermediate_dim=16,
                                                  shared_expert_intermediate_dim=24, num_experts=4, top_k=2)),
    ("qwen2moe-3e1-norm", "QwenMoeBackbone", _decoder(num_query_heads=3, num_key_value_heads=1, hidden_dim=24,
                                                       intermediate_dim=40, moe_intermediate_dim=8,
                                                       shared_expert_intermediate_dim=40, num_experts=3, top_k=1,
                                                       norm_top_k_prob=True)),
    ("qwen2moe-5e3-tied", "QwenMoeBackbone", _decoder(num_query_heads=4, num_key_value_heads=4, hidden_dim=32,
                                                       intermediate_dim=24, moe_intermediate_dim=12,
                                                       shared_expert_intermediate_dim=20, num_experts=5, top_k=3,
                                                       tie_word_embeddings=True)),
    # Qwen 3 MoE.
    ("qwen3moe-4e2-hd16", "Qwen3MoeBackbone", _decoder(num_query_heads=4, num_key_value_heads=2, head_dim=16,
                                                        hidden_dim=32, intermediate_dim=40, moe_intermediate_dim=16,
                                                        num_experts=4, top_k=2)),
    ("qwen3moe-3e1-tied", "Qwen3MoeBackbone", _decoder(num_query_heads=6, num_key_value_heads=3, head_dim=4,
                                                        hidden_dim=24, intermediate_dim=40, moe_intermediate_dim=8,
                                                        num_experts=3, top_k=1, tie_word_embeddings=True)),
    ("qwen3moe-5e3-norm", "Qwen3MoeBackbone", _decoder(num_query_heads=2, num_key_value_heads=1, head_dim=12,
                                                        hidden_dim=32, intermediate_dim=24, moe_intermediate_dim=12,
                                                        num_experts=5, top_k=3, norm_top_k_prob=True)),
    # Phi-3 (shardckpt's converter: keras-hub has none).
    ("phi3-6q2kv", "Phi3Backbone", _decoder(num_query_heads=6, num_key_value_heads=2, hidden_dim=48,
                                             intermediate_dim=40)),
    ("phi3-3q3kv-eps1e-5", "Phi3Backbone", _decoder(num_query_heads=3, num_key_value_heads=3, hidden_dim=24,
                                                     intermediate_dim=40, layer_norm_epsilon=1e-5)),
    ("phi3-4q1kv-rope5e5", "Phi3Backbone", _decoder(num_query_heads=4, num_key_value_heads=1, hidden_dim=32,
                                                     intermediate_dim=24, rope_max_wavelength=500000)),
    # Gemma: head_dim apart from hidden / heads, one and several key/value heads.
    ("gemma-4q1kv-hd16", "GemmaBackbone", _decoder(num_query_heads=4, num_key_value_heads=1, hidden_dim=32,
                                                    intermediate_dim=48, head_dim=16)),
    ("gemma-3q3kv-hd8", "GemmaBackbone", _decoder(num_query_heads=3, num_key_value_heads=3, hidden_dim=24,
                                                   intermediate_dim=40, head_dim=8)),
    ("gemma-2q1kv-hd32-eps1e-5", "GemmaBackbone", _decoder(num_query_heads=2, num_key_value_heads=1, hidden_dim=24,
                                                            intermediate_dim=24, head_dim=32, layer_norm_epsilon=1e-5)),
    # Gemma 2 (GemmaBackbone with Gemma 2's switches, Hugging Face `gemma2`).
    ("gemma2-4q2kv-hd8", "GemmaBackbone", _decoder(num_query_heads=4, num_key_value_heads=2, hidden_dim=32,
                                                    intermediate_dim=48, head_dim=8, **{
                                                        "use_post_ffw_norm": True, "use_post_attention_norm": True,
                                                        "final_logit_soft_cap": 30.0, "attention_logit_soft_cap": 50.0,
                                                        "use_sliding_window_attention": True,
                                                        "sliding_window_size": 16})),
    ("gemma2-3q1kv-hd16-caps20-40", "GemmaBackbone", _decoder(
        num_query_heads=3, num_key_value_heads=1, hidden_dim=24, intermediate_dim=40, head_dim=16,
        use_post_ffw_norm=True, use_post_attention_norm=True,
        final_logit_soft_cap=20.0, attention_logit_soft_cap=40.0, use_sliding_window_attention=True,
        sliding_window_size=8)),
    ("gemma2-2q2kv-hd12", "GemmaBackbone", _decoder(
        num_query_heads=2, num_key_value_heads=2, hidden_dim=32, intermediate_dim=24, head_dim=12,
        use_post_ffw_norm=True, use_post_attention_norm=True, final_logit_soft_cap=30.0,
        attention_logit_soft_cap=50.0, use_sliding_window_attention=True, sliding_window_size=32)),
    # Gemma 3, text only (image_size=None).
    ("gemma3-4q2kv-hd16", "Gemma3Backbone", _decoder(num_query_heads=4, num_key_value_heads=2, hidden_dim=32,
                                                      intermediate_dim=48, head_dim=16, image_size=None,
                                                      use_post_ffw_norm=True, use_post_attention_norm=True)),
    ("gemma3-3q1kv-hd8-window8", "Gemma3Backbone", _decoder(num_query_heads=3, num_key_value_heads=1, hidden_dim=24,
                                                             intermediate_dim=40, head_dim=8, image_size=None,
                                                             use_post_ffw_norm=True, use_post_attention_norm=True,
                                                             use_sliding_window_attention=True,
                                                             sliding_window_size=8)),
    ("gemma3-2q2kv-hd32-softcap", "Gemma3Backbone", _decoder(num_query_heads=2, num_key_value_heads=2, hidden_dim=24,
                                                              intermediate_dim=24, head_dim=32, image_size=None,
                                                              use_post_ffw_norm=True, use_post_attention_norm=True,
                                                              final_logit_soft_cap=30.0,
                                                              attention_logit_soft_cap=50.0)),
]


def build(class_name: str, args: dict[str, Any]) -> Any:
    """The backbone, built lazily (values come from `hf_fixtures.randomize`)."""
    import keras_hub

    from shardckpt import _keras_hub, lazy_init

    cls: Callable[..., Any] = (
        _keras_hub.phi3_backbone() if class_name == "Phi3Backbone" else getattr(keras_hub.models, class_name)
    )
    with lazy_init():
        return cls(**args)


# Configs Hugging Face's classes cannot express: export refuses them, naming the argument.
REFUSED: list[tuple[str, str, dict[str, Any], str]] = [
    # Hugging Face's Gemma 3 always applies the post-attention and post-feed-forward norms.
    ("gemma3-no-post-norms", "Gemma3Backbone", _decoder(num_query_heads=4, num_key_value_heads=2, hidden_dim=32,
                                                         intermediate_dim=48, head_dim=16, image_size=None),
     "use_post_attention_norm=False"),
    # keras-hub reads Gemma 2's query scaling only as "query_pre_attn_scalar == head_dim".
    ("gemma2-unnormalized", "GemmaBackbone", _decoder(
        num_query_heads=3, num_key_value_heads=1, hidden_dim=24, intermediate_dim=40, head_dim=16,
        query_head_dim_normalize=False, use_post_ffw_norm=True, use_post_attention_norm=True,
        final_logit_soft_cap=20.0, attention_logit_soft_cap=40.0, use_sliding_window_attention=True,
        sliding_window_size=8), "query_head_dim_normalize=False"),
]
