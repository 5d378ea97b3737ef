#!/usr/bin/env python3
"""How fast bytes of a file reach a device, by the ways a loader can send them.

The restore pipeline (`shardckpt.restore.pipeline`) chooses between these; this
probe measures each on the machine at hand, each in a fresh process (after one
small `device_put`, which pays for the runtime's set-up), on a file of float32
arrays written here and read once before (page cache warm):

- `view`: `device_put` of a view of the memory-mapped file, one per array
  (what the pipeline does for mapped files on accelerators);
- `view-64m`: the same in 64 MiB row blocks, joined on the device;
- `slot-pinned`: each 64 MiB block copied into a reused host buffer, then to
  `pinned_host` memory, then to the device (the pipeline's slots);
- `slot`: the same without the pinned step (the runtime stages it);
- `fresh`: each array read into fresh memory, then `device_put` (as Keras'
  h5 load does).

It prints seconds and GB/s of each, and each one's ratio to `view`. On CPU
devices `view` is no copy at all (the device adopts the mapping): there the
probe only checks that it runs.

Usage:
    python tools/bench_transfer.py [--mb 4096] [--arrays 16]
    python tools/bench_transfer.py --smoke      # tiny, on whatever device is there
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import subprocess
import sys
import tempfile
import time

WAYS = ("view", "view-64m", "slot-pinned", "slot", "fresh")
BLOCK = 64 * 1024 * 1024


def _child(way: str, path: str, arrays: int, rows: int, cols: int) -> dict:
    import jax  # noqa: PLC0415  (after the parent chose the platform)
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    device = jax.devices()[0]
    jax.device_put(np.zeros(1024, np.float32), device).block_until_ready()  # runtime set-up
    nbytes = rows * cols * 4
    block_rows = max(1, BLOCK // (cols * 4))
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    whole = np.frombuffer(mapped, np.float32).reshape(arrays, rows, cols)
    pinned = "pinned_host" in {m.kind for m in device.addressable_memories()} and device.platform != "cpu"
    slots = [np.empty((block_rows, cols), np.float32) for _ in range(2)]
    start = time.perf_counter()
    out = []
    if way == "view":
        out = [jax.device_put(whole[i], device) for i in range(arrays)]
    elif way == "view-64m":
        for i in range(arrays):
            parts = [jax.device_put(whole[i, a:a + block_rows], device) for a in range(0, rows, block_rows)]
            out.append(parts[0] if len(parts) == 1 else jnp.concatenate(parts))
    elif way in ("slot", "slot-pinned"):
        pending: list = [None, None]
        n = 0
        for i in range(arrays):
            parts = []
            for a in range(0, rows, block_rows):
                k = n % 2
                if pending[k] is not None:
                    jax.block_until_ready(pending[k])
                block = whole[i, a:a + block_rows]
                slot = slots[k][: block.shape[0]]
                np.copyto(slot, block)
                if way == "slot-pinned":
                    kind = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
                    staged = jax.device_put(slot, kind, may_alias=False)
                    sent = jax.device_put(staged, jax.sharding.SingleDeviceSharding(device))
                else:
                    sent = jax.device_put(np.array(slot) if device.platform == "cpu" else slot, device, may_alias=False)
                pending[k] = sent
                parts.append(sent)
                n += 1
            out.append(parts[0] if len(parts) == 1 else jnp.concatenate(parts))
    elif way == "fresh":
        with open(path, "rb") as f:
            for _ in range(arrays):
                host = np.empty((rows, cols), np.float32)
                f.readinto(memoryview(host).cast("B"))
                out.append(jax.device_put(host, device))
    jax.block_until_ready(out)
    seconds = time.perf_counter() - start
    # The mapping stays open: a CPU device may have adopted views of it.
    return {"way": way, "seconds": seconds, "gb_per_s": arrays * nbytes / seconds / 1e9, "pinned": pinned,
            "device": str(device.device_kind)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=4096, help="bytes of the file, MiB")
    parser.add_argument("--arrays", type=int, default=16)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        way, path, arrays, rows, cols = args.child
        print("RESULT " + json.dumps(_child(way, path, int(arrays), int(rows), int(cols))), flush=True)
        return 0
    mb, arrays = (8, 2) if args.smoke else (args.mb, args.arrays)
    cols = 1024
    rows = max(1, mb * 2**20 // arrays // (cols * 4))
    with tempfile.TemporaryDirectory(prefix="bench_transfer_") as folder:
        path = os.path.join(folder, "arrays.bin")
        chunk = os.urandom(2**20)
        with open(path, "wb") as f:
            for _ in range(arrays * rows * cols * 4 // len(chunk)):
                f.write(chunk)
            f.write(chunk[: arrays * rows * cols * 4 % len(chunk)])
        with open(path, "rb") as f:  # into the page cache
            while f.read(2**26):
                pass
        results = []
        for way in WAYS:
            done = subprocess.run([sys.executable, __file__, "--child", way, path, str(arrays), str(rows), str(cols)],
                                  capture_output=True, text=True, check=False)
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if done.returncode or not lines:
                print(f"{way}: failed ({done.returncode})\n{done.stderr[-2000:]}", flush=True)
                continue
            results.append(json.loads(lines[-1][len("RESULT "):]))
    if not results:
        return 1
    base = next((r["seconds"] for r in results if r["way"] == "view"), results[0]["seconds"])
    print(f"{arrays} arrays, {arrays * rows * cols * 4 / 1e9:.2f} GB, device {results[0]['device']} "
          f"(pinned_host: {results[0]['pinned']})")
    print(f"{'way':<12} {'seconds':>8} {'GB/s':>7} {'vs view':>8}")
    for r in results:
        print(f"{r['way']:<12} {r['seconds']:>8.3f} {r['gb_per_s']:>7.2f} {r['seconds'] / base:>7.2f}x")
    print("RESULT " + json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
