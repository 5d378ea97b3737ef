"""Runs keras-hub's own Hugging Face converter against a loader that reads nothing.

keras-hub converts a Hugging Face folder with one module per architecture
(`keras_hub/src/utils/transformers/convert_<arch>.py`): `convert_weights(
backbone, loader, config)` calls `loader.port_weight(variable, hf_key,
hook_fn)`, or `loader.get_tensor(hf_key)` and then `variable.assign(value)`
for values it combines itself (stacked MoE experts). `RecordingLoader` is
such a loader whose tensors are `hf_remap.Tensor`s (positions, no data): the
converter runs unchanged, and what it assigns to each variable is recorded
as an index remap of the stored tensors. Tensor names and per-tensor
transforms are therefore keras-hub's, for every architecture it converts,
never retyped here.

Key lookup (a `model.` prefix present or not, BERT's `bert.` prefix) reuses
keras-hub's own `SafetensorLoader.get_prefixed_key`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, Self

from shardckpt import _keras_hub
from shardckpt.formats.base import ArraySpec
from shardckpt.formats.hf_remap import Strided, Tensor, Unsupported


class MissingTensorError(KeyError):
    """The converter asked for a tensor the folder does not hold."""


class ConversionProblems(ValueError):
    """Tensors the converter needs that the folder lacks, or holds in another shape.

    Collected over the whole conversion and raised once (`record`), so one
    error lists every difference between the model and the folder.

    Attributes:
        missing: `"<variable path> (Hugging Face tensor '<key>')"` per tensor
            the folder lacks.
        mismatched: One line per variable whose tensor has another shape:
            the variable, the tensor, expected and found shapes.
    """

    def __init__(self, missing: list[str], mismatched: list[str]) -> None:
        super().__init__("; ".join([*missing, *mismatched]))
        self.missing = missing
        self.mismatched = mismatched


class RecordingLoader:
    """keras-hub's `SafetensorLoader` interface, recording instead of reading.

    Args:
        preset: The folder (some converters look at `loader.preset`).
        stored: Every stored tensor's key and spec.
        safetensor_config: The `model.safetensors.index.json` content, if any
            (some converters inspect it).
    """

    def __init__(self, preset: str, stored: Mapping[str, ArraySpec], safetensor_config: Any = None) -> None:
        self.preset = preset
        self.prefix: str | None = None
        self.safetensor_config = safetensor_config
        self._stored = stored
        self.assigned: dict[int, tuple[Any, Tensor]] = {}
        self.used: set[str] = set()
        self.missing: list[str] = []
        self.mismatched: list[str] = []

    def get_prefixed_key(self, hf_weight_key: str, dict_like: Any) -> str:
        # keras-hub's resolution (exact, cached prefix, then suffix match),
        # called on this object: it only reads and sets `self.prefix`.
        return _keras_hub.safetensor_loader().get_prefixed_key(self, hf_weight_key, dict_like)

    def get_tensor(self, hf_weight_key: str) -> Tensor:
        key = self.get_prefixed_key(hf_weight_key, self._stored)
        spec = self._stored.get(key)
        if spec is None:
            raise MissingTensorError(f"no tensor {hf_weight_key!r} in {self.preset!r}")
        return Strided.stored(key, spec.dtype, tuple(spec.shape))

    def port_weight(self, keras_variable: Any, hf_weight_key: str, hook_fn: Any = None) -> None:
        # Missing tensors and shapes that do not fit are collected, not
        # raised, so that `record` names every one of them at once.
        try:
            value = self.get_tensor(hf_weight_key)
        except MissingTensorError:
            self.missing.append(f"{keras_variable.path} (Hugging Face tensor {hf_weight_key!r})")
            return
        if hook_fn:
            try:
                value = hook_fn(value, list(keras_variable.shape))
            except Unsupported:
                raise
            except ValueError as e:  # a reshape to the variable's shape that cannot be
                self._mismatch(keras_variable, value, f" ({e})")
                return
        self.assign(keras_variable, value)

    def _mismatch(self, variable: Any, value: Tensor, detail: str = "") -> None:
        stored = ", ".join(
            f"{key!r} of shape {tuple(self._stored[key].shape)}" for key in value.sources() if key in self._stored
        )
        self.mismatched.append(
            f"{variable.path}: expected shape {tuple(variable.shape)}, the folder's Hugging Face "
            f"tensor {stored} gives {tuple(value.shape)}{detail}"
        )

    def assign(self, variable: Any, value: Any) -> None:
        if not isinstance(value, Tensor):
            raise Unsupported(
                f"the converter assigns {variable.path!r} a value computed on the host "
                f"({type(value).__name__}), not a remap of stored tensors"
            )
        if tuple(value.shape) != tuple(variable.shape):
            self._mismatch(variable, value)
            return
        self.assigned[id(variable)] = (variable, value)
        self.used.update(value.sources())

    # keras-hub's loader is a context manager (an ExitStack of open files).
    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


@contextlib.contextmanager
def _assigns_recorded(model: Any, loader: RecordingLoader) -> Iterator[None]:
    # Converters assign combined values with `variable.assign(...)` directly.
    # An instance attribute shadows the method for this model's variables
    # only, while the converter runs; nothing global is patched.
    variables = list(model.weights)
    for v in variables:
        v.assign = lambda value, _v=v: loader.assign(_v, value)
    try:
        yield
    finally:
        for v in variables:
            del v.assign


def record(model: Any, converter: Any, preset: str, config: dict, stored: Mapping[str, ArraySpec],
           safetensor_config: Any = None) -> RecordingLoader:
    """Runs `converter.convert_weights` on `model` and returns what it assigned.

    Args:
        model: The keras-hub backbone (built lazily: nothing is read or written).
        converter: keras-hub's `convert_<arch>` module for the folder.
        preset: The folder.
        config: Its `config.json`.
        stored: Specs of the folder's tensors.
        safetensor_config: Its safetensors index, if any.

    Returns:
        The loader: `assigned` maps `id(variable)` to `(variable, Tensor)`.

    Raises:
        Unsupported: a hook is not an index remap (e.g. arithmetic on values).
        ConversionProblems: every tensor the converter needs that the folder
            lacks, and every variable its tensor does not fit.
    """
    loader = RecordingLoader(preset, stored, safetensor_config)
    with _assigns_recorded(model, loader):
        try:
            converter.convert_weights(model, loader, config)
        except MissingTensorError as e:  # read outside port_weight: the converter stops here
            loader.missing.append(f"(read by the converter) Hugging Face tensor {e.args[0]}")
        except ValueError as e:
            # A converter's own reshape of a tensor read outside port_weight
            # (stacked experts); reported beside what was found so far.
            if isinstance(e, Unsupported) or not (loader.missing or loader.mismatched):
                raise
            loader.mismatched.append(f"(the converter stopped: {e})")
    if loader.missing or loader.mismatched:
        raise ConversionProblems(loader.missing, loader.mismatched)
    return loader
