"""A one-process save into a local folder: the arrays' OCDBT store encoded in memory by TensorStore,
its files written past the page cache (`O_DIRECT`) and fsynced, then the step renamed into place."""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time

import keras
import numpy as np
import orbax.checkpoint.experimental.v1 as ocp
import pytest

from shardckpt import load_sharded
from shardckpt.formats.orbax.writer import CHUNK_BYTES, OrbaxStepWriter
from shardckpt.storage.direct import ALIGN, DirectWriter
from shardckpt.training import OrbaxCheckpoint
from shardckpt.training.step_save import StepCheckpointer, _write_arrays
from tests.support import assert_training_state_equal, column_then_row_parallel, training_state
from tests.zoo import small_regressor

_libc = ctypes.CDLL(None, use_errno=True)


def resident_pages(path: str) -> int:
    """How many of the file's pages are in the page cache now (`mincore`; nothing is read)."""
    size = os.path.getsize(path)
    if not size:
        return 0
    with open(path, "rb") as f:
        # A private writable map: ctypes can take its address; untouched, it shows the file's cache.
        mapped = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * pages)()
        anchor = ctypes.c_char.from_buffer(mapped)
        try:
            if _libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
        finally:
            del anchor
        return sum(v & 1 for v in vec)
    finally:
        mapped.close()


def _data_files(step: str) -> list[str]:
    folder = os.path.join(step, "pytree", "d")
    return [os.path.join(folder, n) for n in sorted(os.listdir(folder))]


@pytest.mark.parametrize("size", [0, 1, ALIGN - 1, ALIGN, 3 * ALIGN + 17, 2 * 8192, 2 * 8192 + ALIGN + 5])
def test_direct_writer_writes_the_exact_bytes_past_the_page_cache(tmp_path, size):
    """Whole ring loads, whole blocks and a tail that is not a block: the file holds exactly the
    bytes given, and none of its whole blocks went through the page cache."""
    rng = np.random.default_rng(size)
    data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
    writer = DirectWriter(ring_bytes=8192)  # small ring: several loads per file
    pieces = [data[i : i + 3000] for i in range(0, size, 3000)]  # pieces that straddle the ring's loads
    path = str(tmp_path / "f.bin")
    assert writer.write(path, pieces) == size
    assert writer.direct_files == 1 and writer.buffered_files == 0
    assert resident_pages(path) <= (1 if size % ALIGN else 0)  # at most the tail's page
    with open(path, "rb") as f:
        assert f.read() == data
    with pytest.raises(FileExistsError):  # files are written once
        writer.write(path, [b"x"])


def _fit(directory: str, **kwargs) -> tuple[keras.Model, OrbaxCheckpoint]:
    keras.distribution.set_distribution(column_then_row_parallel("hidden", "head"))
    model = small_regressor(3, width=512)
    ckpt = OrbaxCheckpoint(directory, save_freq=2, max_to_keep=2, **kwargs)
    x, y = np.ones((32, 6), "float32"), np.ones((32, 1), "float32")
    model.fit(x, y, batch_size=8, epochs=2, callbacks=[ckpt], verbose=0)
    ckpt.wait_until_finished()
    return model, ckpt


def test_a_local_save_is_written_past_the_page_cache_and_reads_back_bit_equal(tmp_path):
    """One process, a local folder: every step of the fit is written by shardckpt's own writer
    with O_DIRECT (the arrays' data files hold no page in the cache afterwards), retention keeps
    the last two, and Keras' `load_weights`, Orbax and `load_sharded` read the latest bit-equal."""
    root = str(tmp_path / "ckpt")
    model, ckpt = _fit(root)
    checkpointer = ckpt.checkpointer
    assert isinstance(checkpointer, StepCheckpointer) and checkpointer.local
    assert sorted(os.listdir(root)) == ["6", "8"]  # 8 batches, a save every 2, max_to_keep=2
    direct = checkpointer._direct
    assert direct is not None and direct.buffered_files == 0
    step = os.path.join(root, "8")
    files = _data_files(step)
    values = [f for f in files if not os.path.basename(f).startswith("n")]  # the value files (nodes: "n...")
    assert values and direct.direct_files >= len(files)
    # Whole blocks went to the disk, not the page cache: at most each file's last page is there.
    assert sum(resident_pages(f) for f in values) <= len(values), [resident_pages(f) for f in values]
    assert not [n for n in os.listdir(root) if "tmp" in n]  # the temporary folder was renamed

    trained = training_state(model)
    keras.backend.clear_session()
    keras.distribution.set_distribution(column_then_row_parallel("hidden", "head"))
    other = small_regressor(99, width=512)
    other.optimizer.build(other.trainable_variables)
    other.load_weights(root)  # Keras' own reader (through Orbax)
    assert_training_state_equal(other, trained, [k for k in trained if not k.startswith("metrics")])
    restored = ocp.load_checkpointables(step, {"pytree": None})["pytree"]  # Orbax, no targets
    for key, value in trained.items():
        if not key.startswith(("trainable_variables/", "optimizer_variables/")):
            continue
        np.testing.assert_array_equal(np.asarray(_at(restored, key)), value, err_msg=key)
    keras.backend.clear_session()
    keras.distribution.set_distribution(column_then_row_parallel("hidden", "head", (1, 8)))
    moved = small_regressor(5, width=512)
    moved.optimizer.build(moved.trainable_variables)
    moved.evaluate(np.ones((8, 6), "float32"), np.ones((8, 1), "float32"), verbose=0)
    load_sharded(moved, root, progress=False)
    assert_training_state_equal(moved, trained)


