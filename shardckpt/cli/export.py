"""`shardckpt convert SRC DST --to hf|keras-hub|safetensors`: load sharded, then `shardckpt.export`.

A keras-hub preset folder or a Hugging Face folder is loaded with
`from_preset` (its own architecture); any other checkpoint needs `--model`
(built lazily, then `load_sharded`). The model is placed on all devices
(`--mesh RxC` simulates that many on CPU) and exported with each device's
piece written where it belongs, never gathered.
"""

from __future__ import annotations

import argparse
import os

from shardckpt.errors import ModelRequiredError


def convert_to(args: argparse.Namespace, mesh: tuple[int, ...] | None) -> int:
    """Runs `convert --to` for a target other than orbax; returns the exit code."""
    import keras

    from shardckpt.convert.architecture import load_architecture
    from shardckpt.export import export
    from shardckpt.layout import auto_layout
    from shardckpt.presets import from_preset, preset_kind
    from shardckpt.restore import load_sharded

    src = os.fspath(args.src)
    is_preset = False
    try:
        is_preset = preset_kind(src) in ("hf", "keras-hub")
    except Exception:  # noqa: BLE001 (not a preset folder: a weights file, read below with --model)
        is_preset = False
    if is_preset and not args.model:
        model = from_preset(src, mesh=mesh)
    else:
        if not args.model:
            raise ModelRequiredError(
                f"--to {args.to} from {src!r} needs the architecture: pass --model package.module:function "
                "or a .keras file (a keras-hub preset or Hugging Face folder carries its own)."
            )
        model = load_architecture(args.model)
        import jax

        shape = mesh or (1, jax.device_count())
        plan = auto_layout(model, keras.distribution.DeviceMesh(shape, ["data", "model"]))
        keras.distribution.set_distribution(plan.distribution())
        load_sharded(model, src, layout=plan)
    report = export(
        model, args.dst, format=args.to, max_shard_size=args.max_shard_size, dtype=args.dtype,
        max_inflight_bytes=args.max_inflight_mb * 2**20, progress=False if args.quiet else None,
        overwrite=args.force,
    )
    print(report)
    return 0
