"""Hugging Face folders into keras-hub models, each device reading its own piece.

`build(folder)` builds the keras-hub backbone of a Hugging Face folder under
`shardckpt.lazy_init()`, its config converted by keras-hub's own converter
(`TransformersPresetLoader.load_backbone(..., load_weights=False)`), so the
model is exactly the one keras-hub's `Backbone.from_preset(folder)` builds,
without random weights. `load_sharded(model, folder)` then fills it.

How each variable is made of stored tensors is not typed here: keras-hub's
`convert_weights` runs against `hf_record.RecordingLoader`, whose tensors
(`hf_remap`) carry positions, not data. Every transpose, reshape, slice,
stack, concatenation and cast a converter hook performs becomes an index
remap, and a device's box of a variable is read from the bytes its elements
live in (see `hf_remap`). Casts follow keras-hub: a hook's own `astype`
first, then the variable's dtype, as `Variable.assign` casts (a bfloat16
checkpoint into float32 or bfloat16 variables).

Supported: every `model_type` keras-hub 0.32 converts whose hooks are index
remaps; tested with small folders for Llama/Llama3 (`llama`), Mistral,
Mixtral, Gemma, Gemma2, Gemma3 (text), Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE,
GPT-2 and BERT. Phi-3 (`phi3`), for which keras-hub has a backbone but no
converter, maps through `hf_phi3`, a converter in keras-hub's interface.
"""

from __future__ import annotations

import os
from typing import Any

from shardckpt import _keras_hub, storage
from shardckpt.errors import CheckpointMismatchError, MissingDependencyError, UnsupportedModelError
from shardckpt.formats import hf_carried
from shardckpt.formats.hf import (
    CONFIG,
    HFReader,
    is_hf_folder,
    open_tensors,
    read_config,
    safetensors_index,
)
from shardckpt.formats.hf_record import ConversionProblems, record
from shardckpt.formats.hf_remap import Unsupported
from shardckpt.lazy import is_unloaded, lazy_init, original_initializer
from shardckpt.presets import hf_unread
from shardckpt.structure import lora_off

__all__ = ["build", "initialize_states", "is_hf_folder", "open_reader", "preset_loader", "reader"]


# model_types keras-hub has a backbone for but no converter: shardckpt's own
# converter modules, in keras-hub's converter interface.
_DATA_CONVERTERS = {"phi3": "shardckpt.formats.hf_phi3"}


def _DataLoader(folder: str, config: dict, converter: Any) -> Any:
    preset_loader_cls, transformers_loader_cls = _keras_hub.preset_loaders()

    class Loader(transformers_loader_cls):  # type: ignore[misc,valid-type]
        # keras-hub's loader (config conversion, backbone construction) with
        # the converter chosen here instead of by keras-hub's dispatch.
        def __init__(self) -> None:
            preset_loader_cls.__init__(self, folder, config)
            self.converter = converter

    return Loader()


def preset_loader(folder: str, config: dict | None = None) -> Any:
    """keras-hub's `TransformersPresetLoader` for `folder` (its converter by `model_type`).

    Raises:
        MissingDependencyError: keras-hub is not installed.
        UnsupportedModelError: keras-hub has no converter for the `model_type`.
    """
    try:
        _, TransformersPresetLoader = _keras_hub.preset_loaders()
    except ImportError as e:
        raise MissingDependencyError(
            f"Loading the Hugging Face folder {folder!r} needs keras-hub (its model classes "
            f"and name maps): {e}. Fix: pip install keras-hub."
        ) from e
    config = read_config(folder) if config is None else config
    data_converter = _DATA_CONVERTERS.get(str(config.get("model_type")))
    if data_converter is not None:
        import importlib

        return _DataLoader(folder, config, importlib.import_module(data_converter))
    try:
        # keras-hub's own dispatch on model_type (a private module: keras-hub
        # exposes it only through from_preset, which also loads weights).
        return TransformersPresetLoader(folder, config)
    except ValueError as e:
        raise UnsupportedModelError(
            f"{folder!r}: {e} Fix: use a model_type keras-hub converts (llama, mistral, "
            "mixtral, gemma, gemma2, gemma3, qwen2, qwen3, qwen2_moe, qwen3_moe, gpt2, bert, ...)."
        ) from e


def build(folder: str | os.PathLike, *, dtype: Any = None) -> Any:
    """Builds the keras-hub backbone of a Hugging Face folder, with no weights.

    The config is converted as keras-hub's `Backbone.from_preset(folder)`
    converts it; the model is built under `shardckpt.lazy_init()` (no
    initializer runs, no weight memory). Fill it with
    `shardckpt.load_sharded(model, folder)`.

    Example:

    ```python
    model = shardckpt.presets.hf.build("Llama-3.2-1B/")
    keras.distribution.set_distribution(my_model_parallel)
    shardckpt.load_sharded(model, "Llama-3.2-1B/")
    ```

    Args:
        folder: A folder with `config.json` (with `model_type`) and safetensors.
        dtype: The backbone's dtype (e.g. "bfloat16"); None: Keras' default,
            as in keras-hub's `from_preset`.

    Returns:
        The keras-hub backbone, its variables unloaded.
    """
    folder = os.fspath(folder)
    loader = preset_loader(folder)
    # Config keys keras-hub's converter leaves unread (GPT-2's n_inner) are
    # read as transformers reads them.
    carried = hf_carried.read(loader.config)
    try:
        with lazy_init():
            model = loader.load_backbone(loader.check_backbone_class(), load_weights=False, dtype=dtype, **carried)
    except UnsupportedModelError as e:  # a converter refusing a config value: name the file
        raise UnsupportedModelError(f"{storage.parse(folder).join(CONFIG).url!r}: {e}") from e
    initialize_states(model)
    return model


