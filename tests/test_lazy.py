"""lazy_init(): no initializer runs, no value exists, and nothing fills values later."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import shardckpt
from shardckpt import errors
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
    assert all(v._value is not None for v in model.weights)
