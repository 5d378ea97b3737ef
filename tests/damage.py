"""Damage done to checkpoints on disk, as a bad disk or a torn copy would."""

from __future__ import annotations

import os

import numpy as np


def flip_byte_of(tree: str, data: np.ndarray) -> str:
    """Flips one byte in the middle of `data`'s (uncompressed) bytes in the OCDBT data files under `tree`.

    Data files are those in folders named `d` (Orbax's own saves write
    per-process stores, `ocdbt.process_0/d/`). Returns the file changed.
    """
    raw = data.tobytes()
    files = [os.path.join(folder, n) for folder, _, names in os.walk(tree) for n in names]
    for path in sorted(f for f in files if os.path.basename(os.path.dirname(f)) == "d"):
        blob = open(path, "rb").read()
        at = blob.find(raw)
        if at >= 0:
            with open(path, "r+b") as f:
                f.seek(at + len(raw) // 2)
                f.write(bytes([blob[at + len(raw) // 2] ^ 0x10]))
            return path
    raise AssertionError("array bytes not found in the data files")
