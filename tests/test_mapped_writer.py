"""`MappedFiles`, the export's writer of laid-out files, against the kernel's partial writes."""

from __future__ import annotations

import errno
import resource
import signal

import numpy as np
import pytest

from shardckpt.formats.base import ArraySpec
from shardckpt.formats.mapped_writer import MappedFiles
from shardckpt.formats.safetensors_writer import TensorSlot


def test_put_finishes_a_run_the_kernel_wrote_in_part_or_fails_never_a_silent_gap(tmp_path):
    """`pwrite` may write fewer bytes than asked (over 2 GiB, a signal; here the file size limit,
    set to half the run): the rest is written by another call, which fails here (EFBIG)."""
    n = 64 * 1024  # float32 elements: one contiguous run of 256 KiB
    (tmp_path / "a.bin").write_bytes(bytes(4 * n))
    slot = TensorSlot(file="a.bin", offset=0, spec=ArraySpec(shape=(n,), dtype=np.dtype("float32")))
    files = MappedFiles(str(tmp_path), {"k": slot})
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of the signal's exit
    resource.setrlimit(resource.RLIMIT_FSIZE, (2 * n, hard))
    try:
        with pytest.raises(OSError) as info:
            files.put("k", 0, (1,), np.arange(n, dtype=np.float32))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
        files.close()
    assert info.value.errno == errno.EFBIG
