"""Device memory of a "device" snapshot: at most one copy of the state during a save,
and the move of a snapshot off the devices that drops each device piece."""

from __future__ import annotations

import threading

import jax
import keras
import numpy as np

from shardckpt.training import OrbaxCheckpoint
from shardckpt.training import snapshot as snapshot_lib
from tests.support import column_then_row_parallel


def _mlp_256_512_256() -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((256,), name="x")
    h = keras.layers.Dense(512, activation="relu", name="d0")(inputs)
    outputs = keras.layers.Dense(256, name="d1")(h)
    model = keras.Model(inputs, outputs, name="mem")
    model.compile(optimizer="adam", loss="mse")
    return model


def _device_bytes() -> int:
    """Bytes of the device buffers live `jax.Array`s hold, each buffer once.

    A shard's `.data` (which Orbax takes of every array it writes) is a
    second `jax.Array` over the same buffer: buffers are told apart by their
    device and address, so views are not counted twice.
    """
    buffers: dict[tuple[int, int], int] = {}
    for array in jax.live_arrays():
        if array.sharding.memory_kind not in (None, "device"):
            continue
        try:
            for shard in array.addressable_shards:
                buffers[(shard.device.id, shard.data.unsafe_buffer_pointer())] = shard.data.nbytes
        except (RuntimeError, TypeError) as e:
            # Deleted (or donated) by another thread since live_arrays() listed it: JaxRuntimeError
            # "Buffer has been deleted or donated" (also from a shard's view of a deleted buffer,
            # whose array still says not deleted), or TypeError once the array's own list of
            # buffers is gone (`addressable_shards` iterates None).
            if "deleted or donated" in str(e) or array.is_deleted():
                continue
            raise
    return sum(buffers.values())


class _Sampler:
    """Samples `_device_bytes` on a thread as fast as it can, keeping the peak."""

    def __init__(self) -> None:
        self.peak = 0
        self.samples = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.peak = max(self.peak, _device_bytes())
                self.samples += 1
        except BaseException as e:  # raised by __exit__: a dead sampler's peak says nothing
            self.error = e

    def __enter__(self) -> _Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if self.error is not None:
            raise AssertionError("the device-memory sampler failed") from self.error


def test_device_snapshot_holds_at_most_one_copy_of_the_state_during_a_save(tmp_path):
    keras.distribution.set_distribution(column_then_row_parallel("d0", "d1"))
    model = _mlp_256_512_256()
    x = np.random.default_rng(1).standard_normal((64, 256)).astype("float32")
    model.fit(x[:16], x[:16], batch_size=16, verbose=0)  # state built, step compiled
    state = [v.value for v in model.variables] + [v.value for v in model.optimizer.variables]
    state_bytes = sum(int(np.prod(v.sharding.shard_shape(v.shape))) * v.dtype.itemsize * len(v.sharding.device_set)
                      for v in state)
    base = _device_bytes()
    assert base >= state_bytes > 2 * 2**20  # the state dwarfs a batch (16 x 256 floats)
    ckpt = OrbaxCheckpoint(str(tmp_path), save_freq=1, snapshot="device")
    with _Sampler() as sampler:
        model.fit(x, x, batch_size=16, epochs=1, verbose=0, shuffle=False, callbacks=[ckpt])
        ckpt.wait_until_finished()
    assert ckpt.snapshot_modes == ["device"] * 4 and sampler.samples > 10
    assert sampler.peak - base >= state_bytes // 2  # the sampler did see a copy
    # One copy of the state above it, and a batch's worth of slack.
    assert sampler.peak - base <= state_bytes + 2**20, (sampler.peak - base, state_bytes)


def test_to_host_dropping_moves_every_leaf_to_host_memory_and_deletes_the_device_copy():
    keras.distribution.set_distribution(column_then_row_parallel("d0", "d1"))
    model = _mlp_256_512_256()
    x = np.ones((16, 256), "float32")
    model.fit(x, x, batch_size=16, verbose=0)
    tree, used = snapshot_lib.snapshot_state(model, mode="device")
    # CPU devices: the copy stays where it is (their memory is the host's).
    assert used.mode == "device" and snapshot_lib.before_write(tree, used) is None
    device_copies = [tree["trainable_variables"]["d0"]["kernel"], tree["optimizer_variables"]["adam"]["d1_kernel_momentum"]]
    snapshot_lib.to_host_dropping(tree)
    assert all(copy.is_deleted() for copy in device_copies)
    kernel = tree["trainable_variables"]["d0"]["kernel"]
    assert kernel.sharding.memory_kind == "pinned_host"
    assert kernel.sharding.spec == model.get_layer("d0").kernel.value.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    np.testing.assert_array_equal(np.asarray(kernel), np.asarray(model.get_layer("d0").kernel.value))
    momentum = tree["optimizer_variables"]["adam"]["d1_kernel_momentum"]
    assert momentum.sharding.memory_kind == "pinned_host"
    [source] = [v.value for v in model.optimizer.variables if v.path == "adam/d1_kernel_momentum"]
    np.testing.assert_array_equal(np.asarray(momentum), np.asarray(source))
