"""The transfer pipeline (`shardckpt.restore.pipeline`), forced on the 8 CPU devices.

On accelerators every restore goes through the ring; here `transfer="ring"`
sends the same code path to CPU devices: every format restores bit-equal
with the sharding Keras gives, reads overlap transfers on a variable of many
pieces, and the ring stays within the budget. `transfer="auto"` on CPU
devices keeps the zero-copy adoption (no ring).
"""

from __future__ import annotations

import jax
import keras
import numpy as np
import pytest

import shardckpt
from shardckpt.formats import open_reader
from shardckpt.restore import pipeline, readplan
from tests.zoo import build_zoo, lazy_zoo, model_parallel, randomize, save_as

BUDGET = 256 * 1024
"""Small enough that the ring's slots (12 KiB) cut most pieces into several row blocks."""


def _save(tmp_path, fmt):
    keras.backend.clear_session()
    src = build_zoo()
    randomize(src, seed=5)
    want = [np.asarray(v.value) for v in src.weights]
    if fmt == "h5-sharded":
        path = str(tmp_path / "m.weights.json")
        src.save_weights(path, max_shard_size=8e-6)  # several shards of 8 KB
        return path, want
    if fmt == "orbax-keras":
        path = str(tmp_path / "ck")
        src.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
        callback = keras.callbacks.OrbaxCheckpoint(path, save_freq="epoch", save_weights_only=True)
        x, y = np.zeros((8, 8), "int32"), np.zeros((8, 8, 32), "float32")
        src.fit(x, y, epochs=1, batch_size=8, verbose=0, callbacks=[callback])
        callback.wait_until_finished()
        return path, [np.asarray(v.value) for v in src.weights]  # after fit: BatchNorm's statistics moved
    if fmt == "orbax":
        h5 = save_as(src, tmp_path, "h5")
        path = str(tmp_path / "orbax")
        shardckpt.convert(h5, path, model=src)  # shardckpt-written: zarr3 chunks with crc32c
        return path, want
    return save_as(src, tmp_path, fmt), want


@pytest.mark.parametrize("fmt", ["h5", "keras", "h5-sharded", "safetensors", "orbax", "orbax-keras"])
def test_every_format_restores_bit_equal_through_the_ring(tmp_path, fmt):
    path, want = _save(tmp_path, fmt)
    model, dist = lazy_zoo(mesh_shape=(2, 4))
    report = shardckpt.load_sharded(model, path, max_inflight_bytes=BUDGET, transfer="ring")
    assert report.transfer == "ring" and report.arrays >= len(model.weights)  # Orbax: seed states too
    for v, w in zip(model.weights, want):
        np.testing.assert_array_equal(np.asarray(v.value), w, err_msg=v.path)
        assert v.value.sharding.is_equivalent_to(dist.get_variable_layout(v).backend_layout, v.ndim), v.path
    reads = [e for e in report.timeline if e.kind == "read"]
    transfers = [e for e in report.timeline if e.kind == "transfer"]
    assert {e.key for e in reads} == {e.key for e in transfers}
    assert len({e.key for e in reads}) == report.arrays  # every variable went through the ring
    assert len(transfers) == len(reads)
    assert all(r.start <= r.end for r in reads) and all(t.start <= t.end for t in transfers)


def _wide(tmp_path):
    def build():
        return keras.Sequential([keras.Input((512,)), keras.layers.Dense(1024, name="wide")])

    keras.backend.clear_session()
    src = build()
    randomize(src, seed=3)
    path = str(tmp_path / "wide.weights.h5")
    src.save_weights(path)
    model_parallel({".*wide/kernel": (None, "model")}, (1, 8))
    with shardckpt.lazy_init():
        model = build()
    return model, path, [np.asarray(v.value) for v in src.weights]


def test_reads_overlap_transfers_on_a_variable_of_many_pieces(tmp_path):
    """The kernel's 8 pieces (256 KiB each) go in blocks of at most 64 KiB (a ring of
    256 KiB): a block's read runs while earlier blocks of the same variable are
    still being transferred."""
    model, path, want = _wide(tmp_path)
    report = shardckpt.load_sharded(model, path, max_inflight_bytes=512 * 1024, transfer="ring")
    kernel = model.weights[0]
    np.testing.assert_array_equal(np.asarray(kernel.value), want[0])
    events = [e for e in report.timeline if e.key == "layers/dense/vars/0"]
    reads = [e for e in events if e.kind == "read"]
    transfers = [e for e in events if e.kind == "transfer"]
    assert len(reads) == len(transfers) >= 16, len(reads)  # many pieces
    overlapping = sum(1 for r in reads for t in transfers if r.start < t.end and t.start < r.end)
    assert overlapping >= len(reads) // 2, (overlapping, len(reads))


def test_the_ring_stays_within_the_budget(tmp_path):
    """The ring holds at most half the budget, and the bytes of the blocks that
    hold a slot (from their read's start to their transfer's end) never exceed it."""
    model, path, want = _wide(tmp_path)
    budget = 1024 * 1024
    report = shardckpt.load_sharded(model, path, max_inflight_bytes=budget, transfer="ring")
    for v, w in zip(model.weights, want):
        np.testing.assert_array_equal(np.asarray(v.value), w)
    assert 0 < report.ring_bytes <= budget // pipeline.RING_SHARE
    assert report.max_inflight_bytes == budget
    reads = {(e.key, e.piece): e for e in report.timeline if e.kind == "read"}
    ends = {(e.key, e.piece): e.end for e in report.timeline if e.kind == "transfer"}
    held = [(r.start, ends[k], r.nbytes) for k, r in reads.items()]
    for start, _, _ in held:
        in_slots = sum(n for a, b, n in held if a <= start < b)
        assert in_slots <= report.ring_bytes, (in_slots, report.ring_bytes)


