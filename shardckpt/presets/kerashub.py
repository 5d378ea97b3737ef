"""keras-hub presets: build a model from `config.json` / `task.json` with no weights.

The model is built by keras-hub's own `from_preset(..., load_weights=False)`
under `shardckpt.lazy_init()`: keras-hub resolves the class registered in the
config (`keras_hub>LlamaBackbone`), its dtype rules and its arguments, and
Keras deserialises the config with `safe_mode` (nothing in the folder is
executed; only classes keras-hub registered are built). No variable gets a
value; `shardckpt.load_sharded` then fills each one in its sharding.

keras-hub is optional: it is imported here, when a keras-hub preset is asked
for, and its absence raises `MissingDependencyError` naming what to install.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from typing import Any

from shardckpt import _keras, _keras_hub, storage
from shardckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, MissingDependencyError
from shardckpt.formats.preset import (
    CONFIG_FILE,
    MODEL_WEIGHTS,
    SHARDED_MODEL_WEIGHTS,
    TASK_CONFIG_FILE,
    TASK_WEIGHTS,
)
from shardckpt.lazy import lazy_init

# keras-hub handles resolved through keras-hub's download cache.
HANDLE_SCHEMES = ("kaggle", "hf", "modelscope")


def import_keras_hub(what: str) -> Any:
    """Returns the `keras_hub` module, or raises a clear error naming the install."""
    try:
        import keras_hub
    except ImportError as e:
        raise MissingDependencyError(
            f"{what} needs keras-hub, which is not installed ({e}). Fix: pip install "
            "keras-hub (or pip install 'shardckpt[hub]')."
        ) from e
    return keras_hub


def read_json(folder: str, name: str) -> dict[str, Any]:
    """Reads `folder/name` as a JSON object.

    Raises:
        CheckpointNotFoundError: no such file or object.
        CorruptCheckpointError: not valid JSON, or not an object.
    """
    location = storage.parse(folder).join(name)
    path = location.url
    data = storage.read_json(location, fix="re-save the preset.", missing_ok=True)  # a small file: read whole
    if data is None:
        raise CheckpointNotFoundError(f"No {name} in {folder!r}. Fix: add the preset's {name}.")
    if not isinstance(data, dict):
        raise CorruptCheckpointError(f"{path!r} holds {type(data).__name__}, not a JSON object. Fix: re-save the preset.")
    return data


@contextlib.contextmanager
def local_configs(url: str) -> Iterator[str]:
    """A temporary local copy of a bucket preset's files other than weights.

    keras-hub builds from local folders (configs, tokenizer assets); the
    weights files (`*.weights.h5`, `*.weights.json`) are left in the bucket.
    """
    location = storage.parse(url)
    with tempfile.TemporaryDirectory(prefix="shardckpt-preset-") as local:
        for key in storage.list_keys(location):
            if key.endswith((".weights.h5", ".weights.json")):
                continue
            data = storage.read_bytes(location.join(key))
            if data is None:
                continue  # deleted since the listing
            target = os.path.join(local, *key.split("/"))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "wb") as f:
                f.write(data)
        yield local


def build(folder: str, *, dtype: Any = None, cls: Any = None) -> Any:
    """Builds the preset's model under `lazy_init()`; no weights are read.

    Args:
        folder: A local keras-hub preset folder.
        dtype: Overrides the saved dtype policy (keras-hub's `dtype=`); None
            keeps keras-hub's rule (saved floats become Keras' default policy).
        cls: The keras-hub class to build: a `Backbone` or `Task` subclass.
            None: the backbone class registered in `config.json`. A task
            class uses `task.json` when its class fits, as keras-hub does.

    Returns:
        The model, every variable unloaded (a task not yet compiled).

    Raises:
        MissingDependencyError: keras-hub is not installed.
    """
    keras_hub = import_keras_hub(f"The keras-hub preset {folder!r}")
    kwargs: dict[str, Any] = {} if dtype is None else {"dtype": dtype}
    target = keras_hub.models.Backbone if cls is None else cls
    if not hasattr(target, "from_preset"):
        raise TypeError(
            "cls must be a keras-hub Backbone or Task class (with from_preset). "
            f"Received: cls={cls!r}"
        )
    if is_task_class(target):
        # keras-hub tasks compile on construction, and an optimizer's step
        # counter cannot be created unloaded; `from_preset` compiles the task
        # with keras-hub's defaults once its weights are loaded.
        kwargs["compile"] = False
    elif dtype is None:
        config = read_json(folder, CONFIG_FILE)
        if _quantized(config):
            return _build_quantized(config, target, folder)
    with lazy_init():
        return target.from_preset(folder, load_weights=False, **kwargs)


def _quantized(config: dict[str, Any]) -> bool:
    """Whether a backbone config saves a `DTypePolicyMap` (what `quantize()` + `save_to_preset` write)."""
    saved = (config.get("config") or {}).get("dtype")
    return isinstance(saved, dict) and "DTypePolicyMap" in str(saved.get("class_name", ""))


def _build_quantized(config: dict[str, Any], target: Any, folder: str) -> Any:
    """Builds a quantized backbone with the per-layer policies its config saved.

    keras-hub 0.32's `from_preset` forwards a saved `DTypePolicyMap` as the
    map's own default and as every entry's `source_name`, so the layers are
    built unquantized and its own load fails ("Layer 'token_embedding'
    expected 2 variables, but received 0"; keras#21378). Keras' safe
    deserialisation of the same config builds each layer with its saved
    policy (int8 / int4 / float8 variables and scales), as `quantize()` left it
    once each layer gets its own policy from the map (`_keras.resolve_policy_map`).
    """
    import keras

    with lazy_init():
        model = keras.saving.deserialize_keras_object(config, safe_mode=True)
    # Each layer still holds the whole map as its policy, whose
    # `quantization_mode` is None: Keras would save (and look for) no scales.
    _keras.resolve_policy_map(model)
    if not isinstance(model, target):
        raise TypeError(
            f"The preset {folder!r} holds a {type(model).__name__}, not a {target.__name__}. "
            f"Fix: pass cls=None or a matching class. Received: cls={target!r}"
        )
    return model


def is_task_class(cls: Any) -> bool:
    """True for a keras-hub `Task` subclass."""
    if cls is None:
        return False
    keras_hub = import_keras_hub("A keras-hub task class")
    return isinstance(cls, type) and issubclass(cls, keras_hub.models.Task)


def download(handle: str, *, task: bool) -> str:
    """Fetches a keras-hub handle's config and weights files; returns the local folder.

    Uses keras-hub's own download and cache (`kaggle://`, `hf://`,
    `modelscope://`, and its built-in preset names). `preset_utils.get_file`
    is keras-hub's internal downloader; keras-hub has no public API that
    returns a preset's local folder.
    """
    import_keras_hub(f"The preset handle {handle!r}")
    preset_utils = _keras_hub.preset_utils()
    config = preset_utils.get_file(handle, CONFIG_FILE)
    names = [MODEL_WEIGHTS]
    if not preset_utils.check_file_exists(handle, MODEL_WEIGHTS):
        index = preset_utils.get_file(handle, SHARDED_MODEL_WEIGHTS)
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map", {})
        shards = {n for v in weight_map.values() for n in ([v] if isinstance(v, str) else v)}
        names = sorted(shards)
    if task:
        names += [n for n in (TASK_CONFIG_FILE, TASK_WEIGHTS) if preset_utils.check_file_exists(handle, n)]
    for name in names:
        preset_utils.get_file(handle, name)
    return os.path.dirname(config)


def architecture(folder: str) -> Any:
    """The backbone of the keras-hub preset at `folder` (local or in a bucket), built lazily.

    The formats' catalog names it as keras-hub presets' `architecture`, so that
    `convert` takes a preset folder with no model given (its `config.json`
    names the class), as it takes a Hugging Face folder.
    """
    if storage.parse(folder).local_path is None:
        with local_configs(folder) as local:
            return build(local)
    return build(folder)

