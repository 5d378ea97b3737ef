"""Keras variables <-> checkpoint keys, for each family of formats, and `match`.

- Keras h5 (`.weights.h5`, `.keras`): keys follow Keras' object-graph walk
  (`layers/dense_1/vars/0`), not layer names. Rather than re-deriving that walk,
  `h5_keys` runs Keras' own `saving_lib._save_state` against a store that
  records which variable each layer writes under which key, so the mapping is
  exactly what `model.save_weights` would produce for this Keras version.
- Orbax (Keras' `OrbaxCheckpoint` / `get_state_tree()`): `<collection>/<path>`
  where collection is trainable_variables, non_trainable_variables,
  optimizer_variables or metrics_variables and path is `variable.path`.
- safetensors: `variable.path` (what `{v.path: v for v in model.weights}` gives).
- keras-hub preset folders: `model/<h5 key>` for the backbone's weights file,
  `task/<h5 key>` for `task.weights.h5` (a task's weights outside its
  backbone, named with the backbone's layers skipped, as keras-hub saves them).

Two adjustments to what Keras names:
- LoRA: Keras saves a LoRA-enabled layer's merged kernel (`kernel` property:
  base + A @ B * scale) under the kernel's key, and never the factors. The
  key maps to the base kernel variable, so a lazily built model receives the
  merged kernel there; its factors are not in the checkpoint and keep their
  `enable_lora` initialisation (A random, B zeros), so the model computes
  exactly the saved function and LoRA training can go on. (Keras'
  `load_weights` zeroes both factors, which leaves them with zero gradients.)
- Optimizer: Orbax keys hold the optimizer's generated name
  (`optimizer_variables/adam/...`), which becomes `adam_1` in a process that
  created another optimizer first. `align_optimizer_keys` matches by the path
  under the optimizer when model and checkpoint each have one optimizer.
- Frozen or not: Orbax keys hold the collection, and `trainable` decides it
  (`enable_lora` freezes the base, `backbone.trainable = False` a backbone),
  so the same variable is `non_trainable_variables/<path>` in a checkpoint
  saved frozen and `trainable_variables/<path>` in the model built again.
  Variables match by path whichever of the two collections they sit in, on
  either side (`align_generated_names` treats the two as one). Optimizer
  slots follow trainability: those of a variable that became trainable are
  not in the checkpoint and start fresh; those of a variable that became
  frozen have no target and are skipped (one warning says which).
- Generated layer names: Orbax keys hold `variable.path`, and Keras names an
  unnamed layer by a process-wide counter, so a model built a second time has
  `sequential_2/dense_2/kernel` where the checkpoint has
  `sequential_1/dense_1/kernel`. `align_generated_names` matches such keys by
  structure, as `.weights.h5` keys (the object graph) are immune to names:
  see its docstring. Names the user gave (`layer_3`: `structure.
  explicit_names`) match by name only, counter included.

Keras' `_save_state` walk and `H5IOStore` are private (see `shardckpt._keras`):
there is no public way to ask Keras which key a variable is saved under.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Collection, Iterable, Iterator
from typing import Any

import keras
import numpy as np

from shardckpt import _keras, state, userwarn
from shardckpt.errors import CheckpointMismatchError
from shardckpt.formats.base import Reader, RemappedReader
from shardckpt.formats.registry import FORMATS
from shardckpt.natsort import natural_sorted
from shardckpt.progress import some
from shardckpt.structure import RecordingStore, lora_layers, lora_off, reference_prefixes

# Checkpoint collections that are optional: a weights-only checkpoint lacks
# them, and a model without a built optimizer has nothing to put there.
# ("optimizer/" is where Keras' h5 files keep optimizer variables.)
OPTIONAL_PREFIXES = (*(f"{c}/" for c in state.OPTIONAL_COLLECTIONS), "optimizer/")
# Keras makes object names unique by appending `_<n>` (`adam`, `adam_1`).
_UNIQUIFIED = re.compile(r"_\d+$")
# The same inside a key, at the end of each name ("/" between layers, "_"
# where an optimizer slot embeds its variable's path): `sequential_1/dense_12/kernel`.
_SUFFIXES = re.compile(r"_(\d+)(?=[/_]|$)")
# Both weight collections of a state tree, as one: which of the two holds a
# variable follows its `trainable` flag, which changes between runs.
_WEIGHT_COLLECTION = re.compile(rf"^(?:{'|'.join(state.WEIGHT_COLLECTIONS)})/")
_OPTIMIZER_PREFIX = "optimizer_variables/"
# The roles of a preset's weights files (see `preset_keys`).
PRESET_PREFIXES = ("model/", "task/")


@contextlib.contextmanager
def _optimizers_record_variables(model: Any) -> Iterator[None]:
    # BaseOptimizer.save_own_variables stores `variable.numpy()` (a host copy of
    # the whole optimizer state, and an error for unloaded variables); record
    # the variables themselves, in the same order, instead.
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or not hasattr(optimizer, "variables"):
        yield
        return

    def record(store: Any) -> None:
        for i, variable in enumerate(optimizer.variables):
            store[str(i)] = variable

    optimizer.save_own_variables = record
    try:
        yield
    finally:
        del optimizer.save_own_variables


def h5_keys(model: Any, *, skip: Iterable[Any] = ()) -> dict[str, Any]:
    """Returns `{h5 key: variable}` exactly as Keras' `save_weights` names them.

    A value that is not a variable (a quantized layer's merged kernel, say)
    is recorded as given; `load_sharded` reports such keys as unsupported.

    Args:
        model: The model.
        skip: Objects left out of the walk, as Keras' `objects_to_skip`
            (keras-hub saves a task's own weights with its backbone's layers
            skipped).
    """
    store = RecordingStore()
    with _optimizers_record_variables(model), lora_off(model):
        _keras.save_state(model, store, skip=skip)
    return store.records


def is_task(model: Any) -> bool:
    """True for a keras-hub task: a model holding a `backbone` model."""
    backbone = getattr(model, "backbone", None)
    return isinstance(backbone, keras.Model) and backbone is not model


def preset_keys(model: Any) -> dict[str, Any]:
    """Returns `{preset key: variable}` for a keras-hub preset folder.

    A backbone's keys are its h5 keys behind `model/`; a task's are its
    backbone's behind `model/` and its other weights (named as keras-hub's
    `save_task_weights` does, backbone layers skipped) behind `task/`.
    """
    if not is_task(model):
        return {f"model/{k}": v for k, v in h5_keys(model).items()}
    backbone = model.backbone
    out = {f"model/{k}": v for k, v in h5_keys(backbone).items()}
    out.update({f"task/{k}": v for k, v in h5_keys(model, skip=list(backbone._flatten_layers())).items()})
    return out


def align_optimizer_keys(wanted: dict[str, Any], stored: Iterable[str]) -> dict[str, Any]:
    """Renames the model's optimizer keys to the checkpoint's optimizer name.

    Orbax state-tree keys of optimizer variables are
    `optimizer_variables/<optimizer name>/<variable>`, and the name is
    generated (`adam`, `adam_1`, ...). When the model's keys and the
    checkpoint's each hold exactly one optimizer name and the two differ only
    in Keras' uniquifying suffix (`adam` / `adam_3`), the model's keys take
    the checkpoint's name, so variables match by their path under the
    optimizer. Otherwise (another optimizer class: `adam` / `sgd`) `wanted` is
    returned as is, and the difference is reported key by key.
    """
    prefix = "optimizer_variables/"

    def names(keys: Iterable[str]) -> set[str]:
        return {k[len(prefix) :].split("/", 1)[0] for k in keys if k.startswith(prefix) and "/" in k[len(prefix) :]}

    ours, theirs = names(wanted), names(stored)
    if len(ours) != 1 or len(theirs) != 1 or ours == theirs:
        return wanted
    mine, saved = ours.pop(), theirs.pop()
    if _UNIQUIFIED.sub("", mine) != _UNIQUIFIED.sub("", saved):
        return wanted
    old, new = f"{prefix}{mine}/", f"{prefix}{saved}/"
    return {(new + k[len(old) :] if k.startswith(old) else k): v for k, v in wanted.items()}


@dataclasses.dataclass(frozen=True)
class _Identity:
    """What a key says about its variable whatever names Keras generated.

    Attributes:
        pattern: The key without the `_<n>` counters of generated names nor
            its weight collection: the same for every build of a model, frozen
            or not. Explicit names (`layer_3`) stay whole.
        order: The counters of its generated names, 0 where a name has none
            (`dense` before `dense_1`): Keras hands them out in creation order.
    """

    pattern: str
    order: tuple[int, ...]


def _name_identity(key: str, explicit: Collection[str]) -> _Identity:
    """The identity of a key read name by name ("/" between names)."""
    parts, order = [], []
    for part in _WEIGHT_COLLECTION.sub("weights/", key).split("/"):
        if part in explicit:
            parts.append(part)
            continue
        parts.append(_SUFFIXES.sub("", part))
        order.extend([int(n) for n in _SUFFIXES.findall(part)] or [0])
    return _Identity("/".join(parts), tuple(order))


def _identities(keys: Iterable[str], explicit: Collection[str]) -> dict[str, _Identity]:
    """`{key: identity}`; an optimizer slot's from the variable it was made from.

    A slot's name embeds its variable's path with "_" for "/"
    (`optimizer_variables/adam/layer_3_kernel_momentum`), where a name's own
    "_" cannot be told from a separator: the slot takes its variable's
    identity (the variable's key on the same side, found by the longest
    prefix), so an explicit name stays whole in it too.
    """
    keys = list(keys)
    weights = {_stem(k): k for k in keys if _WEIGHT_COLLECTION.match(k)}
    out: dict[str, _Identity] = {}
    for key in keys:
        owner = _owner_stem(key, weights)
        if owner is None:
            out[key] = _name_identity(key, explicit)
            continue
        _, optimizer, name = key.split("/", 2)
        of = _name_identity(weights[owner], explicit)
        slot = name[len(owner) + 1 :]
        pattern = f"{_OPTIMIZER_PREFIX}{_UNIQUIFIED.sub('', optimizer)}/{_stem(of.pattern)}_{slot}"
        out[key] = _Identity(pattern, of.order)
    return out


def _owner_stem(slot_key: str, stems: Collection[str]) -> str | None:
    """The stem (`_stem`) of the variable the optimizer slot `slot_key` was made from, or None.

    Keras names a slot `<optimizer>/<variable path, / -> _>_<slot name>`
    (`BaseOptimizer.add_variable_from_reference`); the longest of `stems`
    its name starts with wins.
    """
    parts = slot_key.split("/", 2)
    if len(parts) < 3 or not slot_key.startswith(_OPTIMIZER_PREFIX):
        return None
    return next((stem for stem in reference_prefixes(parts[2]) if stem in stems), None)


def _differing_names(
    wanted: dict[str, Any], stored: Iterable[str], found: KeyMatch, explicit: Collection[str]
) -> tuple[list[str], list[str]] | None:
    """(layer names only the checkpoint's unexpected keys hold, those only the model's missing
    variables hold), where every layer of the model has a name the user gave; else None.

    Layer names are the parts of a variable path before its variable's own
    name; a state-tree key (Orbax) is read without its collection.
    """
    weights = [v for k, v in wanted.items() if is_variable(v) and not is_optional_key(k, found.format)]
    layers = [v.path.split("/")[:-1] for v in weights]
    if not layers or not all(parts and all(p in explicit for p in parts) for parts in layers):
        return None
    state_keyed = FORMATS[found.format].keys == "state" if found.format in FORMATS else False

    def parts(key: str) -> list[str]:
        return (key.split("/", 1)[-1] if state_keyed else key).split("/")[:-1]

    ours = {p for path in layers for p in path}
    theirs = {p for key in stored if not is_optional_key(key, found.format) for p in parts(key)}
    # Optimizer and metric keys name no layer (`optimizer_variables/adam/...`): not a layer name.
    only_theirs = {p for key in found.unexpected if not is_optional_key(key, found.format) for p in parts(key)} - ours
    only_ours = {p for _, v in found.missing for p in v.path.split("/")[:-1]} - theirs
    return natural_sorted(only_theirs), natural_sorted(only_ours)


def align_generated_names(wanted: dict[str, Any], reader: Reader, explicit: Collection[str]) -> dict[str, Any]:
    """Renames the model's keys whose generated names differ from the checkpoint's.

    Keys are grouped by their pattern: the key without the `_<n>` counters
    Keras appends to generated names (`trainable_variables/sequential/dense/
    kernel`). Only generated names lose their counter: a name in `explicit`
    (one the user gave, `structure.explicit_names`) stays whole, so keys of
    explicitly named layers match by name only, as Keras' own `load_weights`
    matches them (`layer_3` never takes `layer_1`'s weights because both
    have one shape). An optimizer slot is grouped by its variable's pattern.
    The pattern carries the collection (trainable and non-trainable
    variables count as one: a variable frozen on one side sits in the other
    collection), the layer classes along the path (a generated name is the
    class name in snake case), the explicit names and the variable name. In
    a group where model and checkpoint hold the same keys, nothing changes.
    In a group where they differ, the model's keys and the checkpoint's are
    paired in creation order (the generated names' counters, oldest first:
    the position in the model), and renamed only if the counts are equal
    and every pair has the same shape and dtype. Anything else is left as
    it is and reported by `match` (another architecture: missing and
    unexpected keys, each named).

    Args:
        wanted: `{key: variable}` of the model.
        reader: The checkpoint.
        explicit: The names in the model's paths that were given, not
            generated (`structure.explicit_names(model)`).
    """
    stored = list(reader.keys())
    theirs: dict[str, list[tuple[tuple[int, ...], str]]] = {}
    for key, identity in _identities(stored, explicit).items():
        theirs.setdefault(identity.pattern, []).append((identity.order, key))
    ours: dict[str, list[tuple[tuple[int, ...], str]]] = {}
    for key, identity in _identities(wanted, explicit).items():
        ours.setdefault(identity.pattern, []).append((identity.order, key))
    renames: dict[str, str] = {}
    for pattern, mine in ours.items():
        saved = theirs.get(pattern, [])
        if {k for _, k in saved} == {k for _, k in mine} or len(saved) != len(mine):
            continue
        pairs = [(key, other) for (_, key), (_, other) in zip(sorted(mine), sorted(saved))]
        if all(_same_array(wanted[key], reader.spec(other)) for key, other in pairs):
            renames.update(pairs)
    if not renames:
        return wanted
    return {renames.get(key, key): variable for key, variable in wanted.items()}


def _same_array(variable: Any, spec: Any) -> bool:
    if not is_variable(variable):
        return False
    return tuple(spec.shape) == tuple(variable.shape) and np.dtype(spec.dtype) == np.dtype(variable.dtype)


def state_keys(model: Any, *, held: Iterable[str] | None = None, loading: bool = False) -> dict[str, Any]:
    """Returns `{state-tree key: variable}` as `model.get_state_tree()` nests them.

    Args:
        model: The model.
        held: The collections a checkpoint holds (or is to hold); None: all.
            Only these must key each variable once: an Adafactor model's
            optimizer slots share paths, which does not matter to a
            weights-only checkpoint.
        loading: Said for a restore (`state.check_unique_paths`).

    Raises:
        DuplicateStateKeyError: Two variables of a collection in `held` share
            a path: one key cannot hold both (a restore would fill one and
            leave the other, an export would write one).
    """
    groups = state.collections(model)
    wanted = groups if held is None else {k: v for k, v in groups.items() if k in set(held)}
    state.check_unique_paths(wanted, getattr(model, "optimizer", None), loading=loading)
    out: dict[str, Any] = {}
    for name, variables in groups.items():
        for variable in variables:
            out.setdefault(f"{name}/{variable.path}", variable)
    return out


def path_keys(model: Any) -> dict[str, Any]:
    """Returns `{variable.path: variable}` for every model weight (safetensors)."""
    return {v.path: v for v in model.weights}


def keys_for(model: Any, fmt: str, stored: Iterable[str] | None = None) -> dict[str, Any]:
    """Returns the key -> variable map for checkpoint format `fmt` (its naming: `Format.keys`).

    Args:
        model: The model.
        fmt: The checkpoint's format.
        stored: The checkpoint's keys, when loading it: a state-tree
            checkpoint's collections are then checked to key each variable
            once (`state_keys`).
    """
    naming = FORMATS[fmt].keys if fmt in FORMATS else fmt
    if naming == "h5":
        return h5_keys(model)
    if naming == "preset":
        return preset_keys(model)
    if naming == "state":
        if stored is None:
            return state_keys(model)
        return state_keys(model, held={collection(k) for k in stored}, loading=True)
    return path_keys(model)  # safetensors; "hf" readers key variables by path too


def is_variable(value: Any) -> bool:
    return isinstance(value, keras.Variable)


def _in_file(key: str) -> str:
    """`key` without a preset's `model/` / `task/` part: the key inside its h5 file."""
    for prefix in PRESET_PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix) :]
    return key


