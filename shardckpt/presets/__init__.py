"""`from_preset`: a pretrained model built lazily and loaded straight into its sharding.

One module per kind of folder: `kerashub` (keras-hub presets: `config.json`
with `registered_name`, `model.weights.h5` or a sharded `model.weights.json`),
`hf` (Hugging Face folders: `config.json` with `model_type`, safetensors);
`load` detects the kind, plans the layout and loads.
"""

# hf fills the formats' reader slot of Hugging Face folders (keras-hub is imported lazily).
from shardckpt.presets import hf as hf
from shardckpt.presets.load import from_preset, load_preset, preset_kind

__all__ = ["from_preset", "load_preset", "preset_kind"]