def _at(tree: dict, key: str):
    node = tree
    for part in key.split("/"):
        node = node[part]
    return node


def test_the_memory_encoded_store_is_orbaxs_and_bounded_per_transaction(tmp_path):
    """The writer alone: several transactions (one value file each, written out and dropped from
    memory at its commit), read back bit-equal by Orbax; in /dev/shm too (tmpfs)."""
    rng = np.random.default_rng(0)
    tree = {"a": {f"w{i}": rng.standard_normal((300 + i, 777)).astype("float32") for i in range(5)},
            "b": np.arange(5, dtype="int32")}
    for parent in (str(tmp_path), "/dev/shm"):
        if not os.path.isdir(parent):
            continue
        step = os.path.join(parent, f"direct-{os.getpid()}-{id(tree)}")
        try:
            direct = DirectWriter()
            writer = OrbaxStepWriter(step, compression="none", chunk_byte_size=CHUNK_BYTES["none"], direct=direct)
            # Two arrays per transaction: the budget is shared by the transactions in memory at once.
            _write_arrays(writer, tree, limit=(direct.streams + 1) * 2 * 305 * 777 * 4)
            memory = writer._memory_store()
            left = [k.decode() for k in memory.list().result()]
            assert left and all(k.startswith("d/n") or k == "manifest.ocdbt" for k in left), left
            writer.finish(custom_metadata={})
            assert memory.list().result() == []
            values = [f for f in _data_files(step) if not os.path.basename(f).startswith("n")]
            assert len(values) == 3, values  # 5 arrays two at a time, the small one with the last
            back = ocp.load_pytree(step)
            for key, value in tree["a"].items():
                np.testing.assert_array_equal(back["a"][key], value)
            np.testing.assert_array_equal(back["b"], tree["b"])
        finally:
            import shutil

            shutil.rmtree(step, ignore_errors=True)


class _WatchedWriter(DirectWriter):
    """A real `DirectWriter` that, while it writes the save's first value file, waits (up to 10 s) for
    the next transaction's value file to be in memory, and counts the value files in memory at each file."""

    def __init__(self) -> None:
        super().__init__()
        self.step: OrbaxStepWriter | None = None
        self.next_encoded_meanwhile: bool | None = None
        self.in_memory: list[int] = []

    def _values_in_memory(self) -> list[str]:
        assert self.step is not None
        names = [k.decode() for k in self.step._memory_store().list().result()]
        return [n for n in names if n.startswith("d/") and not n.startswith("d/n")]

    def write(self, path, pieces):
        name = "d/" + os.path.basename(path)
        if name in self._values_in_memory():
            self.in_memory.append(len(self._values_in_memory()))
            if self.next_encoded_meanwhile is None:
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline and set(self._values_in_memory()) <= {name}:
                    time.sleep(0.01)
                self.next_encoded_meanwhile = bool(set(self._values_in_memory()) - {name})
        return super().write(path, pieces)


def test_the_next_transaction_is_encoded_while_a_value_file_is_written_out(tmp_path):
    """The disk and the encoding overlap: while the first transaction's value file is being written,
    the next transaction is committed into memory; at most `streams + 1` transactions' value files
    are in memory at once (the budget is shared by them), and the step reads back bit-equal."""
    rng = np.random.default_rng(1)
    tree = {"a": {f"w{i}": rng.standard_normal((256, 512)).astype("float32") for i in range(8)}}
    direct = _WatchedWriter()
    step = str(tmp_path / "0")
    writer = OrbaxStepWriter(step, compression="none", chunk_byte_size=CHUNK_BYTES["none"], direct=direct)
    direct.step = writer
    _write_arrays(writer, tree, limit=(direct.streams + 1) * 256 * 512 * 4)  # one array per transaction
    writer.finish(custom_metadata={})
    assert direct.next_encoded_meanwhile is True
    assert len(direct.in_memory) == 8 and max(direct.in_memory) <= direct.streams + 1, direct.in_memory
    back = ocp.load_pytree(step)
    for key, value in tree["a"].items():
        np.testing.assert_array_equal(back["a"][key], value)


class _ClashingWriter(DirectWriter):
    """A real `DirectWriter` whose first file's path is taken (a folder made there first), and whose
    later files take a while: the first write-out fails while the next one is still writing."""

    def __init__(self) -> None:
        super().__init__()
        self.files = 0

    def write(self, path, pieces):
        self.files += 1
        if self.files == 1:
            os.makedirs(path)
        else:
            time.sleep(0.5)
        return super().write(path, pieces)


def test_a_failed_write_out_fails_the_save_and_leaves_no_writer_running(tmp_path):
    """A value file that cannot be written fails the save with that error, and the save returns only
    once no write-out is left running into the folder (which its caller then removes)."""
    rng = np.random.default_rng(2)
    tree = {"a": {f"w{i}": rng.standard_normal((64, 128)).astype("float32") for i in range(6)}}
    direct = _ClashingWriter()
    writer = OrbaxStepWriter(str(tmp_path / "0"), compression="none", chunk_byte_size=CHUNK_BYTES["none"],
                             direct=direct)
    with pytest.raises(FileExistsError):
        _write_arrays(writer, tree, limit=(direct.streams + 1) * 64 * 128 * 4)  # one array per transaction
    assert direct.files >= 2
    assert not [t for t in threading.enumerate() if t.name == "shardckpt-write-out" and t.is_alive()]