def collection(key: str, fmt: str = "") -> str:
    """The group a key belongs to (`optimizer`, `trainable_variables`, `task/optimizer`...)."""
    if fmt == "preset":
        head, _, rest = key.partition("/")
        return f"{head}/{rest.split('/', 1)[0]}"
    return key.split("/", 1)[0]


def is_optional_key(key: str, fmt: str = "") -> bool:
    """True for optimizer/metric keys, which a model may legitimately lack."""
    return (_in_file(key) if fmt == "preset" else key).startswith(OPTIONAL_PREFIXES)


@dataclasses.dataclass
class KeyMatch:
    """How a checkpoint's keys and a model's variables pair up (`match`).

    Attributes:
        pairs: `(key, variable)` to load, one per variable, shapes equal.
        missing: `(key, variable)` the checkpoint lacks, except keys of an
            optional collection the checkpoint has none of (those are `kept`).
        kept: `(key, variable)` of an optional collection the checkpoint has
            none of (a weights-only checkpoint: the optimizer keeps its state).
        unexpected: Checkpoint keys no variable wants, sorted (then a
            `RemappedReader`'s unexpected stored arrays).
        skipped: Optional checkpoint keys whose collection the model lacks
            entirely (optimizer state into a model without an optimizer), and
            a `RemappedReader`'s skipped stored arrays.
        mismatched: One line per variable that cannot be loaded from its key:
            shapes differ, or the layer saves a computed value.
        fresh: `(key, variable)` of optimizer slots the checkpoint cannot
            hold: their variable was frozen when it was saved and is
            trainable now (they keep their values, or start from their
            initializer under `lazy_init()`).
        format: The checkpoint's format (`Reader.format`), for the error's advice.
        fix: Advice replacing the format's generic one (see `CheckpointMismatchError`).
        note: A line said before the problems.
        names: `CheckpointMismatchError.names`: set where keys are missing
            or unexpected and every layer of the model is named by the user.
        miscounted: One line per group of positional keys (Keras h5: a
            layer's or the optimizer's `vars/0`, `vars/1`, ...) that holds
            another number of arrays in the checkpoint than in the model;
            none of its keys is paired (`_unpair_miscounted`).
    """

    pairs: list[tuple[str, Any]] = dataclasses.field(default_factory=list)
    missing: list[tuple[str, Any]] = dataclasses.field(default_factory=list)
    kept: list[tuple[str, Any]] = dataclasses.field(default_factory=list)
    unexpected: list[str] = dataclasses.field(default_factory=list)
    skipped: list[str] = dataclasses.field(default_factory=list)
    mismatched: list[str] = dataclasses.field(default_factory=list)
    fresh: list[tuple[str, Any]] = dataclasses.field(default_factory=list)
    format: str = ""
    fix: str | None = None
    note: str = ""
    names: tuple[list[str], list[str]] | None = None
    miscounted: list[str] = dataclasses.field(default_factory=list)

    def missing_lines(self) -> list[str]:
        """`missing` as `CheckpointMismatchError` lists it."""
        return [f"{variable.path} (key {key!r})" for key, variable in self.missing]

    def raise_if_mismatched(self, path: str, *, strict: bool) -> None:
        """Raises one error listing every problem: mismatches always, missing and
        unexpected keys when `strict`.

        Raises:
            CheckpointMismatchError: naming each key and variable.
        """
        if self.mismatched or (strict and (self.missing or self.unexpected)):
            raise CheckpointMismatchError(
                path,
                missing=self.missing_lines() if strict else (),
                unexpected=self.unexpected if strict else (),
                mismatched=self.mismatched,
                fmt=self.format,
                fix=self.fix,
                note=self.note,
                names=self.names,
            )


