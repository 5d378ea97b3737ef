"""The `shardckpt` command: convert | inspect | verify | plan | demo.

Exit codes: 0 success; 1 damaged checkpoint or bad input (one line naming the
problem and the fix, no traceback, nothing written); 2 usage (argparse).

Environment: none of these commands needs an accelerator. `demo` runs on 8
simulated CPU devices (`XLA_FLAGS=--xla_force_host_platform_device_count=8`,
`JAX_PLATFORMS=cpu`, unless already set); `convert --mesh RxC` simulates that
many CPU devices to plan the layout. JAX reads these when its backend starts,
which no import before `main` does, so setting them here is in time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "jax")

from shardckpt.budget import DEFAULT_MAX_INFLIGHT_BYTES  # noqa: E402
from shardckpt.formats.orbax.writer import COMPRESSIONS, DEFAULT_COMPRESSION  # noqa: E402

_DEVICE_FLAG = "--xla_force_host_platform_device_count"


def _simulate_cpu_devices(count: int) -> None:
    """Asks JAX for `count` CPU devices unless the user set a device count or platform."""
    if _DEVICE_FLAG not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_FLAG}={count}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardckpt",
        description="Load, save, convert and check sharded checkpoints of Keras 3 models on JAX.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("convert", help="convert .keras / .weights.h5 / safetensors to an Orbax checkpoint")
    p.add_argument("src", help=".keras, .weights.h5, .safetensors or *.safetensors.index.json")
    p.add_argument("dst", help="Orbax checkpoint folder to create")
    p.add_argument("--model", help="architecture for .weights.h5/safetensors: package.module:function or a .keras file")
    p.add_argument("--mesh", help="align chunks to the auto layout on this mesh, e.g. 1x8")
    p.add_argument("--dtype", help="cast floating-point arrays, e.g. bfloat16")
    p.add_argument("--compression", choices=COMPRESSIONS, default=DEFAULT_COMPRESSION,
                   help=f"chunk compression (default: {DEFAULT_COMPRESSION})")
    p.add_argument("--max-inflight-mb", type=_positive_int, default=DEFAULT_MAX_INFLIGHT_BYTES // 2**20,
                   help="array data in memory at once (MiB)")
    p.add_argument("--force", action="store_true", help="replace DST if it exists")
    p.add_argument("--quiet", action="store_true", help="no progress bar")

    p = sub.add_parser("inspect", help="show the arrays, steps and metadata of a checkpoint")
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")

    p = sub.add_parser("verify", help="re-read every array; check shapes, dtypes, checksums")
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")

    p = sub.add_parser("plan", help="show a layout plan and per-device memory for a model")
    p.add_argument("model", help="package.module:function or a .keras file")
    p.add_argument("--mesh", default="1x8", help="mesh shape, data x model (default 1x8)")
    p.add_argument("--optimizer", help="optimizer whose slots to count, e.g. adam")

    p = sub.add_parser("demo", help="the guided tour on 8 simulated CPU devices")
    p.add_argument("--workdir", help="keep the files here (default: a temporary folder)")
    return parser


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit code (0, 1 or 2)."""
    args = _parser().parse_args(argv)
    if args.command == "demo":
        _simulate_cpu_devices(8)
    elif args.command == "plan":
        _simulate_cpu_devices(_mesh_size(args.mesh))
    elif args.command == "convert" and args.mesh:
        _simulate_cpu_devices(_mesh_size(args.mesh))
    else:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")  # converting and reading need no accelerator
    from shardckpt.errors import ShardckptError

    try:
        return _COMMANDS[args.command](args)
    except (ShardckptError, OSError) as e:
        # Bad input or damage: one line, the message carries the fix.
        print(f"shardckpt {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return 1


def _mesh_size(text: str) -> int:
    size = 1
    for part in text.lower().split("x"):
        if not part.isdigit() or int(part) < 1:
            _parser().error(f"--mesh must look like 1x8 or 2x4. Received: {text!r}")
        size *= int(part)
    return size


def _one_line(error: BaseException) -> str:
    text = str(error) or type(error).__name__
    if isinstance(error, OSError) and not str(error.args[0] if error.args else ""):
        text = f"{error.strerror}: {error.filename!r}"
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def _convert(args: argparse.Namespace) -> int:
    from shardckpt.convert.architecture import load_architecture
    from shardckpt.convert.converter import convert

    model = load_architecture(args.model) if args.model else None
    mesh = tuple(int(p) for p in args.mesh.lower().split("x")) if args.mesh else None
    report = convert(
        args.src,
        args.dst,
        model=model,
        mesh=mesh,
        dtype=args.dtype,
        compression=args.compression,
        max_inflight_bytes=args.max_inflight_mb * 2**20,
        force=args.force,
        progress=False if args.quiet else None,
    )
    print(report)
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from shardckpt.convert.info import inspect
    from shardckpt.convert.integrity import read_checksums

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
    for name, justify in (("key", "left"), ("shape", "left"), ("dtype", "left"), ("bytes", "right")):
        table.add_column(name, justify=justify)
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
    from shardckpt.formats import open_reader
    from shardckpt.convert.integrity import verify
    from shardckpt.progress import ByteProgress

    reader = open_reader(args.path)  # errors here are whole-checkpoint damage: one line, exit 1
    total = sum(reader.spec(k).nbytes for k in reader.keys())
    reader.close()
    show = sys.stderr.isatty() and not args.quiet and not args.json
    with ByteProgress(total, f"verifying {os.path.basename(os.path.normpath(args.path))}", enabled=show) as bar:
        report = verify(args.path, advance=bar.advance)
    if args.json:
        print(json.dumps(dataclasses.asdict(report) | {"ok": report.ok}, indent=2))
    else:
        print(report)
        if not report.ok:
            print("Fix: re-create the checkpoint from its source (re-convert, or restore another step).")
    return 0 if report.ok else 1


def _plan(args: argparse.Namespace) -> int:
    from shardckpt.cli.plan import run_plan

    return run_plan(args.model, args.mesh, args.optimizer)


def _demo(args: argparse.Namespace) -> int:
    from shardckpt.cli.demo import run_demo

    return run_demo(workdir=args.workdir)


_COMMANDS = {"convert": _convert, "inspect": _inspect, "verify": _verify, "plan": _plan, "demo": _demo}


if __name__ == "__main__":
    sys.exit(main())
