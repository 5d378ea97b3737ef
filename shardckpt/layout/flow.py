"""Where a split dimension goes through one operation.

`follow(op, pos, dim)` answers: if operand `pos` of `op` is split along
`dim`, which output dimensions carry that split? The answer is one of

- `Kept(((output, dim), ...))`: the split passes through with no
  communication (element-wise ops, reshapes that keep the split major,
  transposes, the batch and free dimensions of a matmul);
- `CONTRACTED`: the op sums over the split dimension (a matmul or
  convolution contraction, an embedding lookup over a split vocabulary, a
  sum of a matmul's product that nothing else reads):
  each device holds a partial result, and one all-reduce completes it;
- `LOST`: anything else (a reduction such as a normalization's mean, a
  reshape that scatters the split, an op this module does not know): the
  split would have to be gathered first.
"""

from __future__ import annotations

import dataclasses
import math

from shardckpt.layout.trace import Op, Value


@dataclasses.dataclass(frozen=True)
class Kept:
    """The split continues on these `(output value, dimension)` pairs."""

    outputs: tuple[tuple[Value, int], ...]


class _Marker:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


CONTRACTED = _Marker("CONTRACTED")
LOST = _Marker("LOST")

# Ops whose output keeps the operand's layout one to one (besides the
# element-wise ops recognised by shape).
_VIEW_OPS = {"convert_element_type", "copy", "copy_p", "reduce_precision", "stop_gradient", "optimization_barrier"}
_REDUCTIONS = {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "argmax", "argmin"}
_SCANS = {"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"}


def follow(op: Op, pos: int, dim: int) -> Kept | _Marker:
    """Where a split of operand `pos` along `dim` goes (see the module docstring)."""
    handler = _HANDLERS.get(op.name)
    if handler is not None:
        return handler(op, pos, dim)
    if is_elementwise(op):
        return Kept(tuple((out, dim) for out in op.outputs))
    return LOST


def is_elementwise(op: Op) -> bool:
    """Same-rank operands whose dims equal the output's or are 1 (or scalars)."""
    if op.name in _VIEW_OPS:
        return True
    if not op.outputs:
        return False
    shape = op.outputs[0].shape
    if any(o.shape != shape for o in op.outputs):
        return False
    for value in op.inputs:
        if value.shape == ():
            continue
        if len(value.shape) != len(shape):
            return False
        if any(a != b and a != 1 for a, b in zip(value.shape, shape)):
            return False
    return True


def _broadcast(op: Op, pos: int, dim: int) -> Kept | _Marker:
    out = op.outputs[0]
    target = op.params["broadcast_dimensions"][dim]
    if op.inputs[0].shape[dim] != out.shape[target]:
        return LOST
    return Kept(((out, int(target)),))


def _transpose(op: Op, pos: int, dim: int) -> Kept | _Marker:
    return Kept(((op.outputs[0], list(op.params["permutation"]).index(dim)),))


def _squeeze(op: Op, pos: int, dim: int) -> Kept | _Marker:
    removed = sorted(d % len(op.inputs[0].shape) for d in op.params["dimensions"])
    if dim in removed:
        return LOST
    return Kept(((op.outputs[0], dim - sum(1 for d in removed if d < dim)),))


def reshape_dim(src: tuple[int, ...], dst: tuple[int, ...], dim: int) -> int | None:
    """The output dim a split of `src[dim]` lands on, or None if it is scattered.

    A split survives a reshape when it stays the major (outermost) part of
    its group: `(8 heads, 16) -> 128` keeps a head split as contiguous
    blocks of 128, and `64 -> (8, 8)` moves a split onto the first 8.
    """
    if src[dim] == 1:
        return None
    before = math.prod(src[:dim])
    acc = 1
    for j, size in enumerate(dst):
        if acc == before and size != 1:
            # The dst dim starts where src[dim] starts; the split survives if
            # one of them is a whole multiple of the other.
            if size % src[dim] == 0 or src[dim] % size == 0:
                return j
            return None
        acc *= size
        if acc > before:
            return None
    return None