def match(wanted: dict[str, Any], reader: Reader, *, explicit: Collection[str]) -> KeyMatch:
    """Pairs the model's keys (`keys_for`, or a subset) with the checkpoint's.

    Reads metadata only (`reader.spec`). A variable saved under two keys (a
    shared layer) is loaded once. Optimizer keys match whatever name the
    optimizer was given (`align_optimizer_keys`), and Orbax keys whatever
    names Keras generated for the layers (`align_generated_names`); names in
    `explicit` (`structure.explicit_names(model)`) match by name only.
    """
    fmt = reader.format
    stored_keys = list(reader.keys())
    stored = set(stored_keys)
    # Each variable's key as the model names it (its collection: trainable now or not).
    model_keys = {id(v): k for k, v in reversed(list(wanted.items()))}
    wanted = align_optimizer_keys(wanted, stored)
    if fmt == "orbax":
        wanted = align_generated_names(wanted, reader, explicit)
    collections_stored = {collection(k, fmt) for k in stored}
    result = KeyMatch(format=fmt)
    seen: set[int] = set()
    for key, variable in wanted.items():
        if not is_variable(variable):
            result.mismatched.append(
                f"{key}: the layer saves a computed value here (quantized or LoRA "
                "layer), which load_sharded cannot place; load it with "
                "model.load_weights"
            )
            continue
        if key not in stored:
            if id(variable) not in seen:
                absent = is_optional_key(key, fmt) and collection(key, fmt) not in collections_stored
                (result.kept if absent else result.missing).append((key, variable))
            continue
        stored.discard(key)
        if id(variable) in seen:
            continue
        seen.add(id(variable))
        spec = reader.spec(key)
        if tuple(spec.shape) != tuple(variable.shape):
            result.mismatched.append(
                f"{variable.path}: checkpoint {key!r} has shape {tuple(spec.shape)}, "
                f"the variable {tuple(variable.shape)}"
            )
            continue
        result.pairs.append((key, variable))
    for key in natural_sorted(stored):
        group = collection(key, fmt)
        if is_optional_key(key, fmt) and not any(collection(k, fmt) == group for k in wanted):
            result.skipped.append(key)
        else:
            result.unexpected.append(key)
    if isinstance(reader, RemappedReader):
        # Keys that are variables (a Hugging Face folder): the stored arrays
        # none of them is made of are listed as a reader of stored names lists them.
        unread = reader.unread()
        result.unexpected += unread.unexpected
        result.skipped = natural_sorted([*result.skipped, *unread.skipped])
        if unread.unexpected:
            result.fix = unread.fix
    if result.missing or result.unexpected:
        result.names = _differing_names(wanted, stored_keys, result, explicit)
    if fmt == "orbax":
        _follow_trainability(result, model_keys, reader.keys())
    if result.unexpected or result.skipped:  # (Orbax: scales are non-trainable variables)
        _refuse_quantized_into_float(result, reader)
    if fmt in FORMATS and FORMATS[fmt].keys in ("h5", "preset"):
        _unpair_miscounted(result, wanted, stored_keys, reader)
    return result


