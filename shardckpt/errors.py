"""Typed errors raised by shardckpt.

Every error subclasses a built-in exception so that existing `except
ValueError` / `except FileNotFoundError` code keeps working, and every message
names the checkpoint key or variable path, what was expected, what was found,
and what to do next.
"""

from __future__ import annotations

from collections.abc import Sequence


class ShardckptError(Exception):
    """Base class of every error raised on purpose by shardckpt."""


class CheckpointNotFoundError(ShardckptError, FileNotFoundError):
    """The path does not exist, or an Orbax root holds no committed step."""


class UnknownFormatError(ShardckptError, ValueError):
    """The path exists but is not a checkpoint format shardckpt reads."""


class CorruptCheckpointError(ShardckptError, ValueError):
    """A checkpoint file is truncated, damaged, or its header is invalid."""


class IncompleteCheckpointError(CorruptCheckpointError):
    """An Orbax step was not committed (a save was interrupted)."""


class ChecksumMismatchError(CorruptCheckpointError):
    """An array's bytes do not match the checksum stored beside it."""


class DtypeMismatchError(ShardckptError, TypeError):
    """A checkpoint array's dtype cannot be cast to the variable's dtype."""


class IndivisibleLayoutError(ShardckptError, ValueError):
    """A mesh axis does not divide the dimension it is asked to shard."""


class UnloadedVariableError(ShardckptError, RuntimeError):
    """A variable built under `lazy_init()` was used before it got a value."""


class DestinationExistsError(ShardckptError, FileExistsError):
    """The output path of a conversion or save already exists."""


class StepExistsError(DestinationExistsError, ValueError):
    """A checkpoint step about to be saved is committed already (a `ValueError` too, as Orbax's
    `StepAlreadyExistsError`)."""


class BackgroundSaveError(ShardckptError, RuntimeError):
    """A checkpoint save that ran in the background failed.

    Attributes:
        original: The exception the save raised on its thread.
        step: The step that was being saved (None if not known).
    """

    def __init__(self, message: str, *, original: Exception | None = None, step: int | None = None) -> None:
        super().__init__(message)
        self.original = original
        self.step = step


class ProcessSaveError(ShardckptError, RuntimeError):
    """Another process of a multi-process save failed, or stopped answering;
    the step was not committed on any process.

    Attributes:
        step: The step being saved.
        processes: The indices of the processes that failed.
    """

    def __init__(self, message: str, *, step: int, processes: Sequence[int]) -> None:
        super().__init__(message)
        self.step = step
        self.processes = list(processes)


class CheckpointMismatchError(ShardckptError, ValueError):
    """Checkpoint and model disagree: keys missing, unexpected, or mis-shaped.

    All problems are collected and raised at once, as Keras does for
    `load_weights`, so that one run shows everything that must be fixed.

    Attributes:
        missing: Model variable paths with no array in the checkpoint.
        unexpected: Checkpoint keys that match no model variable.
        mismatched: One line per variable whose shape or dtype is wrong.
        names: Where every layer of the model has a name the user gave
            (`structure.explicit_names`): the layer names only the
            checkpoint's keys hold, and those only the model's hold. None
            where some name was generated.
    """

    def __init__(
        self,
        path: str,
        *,
        missing: Sequence[str] = (),
        unexpected: Sequence[str] = (),
        mismatched: Sequence[str] = (),
        fmt: str = "",
        fix: str | None = None,
        note: str = "",
        names: tuple[Sequence[str], Sequence[str]] | None = None,
    ) -> None:
        """Args: the checkpoint `path`, the problems, the checkpoint's format
        (`LoadReport.format`: selects the advice), optionally the whole fix, a
        `note` said before the problems, and `names` (see Attributes): with
        them, a path-keyed format's advice names the differing layer names
        instead of asking to name the layers."""
        self.path = path
        self.missing = list(missing)
        self.unexpected = list(unexpected)
        self.mismatched = list(mismatched)
        self.names = None if names is None else (list(names[0]), list(names[1]))
        total = len(self.missing) + len(self.unexpected) + len(self.mismatched)
        lines = [f"A total of {total} problem(s) between the model and checkpoint {path!r}:"]
        if note:
            lines.insert(0, note)
        lines += [f"  missing from checkpoint: {p}" for p in self.missing]
        lines += [f"  not in the model: {k}" for k in self.unexpected]
        lines += [f"  mismatch: {m}" for m in self.mismatched]
        lines.append("Fix: " + (fix if fix is not None else _mismatch_fix(self, fmt)))
        super().__init__("\n".join(lines))


