"""Simulated CPU devices for the commands (and benchmarks) that shard without an accelerator.

XLA reads `XLA_FLAGS` when JAX's backend starts (the first device use), so
setting the device count before a command touches a device is in time. JAX
reads `JAX_PLATFORMS` when it is imported, which `import shardckpt` already
did, so the platform is also set in JAX's config.
"""

from __future__ import annotations

import os
import sys

DEVICE_FLAG = "--xla_force_host_platform_device_count"
"""XLA's flag for the number of CPU devices of the host platform."""


def simulate_cpu_devices(count: int, *, cpu_only: bool = True) -> None:
    """Asks XLA for `count` CPU devices unless the user set a device count.

    Args:
        count: Host devices to simulate.
        cpu_only: Also use the CPU platform, unless the user chose one
            (`use_cpu_platform`). False keeps accelerators visible.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if DEVICE_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {DEVICE_FLAG}={count}".strip()
    if cpu_only:
        use_cpu_platform()


def use_cpu_platform() -> None:
    """Makes JAX use its CPU platform unless the user chose one (`JAX_PLATFORMS`)."""
    if "JAX_PLATFORMS" in os.environ:
        return
    os.environ["JAX_PLATFORMS"] = "cpu"
    jax = sys.modules.get("jax")
    if jax is not None:  # imported already: it read the variable then
        jax.config.update("jax_platforms", "cpu")
