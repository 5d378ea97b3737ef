"""Every use of keras-hub internals, in one place: the upgrade surface behind the keras-hub pin.

keras-hub is optional, so each function imports what it needs when called.
What is here has no public name in keras-hub:

- `preset_utils` (presets.kerashub, presets.load): keras-hub's preset file
  resolution (`get_file`, `check_file_exists` for `kaggle://`, `hf://`, ...
  handles) and `BUILTIN_PRESETS`; no public API returns a preset's local folder.
- `PresetLoader`, `TransformersPresetLoader` (presets.hf): keras-hub's
  dispatch from a Hugging Face `model_type` to its converter and backbone
  config; exposed only through `from_preset`, which also loads the weights.
- `SafetensorLoader.get_prefixed_key` (presets.hf_record): keras-hub's
  resolution of a converter's tensor name against the stored names.
- `Phi3Backbone` (presets.hf_phi3): the backbone of a model type keras-hub
  has no converter for, exported under no public name.
"""

from __future__ import annotations

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
