"""Reading a step back: metadata, iterator position, and `restore_latest`.

Values go into the model through `shardckpt.load_sharded`, which reads each
variable's pieces straight into its current sharding (any mesh), so resuming
on a different topology is the same call.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from shardckpt import storage
from shardckpt.errors import CheckpointNotFoundError, CorruptCheckpointError
from shardckpt.formats.orbax.ondisk import (  # noqa: F401  (the callback's names for them)
    ARRAYS_ITEM,
    ITERATOR_ITEM,
    METADATA_ITEM,
    latest_step_dir,
    read_json_item,
)
from shardckpt.restore import LoadReport, load_sharded
from shardckpt.training.iterators import decode_state
from shardckpt.types import Model, StatefulIterator


@dataclasses.dataclass(kw_only=True)
class ResumeInfo:
    """Where a restored run stands.

    Attributes:
        step: The Orbax step restored.
        path: Its step folder.
        epoch: The epoch (0-based) the save happened in.
        batch: Batches of that epoch done when saved.
        epoch_complete: True for a save at the end of `epoch`.
        total_batches: Batches trained since the run began.
        metadata: The whole metadata item (user's dict under "user").
        iterator_state: The state given to the data iterator (this process's),
            or None.
        report: What `load_sharded` loaded.
    """

    step: int
    path: str
    epoch: int | None
    batch: int | None
    epoch_complete: bool
    total_batches: int | None
    metadata: dict[str, Any]
    iterator_state: Any
    report: LoadReport | None

    @property
    def next_epoch(self) -> int:
        """The epoch `fit` continues with."""
        if self.epoch is None:
            return 0
        return self.epoch + 1 if self.epoch_complete else self.epoch


def iterator_state_for_process(item: Any, process_index: int) -> Any:
    """Picks this process's state out of a saved iterator item."""
    if item is None:
        return None
    states = item.get("process_states") or []
    if process_index >= len(states):
        raise CorruptCheckpointError(
            f"The checkpoint holds iterator states for {len(states)} process(es); this "
            f"is process {process_index}. Fix: resume with the same number of "
            "processes, or set the iterator position yourself."
        )
    # Tagged bytes/tuples (see iterators.encode_state) become themselves again.
    return decode_state(states[process_index])


def build_optimizer(model: Any) -> None:
    """Creates optimizer variables so that their saved values have a target."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and not optimizer.built:
        optimizer.build(model.trainable_variables)


def restore_step(model: Any, step_dir: str, *, data_iterator: Any = None, strict: bool = True) -> ResumeInfo:
    """Restores one step into `model` (and `data_iterator`); see `restore_latest`."""
    import jax

    build_optimizer(model)
    metadata = read_json_item(step_dir, METADATA_ITEM) or {}
    iterator_state = None
    if data_iterator is not None:
        iterator_state = iterator_state_for_process(read_json_item(step_dir, ITERATOR_ITEM), jax.process_index())
    # A weights-only step has no optimizer/metric arrays: those keep their
    # values (such a step cannot resume bit-exactly; documented on the callback).
    strict = strict and not metadata.get("save_weights_only", False)
    # The one call that moves values (switch point for another restore engine).
    report = load_sharded(model, step_dir, strict=strict, progress=False)
    if data_iterator is not None and iterator_state is not None:
        data_iterator.set_state(iterator_state)
    return ResumeInfo(
        step=int(os.path.basename(step_dir)),
        path=step_dir,
        epoch=metadata.get("epoch"),
        batch=metadata.get("batch"),
        epoch_complete=bool(metadata.get("epoch_complete", True)),
        total_batches=metadata.get("total_batches"),
        metadata=metadata,
        iterator_state=iterator_state,
        report=report,
    )


def restore_latest(
    model: Model, directory: str | os.PathLike, *, data_iterator: StatefulIterator | None = None, strict: bool = True
) -> ResumeInfo:
    """Restores the latest committed checkpoint of `directory` outside `fit`.

    Every model, optimizer and metric variable (seed-generator states included)
    gets its saved value in its current sharding, so this works on any mesh.
    The optimizer is built first if needed. With `data_iterator`, its saved
    position (this process's) is set too.

    Example:

    ```python
    model.compile(optimizer="adam", loss="mse")
    info = shardckpt.restore_latest(model, "ckpts/", data_iterator=it)
    print(info.step, info.next_epoch, info.metadata["user"])
    ```

    Args:
        model: A compiled, built Keras model (JAX backend).
        directory: A root written by `OrbaxCheckpoint` (or Keras' callback),
            local or a `gs://` / `s3://` URL (steps there count once their
            `commit_success.txt` exists).
        data_iterator: Optional iterator with `set_state(state)`.
        strict: Passed to `load_sharded`: refuse missing/unexpected arrays.

    Returns:
        A `ResumeInfo`.

    Raises:
        CheckpointNotFoundError: `directory` holds no committed step.
        CheckpointMismatchError, DtypeMismatchError, ...: see `load_sharded`.
    """
    # Classified first: an unsupported scheme:// is refused, never a local folder.
    step_dir = latest_step_dir(storage.parse(directory, what="directory").url)
    if step_dir is None:
        raise CheckpointNotFoundError(
            f"No committed checkpoint step under {os.fspath(directory)!r} (half-written "
            "steps are ignored). Fix: check the directory, or train with "
            "OrbaxCheckpoint first."
        )
    return restore_step(model, step_dir, data_iterator=data_iterator, strict=strict)
