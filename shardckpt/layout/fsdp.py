"""FSDP (ZeRO-3): parameters also split over the batch axis, on a dimension the model axis left free.

Under FSDP each device stores a slice of every parameter (and, since Keras
makes optimizer slots with their variable's layout, of its slots); XLA
all-gathers a parameter where the forward pass uses it and reduce-scatters
its gradient, as MaxText's `ici_fsdp_parallelism` does. Which dimension
takes the batch axis does not change the math, only the size of the pieces:

1. a parameter split over the model axis takes the batch axis on its
   largest other dimension the batch axis divides; failing that, its split
   dimension takes both axes (model major, so that gathering over the batch
   axis gives back exactly the model-axis piece) where their product
   divides it;
2. a parameter the model axis left whole (a key/value head the axis does not
   divide, a normalization scale) is stored split over both axes where two
   of its dimensions allow it (the model axis on the largest dimension it
   divides, the batch axis on the largest other one), else over the batch
   axis alone: it is gathered before use all the same;
3. an embedding table takes both axes on the dimension the model axis
   splits (the lookup then stays a masked lookup over the whole mesh);
   where the mesh does not divide it, the batch axis goes on another
   dimension and the lookup's output is relayed to batch-only (left split
   along the width over the batch axis, the looked-up rows would pull the
   activations off their batch split);
4. a parameter applied element-wise (a bias, a normalization scale) stays
   as it is: split over the batch axis, XLA would rather split the
   activations it touches that way than gather it (measured: collective
   permutes and extra all-reduces in the training step); they are small;
5. a scalar, or a parameter no dimension of which divides, stays as it is.

One dimension over two axes is a `PartitionSpec` entry naming both
(`_keras.tensor_layout` passes it through Keras' `TensorLayout`).
"""

from __future__ import annotations

from shardckpt.layout.plan import Axis


def fsdp_axes(
    shape: tuple[int, ...],
    axes: tuple[Axis, ...],
    *,
    model_axis: str,
    batch_axis: str,
    sizes: dict[str, int],
    use: str = "contract",
) -> tuple[tuple[Axis, ...], str]:
    """`axes` with the batch axis added (see the module docstring), and why.

    Args:
        shape: The parameter's shape.
        axes: Its model-axis placement (one entry per dimension).
        model_axis: The model axis name.
        batch_axis: The batch (FSDP) axis name.
        sizes: Mesh axis name -> size.
        use: How the forward pass uses the parameter (`analyze.Decision.use`).

    Returns:
        The new axes and a short reason ("" when nothing changed).
    """
    d, m = sizes[batch_axis], sizes[model_axis]
    if d == 1 or not shape:
        return axes, ""
    out = list(axes)
    by_size = sorted(range(len(shape)), key=lambda k: (-shape[k], -k))
    if use not in ("contract", "lookup"):
        return axes, "FSDP: applied element-wise, kept (split over the batch axis it would pull activations off their batch split)"
    if use == "lookup":
        split = axes.index(model_axis) if model_axis in axes else None
        if split is not None and shape[split] % (m * d) == 0:
            out[split] = (model_axis, batch_axis)
            return tuple(out), f"FSDP: looked-up dim {split} over {model_axis!r} x {batch_axis!r}"
        free = [k for k in by_size if axes[k] is None and shape[k] % d == 0]
        if free:
            # The looked-up rows come out split over the batch axis along
            # their width; the plan relays them to batch-only right after
            # the lookup (`LayoutPlan.gathered_outputs`).
            out[free[0]] = batch_axis
            return tuple(out), f"FSDP: dim {free[0]} over {batch_axis!r}, lookups gathered"
        return axes, "FSDP: a lookup table no free dimension of which the batch axis divides: kept"
    if model_axis in axes:
        split = axes.index(model_axis)
        free = [k for k in by_size if k != split and axes[k] is None and shape[k] % d == 0]
        if free:
            out[free[0]] = batch_axis
            return tuple(out), f"FSDP: dim {free[0]} over {batch_axis!r}"
        if shape[split] % (m * d) == 0:
            # Model major: gathering over the batch axis gives back exactly the model-axis piece.
            out[split] = (model_axis, batch_axis)
            return tuple(out), f"FSDP: dim {split} over {model_axis!r} x {batch_axis!r}"
        return axes, f"FSDP: no free dimension divides by {batch_axis!r} ({d}): kept"
    if any(a is not None for a in axes):
        return axes, ""  # placed by a user rule on other axes: left alone
    whole = [k for k in by_size if m > 1 and shape[k] % (m * d) == 0]
    if whole:
        out[whole[0]] = (batch_axis, model_axis)
        return tuple(out), f"FSDP: dim {whole[0]} over the whole mesh"
    part = [k for k in by_size if shape[k] % d == 0]
    if part:
        out[part[0]] = batch_axis
        return tuple(out), f"FSDP: dim {part[0]} over {batch_axis!r}"
    return axes, f"FSDP: no dimension divides by {batch_axis!r} ({d}): replicated"