def _position_group(key: str) -> str | None:
    """The group of a positional h5 key (`layers/dense/vars/1` -> `layers/dense/vars`), else None."""
    group, _, index = key.rpartition("/")
    return group if group and index.isdigit() else None


def _positions(keys: Iterable[str]) -> dict[str, set[str]]:
    """`{group: its positions}` of the positional keys among `keys`."""
    out: dict[str, set[str]] = {}
    for key in keys:
        group = _position_group(key)
        if group is not None:
            out.setdefault(group, set()).add(key)
    return out


def _indices(keys: Iterable[str]) -> set[str]:
    return {key.rsplit("/", 1)[1] for key in keys}


def _float_into_quantized(result: KeyMatch, reader: Reader) -> set[str]:
    """Groups where a stored float array is paired with an integer variable: a quantized model
    built for a float checkpoint. Their count differs (the scales), but the load's dtype check
    refuses them with the better fix (load the float model, then `quantize()`), so they stay paired."""
    groups = set()
    for key, variable in result.pairs:
        group = _position_group(key)
        if group is not None and np.dtype(variable.dtype).kind in "iu" and np.dtype(reader.spec(key).dtype).kind == "f":
            groups.add(group)
    return groups


def _unpair_miscounted(result: KeyMatch, wanted: dict[str, Any], stored: Iterable[str], reader: Reader) -> None:
    """Pairs no key of a group whose number of arrays differs between model and checkpoint.

    Keras saves a layer's variables (and an optimizer's) by position only
    (`vars/0`, `vars/1`, ...: `Layer.save_own_variables`). When the two sides
    hold another number of them (a `BatchNormalization(center=False)` against
    a checkpoint with `beta`, an optimizer of other slots), equal positions
    are not the same variables: pairing them loads `beta` into
    `moving_mean`. Keras' `load_weights` refuses such a layer (skips it with
    `skip_mismatch=True`) and skips such an optimizer with a warning; here
    the group's variables become missing (an optimizer's `kept`), its stored
    arrays unexpected, and `miscounted` names the group, so `strict=True`
    refuses the load and `strict=False` leaves the group as it is, said.
    A float checkpoint meeting a quantized layer (`_float_into_quantized`)
    is left paired: the dtype check refuses it, naming `quantize()`.
    """
    fmt = result.format
    ours, theirs = _positions(wanted), _positions(stored)
    quantizing = _float_into_quantized(result, reader)
    groups = natural_sorted(g for g in ours.keys() & theirs.keys()
                            if _indices(ours[g]) != _indices(theirs[g]) and g not in quantizing)
    if not groups:
        return
    unpaired = [(k, v) for k, v in result.pairs if _position_group(k) in groups]
    result.pairs = [(k, v) for k, v in result.pairs if _position_group(k) not in groups]
    # An optimizer's variables (an optional collection) keep their values as a whole, as
    # Keras' optimizer does when the counts differ; a layer's are missing.
    order = {key: i for i, key in enumerate(wanted)}
    held = sorted([*result.missing, *unpaired], key=lambda pair: order.get(pair[0], len(order)))
    result.missing = [(k, v) for k, v in held if _position_group(k) not in groups or not is_optional_key(k, fmt)]
    result.kept += [(k, v) for k, v in held if _position_group(k) in groups and is_optional_key(k, fmt)]
    result.unexpected = natural_sorted([*result.unexpected, *(k for k, _ in unpaired)])
    for group in groups:
        variables = [wanted[k] for k in natural_sorted(ours[group])]
        names = some([v.path if is_variable(v) else "(a computed value)" for v in variables], 4)
        result.miscounted.append(
            f"{group}: {len(theirs[group])} stored, {len(ours[group])} in the model ({names})"
        )
    result.note = (
        "Keras stores a layer's (and an optimizer's) variables by position (vars/0, vars/1, ...), and "
        "these groups hold another number of them in the checkpoint than in the model, so no position "
        f"is the same variable and none of them is loaded: {'; '.join(result.miscounted)}."
    )


