#!/usr/bin/env bash
# Checkpoint saving during fit on one GPU: Keras' OrbaxCheckpoint (sync, async) vs shardckpt's
# snapshot modes, at a save every 30 and every 10 batches (tools/bench_save.py, 201M parameters,
# 2.3 GB of state with Adam), then the table of issue 35: blocking per save, max, vs Keras sync,
# peak device memory above the state, fit total, background write / plain write, D2H GB/s.
#
# The accelerator machine has JAX with CUDA but no Keras and no registry: the wheels come from
# .whl/ (gitignored, so the run tool must carry it), downloaded beforehand for Python 3.12:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl keras==3.15.1 namex optree==0.20.0 orbax-checkpoint==0.12.8 tensorstore==0.1.86 isal
# Nothing else is installed. Run from the repository root:
#   bash tools/gpu_bench_save.sh            # results under $OUT if set, else ./bench_out/save_gpu
# About 4-5 minutes on one H100/H200 (8 fresh processes). Override the runs with RUNS=... and the
# intervals with INTERVALS="30 10"; PARAMS, STEPS likewise.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-$PWD/bench_out}/save_gpu"
mkdir -p "$OUT_DIR"
SITE=/tmp/shardckpt_site
export KERAS_BACKEND=jax JAX_PLATFORMS="${JAX_PLATFORMS:-cuda}"
if ! python3 -c "import keras, orbax.checkpoint" 2>/dev/null; then
    if [ ! -d .whl ] || [ -z "$(ls .whl/*.whl 2>/dev/null)" ]; then
        echo "no Keras here and no wheels in .whl/: download them first (see the top of $0)" >&2
        exit 2
    fi
    python3 -m pip install -q --no-index --no-deps --target "$SITE" .whl/*.whl
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
PARAMS="${PARAMS:-2e8}"
STEPS="${STEPS:-60}"
RUNS="${RUNS:-keras_sync,keras_async,shardckpt_auto,shardckpt_host}"
INTERVALS="${INTERVALS:-30 10}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT_DIR/gpu.txt" || true
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee "$OUT_DIR/jax.txt"
for every in $INTERVALS; do
    echo "== save every $every batches"
    python3 tools/bench_save.py --params "$PARAMS" --steps "$STEPS" --save-every "$every" --only "$RUNS" \
        --workdir "$OUT_DIR/work" --json "$OUT_DIR/every_$every.json" 2>&1 \
        | grep -v -e "^WARNING:absl" -e "UserWarning" | tee "$OUT_DIR/every_$every.txt"
done
rm -rf "$OUT_DIR/work"
python3 - "$OUT_DIR" $INTERVALS <<'PY' | tee "$OUT_DIR/table.md"
import json, os, statistics, sys

out, intervals = sys.argv[1], sys.argv[2:]
print("| run | saves | blocking per save | max | vs Keras sync | peak device above state | fit total "
      "| bg write / plain write | D2H |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
for every in intervals:
    data = json.load(open(os.path.join(out, f"every_{every}.json")))
    results = {r["name"]: r for r in data["results"]}
    sync = results.get("keras_sync")
    sync_mean = statistics.mean(sync["saves"]) if sync and sync["saves"] else float("nan")
    first = data["results"][0]
    print(f"| save every {every} batches ({first['state_mb']:.0f} MiB of state, {first['devices']}) "
          "| | | | | | | | |")
    for name, r in results.items():
        saves = r["saves"]
        mean = statistics.mean(saves) if saves else 0.0
        ratio = (f"{statistics.mean(r['writes']) / statistics.mean(r['plain_s']):.2f}x"
                 if r["writes"] else "-")
        mode = f" ({','.join(r['modes'])})" if r["modes"] else ""
        print(f"| {name}{mode} | {len(saves)} | {mean:.3f} s | {max(saves or [0]):.3f} s | {mean / sync_mean:.1%} "
              f"| {r['peak_above_mb']:.0f} MiB | {r['fit_s']:.2f} s | {ratio} | {r['d2h_gbs']:.1f} GB/s |")
PY
echo "results in $OUT_DIR"
