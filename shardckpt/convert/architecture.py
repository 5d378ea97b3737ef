"""`load_architecture(spec)`: a model's structure, built lazily, from the command line.

`convert --model` and `plan MODEL` both take `package.module:function` (a
function returning a Keras model) or a `.keras` file, of which only the
config is read (no weights), deserialised with `safe_mode=True` so no lambda
code runs. The model is built under `shardckpt.lazy_init()`: no weight memory.
"""

from __future__ import annotations

import importlib
import json
import zipfile
from typing import Any

from shardckpt import storage
from shardckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, ModelRequiredError
from shardckpt.formats import containers
from shardckpt.lazy import lazy_init


def load_architecture(spec: str) -> Any:
    """Builds a model under `lazy_init()` from `package.module:function` or a `.keras` file.

    A `.keras` file gives its config only (no weights are read), deserialised
    with `safe_mode=True` (no lambda code is run).

    Raises:
        ModelRequiredError: `spec` is neither form, or names nothing.
        CheckpointNotFoundError: the `.keras` file does not exist.
    """
    import keras

    if spec.endswith(".keras"):
        location = storage.parse(spec)
        try:
            source = containers.open_container(location)
        except CheckpointNotFoundError as e:
            raise CheckpointNotFoundError(f"No .keras file at {spec!r}. Fix: check the --model path.") from e
        try:
            # In a bucket: the zip directory and config.json by byte ranges.
            with source.open() as file, zipfile.ZipFile(file) as archive:
                config = json.loads(archive.read("config.json"))
        except (zipfile.BadZipFile, KeyError, json.JSONDecodeError) as e:
            raise CorruptCheckpointError(
                f"{spec!r} holds no readable config.json ({e}); it is not a Keras 3 .keras file "
                "or it is damaged. Fix: pass a file written by model.save(...)."
            ) from e
        finally:
            source.close()
        # The compile config would build an optimizer, whose variables cannot
        # be created lazily; only the weights' architecture is needed.
        config.pop("compile_config", None)
        try:
            with lazy_init():
                built = keras.saving.deserialize_keras_object(config, safe_mode=True)
                if not built.built and config.get("build_config"):
                    built.build_from_config(config["build_config"])
        except (TypeError, ValueError) as e:
            raise ModelRequiredError(
                f"Cannot build the architecture stored in {spec!r}: {e}. Fix: import the module "
                "that registers its custom layers first, or pass --model package.module:function."
            ) from e
        return built
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ModelRequiredError(
            "The model must be given as package.module:function (a function returning a "
            f"Keras model) or as a .keras file. Received: model={spec!r}"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ModelRequiredError(f"Cannot import {module_name!r}: {e}. Received: model={spec!r}") from e
    if not callable(getattr(module, attr, None)):
        raise ModelRequiredError(f"Module {module_name!r} has no function {attr!r}. Received: model={spec!r}")
    with lazy_init():
        return getattr(module, attr)()
