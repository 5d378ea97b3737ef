#!/usr/bin/env python3
"""Set up `.venv` (once) and run the demo or the tests inside it.

Usage:
    python3 tools/run.py demo      # `shardckpt demo` on 8 simulated CPU devices
    python3 tools/run.py test [pytest args]

Needs only a Python >= 3.11 with the standard `venv` module; everything else is
installed into `.venv` beside the repository root from `pyproject.toml`: the
`test` and `hub` extras, and keras-hub itself without its pip requirements
(they pull TensorFlow, which keras-hub's JAX path does not use).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
# Re-install when pyproject.toml or this file changes; the stamp holds their hash.
STAMP = VENV / ".shardckpt-installed"
# keras-hub is a test dependency and optional for users; see the `hub` extra.
KERAS_HUB = "keras-hub==0.32.0"


def _ensure_venv() -> Path:
    python = BIN / "python"
    if not python.exists():
        print(f"[run] creating {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    want = hashlib.sha256(
        (ROOT / "pyproject.toml").read_bytes() + Path(__file__).read_bytes()
    ).hexdigest()
    if not STAMP.exists() or STAMP.read_text() != want:
        print("[run] installing shardckpt[test,hub] and keras-hub into .venv", flush=True)
        subprocess.check_call(
            [str(python), "-m", "pip", "install", "-q", "--upgrade", "pip"]
        )
        subprocess.check_call(
            [str(python), "-m", "pip", "install", "-q", "-e", f"{ROOT}[test,hub]"]
        )
        subprocess.check_call(
            [str(python), "-m", "pip", "install", "-q", "--no-deps", KERAS_HUB]
        )
        STAMP.write_text(want)
    return python


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("demo", "test"):
        print(__doc__, file=sys.stderr)
        return 2
    python = _ensure_venv()
    if argv[0] == "demo":
        cmd = [str(BIN / "shardckpt"), "demo", *argv[1:]]
    else:
        cmd = [str(python), "-m", "pytest", *argv[1:]]
    return subprocess.call(cmd, cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
