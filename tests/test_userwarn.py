"""shardckpt's warnings name the user's line, whichever route reached them."""

from __future__ import annotations

import warnings

import keras

import shardckpt


def _mostly_replicated() -> keras.Model:
    # Widths 90 and 30 divide by no model axis of 8: every variable stays replicated.
    return keras.Sequential([keras.Input((90,)), keras.layers.Dense(30), keras.layers.Dense(90)])


def test_layout_warnings_point_at_the_callers_line_through_auto_layout_and_parallelize():
    model = _mostly_replicated()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shardckpt.auto_layout(model, (1, 8), rules={r"nothing": (None, "model")})
        shardckpt.parallelize(model, (1, 8), rules={r"nothing": (None, "model")})
    said = [(w.filename, str(w.message).split(" ")[0]) for w in caught if issubclass(w.category, UserWarning)]
    # Two warnings per call (the rule that places nothing, the replicated share), both here.
    assert len(said) == 4, said
    assert {filename for filename, _ in said} == {__file__}
