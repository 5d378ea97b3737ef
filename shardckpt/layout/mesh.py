"""Turn the accepted mesh forms (and the CLI's "2x4") into a `keras.distribution.DeviceMesh`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from keras import distribution as kd

from shardckpt.errors import LayoutError

DEFAULT_AXES_2D = ("data", "model")


def parse_mesh(text: str) -> tuple[int, ...]:
    """`"1x8"` -> `(1, 8)`: the mesh shape of `--mesh`.

    Raises:
        LayoutError: The text is not one or two positive integers joined by "x".
    """
    parts = text.lower().split("x")
    # The command line names no axes: one or two sizes, read as model or data x model.
    if not all(p.isdigit() and int(p) >= 1 for p in parts) or len(parts) > 2:
        raise LayoutError(
            "--mesh must look like 1x8 or 2x4 (data x model: two sizes joined by x; the command line "
            f"plans on those two axes). Fix: e.g. --mesh 2x4. Received: --mesh {text}"
        )
    return tuple(int(p) for p in parts)


def check_device_count(shape: Sequence[int], available: int, *, what: str, fix: str) -> None:
    """Raises unless a mesh of `shape` uses exactly the `available` devices.

    Args:
        shape: The mesh shape.
        available: How many devices there are to fill it.
        what: The mesh, as the message names it ("Mesh shape (2, 4)").
        fix: What the user should do instead.

    Raises:
        LayoutError: "<what> needs N devices but M are available. Fix: <fix>".
    """
    needed = math.prod(shape)
    if needed != available:
        raise LayoutError(f"{what} needs {needed} devices but {available} are available. Fix: {fix}")


def resolve_mesh(
    mesh: Any, *, model_axis: str, batch_axis: str | None, devices: Sequence[Any] | None = None
) -> tuple[kd.DeviceMesh, str]:
    """Returns `(device mesh, batch axis)` for any accepted `mesh` form.

    Accepted: a `keras.distribution.DeviceMesh`; a shape such as `(1, 8)` or
    `(8,)` (axis names `("data", model_axis)` for 2-D, `(model_axis,)` for
    1-D); or a pair `(shape, axis_names)`. A 1-D mesh gets a size-1 batch axis
    in front ("data"), because Keras' `ModelParallel` needs a batch dimension.
    `batch_axis` defaults to the first axis that is not `model_axis`.

    Raises:
        LayoutError: The axis names do not include `model_axis` (or
            `batch_axis`), or the shape does not use exactly the devices.
    """
    if isinstance(mesh, kd.DeviceMesh):
        shape, names, devs = tuple(mesh.shape), tuple(mesh.axis_names), np.asarray(mesh.devices)
    else:
        if (
            isinstance(mesh, (tuple, list))
            and len(mesh) == 2
            and isinstance(mesh[0], (tuple, list))
            and isinstance(mesh[1], (tuple, list))
        ):
            shape, names = tuple(int(s) for s in mesh[0]), tuple(mesh[1])
        elif isinstance(mesh, (tuple, list)) and all(isinstance(s, int) for s in mesh):
            shape = tuple(mesh)
            names = (model_axis,) if len(shape) == 1 else (DEFAULT_AXES_2D[0], model_axis)
            if len(shape) > 2:
                raise LayoutError(
                    f"A mesh shape with {len(shape)} axes needs axis names. Fix: pass "
                    f"(shape, axis_names) or a keras.distribution.DeviceMesh. Received: mesh={mesh!r}"
                )
        else:
            raise LayoutError(
                "mesh must be a keras.distribution.DeviceMesh, a shape such as (1, 8), or "
                f"(shape, axis_names). Received: mesh={mesh!r}"
            )
        pool = list(devices) if devices is not None else jax.devices()
        check_device_count(
            shape, len(pool), what=f"Mesh shape {shape}",
            fix=f"use a shape whose product is {len(pool)}. Received: mesh={mesh!r}",
        )
        devs = np.asarray(pool).reshape(shape)
    if model_axis not in names:
        raise LayoutError(
            f"Mesh axes {names} have no model axis {model_axis!r}. Fix: pass "
            f"model_axis= one of {names}. Received: model_axis={model_axis!r}"
        )
    if len(names) == 1:
        batch_name = "data" if model_axis != "data" else "batch"
        shape, names, devs = (1, *shape), (batch_name, *names), devs.reshape((1, *shape))
    if batch_axis is None:
        batch_axis = next(n for n in names if n != model_axis)
    if batch_axis not in names or batch_axis == model_axis:
        raise LayoutError(
            f"Batch axis {batch_axis!r} must be a mesh axis other than the model axis "
            f"{model_axis!r}; mesh axes are {names}. Received: batch_axis={batch_axis!r}"
        )
    return kd.DeviceMesh(shape, list(names), devs), batch_axis