def initialize_states(model: Any) -> None:
    """Gives lazily built variables that are not weights their initial value.

    Seed-generator states (dropout) are variables but not weights: no
    checkpoint holds them. They get their initial value, as in keras-hub's
    own build, so training the model does not meet an unloaded variable.
    """
    weights = {id(v) for v in model.weights}
    for variable in model.variables:
        if id(variable) not in weights and is_unloaded(variable):
            initializer = original_initializer(variable)
            variable._initializer = None  # lazy_init's sentinel; see shardckpt.lazy
            variable._initialize_with_initializer(initializer)


def remaps(model: Any, folder: str, tensors: Any) -> dict[str, Any]:
    """`variable.path -> hf_remap.Tensor` for `model` from keras-hub's converter."""
    loader = preset_loader(folder)
    stored = {k: tensors.spec(k) for k in tensors.keys()}  # noqa: SIM118 (a Reader, not a dict)
    try:
        # Converters port `layer.kernel`: with LoRA on, that is the merged kernel (computed from the
        # factors); off, the base kernel variable, which the folder's merged tensor fills.
        with lora_off(model):
            recorded = record(model, loader.converter, folder, loader.config, stored, safetensors_index(folder))
    except Unsupported as e:
        raise UnsupportedModelError(
            f"{folder!r} ({loader.config['model_type']}): keras-hub's converter does a step that is "
            f"not an index remap of stored tensors: {e}. Fix: load it with keras-hub's from_preset, "
            "or convert it there and save with save_to_preset."
        ) from e
    except ConversionProblems as e:
        raise CheckpointMismatchError(
            folder, missing=e.missing, mismatched=e.mismatched, fmt="hf", fix=_folder_fix(model, loader)
        ) from e
    return {variable.path: value for variable, value in recorded.assigned.values()}


def _config_differences(model: Any, loader: Any) -> list[str]:
    """Constructor arguments of `model` that differ from those of the folder's config.json.

    keras-hub's converter turns the Hugging Face config into the backbone's
    constructor arguments (`convert_backbone_config`); compared with the
    model's own `get_config()`, they name what makes the model another one.
    """
    try:
        wanted = loader.converter.convert_backbone_config(loader.config)
        ours = model.get_config()
    except (AttributeError, KeyError, TypeError, ValueError, NotImplementedError):
        return []  # no comparable config (a converter without one): the generic advice stands
    missing = object()
    out = []
    for name, value in wanted.items():
        # Some backbones keep an argument as an attribute only (Llama's tie_word_embeddings).
        mine = ours.get(name, getattr(model, name, missing))
        if mine is not missing and mine != value and not isinstance(value, dict):
            out.append(f"{name}={mine!r} (the folder's: {value!r})")
    return out


def _folder_fix(model: Any, loader: Any) -> str:
    """The advice for tensors a folder lacks or holds in other shapes, for `model`."""
    differences = _config_differences(model, loader)
    if differences:
        return (
            f"the model differs from the folder's config.json ({loader.config.get('model_type')}): "
            + ", ".join(differences)
            + ". Build the model from the folder (shardckpt.from_preset(folder), or "
            "shardckpt.presets.hf.build(folder)) or with the folder's configuration."
        )
    return (
        "the model differs from what the folder holds: build it from the folder (shardckpt.from_preset"
        "(folder), or shardckpt.presets.hf.build(folder)) or with the configuration in its config.json "
        "(layers, widths, heads, vocabulary, tied embeddings). If the model was built from this "
        "config.json, the Hugging Face folder is incomplete: Re-download the complete folder "
        "(config.json with the safetensors files it was saved with)."
    )


def open_reader(folder: str | os.PathLike | storage.Location, model: Any) -> HFReader:
    """The `Reader` of a Hugging Face folder as `model`'s variables."""
    folder = folder.url if isinstance(folder, storage.Location) else os.fspath(folder)
    tensors = open_tensors(folder)
    try:
        mapped = remaps(model, folder, tensors)
        return HFReader(folder, tensors, mapped, hf_unread.classify(model, mapped, tensors, folder))
    except BaseException:
        tensors.close()
        raise


def reader(location: storage.Location, *, model: Any, **_: Any) -> HFReader:
    """The reader the formats' catalog names for Hugging Face folders (`open_reader` as a slot)."""
    return open_reader(location, model)
