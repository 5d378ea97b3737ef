"""What each file-based export format writes: its tensors, files, and how the variables fill them.

A planner `(model, dtype, shard) -> Plan` computes everything before a
byte is written (every refusal happens here); `export.api` lays the files
out from the plan and fills them.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from shardckpt.exporting.pieces import Identity
from shardckpt.formats import h5_writer, safetensors_writer
from shardckpt.formats.base import ArraySpec
from shardckpt.formats.hf_remap import Tensor


@dataclasses.dataclass(kw_only=True)
class Plan:
    kind: str  # "safetensors" or "h5" files
    specs: dict[str, ArraySpec]
    files: dict[str, list[str]]
    writes: list[tuple[Any, Tensor]]  # (variable, remap)
    groups: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    index: str | None = None
    small_files: Callable[[str], None] | None = None

    def casts(self) -> list[str]:
        """"path: from -> to" for each variable whose stored tensors take another dtype than its own.

        One line per variable, in write order: a variable stored as several
        tensors (a fused projection split) or written twice is listed once.
        """
        out: list[str] = []
        seen: set[int] = set()
        for variable, remap in self.writes:
            keys = [k for k in remap.sources() if k in self.specs]
            if not keys or id(variable) in seen:
                continue
            seen.add(id(variable))
            own, stored = np.dtype(variable.dtype), np.dtype(self.specs[keys[0]].dtype)
            if own != stored:
                out.append(f"{variable.path}: {own} -> {stored}")
        return out


def max_shard_bytes(max_shard_size: Any) -> int | None:
    """`max_shard_size` in bytes: a number is GB (keras-hub's and Keras' unit), or "5GB", "500MB"."""
    if max_shard_size is None:
        return None
    if isinstance(max_shard_size, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMG]i?B|B)\s*", max_shard_size, re.IGNORECASE)
        if not m:
            raise ValueError(f"max_shard_size must be a number of GB or a size like '5GB'. Received: {max_shard_size!r}")
        unit = m.group(2).upper()
        scale = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3}[unit]
        return max(1, int(float(m.group(1)) * scale))
    if (isinstance(max_shard_size, (int, float)) and not isinstance(max_shard_size, bool) and max_shard_size > 0
            and math.isfinite(max_shard_size)):
        return max(1, int(max_shard_size * 1024**3))  # keras-hub: GB as 1024**3 bytes
    raise ValueError(f"max_shard_size must be a positive number of GB or a size like '5GB'. Received: {max_shard_size!r}")


def plan_hf(model: Any, dtype: Any, shard: int | None) -> Plan:
    from shardckpt import _keras_hub
    from shardckpt.errors import UnsupportedModelError
    from shardckpt.exporting import hf, hf_heads
    from shardckpt.restore.keys import is_task

    task = is_task(model)
    backbone = model.backbone if task else model
    # A task's head (`export.hf_heads`): every variable outside the backbone is placed or refused.
    head = hf_heads.head_map(model) if task else None
    plan = hf.plan(backbone, dtype, prefix=head.prefix if head is not None else "")
    if head is not None:
        tail = hf.plan_head(model, head, dtype)
        clash = sorted(set(plan.specs) & set(tail.specs))
        if clash:
            raise UnsupportedModelError(f"{type(model).__name__}: head tensors {clash[:4]} clash with the backbone's.")
        plan = hf.HFPlan(config={**plan.config, **tail.config, "architectures": [head.architecture]},
                         specs=dict(sorted({**plan.specs, **tail.specs}.items())), remaps=plan.remaps + tail.remaps)
    tokenizer = getattr(getattr(model, "preprocessor", None), "tokenizer", None) if task else None
    if tokenizer is not None and not _keras_hub.exports_tokenizer(tokenizer):
        raise UnsupportedModelError(
            f"{type(model).__name__}: keras-hub has no Hugging Face export of {type(tokenizer).__name__}. "
            "Fix: export the backbone (model.backbone) and convert the tokenizer separately."
        )
    config = _with_stored_dtype(dict(plan.config), plan.specs, type(model).__name__)
    if task:
        from shardckpt.exporting.hf_config import task_architectures

        architectures = task_architectures(config, model)
        if architectures is not None:
            config["architectures"] = architectures
    if tokenizer is not None:  # as keras-hub's export_backbone does
        for key, token in (("bos_token_id", tokenizer.start_token), ("eos_token_id", tokenizer.end_token)):
            if token is not None:
                config[key] = tokenizer.token_to_id(token)

    def small_files(folder: str) -> None:
        import json

        with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
        if tokenizer is not None:
            _keras_hub.export_tokenizer(tokenizer, folder)

    return Plan(kind="safetensors", specs=plan.specs, files=safetensors_writer.plan_files(plan.specs, shard),
                 writes=plan.remaps, small_files=small_files)


def _with_stored_dtype(config: dict[str, Any], specs: dict[str, ArraySpec], name: str) -> dict[str, Any]:
    """`config` with `dtype` and `torch_dtype` naming the dtype its tensors are stored in.

    transformers (5.x: `dtype`; before 4.56 and keras-hub's exporter:
    `torch_dtype`, which 5.x still reads when `dtype` is absent) loads a
    folder in that dtype by default. keras-hub's exporter writes the compute
    dtype of the model's policy, which a `mixed_bfloat16` model (float32
    weights) or `export(dtype=...)` makes differ from the tensors: transformers
    then rounds (or widens) every weight on load, silently. Nested
    configs (`text_config`) that name a dtype get the same.
    """
    import logging

    import jax

    from shardckpt import dtypes

    by_dtype: collections.Counter[str] = collections.Counter()
    for spec in specs.values():
        if dtypes.is_float(spec.dtype):
            by_dtype[str(np.dtype(spec.dtype))] += spec.nbytes
    if not by_dtype:
        return config
    [(stored, _)] = by_dtype.most_common(1)
    # keras-hub backbones hold one float dtype; a hand-made mix is loaded in one. Every process plans
    # the same specs: one says it.
    if len(by_dtype) > 1 and jax.process_index() == 0:
        logging.getLogger("shardckpt").warning(
            "%s: its tensors are stored in %s; config.json says dtype=%s (the most bytes), which "
            "transformers casts every weight to by default. Fix: export with dtype=... to store one dtype.",
            name, ", ".join(sorted(by_dtype)), stored)

    def put(c: dict[str, Any], top: bool) -> dict[str, Any]:
        out = {k: put(v, False) if isinstance(v, dict) else v for k, v in c.items()}
        for key in ("dtype", "torch_dtype"):
            if top or key in c:
                out[key] = stored
        return out

    return put(config, True)


def plan_keras_hub(model: Any, dtype: Any, shard: int | None) -> Plan:
    from shardckpt import _keras_hub
    from shardckpt.exporting import kerashub
    from shardckpt.restore.keys import is_task

    _check_configs(model, is_task(model))
    specs: dict[str, ArraySpec] = {}
    files: dict[str, list[str]] = {}
    groups: dict[str, dict[str, str]] = {}
    writes: list[tuple[Any, Tensor]] = []
    index = None
    for stem, keys, file_groups in kerashub.weight_files(model):
        prefixed = {f"{stem}:{k}": v for k, v in keys.items()}  # one namespace for both files
        for key, v in prefixed.items():
            specs[key] = kerashub.spec_of(v, dtype)
            writes.append((v, Identity(key, specs[key].shape, specs[key].dtype)))
        groups.update({f"{stem}:{g}": a for g, a in file_groups.items()})
        own = {k: specs[k] for k in prefixed}
        if stem == "model" and shard is not None and sum(s.nbytes for s in own.values()) > shard:
            files.update(h5_writer.plan_files(own, shard, stem=stem))
            index = "model.weights.json"
        else:
            files[f"{stem}.weights.h5"] = list(own)
    task = is_task(model)

    def small_files(folder: str) -> None:
        _keras_hub.save_preset_configs(model, folder, task=task)

    return Plan(kind="h5", specs=specs, files=files, writes=writes, groups=groups, index=index,
                 small_files=small_files)


def _check_configs(model: Any, task: bool) -> None:
    """Refuses, before any byte is written, a model whose config keras-hub's preset saver cannot write.

    The saver writes `config.json` (and a task's `task.json`) as JSON of
    `keras.saving.serialize_keras_object`, after the weights (`small_files`):
    a model without a serialisable config (a subclassed model whose
    `__init__` takes other than plain values and has no `get_config`) would
    fail only once every weight is written.

    Raises:
        UnsupportedModelError: naming the object, with the fix.
    """
    import json

    import keras

    from shardckpt.errors import UnsupportedModelError

    for obj, name in ((model.backbone, "config.json"), (model, "task.json")) if task else ((model, "config.json"),):
        try:
            json.dumps(keras.saving.serialize_keras_object(obj))
        except (NotImplementedError, TypeError, ValueError) as e:
            said = " ".join(str(e).strip().split("\n\n")[0].split())  # Keras' first paragraph, not its example
            raise UnsupportedModelError(
                f"{type(obj).__name__} ({obj.name!r}) has no config keras-hub's preset saver can write as "
                f"{name} ({type(e).__name__}: {said}). Fix: give it a get_config() "
                "that returns its constructor's arguments (and from_config), or export format='safetensors' "
                "or 'orbax', which store no config."
            ) from e


def plan_safetensors(model: Any, dtype: Any, shard: int | None) -> Plan:
    from shardckpt.exporting.kerashub import spec_of
    from shardckpt.exporting.model import lora_factors

    specs: dict[str, ArraySpec] = {}
    writes: list[tuple[Any, Tensor]] = []
    # One function: a LoRA layer's kernel is stored merged (`value_getters`) and its factors
    # not, as Keras' save_weights does; `load_sharded` then leaves them at zero delta.
    factors = lora_factors(model)
    for v in model.weights:
        if id(v) in factors:
            continue
        specs[v.path] = spec_of(v, dtype)
        writes.append((v, Identity(v.path, specs[v.path].shape, specs[v.path].dtype)))
    return Plan(kind="safetensors", specs=specs, files=safetensors_writer.plan_files(specs, shard), writes=writes)


def plan_peft(model: Any, dtype: Any, shard: int | None) -> Plan:
    """The LoRA factors alone as a PEFT adapter (`export.peft`); one file, as PEFT reads it."""
    from shardckpt.exporting import hf, hf_heads, peft
    from shardckpt.restore.keys import is_task

    task = is_task(model)
    backbone = model.backbone if task else model
    head = hf_heads.head_map(model) if task else None
    # The Hugging Face tensors of the model in the adapter's dtype: the factors' modules, and the
    # trained biases and head (`export.peft`) under their names.
    base = hf.plan(backbone, dtype, prefix=head.prefix if head is not None else "")
    if head is not None:
        tail = hf.plan_head(model, head, dtype)
        base = hf.HFPlan(config=base.config, specs=dict(sorted({**base.specs, **tail.specs}.items())),
                         remaps=base.remaps + tail.remaps)
    specs, writes, config = peft.plan(model, base, dtype)

    def small_files(folder: str) -> None:
        peft.write_config(folder, config)

    return Plan(kind="safetensors", specs=specs, files={peft.ADAPTER_FILE: list(specs)}, writes=writes,
                small_files=small_files)
