"""The public surface is a contract: pin its names and signatures."""

from __future__ import annotations

import inspect as pyinspect
import pkgutil

import keras

import shardckpt
from shardckpt import errors, storage

PUBLIC = {
    "CheckpointInfo",
    "ConvertReport",
    "ExportReport",
    "LayoutPlan",
    "LoadReport",
    "OrbaxCheckpoint",
    "ResumeInfo",
    "VerifyReport",
    "__version__",
    "auto_layout",
    "convert",
    "errors",
    "export",
    "from_preset",
    "inspect",
    "lazy_init",
    "load_sharded",
    "parallelize",
    "restore_latest",
    "verify",
}


def test_all_lists_exactly_the_public_names():
    assert set(shardckpt.__all__) == PUBLIC
    for name in PUBLIC:
        assert hasattr(shardckpt, name), name


def test_functions_not_shadowed_by_submodules():
    # `shardckpt.convert` / `shardckpt.inspect` are the functions, not modules.
    for name in ("convert", "inspect", "verify", "auto_layout", "parallelize", "load_sharded", "from_preset", "export"):
        assert callable(getattr(shardckpt, name)) and pyinspect.isfunction(getattr(shardckpt, name)), name


def test_no_subpackage_has_the_name_of_a_public_name():
    # A subpackage named like a public function is shadowed by it in `shardckpt`'s
    # namespace: `import shardckpt.<name>.x` and `shardckpt.<name>` then mean two
    # things, and which one wins depends on import order.
    # (`errors` is public as the module itself, so it shadows nothing.)
    submodules = {m.name for m in pkgutil.iter_modules(shardckpt.__path__)}
    shadowed = {name for name in submodules & set(shardckpt.__all__) if not pyinspect.ismodule(getattr(shardckpt, name))}
    assert not shadowed, shadowed


# What README tells users to call below the top level: pinned as the top level is.
STORAGE_PUBLIC = {"deadline", "Deadline", "Location", "parse"}


def test_storage_deadline_is_declared_public():
    assert STORAGE_PUBLIC <= set(storage.__all__)
    for name in storage.__all__:
        assert hasattr(storage, name), name
    p = _params(storage.deadline)
    for kw in ("timeout", "retries"):
        assert p[kw].kind is pyinspect.Parameter.KEYWORD_ONLY, kw
    with storage.deadline(timeout=600, retries=8) as d:  # README's own call
        assert isinstance(d, storage.Deadline)


def _params(fn) -> dict[str, pyinspect.Parameter]:
    return dict(pyinspect.signature(fn).parameters)


def test_signatures_match_the_design():
    p = _params(shardckpt.load_sharded)
    assert list(p)[:2] == ["model", "path"]
    for kw, default in (("layout", None), ("strict", True), ("max_inflight_bytes", None), ("progress", None)):
        assert p[kw].kind is pyinspect.Parameter.KEYWORD_ONLY and p[kw].default == default, kw

    p = _params(shardckpt.from_preset)
    assert list(p)[:1] == ["preset"]
    for kw in ("mesh", "layout", "dtype", "cls", "max_inflight_bytes"):
        assert p[kw].kind is pyinspect.Parameter.KEYWORD_ONLY and p[kw].default is None, kw

    p = _params(shardckpt.auto_layout)
    assert list(p)[:2] == ["model", "mesh"]
    assert {"model_axis", "batch_axis", "rules"} <= set(p)
    assert p["model_axis"].default == "model"

    p = _params(shardckpt.parallelize)
    assert list(p)[:2] == ["model", "mesh"] and p["mesh"].default is None
    assert {"devices", "model_axis", "batch_axis", "rules"} <= set(p)

    p = _params(shardckpt.convert)
    assert list(p)[:2] == ["src", "dst"]
    for kw in ("layout", "mesh", "dtype", "max_inflight_bytes", "progress", "force", "compression"):
        assert p[kw].kind is pyinspect.Parameter.KEYWORD_ONLY, kw
    assert p["max_inflight_bytes"].default is None  # the host's default (shardckpt.budget)

    p = _params(shardckpt.export)
    assert list(p)[:2] == ["model", "dst"]
    for kw, default in (("format", "hf"), ("max_shard_size", None), ("dtype", None), ("max_inflight_bytes", None),
                        ("progress", None), ("overwrite", False)):
        assert p[kw].kind is pyinspect.Parameter.KEYWORD_ONLY and p[kw].default == default, kw

    p = _params(shardckpt.restore_latest)
    assert list(p)[:2] == ["model", "directory"]
    for kw, default in (("data_iterator", None), ("strict", True), ("max_inflight_bytes", None)):
        assert p[kw].kind is pyinspect.Parameter.KEYWORD_ONLY and p[kw].default == default, kw
    assert list(_params(shardckpt.inspect))[:1] == ["path"]
    for name in ("explain", "layout_map", "distribution", "bytes_per_device", "validate", "to_json", "from_json"):
        assert callable(getattr(shardckpt.LayoutPlan, name)), name


def test_callback_is_a_drop_in_for_keras():
    assert issubclass(shardckpt.OrbaxCheckpoint, keras.callbacks.Callback)
    ours = _params(shardckpt.OrbaxCheckpoint.__init__)
    theirs = _params(keras.callbacks.OrbaxCheckpoint.__init__)
    for name, param in theirs.items():
        if name in ("self", "kwargs"):
            continue
        assert name in ours, f"keras.callbacks.OrbaxCheckpoint takes {name!r}; ours must too"
        assert ours[name].kind is param.kind, name  # same position: positional calls work
        # Every default is Keras' own (max_to_keep=1 included).
        assert ours[name].default == param.default, name
    own = ("keep_best", "keep_period", "metadata", "data_iterator", "resume")
    # Keras' callback never restores: ours neither, unless asked.
    assert _params(shardckpt.OrbaxCheckpoint.__init__)["resume"].default is False
    assert set(own) <= set(ours)
    assert callable(shardckpt.OrbaxCheckpoint.wait_until_finished)


def test_every_error_subclasses_a_builtin():
    found = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.ShardckptError)]
    assert len(found) >= 10
    for cls in found:
        if cls is errors.ShardckptError:
            continue
        builtin = [b for b in cls.__mro__ if b.__module__ == "builtins" and b not in (object, BaseException, Exception)]
        assert builtin, f"{cls.__name__} subclasses no built-in error"
