"""The state of layers Keras keeps in asset files, loaded from the checkpoints that hold it.

An adapted `StringLookup`, `IntegerLookup` or `TextVectorization` keeps its
vocabulary in an asset file, not in a variable (keras-hub tokenizers too): a
fresh instance of the model has an empty vocabulary and maps every token to
the out-of-vocabulary index. `keras.saving.load_model` loads those files
from a `.keras` archive (`assets/`) and from an Orbax step ("assets", a
full save of Keras' or shardckpt's `OrbaxCheckpoint`); `load_weights` never
does. `load_sharded` loads them as `load_model` does, through Keras' own
`load_assets` of each layer. A `.weights.h5` (or safetensors, a
weights-only step) holds none: where a layer's vocabulary is still its
constructor's, one WARNING names it and the fix, instead of computing
silently with an empty vocabulary as after Keras' `load_weights`.
"""

from __future__ import annotations

import logging
from typing import Any

import jax

from shardckpt import _keras
from shardckpt.errors import CheckpointMismatchError
from shardckpt.formats import Reader

_log = logging.getLogger("shardckpt")

# Formats whose sources keep assets apart (a keras-hub preset's tokenizer files,
# a Hugging Face folder's tokenizer.json): keras-hub builds those layers from them.
_ASSETS_APART = ("preset", "hf")


def stored_assets(reader: Reader) -> dict[str, Any] | None:
    """The source's asset tree (`{folder: {... file: uint8 array}}`), or None when its format holds none."""
    assets = getattr(reader, "assets", None)
    return assets() if callable(assets) else None


def load_assets(model: Any, reader: Reader, tree: dict[str, Any] | None, *, strict: bool) -> list[str]:
    """Loads `tree` into the layers of `model` as `keras.saving.load_model` does; returns the files loaded.

    With no tree (a weights-only source), warns once naming the layers whose
    asset state is still unset (`_keras.unset_asset_layers`).

    Raises:
        CheckpointMismatchError: a layer's `load_assets` failed on the stored
            files (`strict=True`; warned otherwise).
    """
    if not tree:
        if reader.format not in _ASSETS_APART:
            _say_unset(model, reader)
        return []
    failed, absent = _keras.load_assets(model, tree)
    if failed:
        lines = [f"{name}: load_assets failed: {error}" for name, error in sorted(failed.items())]
        if absent:
            lines.append(f"folders the model's asset layers have and the checkpoint's assets have not: {', '.join(absent)}")
        fix = (
            "load into the architecture the checkpoint was saved from (the same layers, in the same "
            "order, as Keras' load_model would build it), or pass strict=False to load the rest."
        )
        if strict:
            raise CheckpointMismatchError(reader.path, mismatched=lines, fmt=reader.format, fix=fix)
        if jax.process_index() == 0:
            _log.warning(
                "%s %r: the stored assets of %d layer(s) could not be loaded; they keep their state: %s. Fix: %s",
                reader.format, reader.path, len(failed), "; ".join(lines), fix,
            )
    return _files(tree)


def _say_unset(model: Any, reader: Reader) -> None:
    names = _keras.unset_asset_layers(model)
    if names and jax.process_index() == 0:
        _log.warning(
            "%s %r holds no asset files, and layer(s) %s keep their state in them (an adapted "
            "StringLookup / IntegerLookup / TextVectorization vocabulary) and still have the state "
            "they were built with: they compute with an empty vocabulary, as after Keras' load_weights. "
            "Fix: load a `.keras` archive (`model.save(...)`) or a full Orbax save (OrbaxCheckpoint with "
            "save_weights_only=False), or give these layers their vocabulary (the `vocabulary=` argument, "
            "`set_vocabulary` or `adapt`) before or after loading the weights.",
            reader.format, reader.path, ", ".join(repr(n) for n in names),
        )


def _files(tree: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for name, value in sorted(tree.items()):
        out += _files(value, f"{prefix}{name}/") if isinstance(value, dict) else [f"{prefix}{name}"]
    return out
