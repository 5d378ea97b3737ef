"""Names Keras generates never matter for Orbax checkpoints (issue 28 point 2).

A `Sequential` built a second time in one process (a notebook cell run again,
a retry) has `sequential_2/dense_2/kernel` where the checkpoint has
`sequential_1/dense_1/kernel`. Resume, `restore_latest` and `load_sharded` match
such a model by structure, from checkpoints Keras' callback wrote and from
shardckpt's; explicit names still match by name; another architecture is
refused with every problem listed.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import shardckpt
from shardckpt import errors
from tests.support import assert_arrays_equal

X = np.random.default_rng(0).standard_normal((32, 6)).astype("float32")
Y = np.random.default_rng(1).standard_normal((32, 1)).astype("float32")


def _build(widths=(8, 4), dropout: bool = True) -> keras.Model:
    """Unnamed layers and model: every name is generated."""
    keras.utils.set_random_seed(11)
    layers = [keras.Input((6,))]
    for width in widths:
        layers.append(keras.layers.Dense(width, activation="relu"))
    if dropout:
        layers.append(keras.layers.Dropout(0.2))
    layers.append(keras.layers.Dense(1))
    model = keras.Sequential(layers)
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
    return model


def _values(model: keras.Model) -> list[np.ndarray]:
    """Every variable by position: model, optimizer and metric state."""
    variables = model.trainable_variables + model.non_trainable_variables + model.optimizer.variables
    return [np.asarray(v.value) for v in variables + model.metrics_variables]


def _fit(model, epochs, callbacks=(), initial_epoch=0):
    model.fit(X, Y, batch_size=8, epochs=epochs, initial_epoch=initial_epoch, shuffle=False,
              callbacks=list(callbacks), verbose=0)


def test_a_rebuilt_model_resumes_bit_exact_from_a_shardckpt_checkpoint(tmp_path):
    reference = _build()
    _fit(reference, 4)
    want = _values(reference)

    first = _build()
    _fit(first, 2, [shardckpt.OrbaxCheckpoint(str(tmp_path), resume=True)])
    again = _build()  # generated names differ from the checkpoint's
    assert again.trainable_variables[0].path != first.trainable_variables[0].path
    ckpt = shardckpt.OrbaxCheckpoint(str(tmp_path), resume=True)
    _fit(again, 4, [ckpt])
    assert ckpt.resumed is not None and ckpt.resumed.step == 1
    assert again.history.epoch == [2, 3]
    assert_arrays_equal(_values(again), want, "resumed")


def test_a_rebuilt_model_restores_a_keras_written_checkpoint_bit_exact(tmp_path):
    first = _build()
    callback = keras.callbacks.OrbaxCheckpoint(str(tmp_path), save_freq="epoch", save_weights_only=False)
    _fit(first, 2, [callback])
    callback.wait_until_finished()
    saved = _values(first)

    again = _build()
    assert again.trainable_variables[0].path != first.trainable_variables[0].path
    again.evaluate(X, Y, verbose=0)  # builds the compiled metrics, whose state the checkpoint holds
    info = shardckpt.restore_latest(again, str(tmp_path))
    assert info.step == 1 and info.report is not None and not info.report.missing
    assert_arrays_equal(_values(again), saved, "restore_latest")

    # And training goes on from there exactly as the first model would have.
    _fit(first, 4, initial_epoch=2)
    _fit(again, 4, initial_epoch=2)
    assert_arrays_equal(_values(again), _values(first), "continued")


def test_explicit_names_win_over_position(tmp_path):
    """Two layers of one shape, named, built in swapped order: each gets its own weights."""
    def build(order):
        keras.utils.set_random_seed(5)
        inputs = keras.Input((4,))
        layers = {name: keras.layers.Dense(4, name=name) for name in order}
        model = keras.Model(inputs, layers["b"](layers["a"](inputs)))
        model.compile(optimizer="sgd", loss="mse")
        return model

    saved = build(["a", "b"])
    for i, v in enumerate(saved.trainable_variables):
        v.assign(np.full(v.shape, float(i + 1), "float32"))
    callback = shardckpt.OrbaxCheckpoint(str(tmp_path))
    saved.fit(np.zeros((4, 4), "float32"), np.zeros((4, 4), "float32"), epochs=1, verbose=0, callbacks=[callback])
    expected = {v.path: np.asarray(v.value) for v in saved.trainable_variables}

    swapped = build(["b", "a"])  # "b" created first: its position in creation order is a's
    shardckpt.restore_latest(swapped, str(tmp_path))
    for v in swapped.trainable_variables:
        np.testing.assert_array_equal(np.asarray(v.value), expected[v.path], err_msg=v.path)


@pytest.mark.parametrize("widths, problem", [((8, 4, 4), "missing"), ((8, 5), "shape")],
                         ids=["extra_layer", "other_width"])
def test_another_architecture_is_refused_listing_every_problem(tmp_path, widths, problem):
    first = _build()
    _fit(first, 1, [shardckpt.OrbaxCheckpoint(str(tmp_path))])
    other = _build(widths)
    before = [np.asarray(v.value) for v in other.weights]
    with pytest.raises(errors.CheckpointMismatchError) as raised:
        shardckpt.restore_latest(other, str(tmp_path))
    message = str(raised.value)
    if problem == "missing":
        # The new layer's kernel, bias and both Adam slots of each: all named.
        assert message.count("kernel") >= 3 and "bias" in message
    else:
        for variable in other.trainable_variables[2:4]:  # the 5-wide layer and the next kernel
            assert variable.path in message
    assert_arrays_equal([np.asarray(v.value) for v in other.weights], before, "nothing loaded")


def _numbered(names) -> keras.Model:
    """Dense layers of one shape, each named by the user with a number in its name."""
    inputs = keras.Input((8,))
    x = inputs
    for name in names:
        x = keras.layers.Dense(8, name=name)(x)
    return keras.Model(inputs, x, name="m")


@pytest.fixture
def numbered_step(tmp_path):
    """A full-state step of layers `layer_0`, `layer_1`, `layer_2`, each variable a distinct
    constant (so a value says which key it came from), with Adam's slots after one step."""
    saved = _numbered(["layer_0", "layer_1", "layer_2"])
    saved.compile(optimizer="adam", loss="mse")
    for i, v in enumerate(saved.trainable_variables):
        v.assign(np.full(v.shape, float(i + 1), "float32"))
    callback = shardckpt.OrbaxCheckpoint(str(tmp_path))
    x = np.random.default_rng(2).standard_normal((8, 8)).astype("float32")
    saved.fit(x, x, epochs=1, batch_size=8, verbose=0, callbacks=[callback])
    values = {v.path: np.asarray(v.value) for v in saved.weights}
    values.update({f"optimizer_variables/{v.path}": np.asarray(v.value) for v in saved.optimizer.variables})
    return str(tmp_path), values


