"""`format="peft"`: a LoRA model's factors alone, as a PEFT LoRA adapter folder.

The folder is what PEFT's `save_pretrained` writes: `adapter_config.json`
and `adapter_model.safetensors` with tensors
`base_model.model.<module>.lora_A.weight` (r, in) and `....lora_B.weight`
(out, r), where `<module>` is the Hugging Face tensor a LoRA layer's kernel
is exported to (`export.hf`: keras-hub's converter, inverted) without its
`.weight`. PEFT adds `B @ A * lora_alpha / r` to that tensor.

Keras' LoRA adds `A @ B * alpha / rank` to the kernel, with A of shape
`kernel.shape[:-1] + (rank,)` and B `(rank, kernel.shape[-1])`. Where the
kernel is a matrix (`Dense`) PEFT's factors are Keras' transposed. Where
it has more axes (`EinsumDense`: `(hidden, heads, head_dim)`), each axis
of the kernel is an input or an output axis of the Hugging Face matrix,
and the output axes other than the last (heads, `Q` of them together) make
the delta a sum of `Q` rank-`rank` blocks: the PEFT rank is `Q * rank`,
A' stacks A's heads (a strided view of A: rows `(head, j)`), and B' holds B
once per head on its block diagonal (zeros elsewhere: the file's hole).
`lora_alpha` is `alpha * Q`, so PEFT's scale `lora_alpha / (Q * rank)`
equals Keras' `alpha / rank`: the adapter adds exactly Keras' delta.
Ranks and alphas that differ per module go to `rank_pattern` /
`alpha_pattern`.

Variables trained beside the factors. After `enable_lora` Keras freezes
each LoRA layer's kernel only: its bias stays trainable, and so does a
task's head (keras-hub freezes the backbone's other layers). `fit` trains
them, so an adapter of the factors alone does not reproduce the model.
The export sees only the fine-tuned model, not the base it started from,
so every trainable variable other than the factors is taken as trained
(a practitioner who froze what they did not train gets a factors-only
adapter) and stored with PEFT's own mechanisms: a LoRA module's bias
under `bias="lora_only"` (`<module>.base_layer.bias`, as PEFT 0.21 saves
it), any other module whole under `modules_to_save` (`<module>.<param>`).
What PEFT cannot express is refused, naming the variables: a trained
LoRA base kernel, a LoRA module's other parameters, a module holding part
of a LoRA module's tensor, a tied embedding (PEFT would change the input
embedding and leave the tied output one), a variable with no Hugging
Face tensor. A non-trainable variable is never in the adapter, even one
changed while frozen (nothing here knows its base value): its layer must
be made trainable before the export to go to `modules_to_save`.

Each element of A' and B' is a strided position of a factor
(`hf_remap.Strided`), so each device's piece of a factor is written where
it belongs (`export.pieces`), with no gathering.
"""

from __future__ import annotations

import collections
import copy
import json
import math
import os
from typing import Any

import numpy as np

from shardckpt.errors import UnsupportedModelError
from shardckpt.formats.base import ArraySpec
from shardckpt.formats.hf_remap import Cast, Strided, Tensor
from shardckpt.progress import some
from shardckpt.structure import lora_layers

ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
KEY = "base_model.model.{module}.lora_{ab}.weight"
PREFIX = "base_model.model."


def _kernel_layout(layer: Any, remap: Tensor, specs: dict[str, ArraySpec]) -> tuple[str, list[int], list[int], int, int]:
    """`(hf key, input axes, output axes, IN, OUT)` of a LoRA kernel stored as a whole (out, in) matrix.

    Raises:
        UnsupportedModelError: the kernel is not one whole stored matrix
            whose every axis is an input or an output axis.
    """
    while isinstance(remap, Cast):
        remap = remap.child
    name = getattr(layer, "path", layer.name)
    if not isinstance(remap, Strided):
        raise UnsupportedModelError(
            f"LoRA layer {name!r}: its kernel is stored as parts of several Hugging Face tensors "
            f"({remap.sources()[:3]}); PEFT adapts one module per kernel. Fix: export the merged model "
            "(format='hf'), or enable LoRA on layers with a tensor of their own."
        )
    spec = specs[remap.key]
    shape = tuple(layer._kernel.shape)
    if len(spec.shape) != 2 or remap.offset != 0 or math.prod(shape) != math.prod(spec.shape) or not remap.key.endswith(".weight"):
        raise UnsupportedModelError(
            f"LoRA layer {name!r}: its kernel is part of {remap.key!r} {tuple(spec.shape)} (a fused tensor), "
            "not a whole Linear weight PEFT adapts. Fix: export the merged model (format='hf')."
        )
    out_dim, in_dim = spec.shape
    inputs = [k for k, s in enumerate(remap.strides) if shape[k] > 1 and s < in_dim]
    outputs = [k for k, s in enumerate(remap.strides) if shape[k] > 1 and s >= in_dim]
    last = len(shape) - 1
    if (any(remap.strides[k] % in_dim for k in outputs) or math.prod(shape[k] for k in inputs) != in_dim
            or math.prod(shape[k] for k in outputs) != out_dim or (shape[last] > 1 and last not in outputs)):
        raise UnsupportedModelError(
            f"LoRA layer {name!r}: the axes of its kernel {shape} do not split into inputs and outputs of "
            f"{remap.key!r} {tuple(spec.shape)}. Fix: export the merged model (format='hf')."
        )
    return remap.key, inputs, outputs, int(in_dim), int(out_dim)


