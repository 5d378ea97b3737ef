"""bench_storage's save rows: `OrbaxCheckpoint` into fake GCS and S3 from 1 and from 2 JAX processes.

Each cell starts 1 process with 8 simulated CPU devices, or 2 `jax.distributed`
processes on 127.0.0.1 with 4 each, holding bench_restore's model on the same
(1, 8) `ModelParallel` mesh. Per process it measures:

- a bucket save of the state (the callback's writer, `StepCheckpointer`):
  seconds, CPU seconds, peak anonymous memory over the state during the save
  (RssAnon sampled; the state is resident before it starts) against the host's
  in-flight budget, and the bytes this process wrote (its own OCDBT store);
- the training thread's blocking per save of `OrbaxCheckpoint` (a `fit` of 2
  batches, a save after each; SGD, so the state is the weights);
- `load_sharded` of the saved step into a fresh lazily built model: seconds,
  and the bytes the process read.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from _bench import RESULT, ROOT, PeakSampler, cpu_seconds, rss_anon, setup_jax


def child(args, process: str, port: str, urls: str) -> dict:
    """One process of a cell: `process` is "i/n"; `urls`: a JSON list of bucket URLs."""
    index, count = (int(x) for x in process.split("/"))
    setup_jax(8 // count)
    import jax

    if count > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=count, process_id=index)
    import bench_restore
    import keras
    import numpy as np

    import shardckpt
    from shardckpt import budget, storage
    from shardckpt.restore import hostmem
    from shardckpt.training import step_save

    distribution = bench_restore.distribution()
    distribution.auto_shard_dataset = False
    keras.distribution.set_distribution(distribution)
    keras.utils.set_random_seed(0)  # the same initial values on every process
    model = bench_restore.build(args.blocks, args.dim)
    rng = np.random.default_rng(0)
    for v in model.weights:
        v.assign(rng.standard_normal(v.shape, dtype=np.float32) * 0.02)
    state = sum(int(np.prod(v.shape)) * 4 for v in model.weights)
    from shardckpt.training import snapshot

    tree = {"trainable_variables": snapshot.nest([v.path for v in model.weights], [v.value for v in model.weights])}
    jax.block_until_ready([v.value for v in model.weights])
    rows = []
    for url in json.loads(urls):  # every server in one process: one start per cell
        hostmem.trim()
        root = storage.parse(f"{url}/save")
        writer = step_save.StepCheckpointer(root, policy=None, compression=False)
        before = rss_anon()
        with PeakSampler() as sampler:
            start, cpu = time.perf_counter(), cpu_seconds()
            writer.save_checkpointables(1, {"pytree": tree})
            save_s, save_cpu = time.perf_counter() - start, cpu_seconds() - cpu
        tree_dir = root.join("1", "pytree")
        own = tree_dir.join(f"ocdbt.process_{index}") if count > 1 else tree_dir
        rows.append({
            "process": index, "processes": count, "state_gb": state / 1e9, "save_s": save_s, "save_cpu_s": save_cpu,
            "peak_over_state_gb": (sampler.peak - before) / 1e9,
            "budget_gb": budget.default_max_inflight_bytes() / 1e9, "written_gb": storage.du(own) / 1e9,
        })
    model.compile(optimizer="sgd", loss="mse")
    x = np.zeros((16, args.dim), "float32")  # zero inputs: only the biases train
    for url, row in zip(json.loads(urls), rows):
        ckpt = shardckpt.OrbaxCheckpoint(f"{url}/fit", save_freq=1, max_to_keep=1)
        model.fit(x, x, batch_size=8, epochs=1, callbacks=[ckpt], verbose=0)
        ckpt.wait_until_finished()
        row["blocking_s"] = sorted(ckpt.save_blocking_s)[len(ckpt.save_blocking_s) // 2]
    keras.backend.clear_session()
    keras.distribution.set_distribution(bench_restore.distribution())
    with shardckpt.lazy_init():
        fresh = bench_restore.build(args.blocks, args.dim)
    for url, row in zip(json.loads(urls), rows):
        start = time.perf_counter()
        report = shardckpt.load_sharded(fresh, f"{url}/save/1", progress=False)
        jax.block_until_ready([v.value for v in fresh.weights])
        row["load_s"], row["read_gb"] = time.perf_counter() - start, report.bytes_read / 1e9
        kernel = next(v for v in fresh.weights if v.path.endswith("_down/kernel"))
        row["checksum_part"] = sum(float(np.asarray(s.data, np.float64).sum())
                                   for s in kernel.value.addressable_shards if s.replica_id == 0)
    return {"rows": rows}


def cell(script: str, args, urls: list[str], count: int) -> list[list[dict]]:
    """Runs one cell's `count` processes together; returns each one's rows (one per URL)."""
    from tests.mp import free_port

    port = str(free_port())
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [subprocess.Popen(
        [sys.executable, script, "--workdir", args.workdir, "--blocks", str(args.blocks), "--dim", str(args.dim),
         "--_save", f"{i}/{count}", port, json.dumps(urls)], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True) for i in range(count)]
    outputs = [p.communicate()[0] for p in procs]
    results = []
    for p, out in zip(procs, outputs):
        lines = [line for line in out.splitlines() if line.startswith(RESULT)]
        if p.returncode != 0 or not lines:
            raise SystemExit(f"save child failed:\n{out[:6000]}")
        results.append(json.loads(lines[-1][len(RESULT):])["rows"])
    return results


def rows(script: str, args, buckets: dict[str, str]) -> list[dict]:
    """Every save cell: 1 then 2 processes, each saving into every bucket; one row per process and bucket."""
    by_count = {count: cell(script, args, [f"{url}/save{count}" for url in buckets.values()], count)
                for count in (1, 2)}
    out = []
    for b, scheme in enumerate(buckets):
        for per_process in by_count.values():
            for process_rows in per_process:
                out.append(dict(process_rows[b], source=f"fake {'GCS' if scheme == 'gs' else 'S3'}"))
    return out


def show(save_rows: list[dict]) -> None:
    print(f"\n{'save into':<9} {'procs':>5} {'proc':>4} {'save s':>7} {'save CPU s':>10} {'blocking s':>10} "
          f"{'peak over state GB':>18} {'budget GB':>9} {'written GB':>10} {'load s':>7} {'read GB':>7}")
    for r in save_rows:
        print(f"{r['source']:<9} {r['processes']:>5} {r['process']:>4} {r['save_s']:>7.2f} {r['save_cpu_s']:>10.2f} "
              f"{r['blocking_s']:>10.3f} {r['peak_over_state_gb']:>18.3f} {r['budget_gb']:>9.3f} "
              f"{r['written_gb']:>10.3f} {r['load_s']:>7.2f} {r['read_gb']:>7.3f}")
    print(f"state {save_rows[0]['state_gb']:.3f} GB per save (each of 2 processes holds half of it)")
