"""Every use of keras-hub internals, in one place: the upgrade surface behind the keras-hub pin.

keras-hub is optional, so each function imports what it needs when called.
What is here has no public name in keras-hub:

- `preset_utils` (presets.kerashub, presets.load): keras-hub's preset file
  resolution (`get_file`, `check_file_exists` for `kaggle://`, `hf://`, ...
  handles) and `BUILTIN_PRESETS`; no public API returns a preset's local folder.
- `PresetLoader`, `TransformersPresetLoader` (presets.hf): keras-hub's
  dispatch from a Hugging Face `model_type` to its converter and backbone
  config; exposed only through `from_preset`, which also loads the weights.
- `SafetensorLoader.get_prefixed_key` (formats.hf_record): keras-hub's
  resolution of a converter's tensor name against the stored names.
- `Phi3Backbone` (formats.hf_phi3): the backbone of a model type keras-hub
  has no converter for, exported under no public name.
- `transformers.preset_loader`'s `convert_<arch>` modules, `hf_exporter`'s
  `MODEL_CONFIGS`, `export_tokenizer` and `MODEL_TOKENIZER_CONFIGS`, and
  `KerasPresetSaver` (export): keras-hub exposes its Hugging Face converters
  and exporter only through `from_preset` and `export_to_transformers`, which
  read or gather whole tensors; their per-architecture parts (configs, name
  maps, tokenizer files) and the preset config writer live here.
"""

from __future__ import annotations

import types
from typing import Any


def preset_utils() -> Any:
    """`keras_hub.src.utils.preset_utils`."""
    from keras_hub.src.utils import preset_utils  # optional dependency

    return preset_utils


def preset_loaders() -> tuple[Any, Any]:
    """keras-hub's `PresetLoader` and `TransformersPresetLoader` classes."""
    from keras_hub.src.utils.preset_utils import PresetLoader  # optional dependency
    from keras_hub.src.utils.transformers.preset_loader import TransformersPresetLoader

    return PresetLoader, TransformersPresetLoader


def safetensor_loader() -> Any:
    """keras-hub's `SafetensorLoader` class."""
    from keras_hub.src.utils.transformers.safetensor_utils import SafetensorLoader  # optional dependency

    return SafetensorLoader


def phi3_backbone() -> Any:
    """keras-hub's `Phi3Backbone` class."""
    from keras_hub.src.models.phi3.phi3_backbone import Phi3Backbone  # optional dependency

    return Phi3Backbone

def converters() -> dict[str, types.ModuleType]:
    """keras-hub's `convert_<arch>` modules by name (its HF loader's dispatch imports them all)."""
    from keras_hub.src.utils.transformers import preset_loader

    return {name: mod for name, mod in vars(preset_loader).items() if name.startswith("convert_")}


def exporter_config(backbone: Any) -> dict[str, Any] | None:
    """keras-hub's exporter config for `backbone` (`MODEL_CONFIGS`), or None if it has none."""
    from keras_hub.src.utils.transformers.export import hf_exporter

    get = hf_exporter.MODEL_CONFIGS.get(type(backbone).__name__)
    if get is None:
        return None
    config = get(backbone)
    return dict(config.to_dict() if hasattr(config, "to_dict") else config)


def export_tokenizer(tokenizer: Any, folder: str) -> None:
    """keras-hub's Hugging Face tokenizer files (assets renamed, tokenizer_config.json)."""
    from keras_hub.src.utils.transformers.export import hf_exporter

    hf_exporter.export_tokenizer(tokenizer, folder)


def exports_tokenizer(tokenizer: Any) -> bool:
    from keras_hub.src.utils.transformers.export import hf_exporter

    return type(tokenizer).__name__ in hf_exporter.MODEL_TOKENIZER_CONFIGS


def preset_saver(folder: str) -> Any:
    """keras-hub's `KerasPresetSaver` (config, metadata, task and tokenizer files of a preset)."""
    from keras_hub.src.utils.preset_utils import KerasPresetSaver

    return KerasPresetSaver(folder)


def save_preset_configs(model: Any, folder: str, *, task: bool) -> None:
    """keras-hub's config files of a preset, exactly as `save_to_preset` writes them.

    `config.json` + `metadata.json` for the backbone; for a task also
    `task.json` and its preprocessor's files (tokenizer assets). Weights are
    not written here (keras-hub's `save_weights` gathers each variable).
    """
    from keras_hub.src.utils.preset_utils import KerasPresetSaver

    saver = KerasPresetSaver(folder)
    backbone = model.backbone if task else model
    saver._save_serialized_object(backbone, config_file="config.json")  # its config writer, weights apart
    saver._save_metadata(backbone)
    if task:
        saver._save_serialized_object(model, "task.json")
        if model.preprocessor is not None:
            model.preprocessor.save_to_preset(folder)
