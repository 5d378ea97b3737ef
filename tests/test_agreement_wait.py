"""`SHARDCKPT_PROCESS_WAIT_S`, the wait limit of multi-process saves, read from the environment:
a number of seconds is taken, anything else is a `ConfigurationError` naming the variable, the value
and the fix."""

from __future__ import annotations

import pytest

from shardckpt import errors
from shardckpt.training import agreement


def test_unset_is_the_default_and_a_number_of_seconds_is_taken(monkeypatch):
    monkeypatch.delenv("SHARDCKPT_PROCESS_WAIT_S", raising=False)
    assert agreement.wait_s() == agreement.WAIT_S == 3600.0
    monkeypatch.setenv("SHARDCKPT_PROCESS_WAIT_S", "")  # set empty: unset, as the storage deadlines' variables
    assert agreement.wait_s() == 3600.0
    monkeypatch.setenv("SHARDCKPT_PROCESS_WAIT_S", "2.5")
    assert agreement.wait_s() == 2.5
    monkeypatch.setenv("SHARDCKPT_PROCESS_WAIT_S", " 600 ")  # as float() reads it
    assert agreement.wait_s() == 600.0


@pytest.mark.parametrize("text", ["abc", "0", "-5", "nan", "inf", "-inf", "1e999"])
def test_a_value_that_is_no_positive_finite_number_of_seconds_is_refused(monkeypatch, text):
    monkeypatch.setenv("SHARDCKPT_PROCESS_WAIT_S", text)
    with pytest.raises(errors.ConfigurationError) as caught:
        agreement.wait_s()
    assert isinstance(caught.value, ValueError)
    message = str(caught.value)
    assert message.startswith("SHARDCKPT_PROCESS_WAIT_S must be a positive number of seconds"), message
    assert "Fix: set it to a positive number of seconds" in message, message
    assert message.endswith(f"Received: SHARDCKPT_PROCESS_WAIT_S={text!r}"), message