# Formats whose keys are variable paths, which hold Keras' generated layer names.
_PATH_KEYED = ("orbax", "safetensors")


def _mismatch_fix(error: CheckpointMismatchError, fmt: str) -> str:
    """The advice that applies to these problems in a checkpoint of `fmt`.

    Each sentence is tested to work (tests/test_fix_hints.py): strict=False
    skips missing and unexpected keys but never a shape mismatch, and only
    path-keyed formats depend on generated layer names.
    """
    if fmt == "hf":
        return (
            "the Hugging Face folder lacks tensors keras-hub's converter for its model_type "
            "reads: config.json (layers, sizes, tied embeddings) describes another model than "
            "the safetensors files hold, or a file is missing. Re-download the complete folder "
            "(config.json with the safetensors files it was saved with)."
        )
    fixes = []
    if (error.missing or error.unexpected) and fmt in _PATH_KEYED and error.names is not None:
        # Every layer is named already: naming them is no fix, the names that differ are.
        fixes += [renaming_fix(*error.names)] if any(error.names) else []
    elif (error.missing or error.unexpected) and fmt in _PATH_KEYED:
        fixes.append(
            "name the model and its layers (name=...), or call keras.backend.clear_session() "
            f"before building: {fmt} keys are variable paths, and auto-generated names "
            "(sequential_1/dense_3) shift with every model built in the process"
        )
    if error.mismatched:
        fixes.append(
            "build the model with the configuration that wrote the checkpoint (layer sizes, "
            "vocabulary, number of layers): shapes must match, strict=False does not skip them"
        )
    else:
        fixes.append(
            "build the same architecture that wrote the checkpoint, or pass strict=False to "
            "load what matches (variables the checkpoint lacks keep their values, or get their "
            "initializer's under lazy_init(); keys the model lacks are ignored)"
        )
    return "; or ".join(fixes) + "."


def renaming_fix(in_checkpoint: Sequence[str], in_model: Sequence[str]) -> str:
    """Advice for a model whose layers are all named, where the names differ from the checkpoint's."""
    from shardckpt.progress import some  # a sibling module; imported here as only this advice needs it

    differ = []
    if in_checkpoint:
        differ.append(f"the checkpoint names layers the model lacks ({some(list(in_checkpoint), 4)})")
    if in_model:
        differ.append(f"the model names layers the checkpoint lacks ({some(list(in_model), 4)})")
    return (
        "rename the model's layers (name=...) to the names the checkpoint was saved with: every layer "
        f"is named already, and {' and '.join(differ)}"
    )


class DuplicateStateKeyError(ShardckptError, ValueError):
    """Two variables of a model's state share a path, the key a state-tree
    (Orbax) checkpoint stores each under: one would overwrite the other.

    Keras' `Model.get_state_tree()` refuses the same. Keras' `Adafactor`
    is the common case: it names its factored slots after the variable's
    short name (`kernel`), not its path.
    """


class LayoutError(ShardckptError, ValueError):
    """A layout request is invalid: an unknown mesh axis, a rule whose axes do
    not fit the variable, a plan that does not match the model or devices."""


class MeshMismatchError(LayoutError):
    """A layout's mesh is not the active distribution's, or covers only some devices.

    Loading there moves every variable off the mesh the model computes on;
    `load_sharded(..., allow_other_mesh=True)` does it on purpose.
    """


