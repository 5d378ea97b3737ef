#!/usr/bin/env python3
"""Set up `.venv` (once) and run the demo or the tests inside it.

Usage:
    python3 tools/run.py demo      # `shardckpt demo` on 8 simulated CPU devices
    python3 tools/run.py test [pytest args]
    python3 tools/run.py --python /path/to/python3.12 --venv .venv312 --extras test,hub test [pytest args]

`--python` picks the interpreter the virtualenv is created from (default: the one
running this script) and `--venv` its folder (default `.venv`); the install is the
same, so pip resolves the newest JAX that interpreter can take (CI's second leg).
`--extras` names the extras installed (default `test,hub,interop`; `interop` brings CPU
torch, transformers and peft for the tests that a real client reads our exports).

Needs only a Python >= 3.11 with the standard `venv` module; everything else is
installed into `.venv` beside the repository root from `pyproject.toml`: the
`test`, `hub` and `interop` extras, and keras-hub itself without its pip requirements
(they pull TensorFlow, which keras-hub's JAX path does not use).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Re-install when pyproject.toml or this file changes; the stamp (in the venv) holds their hash.
STAMP_NAME = ".shardckpt-installed"
# keras-hub is a test dependency and optional for users; see the `hub` extra.
KERAS_HUB = "keras-hub==0.32.0"


def _bin(venv_dir: Path) -> Path:
    return venv_dir / ("Scripts" if os.name == "nt" else "bin")


def _create(venv_dir: Path, base_python: str | None) -> None:
    print(f"[run] creating {venv_dir}", flush=True)
    if base_python is None:
        venv.EnvBuilder(with_pip=True).create(venv_dir)
        return
    # The stdlib's EnvBuilder only creates venvs of the interpreter running it.
    if shutil.which(base_python) is None and not Path(base_python).exists():
        raise SystemExit(f"[run] --python {base_python}: no such interpreter")
    subprocess.check_call([base_python, "-m", "venv", str(venv_dir)])


def _ensure_venv(venv_dir: Path, base_python: str | None, extras: str) -> Path:
    python = _bin(venv_dir) / "python"
    if not python.exists():
        _create(venv_dir, base_python)
    stamp = venv_dir / STAMP_NAME
    want = hashlib.sha256(
        (ROOT / "pyproject.toml").read_bytes() + Path(__file__).read_bytes()
    ).hexdigest()
    if not stamp.exists() or stamp.read_text() != want:
        print(f"[run] installing shardckpt[{extras}] and keras-hub into {venv_dir.name}", flush=True)
        subprocess.check_call(
            [str(python), "-m", "pip", "install", "-q", "--upgrade", "pip"]
        )
        subprocess.check_call(
            [str(python), "-m", "pip", "install", "-q", "-e", f"{ROOT}[{extras}]"]
        )
        subprocess.check_call(
            [str(python), "-m", "pip", "install", "-q", "--no-deps", KERAS_HUB]
        )
        stamp.write_text(want)
    return python


def main(argv: list[str]) -> int:
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument("--python", default=None)
    options.add_argument("--venv", default=".venv")
    options.add_argument("--extras", default="test,hub,interop")
    # Only the options before the command are run.py's; the rest go to pytest / demo.
    split = next((i for i, a in enumerate(argv) if a in ("demo", "test")), len(argv))
    known, extra = options.parse_known_args(argv[:split])
    argv = argv[split:]
    if extra or not argv:
        print(__doc__, file=sys.stderr)
        return 2
    venv_dir = (ROOT / known.venv).resolve()
    python = _ensure_venv(venv_dir, known.python, known.extras)
    if argv[0] == "demo":
        cmd = [str(_bin(venv_dir) / "shardckpt"), "demo", *argv[1:]]
    else:
        cmd = [str(python), "-m", "pytest", *argv[1:]]
    return subprocess.call(cmd, cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