def _reshape(op: Op, pos: int, dim: int) -> Kept | _Marker:
    if pos != 0 or op.params.get("dimensions") is not None:
        return LOST
    out = op.outputs[0]
    j = reshape_dim(op.inputs[0].shape, out.shape, dim)
    return LOST if j is None else Kept(((out, j),))


def _reduce(op: Op, pos: int, dim: int) -> Kept | _Marker:
    axes = op.params.get("axes", ())
    if dim in axes:
        if op.name == "reduce_sum" and _sole_product_of_contraction(op.inputs[pos]):
            # A sum over the split dimension of a matmul's product that
            # nothing else reads combines partial results (a mixture of
            # experts summing its experts' weighted outputs): each device
            # sums its part and one all-reduce completes it, as for a
            # contraction.
            return CONTRACTED
        if op.name == "reduce_max":
            # A maximum over the split dimension (the absolute maximum that
            # int8 / float8 layers quantize their inputs by): each device
            # takes its part's maximum, and one all-reduce (max) of the
            # reduced, small tensor completes it; the split input itself
            # goes on to its contraction.
            return CONTRACTED
        return LOST
    return Kept(tuple((out, dim - sum(1 for a in axes if a < dim)) for out in op.outputs))


# How far back `_sole_product_of_contraction` looks through element-wise ops.
_SUM_LOOKBACK = 6


def _sole_product_of_contraction(value: Value, depth: int = _SUM_LOOKBACK) -> bool:
    """Whether `value` is a matmul's output, possibly weighted element-wise, used only here.

    A normalization sums a tensor that is also used whole (`x - mean(x)`,
    `x * rsqrt(mean(x * x))`; softmax's `exp(x) / sum(exp(x))`): summing it
    split would not spare gathering it. Each tensor on the way back to the
    matmul must therefore have this one use.
    """
    if len(value.consumers) != 1 or value.producer is None or depth == 0:
        return False
    op = value.producer
    if op.name == "dot_general":
        return True
    if not (is_elementwise(op) or op.name in ("transpose", "reshape", "broadcast_in_dim")):
        return False
    return any(
        v.shape == value.shape and _sole_product_of_contraction(v, depth - 1)
        for v in op.inputs
        if len(v.shape) == len(value.shape)
    )


def _scan(op: Op, pos: int, dim: int) -> Kept | _Marker:
    if op.params.get("axis") == dim:
        return LOST
    return Kept(((op.outputs[0], dim),))


def _dot_general(op: Op, pos: int, dim: int) -> Kept | _Marker:
    (lc, rc), (lb, rb) = op.params["dimension_numbers"]
    contract, batch = (lc, lb) if pos == 0 else (rc, rb)
    if dim in contract:
        return CONTRACTED
    if dim in batch:
        return Kept(((op.outputs[0], list(batch).index(dim)),))
    return Kept(((op.outputs[0], dot_free_position(op, pos, dim)),))


def dot_free_position(op: Op, pos: int, dim: int) -> int:
    """Output position of free dim `dim` of operand `pos` of a dot_general."""
    (lc, rc), (lb, rb) = op.params["dimension_numbers"]
    lhs_free = [d for d in range(len(op.inputs[0].shape)) if d not in lc and d not in lb]
    rhs_free = [d for d in range(len(op.inputs[1].shape)) if d not in rc and d not in rb]
    if pos == 0:
        return len(lb) + lhs_free.index(dim)
    return len(lb) + len(lhs_free) + rhs_free.index(dim)


