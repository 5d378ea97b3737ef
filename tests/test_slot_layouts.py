"""Optimizer slots restored into a lazily built model go where their variables go, as Keras puts them.

Keras gives a slot its variable's layout when the optimizer is built
(`add_variable_from_reference(layout=variable._layout)`). A variable built
under `lazy_init()` has no layout until it is loaded, so an optimizer built
before the load (by `restore_latest`, or by the user as the
`CheckpointMismatchError` advice says) asks the distribution for the slot's
own path (`adam/up_kernel_momentum`), which a `LayoutMap` of variable paths
does not match: the slots came back replicated on every device while their
kernels were split, a silent 8x of the optimizer's memory.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import shardckpt
from shardckpt import errors

X = np.random.default_rng(0).standard_normal((16, 8)).astype("float32")
Y = np.random.default_rng(1).standard_normal((16, 8)).astype("float32")


def _build() -> keras.Model:
    inputs = keras.Input((8,))
    x = keras.layers.Dense(16, name="up")(inputs)
    return keras.Model(inputs, keras.layers.Dense(8, name="down")(x), name="m")


def _lazy_compiled() -> keras.Model:
    """`_build()` under `lazy_init()` (no variable has a value or a layout yet), compiled with Adam."""
    with shardckpt.lazy_init():
        model = _build()
    model.compile(optimizer="adam", loss="mse")
    return model


def _layout_map(mesh_shape: tuple[int, int], lora: bool = False) -> keras.distribution.LayoutMap:
    """Column-parallel `up`, row-parallel `down`: an exact path for each kernel, none for the slots
    (with `lora`, `up`'s LoRA factors split along the dimension each shares with the kernel's split)."""
    layout_map = keras.distribution.LayoutMap(keras.distribution.DeviceMesh(mesh_shape, ["batch", "model"]))
    layout_map["up/kernel"] = (None, "model")
    layout_map["down/kernel"] = ("model", None)
    if lora:
        layout_map["up/lora_kernel_a"] = ("model", None)
        layout_map["up/lora_kernel_b"] = (None, "model")
    return layout_map


def _distribution(mesh_shape: tuple[int, int], lora: bool = False) -> keras.distribution.ModelParallel:
    return keras.distribution.ModelParallel(layout_map=_layout_map(mesh_shape, lora), batch_dim_name="batch")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A full-state step of a model built normally under the (1, 8) layout (Keras' own callback),
    with every optimizer variable's value and sharding spec."""
    keras.backend.clear_session()
    keras.distribution.set_distribution(_distribution((1, 8)))
    model = _build()
    model.compile(optimizer="adam", loss="mse")
    directory = tmp_path_factory.mktemp("slots") / "ckpt"
    callback = keras.callbacks.OrbaxCheckpoint(str(directory), save_freq="epoch")
    model.fit(X, Y, epochs=1, batch_size=8, verbose=0, callbacks=[callback])
    callback.wait_until_finished()
    slots = {v.path: (np.asarray(v.value), v.value.sharding.spec) for v in model.optimizer.variables}
    keras.distribution.set_distribution(None)
    return str(directory), slots


def _slot_pairs(model: keras.Model) -> list[tuple[keras.Variable, keras.Variable]]:
    """(slot, its variable) for Adam's momentum and velocity of every trainable variable."""
    slots = {v.path: v for v in model.optimizer.variables}
    prefix = model.optimizer.name  # `adam`, or `adam_1` after another Adam in this process
    return [
        (slots[f"{prefix}/{v.path.replace('/', '_')}_{name}"], v)
        for v in model.trainable_variables
        for name in ("momentum", "velocity")
    ]


def _assert_slots_follow(model: keras.Model) -> None:
    for slot, variable in _slot_pairs(model):
        assert slot.value.sharding == variable.value.sharding, slot.path


def _assert_restored(model: keras.Model, saved_slots: dict) -> None:
    assert len(_slot_pairs(model)) == len(saved_slots) - 2  # all but the step counter and the learning rate
    _assert_slots_follow(model)
    for slot in model.optimizer.variables:
        value, _ = saved_slots[slot.path]
        np.testing.assert_array_equal(np.asarray(slot.value), value, err_msg=slot.path)
        assert np.asarray(slot.value).dtype == value.dtype, slot.path


@pytest.mark.parametrize("mesh", [(1, 8), (2, 4)])
@pytest.mark.parametrize("how", ["restore_latest", "build_then_load", "layout_map", "distribution_arg"])
def test_slots_of_a_lazily_built_model_are_sharded_like_their_variables(saved, mesh, how):
    directory, saved_slots = saved
    if how in ("restore_latest", "build_then_load"):
        keras.distribution.set_distribution(_distribution(mesh))
    model = _lazy_compiled()
    if how == "restore_latest":
        shardckpt.restore_latest(model, directory)  # builds the optimizer, then loads
    else:
        model.optimizer.build(model.trainable_variables)
        layout = {"build_then_load": None, "layout_map": _layout_map(mesh), "distribution_arg": _distribution(mesh)}
        report = shardckpt.load_sharded(model, directory, layout=layout[how])
        assert report.missing == [] and report.unexpected == []
    assert tuple(model.get_layer("up").kernel.value.sharding.spec) == (None, "model")
    _assert_restored(model, saved_slots)
    for slot, _ in _slot_pairs(model):  # as Keras placed them when it built the model normally
        assert slot.value.sharding.spec == saved_slots[slot.path][1], slot.path


