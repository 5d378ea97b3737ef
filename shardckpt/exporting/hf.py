"""A keras-hub backbone as Hugging Face tensors: names, shapes, and where each element goes.

One table for both directions: keras-hub's converter
(`convert_<arch>.convert_weights`, or shardckpt's Phi-3 converter) is run
against `shardckpt.formats.hf_record.RecordingLoader`, exactly as
`from_preset` runs it to read a folder. Each Keras variable gets the
`hf_remap.Tensor` that says where its elements live in the stored tensors;
export writes each device's piece there (`export.pieces.write_box`), the
inverse of the read.

Reading needs the stored shapes, which a folder's header gives; exporting
has no folder, so the shapes are solved first (`hf_shapes`) from the Keras
layers' structure, and then checked: every stored tensor must be covered
exactly once by the recorded remaps, or the architecture is refused.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from shardckpt.errors import UnsupportedModelError
from shardckpt.exporting.hf_shapes import stored_shapes
from shardckpt.exporting.model import lora_factors
from shardckpt.formats.base import ArraySpec
from shardckpt.formats.hf_remap import Concat, Tensor, Unsupported
from shardckpt.structure import lora_off

_OWN_CONVERTERS = {"Phi3Backbone": ("shardckpt.formats.hf_phi3", ["phi3"])}


def converter_for(backbone: Any) -> tuple[Any, list[str]]:
    """keras-hub's converter module for the backbone's class, and the model_types it reads.

    Raises:
        UnsupportedModelError: no converter builds this class.
    """
    import importlib

    from shardckpt import _keras_hub

    name = type(backbone).__name__
    if name in _OWN_CONVERTERS:
        module_name, types = _OWN_CONVERTERS[name]
        return importlib.import_module(module_name), types
    modules = _keras_hub.converters()
    for mod_name, module in modules.items():
        if getattr(module, "backbone_cls", None) is type(backbone):
            return module, _model_types(mod_name)
    for mod_name, module in modules.items():
        if _same_architecture(getattr(module, "backbone_cls", None), type(backbone)):
            return module, _model_types(mod_name)
    raise UnsupportedModelError(
        f"{name} has no Hugging Face mapping: keras-hub has no converter that builds it. "
        "Fix: export it with format='keras-hub' (a keras-hub preset) or format='safetensors' "
        "(keys = variable paths)."
    )


def _same_architecture(built: Any, cls: type) -> bool:
    """True if the converter's class is `cls` under another name.

    keras-hub gives one architecture several classes (`Llama3Backbone`
    subclasses `LlamaBackbone` for its presets and adds nothing): a subclass
    that keeps the constructor and config of `cls` builds the same layers
    from the same arguments, so the converter of one maps the other.
    """
    if not isinstance(built, type) or built is cls or not issubclass(built, cls):
        return False
    return all(getattr(built, attr) is getattr(cls, attr) for attr in ("__init__", "get_config", "build", "call"))


def _model_types(module_name: str) -> list[str]:
    # keras-hub's dispatch is an if-chain on model_type; the module name is
    # the model_type save for these (from keras_hub's preset_loader).
    special = {
        "convert_gemma": ["gemma", "gemma2"], "convert_gemma3": ["gemma3", "gemma3_text"],
        "convert_llama3": ["llama"], "convert_qwen": ["qwen2"], "convert_qwen_moe": ["qwen2_moe"],
    }
    return special.get(module_name, [module_name.removeprefix("convert_")])


@dataclasses.dataclass(kw_only=True)
class HFPlan:
    """What `format="hf"` writes for a backbone.

    Attributes:
        config: `config.json`.
        specs: `{Hugging Face key: spec}`, sorted by key.
        remaps: `[(variable, remap)]` for every exported variable.
    """

    config: dict[str, Any]
    specs: dict[str, ArraySpec]
    remaps: list[tuple[Any, Tensor]]


def _covered(remap: Tensor, counts: dict[str, int]) -> None:
    if isinstance(remap, Concat):
        for part in remap.parts:
            _covered(part, counts)
        return
    child = getattr(remap, "child", None)
    if child is not None:
        _covered(child, counts)
        return
    key = remap.sources()[0]
    counts[key] = counts.get(key, 0) + math.prod(remap.shape)


def plan(backbone: Any, dtype: Any = None, *, prefix: str = "") -> HFPlan:
    """The Hugging Face tensors of `backbone` and how its variables fill them.

    `prefix` goes before every tensor name (a head class's base model
    prefix, `bert.`); keras-hub's key lookup finds the converter's names
    under it, as it does when reading such a folder.

    Raises:
        UnsupportedModelError: no converter, no config that reads back, a
            converter step that is no index remap, or stored tensors the
            variables do not cover exactly once.
    """
    from shardckpt.exporting.hf_config import hf_config
    from shardckpt.formats.hf_record import MissingTensorError, record

    converter, model_types = converter_for(backbone)
    config = hf_config(backbone, converter, model_types)
    name = type(backbone).__name__
    try:
        # Converters port `layer.kernel`: record the base kernel variable; the
        # merged kernel is written there (`value_getters`).
        with lora_off(backbone):
            shapes = stored_shapes(backbone, converter, config)
            stored_dtype = np.dtype(dtype) if dtype is not None else np.dtype("float32")
            specs = {prefix + k: ArraySpec(shape=tuple(s), dtype=stored_dtype) for k, s in sorted(shapes.items())}
            recorded = record(backbone, converter, "<export>", config, specs)
    except (Unsupported, MissingTensorError, KeyError, ValueError) as e:
        raise UnsupportedModelError(
            f"{name}: keras-hub's converter cannot be inverted for export ({e}). Fix: export "
            "with format='keras-hub' or format='safetensors'."
        ) from e
    remaps = [(v, t) for v, t in recorded.assigned.values()]
    specs, wrong = _stored_specs(specs, remaps, dtype)
    skipped = {id(a) for a, _ in remaps} | lora_factors(backbone)
    unassigned = [v.path for v in backbone.weights if id(v) not in skipped]
    if wrong or unassigned:
        raise UnsupportedModelError(
            f"{name}: the recorded Hugging Face mapping does not cover "
            + (f"the stored tensors {wrong[:4]} exactly once" if wrong else f"the variables {unassigned[:4]}")
            + ". Fix: export with format='keras-hub' or format='safetensors'."
        )
    return HFPlan(config=config, specs=specs, remaps=remaps)


def _stored_specs(specs: dict[str, ArraySpec], remaps: list, dtype: Any) -> tuple[dict[str, ArraySpec], list[str]]:
    """`specs` in their stored dtype, and the stored tensors `remaps` do not fill exactly once.

    The stored dtype is the variables' (all floats of one dtype in keras-hub
    backbones and heads), unless `dtype` is given.
    """
    if dtype is None:
        stored = {k: np.dtype(v.dtype) for v, t in remaps for k in t.sources()}
        specs = {k: ArraySpec(shape=s.shape, dtype=stored.get(k, s.dtype)) for k, s in specs.items()}
    counts: dict[str, int] = {}
    for _, t in remaps:
        _covered(t, counts)
    return specs, [k for k, s in specs.items() if counts.get(k, 0) != math.prod(s.shape)]


def plan_head(task: Any, head: Any, dtype: Any = None) -> HFPlan:
    """The head's tensors (`export.hf_heads.HeadMap`) and how the task's head variables fill them.

    Raises:
        UnsupportedModelError: a head variable the map leaves unplaced, or
            a head tensor it does not fill exactly once.
    """
    from shardckpt.exporting.hf_heads import head_variables
    from shardckpt.formats.hf_record import RecordingLoader

    stored_dtype = np.dtype(dtype) if dtype is not None else np.dtype("float32")
    specs = {k: ArraySpec(shape=tuple(s), dtype=stored_dtype) for k, s in sorted(head.shapes.items())}
    loader = RecordingLoader("<export>", specs)
    head.convert_head(task, loader, {})
    remaps = list(loader.assigned.values())
    specs, wrong = _stored_specs(specs, remaps, dtype)
    placed = {id(v) for v, _ in remaps}
    unplaced = [v.path for v in head_variables(task) if id(v) not in placed]
    if wrong or unplaced:
        raise UnsupportedModelError(
            f"{type(task).__name__}: the {head.architecture} head map "
            + (f"leaves the variables {unplaced[:4]} unplaced" if unplaced else f"does not fill {wrong[:4]} exactly once")
            + ". Fix: export model.backbone, or format='keras-hub' / 'safetensors'."
        )
    return HFPlan(config=dict(head.config), specs=specs, remaps=remaps)
