"""What each step of `OrbaxCheckpoint` holds beside the arrays.

Keras' model config and assets (full saves), the sharding layout, the user's
`metadata`, the data-iterator positions, and the Orbax context the items are
written with. Config, assets and layout do not change during `fit`: they are
built once when it starts (Keras' callback rebuilds config and assets at
every save: tens of ms on the training thread).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardckpt import _keras
from shardckpt.training import metadata as metadata_lib
from shardckpt.training import saving
from shardckpt.training.counting import BatchCount


class StepContents:
    """The items of a step other than the state's arrays.

    Attributes:
        metadata: The user's JSON dict, or callable `(epoch, logs) -> dict`.
        compression: zstd-compress array chunks (read when a `fit` starts).
        context: The Orbax context of the saves (`saving.json_context`, built
            with the constructor's `compression`).
    """

    def __init__(self, metadata: dict[str, Any] | Callable[[int, dict], dict] | None, *, compression: bool) -> None:
        self.metadata = metadata
        self.compression = compression
        self.context = saving.json_context(compression=compression)
        self._model_config: Any = None
        self._assets: Any = None
        self._layout: dict[str, Any] = {}

    def begin(self, model: Any, *, weights_only: bool) -> None:
        """Builds what stays the same through one `fit`."""
        self._model_config = None if weights_only else _keras.serialize_model_config(model)
        self._assets = None if weights_only else _keras.save_assets(model)
        self._layout = metadata_lib.layout_of(model)

    def user(self, epoch: int, logs: dict) -> Any:
        """The user's metadata of a save in `epoch`."""
        return self.metadata(epoch, logs) if callable(self.metadata) else self.metadata

    def step_metadata(self, count: BatchCount, step: int, *, epoch_complete: bool, save_freq: str | int,
                      monitor: str, weights_only: bool, snapshot: str | None,
                      preemption: bool = False) -> dict[str, Any]:
        """The metadata item read now (see `metadata.step_metadata`)."""
        return metadata_lib.step_metadata(
            count, step, epoch_complete=epoch_complete, save_freq=save_freq, monitor=monitor,
            weights_only=weights_only, layout=self._layout, snapshot=snapshot, preemption=preemption)

    def items(self, tree: dict[str, Any], iterator_states: list[Any] | None) -> dict[str, Any]:
        """The step's items (see `saving.payload`)."""
        return saving.payload(tree, model_config=self._model_config, assets=self._assets,
                              iterator_states=iterator_states)