def test_explicit_names_with_numbers_match_by_name_not_by_position(numbered_step):
    """`layer_1` removed and `layer_3` added, shapes unchanged: `layer_2` gets its own weights and
    slots, and the two that differ are reported, as Keras' own load_weights matches them (was:
    re-paired by the numbers, `layer_2` got `layer_1`'s weights, `layer_3` `layer_2`'s, silently)."""
    directory, saved = numbered_step
    model = _numbered(["layer_0", "layer_2", "layer_3"])
    model.compile(optimizer="adam", loss="mse")
    model.optimizer.build(model.trainable_variables)
    before = [np.asarray(v.value) for v in model.weights]
    with pytest.raises(errors.CheckpointMismatchError) as raised:
        shardckpt.load_sharded(model, directory)
    ours = model.optimizer.name  # `adam_1`: the checkpoint's is `adam`, and that does not matter
    slots = [f"layer_3_{v}_{s}" for v in ("kernel", "bias") for s in ("momentum", "velocity")]
    assert sorted(raised.value.missing) == sorted(
        [f"layer_3/{v} (key 'trainable_variables/layer_3/{v}')" for v in ("kernel", "bias")]
        + [f"{ours}/{s} (key 'optimizer_variables/adam/{s}')" for s in slots]
    )
    assert sorted(raised.value.unexpected) == sorted(
        [f"trainable_variables/layer_1/{v}" for v in ("kernel", "bias")]
        + [f"optimizer_variables/adam/{s.replace('layer_3', 'layer_1')}" for s in slots]
    )
    assert_arrays_equal([np.asarray(v.value) for v in model.weights], before, "nothing loaded")

    report = shardckpt.load_sharded(model, directory, strict=False)
    assert len(report.missing) == 6 and len(report.unexpected) == 6
    for v in model.weights:
        if not v.path.startswith("layer_3/"):
            np.testing.assert_array_equal(np.asarray(v.value), saved[v.path], err_msg=v.path)
    for v in model.optimizer.variables:
        if "layer_3" not in v.path:
            key = f"optimizer_variables/adam/{v.path.split('/', 1)[1]}"
            np.testing.assert_array_equal(np.asarray(v.value), saved[key], err_msg=v.path)


def test_explicit_names_with_numbers_in_a_weights_only_export_match_by_name(tmp_path):
    """The same through `export(format="orbax")` (weights only) into a lazily built model."""
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    source = _numbered(["layer_0", "layer_1", "layer_2"])
    for i, v in enumerate(source.weights):
        v.assign(np.full(v.shape, float(i), "float32"))
    shardckpt.export(source, str(tmp_path / "o"), format="orbax")
    saved = {v.path: np.asarray(v.value) for v in source.weights}
    with shardckpt.lazy_init():
        model = _numbered(["layer_0", "layer_2", "layer_3"])
    with pytest.raises(errors.CheckpointMismatchError) as raised:
        shardckpt.load_sharded(model, str(tmp_path / "o"))
    assert raised.value.missing == [f"layer_3/{v} (key 'trainable_variables/layer_3/{v}')" for v in ("kernel", "bias")]
    assert raised.value.unexpected == [f"trainable_variables/layer_1/{v}" for v in ("bias", "kernel")]
    report = shardckpt.load_sharded(model, str(tmp_path / "o"), strict=False)
    assert report.initialized == ["layer_3/kernel", "layer_3/bias"]
    for v in model.weights:
        if v.path in saved:
            np.testing.assert_array_equal(np.asarray(v.value), saved[v.path], err_msg=v.path)
        assert v.value.sharding.is_fully_replicated, v.path


def test_a_rebuilt_model_of_generated_and_numbered_names_resumes_bit_exact(tmp_path):
    """Generated names shift (`sequential_1` -> `sequential_2`, `dense_1` -> `dense_3`) around
    explicit numbered ones (`block_1`, `block_2`) that stay: each variable and slot its own."""
    def build() -> keras.Model:
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, name="block_1"),
                                  keras.layers.Dense(8), keras.layers.Dense(8, name="block_2"),
                                  keras.layers.Dense(8), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
        return model

    reference = build()
    _fit(reference, 3)
    first = build()
    _fit(first, 2, [shardckpt.OrbaxCheckpoint(str(tmp_path), resume=True)])
    again = build()
    assert again.trainable_variables[2].path != first.trainable_variables[2].path  # a generated name shifted
    ckpt = shardckpt.OrbaxCheckpoint(str(tmp_path), resume=True)
    _fit(again, 3, [ckpt])
    assert ckpt.resumed is not None and ckpt.resumed.step == 1
    assert_arrays_equal(_values(again), _values(reference), "resumed")
