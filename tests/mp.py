"""Two real `jax.distributed` processes on 127.0.0.1, as the 2-process tests start them
(`run_pair`), and the first lines of each such worker (`start_worker`)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# XLA's CPU code generation without LLVM's optimizations: a compile takes about
# 40% of the time (tests compile hundreds of tiny programs and run each a few
# times). XLA's HLO passes (SPMD partitioning, the collectives the layout tests
# count) are not affected; only the machine code is less optimized.
FAST_COMPILE = "--xla_backend_optimization_level=0"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for JAX's coordination service)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_pair(worker: str, *args: str, env: dict[str, str] | None = None) -> list[subprocess.Popen]:
    """Starts `tests/<worker> <process id> <port> *args` as processes 0 and 1 (output piped).

    Each process sets its own CPU devices (XLA_FLAGS is dropped from the
    environment); `env` adds to the environment.
    """
    port = str(free_port())
    env = {**os.environ, "PYTHONPATH": ROOT, **(env or {})}
    env.pop("XLA_FLAGS", None)
    path = os.path.join(ROOT, "tests", worker)
    return [
        subprocess.Popen([sys.executable, path, str(i), port, *args], env=env, cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(2)
    ]


def run_pair(worker: str, *args: str, timeout: float = 240, env: dict[str, str] | None = None) -> list[str]:
    """Runs `tests/<worker> <process id> <port> *args` as processes 0 and 1; both must exit 0.

    `env` adds to the environment. Returns the two outputs (stdout and stderr together).
    """
    procs = start_pair(worker, *args, env=env)
    outputs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outputs.append(out)
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-4000:]
    return outputs


def join(process_id: int, port: str, devices: int = 4) -> None:
    """In a worker: `devices` CPU devices, gloo collectives, then this process joins the pair's
    `jax.distributed` run. Call before anything imports jax."""
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}"
    os.environ["KERAS_BACKEND"] = "jax"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)


def start_worker(devices: int = 4) -> tuple[int, str]:
    """The start of a worker run by `run_pair`: `devices` CPU devices, `jax.distributed` up.

    Call before anything imports jax. Returns the process id and the folder
    (argv[1] and argv[3]; argv[2] is the coordinator's port).
    """
    process_id, port, folder = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    join(process_id, port, devices)
    return process_id, folder
