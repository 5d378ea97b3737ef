"""`shardckpt plan MODEL [--mesh 1x8 | --devices N] [--fsdp] [--optimizer adam] [--device-memory 16GiB]`.

MODEL is `package.module:function` (a function returning a Keras model), a
`.keras` file (its config only: no weights are read), or a keras-hub preset
folder (`save_to_preset`: its `config.json` only). The model is built under
`shardckpt.lazy_init()`, so planning a large model costs no weight memory.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from typing import Any

from shardckpt.cli.devices import DEVICE_FLAG
from shardckpt.conversion.architecture import load_architecture
from shardckpt.errors import LayoutError, ModelRequiredError
from shardckpt.layout.mesh import check_device_count, parse_mesh
from shardckpt.lazy import lazy_init

__all__ = ["parse_bytes", "parse_mesh", "run_plan"]


def run_plan(
    model: str,
    mesh: str,
    optimizer: str | None,
    *,
    devices: int | None = None,
    fsdp: bool = False,
    device_memory: str | None = None,
    as_json: bool = False,
) -> int:
    """Prints the layout plan of MODEL on a mesh and its per-device memory.

    Memory is printed for the weights alone and with the optimizer's slots
    (Adam's by default), and, given `device_memory`, whether that fits.

    Example:

    ```
    shardckpt plan mypkg.models:build --mesh 1x8 --optimizer adam
    shardckpt plan gemma_preset/ --devices 8 --fsdp --device-memory 16GiB
    ```

    Args:
        model: `package.module:function`, a `.keras` file, or a keras-hub
            preset folder.
        mesh: Mesh shape such as "1x8" (axes data x model; one number: model
            only), or "auto" (the shape `auto_layout` chooses for `devices`,
            among those whose weights plus optimizer slots fit
            `device_memory`).
        optimizer: Optimizer name whose slots to count, or None.
        devices: Device count for mesh "auto".
        fsdp: Plan FSDP (parameters over the data axis too).
        device_memory: One device's memory ("16GiB", "80GB", bytes).
        as_json: Print one JSON object (the plan as `LayoutPlan.to_json` writes
            it, byte counts, balance, fit and problems) instead of the table.

    Returns:
        0 when the plan validates (and fits `device_memory`, when given),
        1 otherwise.
    """
    import jax
    from rich.console import Console

    from shardckpt.layout.auto import auto_layout

    limit = parse_bytes(device_memory) if device_memory else None
    target: Any = "auto"
    if mesh != "auto":
        target = parse_mesh(mesh)
        check_device_count(
            target, jax.device_count(), what=f"Mesh {mesh}",
            fix=f"pick a mesh of {jax.device_count()} devices, or simulate CPU devices with "
            f"XLA_FLAGS={DEVICE_FLAG}={math.prod(target)}.",
        )
    built = load_preset_architecture(model) if os.path.isdir(model) else load_architecture(model)
    if mesh == "auto":  # the shape is chosen among those whose state fits --device-memory
        plan = auto_layout(built, target, devices=devices, fsdp=fsdp, device_memory=limit, optimizer=optimizer)
    else:
        plan = auto_layout(built, target, fsdp=fsdp)
    problems = plan.validate(built)
    weights = plan.bytes_per_device()
    needed = plan.bytes_per_device(optimizer) if optimizer else weights
    what = f"weights + {optimizer} slots" if optimizer else "weights"
    fits = None if limit is None else needed <= limit
    if fits is False:
        problems.append(f"{what} need {needed:,} bytes per device, more than --device-memory {device_memory}")
    if as_json:
        data = {
            "plan": json.loads(plan.to_json()),
            "mesh": list(plan.mesh.shape),
            "fsdp": plan.fsdp,
            "balance": plan.balance(),
            "parameter_bytes": sum(p.nbytes for p in plan.placements),
            "sharded_fraction": plan.sharded_fraction(),
            "bytes_per_device": weights,
            "optimizer": optimizer,
            "bytes_per_device_with_optimizer": needed if optimizer else None,
            "device_memory": limit,
            "fits": fits,
            "problems": problems,
        }
        print(json.dumps(data, indent=2))
        return 1 if problems else 0
    # Piped output (logs, CI) gets wide rows instead of paths folded at 80 columns.
    console = Console(width=None if sys.stdout.isatty() else 200)
    console.print(plan.explain())
    params = sum(p.nbytes for p in plan.placements)
    console.print(
        f"parameters: {params:,} bytes in total; {plan.sharded_fraction():.1%} split; "
        f"mesh {tuple(plan.mesh.shape)}{' with FSDP' if plan.fsdp else ''}; balance {plan.balance():.3f}"
    )
    console.print(f"per device (weights): {weights:,} bytes")
    if optimizer:
        console.print(f"per device (weights + {optimizer} slots): {needed:,} bytes")
    if limit is not None:
        console.print(
            f"fits in {device_memory} ({limit:,} bytes) per device: {'yes' if fits else 'no'} "
            f"({what}: {needed / limit:.0%} of it; activations and temporaries come on top)"
        )
    for line in problems:
        console.print(f"[red]problem:[/red] {line}")
    return 1 if problems else 0


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """`"16GiB"` -> 17179869184; `"80GB"` -> 80000000000; plain digits are bytes.

    Raises:
        LayoutError: Not a number with an optional unit (B, KB, MB, GB, TB, KiB, ..., TiB).
    """
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise LayoutError(
            "--device-memory must be a size such as 16GiB, 80GB or 1073741824 (bytes). "
            f"Received: device_memory={text!r}"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


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
