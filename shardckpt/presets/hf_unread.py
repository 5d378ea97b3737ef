"""Stored tensors of a Hugging Face folder that no variable of the model is made of.

keras-hub's converters read the tensors of the backbone they build; a folder
may hold more. What each kind means for the loaded model, sorted as
transformers sorts its own unexpected keys (`PreTrainedModel.from_pretrained`):

- buffers transformers recomputes from the config and ignores on load
  (`rotary_emb.inv_freq`, `position_ids`, GPT-2's causal-mask `attn.bias`):
  not weights, the result is exact. Skipped.
- tensors outside the modules the model reads (`cls.predictions.*` of a
  BERT pre-training folder, a vision tower): heads of another class, as
  transformers' `BertModel` drops them from a `BertForPreTraining` folder
  (logged at INFO there too). The backbone's result is exact. Skipped.
- the output embedding (`lm_head.weight`) of a model whose embeddings are
  tied: the tied model computes its logits with the input embedding, so a
  stored `lm_head.weight` equal to it changes nothing (skipped). One that
  differs is a weight the model does not use: transformers 5 then unties
  and loads it (with a warning), keras-hub ties and drops it. shardckpt
  loads what keras-hub loads and warns once, naming the tensor and the fix.
- anything else inside the model's own modules (`model.layers.4.*` beyond a
  config's 4 layers): the folder holds more than its config describes.
  Unexpected, refused by `strict=True` as unexpected keys of every format.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from shardckpt.formats.base import Unread
from shardckpt.formats.safetensors import SafetensorsReader
from shardckpt.natsort import natural_sorted
from shardckpt.progress import some

_log = logging.getLogger("shardckpt")

BUFFERS = (
    # transformers ignores old checkpoints' per-layer rotary buffers
    # (`_adjust_missing_and_unexpected_keys`): recomputed from rope_theta.
    re.compile(r"(^|\.)rotary_emb\.inv_freq$"),
    # Persistent in older transformers (BERT, GPT-2, ...), computed since.
    re.compile(r"(^|\.)position_ids$"),
    # GPT-2's causal masks (its `_keys_to_ignore_on_load_unexpected`, and the
    # older `masked_bias`): constants of the architecture, not weights.
    re.compile(r"(^|\.)(attn|crossattention)\.(masked_)?bias$"),
)
"""Stored buffers transformers recomputes instead of loading: never weights."""

OUTPUT_EMBEDDING = re.compile(r"(^|\.)lm_head\.weight$")
"""transformers' name for a causal LM's output embedding (`_tied_weights_keys`)."""

COMPARE_BYTES = 16 * 2**20
"""Bytes of each tensor compared at once: a tied output embedding is as large as the
vocabulary, and comparing it must not hold it whole in host memory."""


def classify(model: Any, remaps: Mapping[str, Any], tensors: SafetensorsReader, folder: str) -> Unread:
    """Sorts the stored tensors no variable is made of (see the module docstring).

    Warns once (logger "shardckpt") for a stored output embedding that
    differs from the tied input embedding that stands for it.

    Args:
        model: The keras-hub backbone the folder is read into.
        remaps: `variable.path -> hf_remap.Tensor` (`presets.hf.remaps`).
        tensors: The folder's stored tensors.
        folder: The folder, for messages.

    Returns:
        The unread tensors, unexpected and skipped.
    """
    read = {key for remap in remaps.values() for key in remap.sources()}
    unread = [key for key in tensors.keys() if key not in read]  # noqa: SIM118 (a Reader, not a dict)
    if not unread:
        return Unread()
    modules = {_module(key) for key in read}
    tied = _tied_sources(model, remaps)
    skipped: list[str] = []
    unexpected: list[str] = []
    differing: list[str] = []
    for key in unread:
        if any(p.search(key) for p in BUFFERS):
            skipped.append(key)
        elif tied and OUTPUT_EMBEDDING.search(key):
            # Before the module test: a top-level `lm_head.weight` is in no module the model reads.
            skipped.append(key)
            if not any(_equal(tensors, key, source) for source in tied):
                differing.append(key)
        elif _module(key) not in modules:
            skipped.append(key)
        else:
            unexpected.append(key)
    if differing:
        _warn_untied(folder, differing, tied)
    return Unread(
        unexpected=natural_sorted(unexpected),
        skipped=natural_sorted(skipped),
        fix=(
            f"the folder holds Hugging Face tensors that keras-hub's converter for its model_type does not "
            f"read ({some(natural_sorted(unexpected), 3)}): its config.json describes a smaller model than "
            "the safetensors hold (layers, experts), or the files come from different saves. Correct "
            "config.json to the model the tensors are (transformers' save_pretrained writes both), or "
            "load with load_sharded(model, folder, strict=False) to leave them out."
        ) if unexpected else None,
    )


def _module(key: str) -> str:
    """The top-level module of a stored tensor (`model`, `lm_head`, `cls`, `bert`)."""
    return key.split(".", 1)[0]


def _tied_sources(model: Any, remaps: Mapping[str, Any]) -> list[str]:
    """The stored tensors of the model's tied embeddings (input embeddings that are the output one too)."""
    sources: list[str] = []
    for layer in model._flatten_layers(include_self=False):
        # keras-hub's ReversibleEmbedding: `tie_weights` means the logits use `embeddings` transposed.
        if getattr(layer, "tie_weights", False) is not True or not hasattr(layer, "embeddings"):
            continue
        remap = remaps.get(layer.embeddings.path)
        if remap is not None:
            sources += remap.sources()
    return sources


def _equal(tensors: SafetensorsReader, a: str, b: str) -> bool:
    """Whether two stored tensors hold the same bytes (shape and dtype included), compared in row blocks."""
    spec_a, spec_b = tensors.spec(a), tensors.spec(b)
    if tuple(spec_a.shape) != tuple(spec_b.shape) or spec_a.dtype != spec_b.dtype:
        return False
    if not spec_a.shape:
        return bool(tensors.read(a, ()).tobytes() == tensors.read(b, ()).tobytes())
    rows = spec_a.shape[0]
    row_bytes = max(1, spec_a.nbytes // max(1, rows))
    step = max(1, COMPARE_BYTES // row_bytes)
    for start in range(0, rows, step):
        box = (slice(start, min(rows, start + step)), *(slice(0, n) for n in spec_a.shape[1:]))
        if not np.array_equal(tensors.read(a, box).view(np.uint8), tensors.read(b, box).view(np.uint8)):
            return False
    return True


def _warn_untied(folder: str, keys: list[str], tied: list[str]) -> None:
    """Says once that stored output embeddings differ from the tied embedding used instead."""
    _log.warning(
        "%r: the model's embeddings are tied (config.json's tie_word_embeddings, or an architecture "
        "keras-hub always ties), so its logits use %s; the folder also stores %s with other values, "
        "which is not loaded. This model computes other logits than the folder's untied one "
        "(transformers 5 unties and loads %s). Fix: if the folder was saved from an untied model, set "
        "\"tie_word_embeddings\": false in its config.json (the model is then built untied and reads %s); "
        "else remove %s from the folder.",
        folder, " and ".join(repr(k) for k in tied), some([repr(k) for k in keys]), keys[0], keys[0], keys[0],
    )