def _stem(weight_key: str) -> str:
    """How an optimizer slot embeds its variable (`<collection>/d1/kernel` -> `d1_kernel`)."""
    return weight_key.split("/", 1)[1].replace("/", "_")


def _follow_trainability(result: KeyMatch, model_keys: dict[int, str], stored: Iterable[str]) -> None:
    """Optimizer slots of variables frozen on one side only: fresh, or skipped, said once.

    A variable loaded from the other weight collection than the model puts it
    in changed its `trainable` flag. An optimizer has slots only for trainable
    variables, so one that became trainable has slots the checkpoint lacks
    (they start fresh: `fresh`, not `missing`), and one that became frozen has
    slots in the checkpoint nothing wants (`skipped`, not `unexpected`).
    """
    weights = tuple(f"{c}/" for c in state.WEIGHT_COLLECTIONS)
    thawed: set[str] = set()
    frozen: set[str] = set()
    for key, variable in result.pairs:
        ours = model_keys.get(id(variable), key)
        if not key.startswith(weights) or collection(ours) == collection(key):
            continue
        if collection(ours) == "trainable_variables":
            thawed.add(_stem(ours))
        else:
            frozen.add(_stem(key))
    if not thawed and not frozen:
        return
    our_stems = {_stem(k) for k in model_keys.values() if k.startswith(weights)}
    their_stems = {_stem(k) for k in stored if k.startswith(weights)}
    missing: list[tuple[str, Any]] = []
    for key, variable in result.missing:
        if _owner_stem(model_keys.get(id(variable), key), our_stems) in thawed:
            result.fresh.append((key, variable))
        else:
            missing.append((key, variable))
    result.missing = missing
    unexpected: list[str] = []
    dropped: list[str] = []
    for key in result.unexpected:
        (dropped if _owner_stem(key, their_stems) in frozen else unexpected).append(key)
    result.unexpected = unexpected
    result.skipped = natural_sorted([*result.skipped, *dropped])
    said = []
    if thawed:
        said.append(
            f"trainable now, frozen in the checkpoint: {some(natural_sorted(thawed))}; their "
            f"{len(result.fresh)} optimizer slot(s) are not in it and start fresh"
        )
    if frozen:
        said.append(
            f"frozen now, trainable in the checkpoint: {some(natural_sorted(frozen))}; their "
            f"{len(dropped)} stored optimizer slot(s) are skipped"
        )
    userwarn.warn(
        "Variables changed their trainable flag since the checkpoint was saved (enable_lora, "
        "layer.trainable = ...); their values load by path. " + "; ".join(said) + "."
    )