def _conv(op: Op, pos: int, dim: int) -> Kept | _Marker:
    numbers = op.params["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = numbers.lhs_spec, numbers.rhs_spec, numbers.out_spec
    groups = op.params.get("feature_group_count", 1)
    out = op.outputs[0]
    if pos == 0:
        if dim == lhs_spec[0] and op.params.get("batch_group_count", 1) == 1:
            return Kept(((out, out_spec[0]),))
        if dim == lhs_spec[1]:
            # A grouped (depthwise) conv keeps channels apart: no sum over them.
            return Kept(((out, out_spec[1]),)) if groups > 1 else CONTRACTED
        return LOST
    if dim == rhs_spec[0]:
        return Kept(((out, out_spec[1]),))
    if dim == rhs_spec[1]:
        return CONTRACTED
    return LOST


def _gather(op: Op, pos: int, dim: int) -> Kept | _Marker:
    numbers = op.params["dimension_numbers"]
    if pos != 0:
        return LOST
    if dim in numbers.operand_batching_dims:
        # `take_along_axis` (a batched gather): the operand's batching dim is
        # matched with one of the indices' dims, which lands on the output
        # where the indices' dims go (output dims that are not offset dims;
        # the indices' last dim holds the index vector).
        k = numbers.start_indices_batching_dims[list(numbers.operand_batching_dims).index(dim)]
        index_dims = list(range(len(op.inputs[1].shape) - 1))
        out_batch = [d for d in range(len(op.outputs[0].shape)) if d not in numbers.offset_dims]
        if k not in index_dims or len(out_batch) != len(index_dims):
            return LOST
        return Kept(((op.outputs[0], out_batch[index_dims.index(k)]),))
    if numbers.operand_batching_dims:
        return LOST
    if dim in numbers.collapsed_slice_dims:
        # A lookup into a split table: each device answers the ids it holds
        # (the rest masked to zero) and an all-reduce sums the answers.
        return CONTRACTED
    if op.params["slice_sizes"][dim] != op.inputs[0].shape[dim]:
        return LOST
    kept = [d for d in range(len(op.inputs[0].shape)) if d not in numbers.collapsed_slice_dims]
    return Kept(((op.outputs[0], numbers.offset_dims[kept.index(dim)]),))


def _concatenate(op: Op, pos: int, dim: int) -> Kept | _Marker:
    if op.params["dimension"] == dim:
        return LOST
    return Kept(((op.outputs[0], dim),))


def _slice(op: Op, pos: int, dim: int) -> Kept | _Marker:
    if pos != 0 or op.outputs[0].shape[dim] != op.inputs[0].shape[dim]:
        return LOST
    return Kept(((op.outputs[0], dim),))


def _pad(op: Op, pos: int, dim: int) -> Kept | _Marker:
    if pos != 0 or tuple(op.params["padding_config"][dim]) != (0, 0, 0):
        return LOST
    return Kept(((op.outputs[0], dim),))


def _sort(op: Op, pos: int, dim: int) -> Kept | _Marker:
    if op.params["dimension"] == dim:
        return LOST
    return Kept(tuple((out, dim) for out in op.outputs))


def _stack(op: Op, pos: int, dim: int) -> Kept | _Marker:
    # `stack` (a primitive since JAX 0.8) inserts a new axis; existing dims
    # at or after it move one place up.
    axis = op.params["axis"] % len(op.outputs[0].shape)
    return Kept(((op.outputs[0], dim if dim < axis else dim + 1),))


def _top_k(op: Op, pos: int, dim: int) -> Kept | _Marker:
    if dim == len(op.inputs[0].shape) - 1:
        return LOST
    return Kept(tuple((out, dim) for out in op.outputs))


def _split(op: Op, pos: int, dim: int) -> Kept | _Marker:
    if op.params["axis"] == dim:
        return LOST
    return Kept(tuple((out, dim) for out in op.outputs))


_HANDLERS = {
    "broadcast_in_dim": _broadcast,
    "transpose": _transpose,
    "squeeze": _squeeze,
    "reshape": _reshape,
    "dot_general": _dot_general,
    "conv_general_dilated": _conv,
    "gather": _gather,
    "concatenate": _concatenate,
    "slice": _slice,
    "dynamic_slice": _slice,
    "pad": _pad,
    "sort": _sort,
    "top_k": _top_k,
    "stack": _stack,
    "split": _split,
    **{name: _reduce for name in _REDUCTIONS},
    **{name: _scan for name in _SCANS},
}
