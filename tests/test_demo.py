"""`shardckpt demo` runs every step to the end on the 8 simulated CPU devices."""

from __future__ import annotations

import os

import pytest

from shardckpt.cli.demo import run_demo


@pytest.mark.slow  # every step of the demo: a conversion, a plan, two epochs and a resume
def test_demo_runs_every_step(tmp_path):
    lines = []
    assert run_demo(workdir=str(tmp_path), echo=lambda x: lines.append(str(x))) == 0
    text = "\n".join(lines)
    assert "skipped" not in text
    for title in ("1. Build", "2. Convert", "3. Plan", "4. Lazy build", "5. Train 2 epochs", "6. Resume"):
        assert title in text, title
    assert text.count("   [green]ok[/green]") == 6
    assert "weights + optimizer bit-exact" in text and "demo complete" in text
    assert sorted(os.listdir(tmp_path)) == ["ckpts", "tiny_lm.weights.h5", "tiny_lm_orbax"]