def _refuse_quantized_into_float(result: KeyMatch, reader: Reader) -> None:
    """Quantized kernels (int8, packed int4) paired with float variables, beside keys the
    model lacks (their scales): a float model built for a quantized checkpoint.

    Casting ints into floats is otherwise allowed (as Keras does); here it would
    load the quantized integers as weights even with `strict=False`, so each
    such variable becomes a mismatch, which is raised whatever `strict` says.
    """
    kept = []
    for key, variable in result.pairs:
        stored = np.dtype(reader.spec(key).dtype)
        if stored.kind in "iu" and np.dtype(variable.dtype).kind == "f":
            result.mismatched.append(
                f"{variable.path}: checkpoint {key!r} holds {stored} (a quantized kernel: the "
                f"checkpoint also has scales the model lacks) for a {variable.dtype} variable. "
                "Fix: build the model with the checkpoint's quantization policy "
                "(dtype='int8_from_float32', 'int4_from_float32', 'int4/128_from_float32', ...), "
                "or from the checkpoint's config (.keras file, preset)"
            )
        else:
            kept.append((key, variable))
    result.pairs = kept


def align_lora(model: Any, wanted: dict[str, Any], stored: Iterable[str]) -> tuple[dict[str, Any], list[Any]]:
    """Matches a LoRA model to a checkpoint of merged kernels (one function, no factors).

    A checkpoint that holds none of a LoRA layer's factors stores its merged
    kernel (Keras' `save_weights`, shardckpt's exports): the factors' keys
    are not wanted (a lazily built factor gets `enable_lora`'s initialisation,
    B zeros). The kernel keeps the model's key: `match` finds it in the other
    weight collection (a plain model's kernel is trainable, a LoRA model's
    base is not) and, from that key, skips the optimizer slots it had while
    trainable.

    Returns:
        `wanted` adjusted, and the factor variables the checkpoint lacks
        (`load_sharded` zeroes those that hold values, as Keras'
        `load_own_variables` does, so the merged kernel is not added to twice).
    """
    stored = set(stored)
    key_of = {id(v): k for k, v in wanted.items() if is_variable(v)}
    drop: set[str] = set()
    absent: list[Any] = []
    for _, _, _, factors in lora_layers(model):
        keys = [key_of[id(f)] for f in factors if id(f) in key_of]
        if any(k in stored for k in keys):
            continue  # the checkpoint holds this layer's factors (and its base kernel unmerged)
        drop.update(keys)
        absent.extend(factors)
    if not absent:
        return wanted, []
    return {k: v for k, v in wanted.items() if k not in drop}, absent
