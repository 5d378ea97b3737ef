"""lazy_init(): no initializer runs, no value exists, and nothing fills values later."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import shardckpt
from shardckpt import errors
from shardckpt.lazy import is_unloaded
from tests.zoo import build_zoo


def test_lazy_build_has_no_values_and_stays_so():
    with shardckpt.lazy_init():
        model = build_zoo()
    assert model.weights and all(v._value is None for v in model.weights)
    # A later plain StatelessScope exit initialises Keras' pending variables;
    # lazy_init took its own off that list.
    with keras.StatelessScope():
        pass
    assert all(v._value is None for v in model.weights)
    assert sum(int(np.prod(v.shape)) for v in model.weights) == model.count_params()


def test_using_an_unloaded_variable_names_it():
    with shardckpt.lazy_init():
        model = build_zoo()
    with pytest.raises(errors.UnloadedVariableError, match="embed/embeddings.*load_sharded"):
        model(np.zeros((1, 8), "int32"))


def test_models_built_outside_are_normal():
    with shardckpt.lazy_init():
        build_zoo()
    model = build_zoo()
    # Every variable has its initializer's value (readable, not the lazy sentinel) and the
    # model runs: nothing of the lazy build leaked into the next one.
    for v in model.weights:
        assert not is_unloaded(v), v.path
        value = v.numpy()
        assert value.shape == tuple(v.shape) and np.isfinite(value).all(), v.path
    kernels = [v.numpy() for v in model.weights if v.path.endswith("kernel") and v.dtype.startswith("float")]
    assert kernels and all(np.any(k != 0) for k in kernels)  # initializers ran (glorot is never all zero)
    out = model(np.zeros((2, 8), "int32"))
    assert np.isfinite(keras.ops.convert_to_numpy(out)).all()
