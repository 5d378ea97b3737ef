"""Optimizers beyond Adam / SGD through checkpoints and plan estimates.

Keras' `Adafactor` keeps, beside a full-size velocity, factored second
moments (`r`: the variable's shape less its last dimension, `c`: less its
second last) made with `add_variable(name=var.name)`: no layout, and a name
that is the variable's short name (`adafactor/kernel` for both factors of
every kernel; `bias` for the scalar placeholders of 1-D variables). `Muon`
keeps a momentum for every variable and a velocity for those it hands to
AdamW (not 2-D, embeddings, `exclude_layers`).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import shardckpt
from shardckpt import errors
from shardckpt.training import OrbaxCheckpoint, restore_latest
from tests.support import column_then_row_parallel, device_bytes
from tests.zoo import CountingIterator

STEPS = 4


def _regressor(seed: int, make_optimizer, lazy: bool = False) -> keras.Model:
    """x (6) -> hidden (Dense 16) -> head (Dense 1), compiled with `make_optimizer()` (no metrics)."""
    keras.utils.set_random_seed(seed)

    def build() -> keras.Model:
        inputs = keras.Input((6,), name="x")
        h = keras.layers.Dense(16, activation="relu", name="hidden")(inputs)
        return keras.Model(inputs, keras.layers.Dense(1, name="head")(h), name="small")

    if lazy:
        with shardckpt.lazy_init():
            model = build()
    else:
        model = build()
    model.compile(optimizer=make_optimizer(), loss="mse")
    return model


def test_adafactor_state_is_refused_by_name_before_training_and_weights_only_resumes(tmp_path):
    """Adafactor's factored slots share paths (`adafactor/kernel`, four times here), which a state-tree
    checkpoint keys by: the callback refuses at the start of fit with a typed error naming the path, the
    optimizer and the fix (was: a bare ValueError at the first save telling to rename the layers, which
    are all named uniquely). The fix it names, `save_weights_only=True`, saves and resumes."""
    keras.distribution.set_distribution(column_then_row_parallel("hidden", "head"))
    model = _regressor(3, keras.optimizers.Adafactor)
    it = CountingIterator()
    ckpt = OrbaxCheckpoint(str(tmp_path / "full"), save_freq=3, data_iterator=it)
    with pytest.raises(errors.DuplicateStateKeyError) as raised:
        model.fit(ckpt.batches(), steps_per_epoch=STEPS, epochs=1, callbacks=[ckpt], verbose=0)
    message = str(raised.value)
    assert "'adafactor/kernel'" in message and "(6,), (16,), (16,), (1,)" in message
    assert "Adafactor" in message and "save_weights_only=True" in message
    assert int(model.optimizer.iterations.value) == 0  # refused before the first step

    ckpt = OrbaxCheckpoint(str(tmp_path / "weights"), data_iterator=it, save_weights_only=True)
    model.fit(ckpt.batches(), steps_per_epoch=STEPS, epochs=1, callbacks=[ckpt], verbose=0)
    ckpt.wait_until_finished()
    keras.backend.clear_session()
    keras.distribution.set_distribution(column_then_row_parallel("hidden", "head"))
    fresh = _regressor(42, keras.optimizers.Adafactor, lazy=True)
    restore_latest(fresh, str(tmp_path / "weights"))
    for got, want in zip(fresh.weights, model.weights):
        np.testing.assert_array_equal(np.asarray(got.value), np.asarray(want.value), err_msg=want.path)
    # Fresh slots where Keras makes them: the velocity like its variable, the factors (no layout) replicated.
    by_stem = {v.path.replace("/", "_"): v for v in fresh.trainable_variables}
    for slot in fresh.optimizer.variables:
        variable = by_stem.get(slot.name.removesuffix("_velocity"))
        if slot.name.endswith("_velocity"):
            assert slot.value.sharding == variable.value.sharding, slot.path
        else:
            assert set(slot.value.sharding.spec) <= {None}, slot.path



def _mixed() -> keras.Model:
    """An embedding (2-D, "embedding" in its path), a 3-D EinsumDense kernel, Dense kernels and biases."""
    tokens = keras.Input((4,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(32, 64, name="embed")(tokens)
    h = keras.layers.EinsumDense("btd,dhk->bthk", (4, 8, 16), bias_axes="hk", name="heads")(h)
    h = keras.layers.Reshape((4, 128))(h)
    h = keras.layers.Dense(64, name="hidden")(h)
    return keras.Model(tokens, keras.layers.Dense(8, name="head")(h), name="mixed")


@pytest.mark.parametrize(
    ("name", "make_optimizer"),
    [
        ("adafactor", keras.optimizers.Adafactor),
        ("muon", keras.optimizers.Muon),
        (None, lambda: keras.optimizers.Muon(exclude_layers=["hidden"], exclude_embeddings=False)),
        (None, lambda: keras.optimizers.Adafactor(gradient_accumulation_steps=2)),
    ],
    ids=["adafactor", "muon", "muon-options", "adafactor-accumulating"],
)
def test_estimates_of_adafactor_and_muon_equal_what_keras_builds_under_the_plan(name, make_optimizer):
    """`bytes_per_device` counts Adafactor's velocity like each variable and its factors (no layout:
    replicated) whole, and Muon's velocity only where Keras' `_should_use_adamw` says, options read from
    the instance: the estimate equals the per-device bytes of the model and the optimizer built under
    the plan's distribution, less the step and learning rate (was: LayoutError for both). A name counts
    as the optimizer with its defaults."""
    keras.backend.clear_session()
    plan = shardckpt.auto_layout(_mixed(), (1, 8))
    keras.distribution.set_distribution(plan.distribution())
    model = _mixed()
    model.compile(optimizer=make_optimizer(), loss="mse")
    optimizer = model.optimizer
    optimizer.build(model.trainable_variables)
    bound = plan.bind(model)
    own = [v for v in optimizer.variables if v.path.split("/")[-1] in ("iteration", "learning_rate")]
    assert len(own) == 2  # the optimizer's own scalars, not any variable's
    held = device_bytes(model.variables + optimizer.variables) - device_bytes(own)
    assert bound.bytes_per_device(optimizer) == held
    if name is not None:
        assert bound.bytes_per_device(name) == held
    assert bound.bytes_per_device() < held < bound.bytes_per_device("adam") + bound.bytes_per_device()


class _Twin(keras.layers.Layer):
    """Adds `count` vectors of 3, each a weight named "w": with 2, two variables at one path."""

    def __init__(self, count: int, **kwargs):
        super().__init__(**kwargs)
        self.count = count

    def build(self, shape):
        self.ws = [self.add_weight(shape=(3,), name="w", initializer="zeros") for _ in range(self.count)]

    def call(self, x):
        return x + sum(self.ws)


def _twins(count: int, value: float) -> keras.Model:
    model = keras.Sequential([keras.Input((3,)), _Twin(count, name="twin")], name="m")
    for i, w in enumerate(model.layers[0].ws):
        w.assign(np.full(3, value * (i + 1), "float32"))
    return model


def test_restore_and_export_refuse_two_variables_at_one_state_tree_key(tmp_path):
    """A state-tree checkpoint holds one array per path; a model with two variables at `m/twin/w` took
    it into the first and left the second as it was, strict=True passing (was: "Loaded 1 arrays", the
    second variable still 0); an export of that model wrote one of them. Both now refuse by name."""
    shardckpt.export(_twins(1, 1.0), str(tmp_path / "one"), format="orbax")
    model = _twins(2, 0.0)
    with pytest.raises(errors.DuplicateStateKeyError) as raised:
        shardckpt.load_sharded(model, str(tmp_path / "one"))
    message = str(raised.value)
    assert "'m/twin/w'" in message and "(3,), (3,)" in message and ".weights.h5" in message
    assert [np.asarray(w.value).tolist() for w in model.layers[0].ws] == [[0.0] * 3] * 2  # untouched
    with pytest.raises(errors.DuplicateStateKeyError, match="'m/twin/w'"):
        shardckpt.export(model, str(tmp_path / "two"), format="orbax")
    assert not (tmp_path / "two").exists()


def test_restore_of_optimizer_state_into_adafactor_is_refused_and_weights_load_before_compile(tmp_path):
    """Adafactor's factored slots share paths (`adafactor/kernel`): a checkpoint with optimizer state
    cannot fill them one each. load_sharded refuses with the path, the shapes and the fix, strict or not
    (was: a CheckpointMismatchError listing 18 keys); the fix it names, loading before compile(), loads
    every weight."""
    source = _regressor(3, keras.optimizers.Adam)
    source.optimizer.build(source.trainable_variables)
    ckpt = OrbaxCheckpoint(str(tmp_path / "adam"), save_freq=1)
    source.fit(np.ones((4, 6), "float32"), np.ones((4, 1), "float32"), epochs=1, callbacks=[ckpt], verbose=0)
    ckpt.wait_until_finished()
    model = _regressor(42, keras.optimizers.Adafactor)
    model.optimizer.build(model.trainable_variables)
    for strict in (True, False):
        with pytest.raises(errors.DuplicateStateKeyError) as raised:
            shardckpt.load_sharded(model, str(tmp_path / "adam"), strict=strict)
        message = str(raised.value)
        assert "'adafactor/kernel'" in message and "(6,), (16,), (16,), (1,)" in message
        assert "Adafactor" in message and "before compile()" in message and ".keras" in message
    plain = keras.models.clone_model(source)  # not compiled yet: no optimizer state to fill
    shardckpt.load_sharded(plain, str(tmp_path / "adam"))
    for got, want in zip(plain.weights, source.weights):
        np.testing.assert_array_equal(np.asarray(got.value), np.asarray(want.value), err_msg=want.path)