class UnplannedVariableError(LayoutError):
    """A layout plan was asked where a variable goes that it has no placement
    for (another architecture, or an instance the plan was not bound to).

    Its message names the variable; the fix is `plan.bind(model)` for an
    instance of the same architecture, or `unknown="replicate"` to opt into
    replicating what the plan does not know.
    """


class UnsupportedURLError(ShardckptError, ValueError):
    """A path is a `scheme://` URL shardckpt cannot read or write there.

    Never taken for a local folder: `s3://bucket/ck` used as a path would
    create `s3:/bucket/ck` on the local disk, and the checkpoint would be lost
    with the machine.
    """


class BucketNotFoundError(ShardckptError, FileNotFoundError):
    """The bucket of a `gs://` / `s3://` URL does not exist."""


class StorageCredentialsError(ShardckptError, PermissionError):
    """No credentials for a bucket were found (environment, default credentials)."""


class StorageAccessDeniedError(ShardckptError, PermissionError):
    """The bucket refused the request (HTTP 403): the credentials lack a permission."""


class StorageTimeoutError(ShardckptError, TimeoutError):
    """A bucket request did not finish within its deadline (no connection, no answer,
    or every retry failed); see `shardckpt.storage.deadline`."""


class ModelRequiredError(ShardckptError, ValueError):
    """Converting needs the model's architecture, which the source file lacks.

    `.weights.h5` and safetensors files store arrays under keys that do not say
    which variable (or whether trainable) each one is; a `.keras` file carries
    its architecture, other sources need `model=` / `--model`.
    """


class MissingDependencyError(ShardckptError, ImportError):
    """An optional dependency (keras-hub) is needed for this input and not installed."""


class UnsupportedModelError(ShardckptError, ValueError):
    """A Hugging Face folder whose architecture (or one conversion step) shardckpt cannot map.

    Names the `model_type` or the variable and the step, and what is supported.
    """


class BackendError(ShardckptError, RuntimeError):
    """Keras runs on a backend other than JAX; shardckpt places JAX arrays only."""


class IteratorStateError(ShardckptError, TypeError):
    """A data iterator's `get_state()` returned a value that cannot be stored
    exactly (only bytes, str, numbers, bool, None, lists, tuples and dicts can)."""


class IteratorCountError(ShardckptError, ValueError):
    """A step holds data-iterator positions of another number of processes than this run has.

    Each process's position is stored under its process index; with another
    process count no position belongs to a process unambiguously. The message
    names the counts and the option that decides instead
    (`on_process_count_change="restart_iterators"`).
    """


class IteratorPositionError(ShardckptError, RuntimeError):
    """The data iterator's position does not match the batches `fit` trained on.

    Raised when a save asks for the position after batches the iterator never
    yielded through `OrbaxCheckpoint.batches()`, or when a resume restored the
    iterator from another step than the model. The message names the batch
    counts or the two steps, and the fix.
    """


class ObjectChangedError(ShardckptError, RuntimeError):
    """A bucket object was replaced while it was being read.

    Every read of a load is pinned to the version its first read saw (the
    object generation on GCS, the ETag on S3); a later read served by another
    version stops the load here instead of mixing old and new bytes.

    Attributes:
        url: The object.
        expected: The version the load began with (as the store names it).
        found: The version a later read got.
    """

    def __init__(self, message: str, *, url: str = "", expected: str = "", found: str = "") -> None:
        super().__init__(message)
        self.url, self.expected, self.found = url, expected, found


class ConfigurationError(ShardckptError, ValueError):
    """A setting shardckpt cannot use: a `SHARDCKPT_*` environment variable's value, or a combination
    of arguments (two `OrbaxCheckpoint` callbacks of one `fit` with `resume=True`; `resume=True` that
    would start a model over from the beginning when it has trained past the steps it would delete).

    The message names the setting, the value received and the fix.
    """
