"""`shardckpt plan MODEL --mesh 1x8 [--optimizer adam]`: show a layout plan.

MODEL is `package.module:function` (a function returning a Keras model), a
`.keras` file (its config only: no weights are read), or a keras-hub preset
folder (`save_to_preset`: its `config.json` only). The model is built under
`shardckpt.lazy_init()`, so planning a large model costs no weight memory.
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any

from shardckpt.cli.devices import DEVICE_FLAG
from shardckpt.convert.architecture import load_architecture
from shardckpt.errors import ModelRequiredError
from shardckpt.layout.mesh import check_device_count, parse_mesh
from shardckpt.lazy import lazy_init

__all__ = ["parse_mesh", "run_plan"]


def run_plan(model: str, mesh: str, optimizer: str | None, *, as_json: bool = False) -> int:
    """Prints the layout plan of MODEL on a mesh and its per-device memory.

    Example:

    ```
    shardckpt plan mypkg.models:build --mesh 1x8 --optimizer adam
    ```

    Args:
        model: `package.module:function`, a `.keras` file, or a keras-hub
            preset folder.
        mesh: Mesh shape such as "1x8" (axes data x model; one number: model only).
        optimizer: Optimizer name whose slots to count, or None.
        as_json: Print one JSON object (the plan as `LayoutPlan.to_json` writes
            it, byte counts and problems) instead of the table.

    Returns:
        0 when the plan validates, 1 when `validate()` lists problems.
    """
    import jax
    from rich.console import Console

    from shardckpt.layout.auto import auto_layout

    shape = parse_mesh(mesh)
    check_device_count(
        shape, jax.device_count(), what=f"Mesh {mesh}",
        fix=f"pick a mesh of {jax.device_count()} devices, or simulate CPU devices with "
        f"XLA_FLAGS={DEVICE_FLAG}={math.prod(shape)}.",
    )
    built = load_preset_architecture(model) if os.path.isdir(model) else load_architecture(model)
    plan = auto_layout(built, shape)
    problems = plan.validate(built)
    if as_json:
        params = sum(p.nbytes for p in plan.placements)
        data = {
            "plan": json.loads(plan.to_json()),
            "parameter_bytes": params,
            "sharded_fraction": plan.sharded_fraction(),
            "bytes_per_device": plan.bytes_per_device(),
            "optimizer": optimizer,
            "bytes_per_device_with_optimizer": plan.bytes_per_device(optimizer) if optimizer else None,
            "problems": problems,
        }
        print(json.dumps(data, indent=2))
        return 1 if problems else 0
    # Piped output (logs, CI) gets wide rows instead of paths folded at 80 columns.
    console = Console(width=None if sys.stdout.isatty() else 200)
    console.print(plan.explain())
    params = sum(p.nbytes for p in plan.placements)
    console.print(f"parameters: {params:,} bytes in total; {plan.sharded_fraction():.1%} split")
    console.print(f"per device (weights): {plan.bytes_per_device():,} bytes")
    if optimizer:
        console.print(f"per device (weights + {optimizer} slots): {plan.bytes_per_device(optimizer):,} bytes")
    for line in problems:
        console.print(f"[red]problem:[/red] {line}")
    return 1 if problems else 0


def load_preset_architecture(folder: str) -> Any:
    """Builds the backbone of a keras-hub preset folder under `lazy_init()`.

    Only `config.json` is read (keras-hub's `from_preset(load_weights=False)`);
    the weights files are not opened and no variable gets memory.

    Raises:
        ModelRequiredError: The folder has no `config.json`, or keras-hub is
            not installed.
    """
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise ModelRequiredError(
            f"{folder!r} is a folder without config.json, so not a keras-hub preset. Fix: pass "
            "a folder written by backbone.save_to_preset(...), a .keras file, or "
            f"package.module:function. Received: model={folder!r}"
        )
    try:
        import keras_hub
    except ImportError as err:
        raise ModelRequiredError(
            f"Planning the keras-hub preset {folder!r} needs keras-hub. Fix: pip install keras-hub "
            "(or shardckpt[hub])."
        ) from err
    with lazy_init():
        return keras_hub.models.Backbone.from_preset(folder, load_weights=False)
