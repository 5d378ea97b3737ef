"""The `shardckpt` command: convert | inspect | verify | plan | demo.

Exit codes: 0 success; 1 damaged checkpoint or bad input (one line naming the
problem and the fix, no traceback, nothing written); 2 usage (argparse).

Environment: none of these commands needs an accelerator. `demo` runs on 8
simulated CPU devices (`XLA_FLAGS=--xla_force_host_platform_device_count=8`,
`JAX_PLATFORMS=cpu`, unless already set); `convert --mesh RxC` simulates that
many CPU devices to plan the layout (see `shardckpt.cli.devices`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "jax")

from shardckpt._version import __version__  # noqa: E402
from shardckpt.budget import default_max_inflight_bytes  # noqa: E402
from shardckpt.cli.devices import simulate_cpu_devices, use_cpu_platform  # noqa: E402
from shardckpt.errors import LayoutError, ShardckptError  # noqa: E402
from shardckpt.formats.orbax.writer import COMPRESSIONS, DEFAULT_COMPRESSION  # noqa: E402
from shardckpt.layout.mesh import parse_mesh  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardckpt",
        description="Load, save, convert and check sharded checkpoints of Keras 3 models on JAX.",
    )
    parser.add_argument("--version", action="version", version=f"shardckpt {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "convert",
        help="convert .keras / .weights.h5 / safetensors / a keras-hub preset or Hugging Face folder to "
        "orbax | hf | keras-hub | safetensors (--to; default orbax)",
        description="Convert a checkpoint to an Orbax checkpoint (streamed, no device), a Hugging Face folder, "
        "a keras-hub preset or safetensors (loaded sharded, then exported piece by piece).",
    )
    p.add_argument(
        "src", help=".keras, .weights.h5, .safetensors, *.safetensors.index.json, a keras-hub preset folder "
        "or a Hugging Face folder"
    )
    p.add_argument("dst", help="folder to create (an Orbax checkpoint unless --to says otherwise)")
    p.add_argument("--to", choices=("orbax", "hf", "keras-hub", "safetensors"), default="orbax",
                   help="what to write: an Orbax checkpoint (default), a Hugging Face folder, a keras-hub "
                   "preset or safetensors (variable paths); the last three load the model sharded and "
                   "export it (shardckpt.export)")
    p.add_argument("--max-shard-size", help="--to hf/keras-hub/safetensors: files of at most this size "
                   "(e.g. 5GB, 500MB; a bare number is GB, as keras-hub's max_shard_size)")
    p.add_argument("--model", help="architecture for .weights.h5/safetensors: package.module:function (found in "
                   "the current directory too), a .keras file or a keras-hub preset folder")
    p.add_argument("--mesh", help="data x model, e.g. 2x4 (simulated CPU devices): --to orbax aligns chunks to "
                   "the auto layout on it; the other targets load the model on it (default: the mesh chosen "
                   "for the model)")
    p.add_argument("--dtype", help="cast floating-point arrays, e.g. bfloat16")
    p.add_argument("--compression", choices=COMPRESSIONS, default=None,
                   help=f"--to orbax: chunk compression (default: {DEFAULT_COMPRESSION})")
    p.add_argument("--max-inflight-mb", type=_positive_int, default=None,
                   help="array data in memory at once (MiB; default: this host's, 64 per core within "
                   f"256 and min(4096, memory/32): {default_max_inflight_bytes() // 2**20}; with --to hf, "
                   "keras-hub or safetensors it bounds loading the model, then the writing; without it the "
                   "load takes load_sharded's default, at least 4096 per local accelerator within memory/32, "
                   "and the report names the load's budget)")
    p.add_argument("--force", action="store_true", help="replace DST if it exists")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the report as JSON (with --to hf, keras-hub or "
                   "safetensors, the load's transfer timeline as counts, bytes and seconds: timeline_summary)")
    p.add_argument("--timeline", action="store_true", help="with --json: also every read and transfer of the "
                   "load's transfer pipeline, one entry each (thousands for a large model on an accelerator)")

    p = sub.add_parser("inspect", help="show the arrays, steps and metadata of a checkpoint")
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")

    p = sub.add_parser("verify", help="re-read every array; check shapes, dtypes, checksums")
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")

    p = sub.add_parser(
        "plan",
        help="show a layout plan and per-device memory for a model",
        description="Plan a tensor-parallel layout for MODEL, built without weights "
        "(shardckpt.lazy_init), and show per-device memory.",
    )
    p.add_argument(
        "model",
        help="package.module:function (returns a Keras model), a .keras file (its config only), "
        "or a keras-hub preset folder (save_to_preset; its config.json only)",
    )
    p.add_argument("--mesh", default=None, help="mesh shape, data x model, e.g. 1x8 (default: the mesh chosen "
                   "for the model among those of --devices, as from_preset and parallelize choose it)")
    p.add_argument("--devices", type=_positive_int, help="choose the (data, model) mesh of N devices for the model "
                   "(default 8)")
    p.add_argument("--fsdp", action="store_true", help="split parameters over the data axis too (FSDP)")
    p.add_argument("--optimizer", default="adam", help="optimizer whose slots to count (default adam)")
    p.add_argument("--device-memory", help="memory of one device, e.g. 16GiB or 80GB: say whether the plan fits")
    p.add_argument("--json", action="store_true", help="print the plan and memory as JSON")

    p = sub.add_parser("demo", help="the guided tour on 8 simulated CPU devices")
    p.add_argument("--workdir", help="keep the files here (default: a temporary folder)")
    p.add_argument("--json", action="store_true", help="print the outcome and the tour's lines as JSON")
    return parser


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit code (0, 1 or 2)."""
    args = _parser().parse_args(argv)
    # `--model module:function` names a module beside the user, as under
    # `python -m shardckpt` (which puts the current directory first); the
    # console script's sys.path starts at its own bin folder instead.
    if os.getcwd() not in [os.path.abspath(p or ".") for p in sys.path]:
        sys.path.insert(0, os.getcwd())
    if args.command == "demo":
        simulate_cpu_devices(8)
    elif args.command == "plan" and not args.mesh:
        simulate_cpu_devices(args.devices or PLAN_DEVICES)
    elif args.command in ("plan", "convert") and args.mesh:
        simulate_cpu_devices(math.prod(_mesh_shape(args.mesh)))
    else:
        use_cpu_platform()  # converting and reading need no accelerator
    try:
        return _COMMANDS[args.command](args)
    except (ShardckptError, OSError) as e:
        # Bad input or damage: one line, the message carries the fix.
        print(f"shardckpt {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return 1


def _mesh_shape(text: str) -> tuple[int, ...]:
    try:
        return parse_mesh(text)
    except LayoutError as e:
        _parser().error(str(e))  # a usage error: exit 2


def _one_line(error: BaseException) -> str:
    text = str(error) or type(error).__name__
    if isinstance(error, OSError) and not str(error.args[0] if error.args else ""):
        text = f"{error.strerror}: {error.filename!r}"
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def _convert(args: argparse.Namespace) -> int:
    from shardckpt.cli.reports import convert_json
    from shardckpt.pipeline import convert

    # Options of the other kind of target: a usage error (exit 2), never ignored.
    if args.to != "orbax" and args.compression is not None:
        _parser().error(f"--compression applies to --to orbax; --to {args.to} writes uncompressed files")
    if args.timeline and not args.json:
        _parser().error("--timeline adds the load's events to the --json report; pass --json too")
    if args.timeline and args.to == "orbax":
        _parser().error("--timeline applies to --to hf, keras-hub and safetensors (they load the model); "
                        "--to orbax streams the arrays without a load")
    if args.to == "orbax" and args.max_shard_size is not None:
        _parser().error("--max-shard-size applies to --to hf, keras-hub and safetensors; an Orbax checkpoint "
                        "is chunked, not split into files")
    max_shard_size = None if args.max_shard_size is None else _max_shard_size(args.max_shard_size)
    report = convert(
        args.src,
        args.dst,
        to=args.to,
        model=_architecture(args.model) if args.model else None,
        mesh=_mesh_shape(args.mesh) if args.mesh else None,
        dtype=args.dtype,
        compression=args.compression or DEFAULT_COMPRESSION,
        max_shard_size=max_shard_size,
        max_inflight_bytes=None if args.max_inflight_mb is None else args.max_inflight_mb * 2**20,
        force=args.force,
        progress=False if args.quiet else None,
    )
    if args.json:
        print(json.dumps(convert_json(report, timeline=args.timeline), indent=2, default=str))
    else:
        print(report)
    return 0


def _max_shard_size(text: str) -> float | str:
    """`--max-shard-size`: a bare number is GB (as `max_shard_size=5` in Python), else a size such as "500MB".

    Checked here, a usage error (exit 2), rather than by the export after the
    model's load, which for a large model takes minutes.
    """
    from shardckpt.exporting.plans import max_shard_bytes

    size: float | str
    try:
        size = float(text)
    except ValueError:
        size = text
    try:
        max_shard_bytes(size)
    except ValueError as e:
        _parser().error(f"--max-shard-size: {e}")
    return size


def _architecture(spec: str) -> Any:
    """`--model`: a keras-hub preset folder, package.module:function or a .keras file, built lazily."""
    from shardckpt.cli.plan import load_preset_architecture
    from shardckpt.conversion.architecture import load_architecture

    return load_preset_architecture(spec) if os.path.isdir(spec) else load_architecture(spec)


def _inspect(args: argparse.Namespace) -> int:
    from shardckpt.conversion.info import inspect
    from shardckpt.conversion.integrity import read_checksums

    info = inspect(args.path)
    checksums = (read_checksums(info.path) if info.format == "orbax" else None) or {}
    if args.json:
        data = dataclasses.asdict(info)
        data["total_bytes"] = info.total_bytes
        for array in data["arrays"]:
            entry = checksums.get(array["key"])
            array["checksum"] = None if entry is None else f"crc32:{entry['crc32']}"
        print(json.dumps(data, indent=2, default=str))
        return 0
    _print_info(info, checksums)
    return 0


def _print_info(info: Any, checksums: dict[str, dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 200)
    console.print(f"[bold]{info.format}[/bold] checkpoint {info.path}")
    for line in info.summary():
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    table = Table(show_footer=False)
    for name in ("key", "shape", "dtype"):
        table.add_column(name, justify="left")
    table.add_column("bytes", justify="right")
    if checksums:
        table.add_column("crc32")
    for a in info.arrays:
        row = [a.key, str(tuple(a.shape)), a.dtype, f"{a.nbytes:,}"]
        if checksums:
            row.append(checksums.get(a.key, {}).get("crc32", "-"))
        table.add_row(*row)
    console.print(table)
    console.print(f"{len(info.arrays)} arrays, {info.total_bytes:,} bytes")


def _verify(args: argparse.Namespace) -> int:
    from shardckpt.conversion.integrity import verify
    from shardckpt.formats import open_reader
    from shardckpt.progress import ByteProgress

    reader = open_reader(args.path)  # errors here are whole-checkpoint damage: one line, exit 1
    total = sum(s.nbytes for s in map(reader.spec, reader.keys()) if not s.dtype.hasobject)  # as verify reads
    reader.close()
    show = sys.stderr.isatty() and not args.quiet and not args.json
    with ByteProgress(total, f"verifying {os.path.basename(os.path.normpath(args.path))}", enabled=show) as bar:
        report = verify(args.path, advance=bar.advance)
    if args.json:
        print(json.dumps(dataclasses.asdict(report) | {"ok": report.ok}, indent=2))
    else:
        print(report)
        if report.damaged:
            print("Fix: re-create the checkpoint from its source (re-convert, or restore another step).")
        elif report.newer_uncommitted:
            print("Fix: if a save is still running, let it finish and verify again; else that save was lost "
                  "and a resume starts from the step verified (OrbaxCheckpoint removes the uncommitted folders).")
    return 0 if report.ok else 1


def _plan(args: argparse.Namespace) -> int:
    from shardckpt.cli.plan import run_plan

    if args.mesh and args.devices:
        raise LayoutError("shardckpt plan takes --mesh or --devices, not both. Fix: drop one of them.")
    return run_plan(
        args.model, args.mesh or "auto", args.optimizer,
        devices=args.devices or PLAN_DEVICES, fsdp=args.fsdp, device_memory=args.device_memory, as_json=args.json,
    )


def _demo(args: argparse.Namespace) -> int:
    from shardckpt.cli.demo import run_demo

    if not args.json:
        return run_demo(workdir=args.workdir)
    from rich.text import Text

    lines: list[str] = []
    code = run_demo(workdir=args.workdir, echo=lambda x: lines.append(Text.from_markup(str(x)).plain))
    print(json.dumps({"ok": code == 0, "workdir": args.workdir, "lines": lines}, indent=2))
    return code


PLAN_DEVICES = 8
"""Devices `shardckpt plan` chooses a mesh among when given neither --mesh nor --devices."""

_COMMANDS = {"convert": _convert, "inspect": _inspect, "verify": _verify, "plan": _plan, "demo": _demo}


if __name__ == "__main__":
    sys.exit(main())
