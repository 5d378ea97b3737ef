"""`load_architecture(spec)`: a model's structure, built lazily, from the command line.

`convert --model` and `plan MODEL` both take `package.module:function` (a
function returning a Keras model) or a `.keras` file, of which only the
config is read (no weights), deserialised with `safe_mode=True` so no lambda
code runs. The model is built under `shardckpt.lazy_init()`: no weight memory.
`convert(model=...)` also takes the function itself (`build_model`), called
the same way (`built`).
"""

from __future__ import annotations

import importlib
import inspect
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


def built(model: Any) -> Any:
    """`model` itself, or what a zero-argument builder returns, called under `lazy_init()`.

    Args:
        model: A Keras model, or a function (any zero-argument callable that
            is not a model) that builds one.

    Raises:
        ModelRequiredError: a builder that needs arguments, or whose result
            is not a Keras model; anything else without weights.
    """
    if hasattr(model, "trainable_variables"):
        return model
    if not callable(model):
        raise ModelRequiredError(
            "model must be a Keras model or a zero-argument function that builds one. "
            f"Received: model={model!r} (of type {type(model).__name__})"
        )
    name = getattr(model, "__qualname__", repr(model))
    try:
        signature = inspect.signature(model)
    except (TypeError, ValueError):  # builtins and C callables without one: just call
        signature = None
    if signature is not None:
        try:
            signature.bind()
        except TypeError as e:
            raise ModelRequiredError(
                f"model={name} needs arguments ({e}); convert calls a builder with none. Fix: pass "
                "model=lambda: " + f"{name}(...) with its arguments, or the built model. Received: model={model!r}"
            ) from e
    with lazy_init():
        result = model()
    if not hasattr(result, "trainable_variables"):
        raise ModelRequiredError(
            f"model={name} returned {type(result).__name__}, not a Keras model. Fix: return the built "
            f"model from the function. Received: model={model!r}"
        )
    return result