def test_the_advice_to_build_the_optimizer_first_gives_sharded_slots(saved):
    """The fix `CheckpointMismatchError` names for an unbuilt optimizer, followed to the letter."""
    directory, saved_slots = saved
    keras.distribution.set_distribution(_distribution((1, 8)))
    model = _lazy_compiled()
    with pytest.raises(errors.CheckpointMismatchError) as raised:
        shardckpt.load_sharded(model, directory)
    assert "model.optimizer.build(model.trainable_variables)" in str(raised.value)
    model.optimizer.build(model.trainable_variables)
    shardckpt.load_sharded(model, directory)
    _assert_restored(model, saved_slots)


def test_a_weights_only_step_leaves_fresh_slots_sharded_like_their_variables(tmp_path):
    """`restore_latest` builds the optimizer, and a weights-only step has no slots to load:
    the fresh ones must be created where Keras would put them, not replicated."""
    keras.distribution.set_distribution(_distribution((1, 8)))
    source = _build()
    source.compile(optimizer="adam", loss="mse")
    callback = keras.callbacks.OrbaxCheckpoint(str(tmp_path), save_freq="epoch", save_weights_only=True)
    source.fit(X, Y, epochs=1, batch_size=8, verbose=0, callbacks=[callback])
    callback.wait_until_finished()
    weights = {v.path: np.asarray(v.value) for v in source.weights}

    model = _lazy_compiled()
    shardckpt.restore_latest(model, str(tmp_path))
    for v in model.weights:
        np.testing.assert_array_equal(np.asarray(v.value), weights[v.path], err_msg=v.path)
    pairs = _slot_pairs(model)
    assert len(pairs) == 2 * len(model.trainable_variables)
    for slot, variable in pairs:
        assert slot.value.sharding == variable.value.sharding, slot.path
        np.testing.assert_array_equal(np.asarray(slot.value), np.zeros(slot.shape, slot.dtype), err_msg=slot.path)


def test_slots_stay_sharded_through_training_after_a_lazy_restore(saved):
    directory, saved_slots = saved
    keras.distribution.set_distribution(_distribution((1, 8)))
    model = _lazy_compiled()
    shardckpt.restore_latest(model, directory)
    model.fit(X, Y, epochs=1, batch_size=8, verbose=0)
    _assert_slots_follow(model)
    for slot, _ in _slot_pairs(model):
        assert slot.value.sharding.spec == saved_slots[slot.path][1], slot.path


@pytest.mark.parametrize("lora", [False, True])
def test_a_weights_file_into_a_hand_built_optimizer_leaves_slots_sharded_like_their_variables(tmp_path, lora):
    """An optimizer built by hand before a `.weights.h5` (no optimizer state) is loaded into a lazily
    built model: Keras made its slots by their own paths, replicated; after the load each slot is
    sharded exactly as its variable (a LoRA factor's as its factor), keeps its value, is listed in
    `report.slots_moved`, and later assigns stay on that sharding."""
    source = _build()
    path = str(tmp_path / "m.weights.h5")
    source.save_weights(path)
    keras.distribution.set_distribution(_distribution((1, 8), lora))
    with shardckpt.lazy_init():
        model = _build()
        if lora:
            model.get_layer("up").enable_lora(2)
    model.compile(optimizer="adam", loss="mse")
    model.optimizer.build(model.trainable_variables)
    pairs = _slot_pairs(model)
    before = {slot.path: np.asarray(slot.value) for slot, _ in pairs}

    report = shardckpt.load_sharded(model, path)

    split = [v.path for v in model.trainable_variables if "model" in tuple(v.value.sharding.spec)]
    assert sorted(split) == (["down/kernel", "up/lora_kernel_a", "up/lora_kernel_b"] if lora
                             else ["down/kernel", "up/kernel"])
    assert sorted(report.slots_moved) == sorted(slot.path for slot, v in pairs if v.path in split)
    for slot, variable in pairs:
        assert slot.value.sharding == variable.value.sharding, slot.path
        np.testing.assert_array_equal(np.asarray(slot.value), before[slot.path], err_msg=slot.path)
        assert np.asarray(slot.value).dtype == before[slot.path].dtype, slot.path
        slot.assign(np.ones(slot.shape, slot.dtype))  # as an optimizer update: placed on the slot's layout
        assert slot.value.sharding == variable.value.sharding, slot.path