def plan(model: Any, hf_plan: Any, dtype: Any) -> tuple[dict[str, ArraySpec], list[tuple[Any, Tensor]], dict[str, Any]]:
    """The adapter's tensors, where each factor's elements go, and `adapter_config.json`.

    Args:
        model: The LoRA model (backbone or task).
        hf_plan: `export.hf.plan` of the model: its base kernels' remaps.
        dtype: Stored dtype of the factors; None: theirs (float32).

    Raises:
        UnsupportedModelError: no LoRA layer, or one PEFT cannot express.
    """
    layers = lora_layers(model)
    if not layers:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no LoRA-enabled layer: format='peft' writes LoRA factors. Fix: "
            "enable LoRA (backbone.enable_lora(rank)) and train it, or export format='hf'."
        )
    remaps = {id(v): t for v, t in hf_plan.remaps}
    specs: dict[str, ArraySpec] = {}
    writes: list[tuple[Any, Tensor]] = []
    ranks: dict[str, tuple[int, Any]] = {}
    for layer, base, _, (a, b) in layers:
        if id(base) not in remaps or not hasattr(layer, "lora_kernel_a"):
            raise UnsupportedModelError(
                f"LoRA layer {layer.name!r} ({type(layer).__name__}) has no Hugging Face Linear weight PEFT "
                "adapts. Fix: enable LoRA on Dense/EinsumDense layers only, or export the merged model (format='hf')."
            )
        key, inputs, outputs, in_dim, out_dim = _kernel_layout(layer, remaps[id(base)], hf_plan.specs)
        shape = tuple(layer._kernel.shape)
        st = remaps[id(base)]
        while isinstance(st, Cast):
            st = st.child
        rank = int(layer.lora_rank)
        heads = [k for k in outputs if k != len(shape) - 1]
        q_count = math.prod(shape[k] for k in heads)
        peft_rank = q_count * rank
        module = key.removesuffix(".weight")
        key_a, key_b = KEY.format(module=module, ab="A"), KEY.format(module=module, ab="B")
        stored = lambda v: np.dtype(dtype) if dtype is not None else np.dtype(v.dtype)  # noqa: E731
        specs[key_a] = ArraySpec(shape=(peft_rank, in_dim), dtype=stored(a))
        specs[key_b] = ArraySpec(shape=(out_dim, peft_rank), dtype=stored(b))
        # A' rows (head, j) in C order over the heads in kernel order; columns: the input index.
        head_strides = {k: math.prod(shape[h] for h in heads[i + 1:]) for i, k in enumerate(heads)}
        a_strides = tuple(
            st.strides[k] if k in inputs else head_strides[k] * rank * in_dim if k in head_strides else 0
            for k in range(len(shape) - 1)
        ) + (in_dim,)
        writes.append((a, Strided(key_a, specs[key_a].dtype, tuple(a.shape), a_strides, 0)))
        # B' once per head, on the block diagonal: B[j, l] at row o(head, l), column (head, j).
        last = len(shape) - 1
        row_step = st.strides[last] // in_dim
        for flat, index in enumerate(np.ndindex(*[shape[k] for k in heads])):
            row0 = sum(i * (st.strides[k] // in_dim) for i, k in zip(index, heads, strict=True))
            writes.append((b, Strided(key_b, specs[key_b].dtype, tuple(b.shape), (1, row_step * peft_rank),
                                      row0 * peft_rank + flat * rank)))
        alpha = float(layer.lora_alpha) * q_count
        ranks[module] = (peft_rank, int(alpha) if alpha.is_integer() else alpha)
    bias, saved = _trained_extras(model, hf_plan, set(ranks), specs, writes)
    config = _config(model, ranks, hf_plan.specs)
    config["bias"] = "lora_only" if bias else "none"
    config["modules_to_save"] = saved or None
    return dict(sorted(specs.items())), writes, config


def _renamed(remap: Tensor, names: dict[str, str]) -> Tensor:
    """`remap` writing into `names[key]` instead of each stored `key`."""
    out = copy.copy(remap)
    if isinstance(out, Strided):
        out.key = names[out.key]
    elif isinstance(out, Cast):
        out.child = _renamed(out.child, names)
    else:
        out.parts = [_renamed(p, names) for p in out.parts]  # type: ignore[attr-defined]
    return out


def _trained_extras(model: Any, hf_plan: Any, lora_modules: set[str], specs: dict[str, ArraySpec],
                    writes: list[tuple[Any, Tensor]]) -> tuple[bool, list[str]]:
    """Adds the trainable variables other than the factors to `specs` / `writes`.

    Returns:
        Whether LoRA modules' biases are stored (`bias="lora_only"`), and
        the modules stored whole (`modules_to_save`).

    Raises:
        UnsupportedModelError: trained variables PEFT cannot express, named.
    """
    from shardckpt.exporting.model import lora_bases, lora_factors

    factors, bases = lora_factors(model), lora_bases(model)
    trained = [v for v in model.trainable_weights if id(v) not in factors]
    if not trained:
        return False, []
    remaps = {id(v): t for v, t in hf_plan.remaps}
    of_key = {k: (v, t) for v, t in hf_plan.remaps for k in t.sources()}
    refused: list[str] = []
    biases: dict[str, str] = {}  # stored key -> adapter key
    modules: set[str] = set()
    for v in trained:
        if id(v) in bases or id(v) not in remaps:
            refused.append(v.path)
            continue
        for key in remaps[id(v)].sources():
            module, param = key.rsplit(".", 1)
            if module in lora_modules and param == "bias" and remaps[id(v)].sources() == [key]:
                biases[key] = f"{PREFIX}{module}.base_layer.bias"
            elif module in lora_modules:
                refused.append(v.path)
            else:
                modules.add(module)
    # A module is saved whole: every stored tensor of it, from every variable that fills one; such a
    # variable's other tensors bring their modules in too.
    names: dict[str, str] = {}
    variables: dict[int, tuple[Any, Tensor]] = {}
    todo = sorted(modules)
    while todo:
        module = todo.pop()
        for key in hf_plan.specs:
            if key.rsplit(".", 1)[0] != module or key in names:
                continue
            names[key] = PREFIX + key
            v, t = of_key[key]
            variables[id(v)] = (v, t)
            for other in t.sources():
                other_module = other.rsplit(".", 1)[0]
                if other_module in lora_modules:
                    refused.append(v.path)
                elif other_module not in modules:
                    modules.add(other_module)
                    todo.append(other_module)
    tied = getattr(getattr(model, "backbone", model), "tie_word_embeddings", False)
    embedding = getattr(getattr(getattr(model, "backbone", model), "token_embedding", None), "embeddings", None)
    if tied and embedding is not None and id(embedding) in variables:
        refused.append(embedding.path)
    if refused:
        paths = sorted(set(refused))
        raise UnsupportedModelError(
            f"{type(model).__name__}: variables trained beside the LoRA factors that a PEFT adapter cannot "
            f"hold: {some(paths, 6)} (a LoRA layer's kernel, a part of a LoRA "
            "module's tensor, a tied embedding, or no Hugging Face tensor). Fix: export the merged model "
            "(format='hf'), or set trainable=False on the layers you did not train before exporting."
        )
    for key, new in biases.items():
        v, t = of_key[key]
        names[key] = new
        variables[id(v)] = (v, t)
    for v, t in variables.values():
        for key in t.sources():
            specs[names[key]] = hf_plan.specs[key]
        writes.append((v, _renamed(t, names)))
    return bool(biases), sorted(modules)


def _config(model: Any, ranks: dict[str, tuple[int, Any]], stored: dict[str, ArraySpec]) -> dict[str, Any]:
    """`adapter_config.json` (PEFT's `LoraConfig` fields) for the adapted modules."""
    short = collections.defaultdict(list)
    for module in ranks:
        short[module.rsplit(".", 1)[-1]].append(module)
    # Short names (`q_proj`) where every such module is adapted with one rank; else full module names.
    every = {name: [k.removesuffix(".weight") for k in stored
                    if k.endswith(f".{name}.weight") and len(stored[k].shape) == 2] for name in short}
    by_short = all(sorted(every[n]) == sorted(ms) and len({ranks[m] for m in ms}) == 1 for n, ms in short.items())
    names = {n: ms[0] for n, ms in short.items()} if by_short else {m: m for m in ranks}
    counts = collections.Counter(ranks[m] for m in names.values())
    # The most frequent (rank, alpha), the largest on a tie: the rest go to the patterns.
    r, alpha = max(counts.items(), key=lambda item: (item[1], item[0][0]))[0]
    from shardckpt.restore.keys import is_task

    task_type = None
    if is_task(model):
        from keras_hub.models import CausalLM

        task_type = "CAUSAL_LM" if isinstance(model, CausalLM) else None
    return {
        "peft_type": "LORA",
        "task_type": task_type,
        "base_model_name_or_path": None,
        "revision": None,
        "inference_mode": True,
        "r": r,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(names),
        "rank_pattern": {n: ranks[m][0] for n, m in sorted(names.items()) if ranks[m][0] != r},
        "alpha_pattern": {n: ranks[m][1] for n, m in sorted(names.items()) if ranks[m][1] != alpha},
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
    }


def write_config(folder: str, config: dict[str, Any]) -> None:
    with open(os.path.join(folder, CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
