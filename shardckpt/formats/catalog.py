"""Every format shardckpt reads or writes: the one list `registry` is made of.

Each entry declares what identifies the format (see `declaration.Format`),
its reader and its writer. Callables from layers above `formats` (the
Hugging Face reader needs keras-hub's converters; writers are the export
package's) are named with `Lazy` and imported at their first call.
"""

from __future__ import annotations

from typing import Any

from shardckpt import storage
from shardckpt.formats.declaration import Format, Lazy, Probe
from shardckpt.formats.h5 import H5Reader
from shardckpt.formats.h5_sharded import ShardedH5Reader, is_sharded_index
from shardckpt.formats.hf import CONFIG, INDEX, SINGLE
from shardckpt.formats.orbax import OrbaxReader, is_orbax_dir
from shardckpt.formats.preset import CONFIG_FILE, MODEL_WEIGHTS, SHARDED_MODEL_WEIGHTS, PresetReader
from shardckpt.formats.safetensors import SafetensorsReader


def _config_has(*keys: str) -> Any:
    """A `confirm`: the folder's config.json is an object with one of `keys` (how keras-hub tells them apart)."""

    def confirm(probe: Probe) -> bool:
        config = probe.json(CONFIG)
        return isinstance(config, dict) and any(key in config for key in keys)

    return confirm


def _h5(location: storage.Location, **_: Any) -> H5Reader:
    return H5Reader(location)


CATALOG = (
    Format(
        name="safetensors",
        description="`.safetensors` files and `*.safetensors.index.json` sets",
        suffixes=(".safetensors", ".safetensors.index.json"),
        priority=60,  # above h5-sharded, whose ".json" an index also ends with
        reader=lambda location, **_: SafetensorsReader(location),
        writer=Lazy("shardckpt.exporting.api:write_safetensors"),
        keys="path",
    ),
    # Keras' own files: one reader (a `.keras` archive holds a `.weights.h5`), told apart by name or magic.
    Format(
        name="h5",
        description="Keras `.weights.h5` files",
        suffixes=(".h5", ".hdf5"),
        magic=b"\x89HDF\r\n\x1a\n",
        priority=40,
        reader=_h5,
        keys="h5",
    ),
    Format(
        name="keras",
        description="`.keras` archives",
        suffixes=(".keras",),
        magic=b"PK\x03\x04",
        priority=30,
        reader=_h5,
        keys="h5",
    ),
    Format(
        name="h5-sharded",
        description="Keras sharded `.weights.json` indexes",
        suffixes=(".json",),
        confirm=lambda probe: is_sharded_index(probe.location),
        confirms="a weight_map of .h5 files",
        priority=50,
        reader=lambda location, **_: ShardedH5Reader(location),
        keys="h5",
    ),
    Format(
        name="orbax",
        description="Orbax checkpoints (a root of step folders, or one step)",
        folder=True,
        confirm=lambda probe: is_orbax_dir(probe.location),
        confirms="numbered step folders or Orbax's _CHECKPOINT_METADATA / _METADATA",
        # Above the other folders: a step folder may hold anything beside Orbax's files.
        priority=90,
        reader=lambda location, *, cache_bytes, **_: OrbaxReader(location, cache_bytes=cache_bytes),
        writer=Lazy("shardckpt.exporting.api:write_orbax"),
        keys="state",
    ),
    Format(
        name="preset",
        description="keras-hub preset folders",
        folder=True,
        markers=(CONFIG_FILE,),
        one_of=(MODEL_WEIGHTS, SHARDED_MODEL_WEIGHTS),
        confirm=_config_has("registered_name", "class_name"),
        confirms="config.json naming a keras-hub class (registered_name)",
        priority=80,
        reader=lambda location, *, task=None, **_: PresetReader(location, task=task),
        writer=Lazy("shardckpt.exporting.api:write_keras_hub"),
        aliases=("keras-hub",),
        architecture=Lazy("shardckpt.presets.kerashub:architecture"),
        keys="preset",
    ),
    Format(
        name="hf",
        description="Hugging Face folders",
        folder=True,
        markers=(CONFIG,),
        one_of=(SINGLE, INDEX),
        confirm=_config_has("model_type"),
        confirms="config.json with a model_type",
        priority=70,
        reader=Lazy("shardckpt.presets.hf:reader"),
        writer=Lazy("shardckpt.exporting.api:write_hf"),
        architecture=Lazy("shardckpt.presets.hf:build"),
        keys="path",
        needs_model=True,
    ),
    # Written only (`export(format="peft")`): LoRA factors as a PEFT adapter folder, no model to read.
    Format(
        name="peft",
        description="PEFT LoRA adapter folders (written by export only)",
        writer=Lazy("shardckpt.exporting.api:write_peft"),
        keys="",
    ),
)
"""Every format, each with its rules; the order is no rule (see `Format.priority`)."""