def test_cpu_devices_keep_zero_copy_adoption_by_default(tmp_path):
    model, path, want = _wide(tmp_path)
    report = shardckpt.load_sharded(model, path)
    assert report.transfer == "direct" and report.timeline == [] and report.ring_bytes == 0
    np.testing.assert_array_equal(np.asarray(model.weights[0].value), want[0])


def test_pinned_staging_is_for_accelerators_only():
    cpu = jax.devices()[0]
    assert "pinned_host" in {m.kind for m in cpu.addressable_memories()}  # listed on CPU too...
    assert pipeline.staging_kind(cpu) is None  # ...but a second host copy would only cost time


def test_blocks_cut_rows_to_fit_a_slot():
    box = (slice(4, 14), slice(0, 8))
    assert pipeline.blocks(box, row_bytes=32, slot_bytes=100) == [
        (slice(4, 7), slice(0, 8)),
        (slice(7, 10), slice(0, 8)),
        (slice(10, 13), slice(0, 8)),
        (slice(13, 14), slice(0, 8)),
    ]
    assert pipeline.blocks(box, row_bytes=200, slot_bytes=100) is None
    # Chunks of 2 rows: blocks of 2 rows (3 would cut a chunk), none of a chunk split.
    assert pipeline.blocks(box, row_bytes=32, slot_bytes=100, align=2) == [
        (slice(a, a + 2), slice(0, 8)) for a in range(4, 14, 2)
    ]
    assert pipeline.blocks((), row_bytes=4, slot_bytes=100) == [()]


def test_unknown_transfer_is_refused(tmp_path):
    model, path, _ = _wide(tmp_path)
    with pytest.raises(ValueError, match="transfer="):
        shardckpt.load_sharded(model, path, transfer="pinned")


def test_only_contiguous_native_runs_of_the_stored_dtype_go_straight_from_a_mapping():
    """A mapped piece is handed to an accelerator as it is only when the runtime can
    read it as the variable's bytes: the stored dtype, native order, one run."""
    f32 = np.dtype("float32")
    rows = np.arange(24, dtype=f32).reshape(4, 6)
    assert pipeline.sendable(rows, f32)
    assert pipeline.sendable(rows[1:3], f32)  # whole rows: still one run
    assert not pipeline.sendable(rows[:, 2:4], f32)  # a column block: strided
    assert not pipeline.sendable(rows.astype(">f4"), np.dtype(">f4"))  # big-endian: needs a swap
    assert not pipeline.sendable(rows, np.dtype("float16"))


def test_cpu_devices_never_get_a_view_of_the_mapping(tmp_path):
    """A CPU device would adopt the view itself, a mapping the reader unmaps when it
    closes: on CPU devices every piece goes through the slots (copied)."""
    model = build_zoo()
    randomize(model, seed=3)
    path = save_as(model, tmp_path, "safetensors")
    reader = open_reader(path)
    try:
        key = next(k for k in reader.keys() if len(reader.spec(k).shape) == 2)
        spec = reader.spec(key)
        box = tuple(slice(0, n) for n in spec.shape)
        assert reader.is_mapped(key)
        assert pipeline.sendable(reader.view(key, box), spec.dtype)  # an accelerator would take it
        assert pipeline.mapped_run(reader, key, box, spec.dtype, jax.devices()[:1]) is None
    finally:
        reader.close()


def test_a_piece_sent_whole_from_its_mapping_may_have_rows_larger_than_a_slot(tmp_path):
    """Rows larger than a slot keep a piece out of the ring only where it would be cut into
    row blocks in slots: a piece sent whole from a memory map (`mapped_run`, accelerators
    only) takes no slot's bytes, whatever its rows. The views here are the reader's own
    (`mapped_runs` gives none on CPU devices: see the test above)."""
    _, path, _ = _wide(tmp_path)  # the kernel: (512, 1024) float32, rows of 4 KiB
    reader = open_reader(path)
    try:
        key = "layers/dense/vars/0"
        spec = reader.spec(key)
        mesh = jax.sharding.Mesh(np.array(jax.devices()), ("model",))
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("model", None))
        parts = readplan.pieces(sharding.addressable_devices_indices_map(spec.shape), spec.shape)
        assert reader.is_mapped(key) and len(parts) == 8
        views = [reader.view(key, p.box) for p in parts]
        assert all(pipeline.sendable(v, spec.dtype) for v in views)  # 64 whole rows each: one run
        slot = 1024
        assert not pipeline.fits(parts, spec.dtype.itemsize, slot)  # in slots: no row fits one
        assert pipeline.fits(parts, spec.dtype.itemsize, slot, views)  # whole from the mapping: no slot
        assert not pipeline.fits(parts, spec.dtype.itemsize, slot, [None, *views[1:]])  # one piece in slots
        assert pipeline.fits(parts, spec.dtype.itemsize, 4096)  # rows of one slot: in slots
        assert pipeline.mapped_runs(reader, key, parts, spec.dtype) == [None] * 8  # CPU devices
        del views
    finally:
        reader.close()
