"""Decide, from how tensors flow, which dimension of each variable to split.

The planner walks the traced forward graph (`trace.py`) in execution order
and keeps, for every array, the one dimension split over the model axis
(or none). Where a variable meets an activation it decides the variable's
split, by the Megatron pairing:

- a matmul/einsum/convolution whose input is *not* split splits its weight
  along the first output dimension (column-parallel: attention heads, MLP
  up/gate features, conv output channels, experts), but only when that
  split output reaches a contraction (the next projection, or attention's
  `probs @ v` and then the output projection) before any reduction such as
  a normalization; otherwise the weight stays replicated;
- one whose input *is* split along a contracted dimension splits its
  weight the same way (row-parallel: attention output, MLP down); the
  result is a partial sum and XLA adds one all-reduce;
- one whose input is split along a batch dimension of the einsum (the
  expert dimension of a mixture of experts) splits the weight along it;
  the sum of the experts' weighted outputs then ends the split like a
  contraction (one all-reduce), so expert weights are split over experts;
- an embedding lookup splits its table over the vocabulary (a masked
  lookup plus one all-reduce), and a head that reuses the table then
  computes logits split over the vocabulary;
- a variable used element-wise (bias, normalization scale, batch-norm
  statistics) follows the split of the tensor it is applied to, so biases
  follow a column-parallel kernel and are replicated after a row-parallel
  one, and normalization weights on the replicated residual stream stay
  replicated.

Names never enter: a layer is known only by the shapes and the
contractions its variables take part in. A split the axis does not divide
falls back to replication with the reason recorded.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Final, Literal

from shardckpt.layout.decision import INDICES_ONLY, Decision
from shardckpt.layout.flow import CONTRACTED, Kept, dot_free_position, follow, is_elementwise
from shardckpt.layout.trace import Graph, Op, Value

# Ops whose output, computed from variables alone, is a view of them: the
# planner follows the variables' dimensions through to where the value meets
# an activation. `stack` and `slice` unpack int4 kernels (two nibbles per
# int8, interleaved along the packed dimension); `gather` maps sub-channel
# int4 scales to rows by their group indices (`take(scale, g_idx)`).
_PARAM_VIEWS = {"broadcast_in_dim", "transpose", "squeeze", "reshape", "stack", "slice", "gather"}
# A lookup table whose vocabulary the model axis does not divide is split
# along its width (one all-gather of the looked-up rows) only when it holds
# at least this share of the parameters; smaller ones (token types, a
# handful of rows) cost less replicated than an all-gather per lookup.
_SMALL_TABLE = 0.01


class _Undecided(enum.Enum):
    """The type of `_UNDECIDED` (an enum member, so `is _UNDECIDED` narrows types)."""

    TOKEN = 0


_UNDECIDED: Final = _Undecided.TOKEN


class _Planner:
    def __init__(self, graph: Graph, axis_size: int, banned: frozenset[int] = frozenset()) -> None:
        self.graph = graph
        self.n = axis_size
        # Variables whose second-choice split met another split in one op
        # (a conflict XLA resolves with an all-gather) in an earlier run.
        self.banned = banned
        self.alternates: set[int] = set()  # variables split on a second-choice dimension
        self.blame: dict[Value, frozenset[int]] = {}  # split value -> the alternates it comes from
        self.conflicts: set[int] = set()
        self.decided: dict[int, Decision] = {}
        self.split: dict[Value, int] = {}
        # Values computed from variables alone (views, or element-wise math
        # such as batch norm's `gamma * rsqrt(variance)`): for each variable,
        # (variable index, value dim -> variable dim or None).
        self.origin: dict[Value, list[tuple[int, tuple[int | None, ...]]]] = {}
        for v in graph.params:
            assert v.param is not None, "Graph.params holds variables' values, each with its index"
            self.origin[v] = [(v.param, tuple(range(len(v.shape))))]
        self._good: dict[tuple[int, int], bool] = {}
        self.indices: set[int] = set()  # variables used as the indices of a lookup into another variable
        self.use = "contract"  # how the op being decided uses its variables (Decision.use)
        self.total = sum(math.prod(v.shape) for v in graph.params)

    # -- state -----------------------------------------------------------
    def effective(self, value: Value) -> int | None | Literal[_Undecided.TOKEN]:
        """The split dim of `value`, None, or _UNDECIDED (built from an undecided variable)."""
        if value not in self.origin:
            return self.split.get(value)
        found = None
        for p, dims in self.origin[value]:
            if p not in self.decided:
                return _UNDECIDED
            d = self.decided[p].dim
            if found is None and d is not None and d in dims:
                found = dims.index(d)
        return found

    def decide(self, p: int, dim: int | None, reason: str, *, fallback: bool = False) -> None:
        if p not in self.decided:
            self.decided[p] = Decision(dim, reason, fallback, use=self.use)

    def assign(self, value: Value, vdim: int | None, reason: str, *, fallback: bool = False, note: str = "") -> None:
        """Decides every undecided variable behind `value`: split on `vdim` of the value, or not."""
        for p, dims in self.origin[value]:
            if p in self.decided:
                continue
            if vdim is None or vdim >= len(dims):
                self.decide(p, None, reason if vdim is None else "a scalar: replicated")
                continue
            pdim = dims[vdim]
            shape = self.graph.params[p].shape
            if pdim is None and p in self.indices:
                self.decide(p, None, INDICES_ONLY)
            elif pdim is None:
                if value.shape[vdim] != 1 and len(shape) and math.prod(shape) == value.shape[vdim]:
                    self.decide(p, None, "the split dimension does not survive a reshape: replicated", fallback=True)
                else:
                    self.decide(p, None, "broadcast along the split dimension: replicated")
            elif shape[pdim] % self.n:
                self.decide(
                    p,
                    None,
                    f"{reason.split(':')[0]} wanted on dim {pdim} ({shape[pdim]}), which "
                    f"the model axis ({self.n}) does not divide: replicated{note}",
                    fallback=True,
                )
            else:
                self.decide(p, pdim, reason, fallback=fallback)

    def divides(self, value: Value, vdim: int) -> bool:
        """Whether the model axis divides every variable dimension behind `value`'s `vdim`."""
        for p, dims in self.origin.get(value, ()):
            if vdim >= len(dims):
                return False
            pdim = dims[vdim]
            if pdim is not None and self.graph.params[p].shape[pdim] % self.n:
                return False
        return value.shape[vdim] % self.n == 0

    # -- lookahead ---------------------------------------------------------
    def reaches_contraction(self, value: Value, dim: int) -> bool:
        """Whether a split of `value` along `dim` ends in contractions only."""
        key = (id(value), dim)
        if key in self._good:
            return self._good[key]
        self._good[key] = False  # cycle guard (graphs are acyclic; cheap insurance)
        ok = True
        if not value.is_output:
            for op, pos in value.consumers:
                where = follow(op, pos, dim)
                if where is CONTRACTED:
                    continue
                if not isinstance(where, Kept) or not where.outputs:
                    ok = False
                    break
                if not all(self.reaches_contraction(out, j) for out, j in where.outputs):
                    ok = False
                    break
        self._good[key] = ok
        return ok

    # -- decisions -----------------------------------------------------------
    def column(self, value: Value, vdim: int, op: Op, out_dim: int, what: str, note: str = "") -> None:
        if value.shape[vdim] % self.n:
            self.assign(value, vdim, what, note=note)
        elif self.reaches_contraction(op.outputs[0], out_dim):
            self.assign(value, vdim, what)
        else:
            self.assign(
                value,
                None,
                "its output feeds a reduction (e.g. a normalization) before any "
                "contraction, so a split output would need an all-gather: replicated",
            )

    def column_any(self, value: Value, op: Op, ppos: int, free: list[int], what: str) -> None:
        """Column-parallel on the first free dim; where the axis does not divide it, the next one that works.

        The next free dimension (a head dimension where heads do not divide)
        is taken only where its split output still ends in contractions: the
        scores of attention then contract the split head dimension, so XLA
        adds one all-reduce (of the scores) per attention, recorded in the
        reason.
        """
        first = free[0]
        if self.divides(value, first) or len(free) == 1:
            self.column(value, first, op, dot_free_position(op, ppos, first), what)
            return
        params = {p for p, _ in self.origin.get(value, ())}
        # Why no next dimension works, for the reason recorded where none does.
        note = (
            "; a split of the next dimension met a differently split operand (XLA would gather one)"
            if params & self.banned else ""
        )
        for dim in free[1:] if not params & self.banned else ():
            if not self.divides(value, dim):
                continue
            if not self.reaches_contraction(op.outputs[0], dot_free_position(op, ppos, dim)):
                note = note or (
                    f"; a split of dim {dim} ({value.shape[dim]}) would not reach a contraction whole "
                    "(e.g. rotary embeddings cut it in halves, or a norm reduces over it)"
                )
                continue
            self.alternates |= params
            self.assign(
                value,
                dim,
                f"column-parallel on dim {dim} ({value.shape[dim]}): the model axis ({self.n}) does not "
                f"divide dim {first} ({value.shape[first]}, heads); the split dimension is contracted "
                "later (one more all-reduce, e.g. of attention scores)",
                fallback=True,
            )
            return
        self.column(value, first, op, dot_free_position(op, ppos, first), what, note)

    def dot(self, op: Op, ppos: int) -> None:
        value = op.inputs[ppos]
        a = self.effective(op.inputs[1 - ppos])
        (lc, rc), (lb, rb) = op.params["dimension_numbers"]
        pc, pb = (lc, lb) if ppos == 0 else (rc, rb)
        ac, ab = (lc, lb) if ppos == 1 else (rc, rb)
        if a is _UNDECIDED:
            a = None
        if a is not None and a in ac:
            self.assign(
                value,
                pc[list(ac).index(a)],
                "row-parallel: contracts the split dimension of its input "
                "(partial sums, one all-reduce after)",
            )
        elif a is not None and a in ab:
            self.assign(value, pb[list(ab).index(a)], "split along the batch (expert) dimension its input is split on")
        elif a is not None:
            self.assign(value, None, "its input is already split along a free dimension: replicated")
        elif pb:
            self.column(value, pb[0], op, 0, "batch-dimension split (experts): each device computes its own")
        else:
            free = [d for d in range(len(value.shape)) if d not in pc]
            if not free:
                self.assign(value, None, "contracted entirely (no output dimension): replicated")
                return
            self.column_any(
                value,
                op,
                ppos,
                free,
                "column-parallel: first output dimension split (heads / features), "
                "consumed by a later contraction",
            )

    def conv(self, op: Op) -> None:
        value = op.inputs[1]
        numbers = op.params["dimension_numbers"]
        a = self.effective(op.inputs[0])
        a = None if a is _UNDECIDED else a
        grouped = op.params.get("feature_group_count", 1) > 1
        if a == numbers.lhs_spec[1]:
            if grouped:
                self.assign(value, numbers.rhs_spec[0], "grouped conv: output channels follow the input's split channels")
            else:
                self.assign(
                    value,
                    numbers.rhs_spec[1],
                    "row-parallel conv: contracts its input's split channels (one all-reduce after)",
                )
        elif a is None and not grouped:
            self.column(value, numbers.rhs_spec[0], op, numbers.out_spec[1], "column-parallel conv: output channels split")
        else:
            self.assign(value, None, "conv input split along a non-channel dimension, or grouped on a replicated input: replicated")

    def gather(self, op: Op) -> None:
        numbers = op.params["dimension_numbers"]
        if len(numbers.collapsed_slice_dims) != 1:
            self.assign(op.inputs[0], None, "multi-dimensional lookup: replicated")
            return
        table, vocab = op.inputs[0], numbers.collapsed_slice_dims[0]
        if not self.divides(table, vocab):
            others = [d for d in range(len(table.shape)) if d != vocab and self.divides(table, d)]
            if others and math.prod(table.shape) < _SMALL_TABLE * self.total:
                self.assign(
                    table,
                    None,
                    f"the model axis ({self.n}) does not divide the vocabulary ({table.shape[vocab]}); a split "
                    f"along dim {others[0]} would gather every lookup for a table under "
                    f"{_SMALL_TABLE:.0%} of the parameters: replicated",
                    fallback=True,
                )
                return
            if others:
                self.assign(
                    table,
                    others[0],
                    f"the model axis ({self.n}) does not divide the vocabulary ({table.shape[vocab]}): split "
                    f"on dim {others[0]} ({table.shape[others[0]]}) instead; each device looks up its slice "
                    "of every row, gathered once after the lookup",
                    fallback=True,
                )
                for p, _ in self.origin.get(table, ()):
                    if self.decided[p].dim is not None:
                        self.decided[p] = dataclasses.replace(self.decided[p], gather_output=True)
                return
        self.assign(table, vocab, "vocabulary split: masked lookup on each device, one all-reduce after")

    def elementwise(self, op: Op) -> None:
        splits = [self.effective(v) for v in op.inputs]
        active = next((s for s in splits if s is not None and s is not _UNDECIDED), None)
        for value, s in zip(op.inputs, splits):
            if s is not _UNDECIDED:
                continue
            if active is None:
                self.assign(value, None, "applied to a replicated tensor: replicated")
            else:
                self.assign(value, active, "follows the split of the tensor it is applied to")

    # -- walk --------------------------------------------------------------
    def param_view(self, op: Op) -> bool:
        """Records `op`'s output as computed from variables alone, when it is."""
        if len(op.outputs) != 1 or not any(v in self.origin for v in op.inputs):
            return False
        if any(v not in self.origin and v.shape != () for v in op.inputs):
            return False
        if op.name not in _PARAM_VIEWS and not is_elementwise(op):
            return False
        out = op.outputs[0]
        sources = []
        for pos, src in enumerate(op.inputs):
            if op.name == "gather" and pos == 1:
                self.indices.update(p for p, _ in self.origin.get(src, ()))
            for p, dims in self.origin.get(src, ()):
                new: list[int | None] = [None] * len(out.shape)
                for d, pdim in enumerate(dims):
                    if pdim is None or src.shape[d] == 1:
                        continue
                    where = follow(op, pos, d)
                    if isinstance(where, Kept):
                        for value, j in where.outputs:
                            if value is out:
                                new[j] = pdim
                sources.append((p, tuple(new)))
        self.origin[out] = sources
        return True

    def run(self) -> dict[int, Decision]:
        for op in self.graph.ops:
            if self.param_view(op):
                continue
            undecided = [i for i, v in enumerate(op.inputs) if self.effective(v) is _UNDECIDED]
            if undecided:
                self.use = {"dot_general": "contract", "conv_general_dilated": "contract", "gather": "lookup"}.get(
                    op.name, "elementwise" if is_elementwise(op) else "other"
                )
                if op.name == "dot_general":
                    for i in undecided:
                        self.dot(op, i)
                elif op.name == "conv_general_dilated" and undecided == [1]:
                    self.conv(op)
                elif op.name == "gather" and undecided == [0]:
                    self.gather(op)
                elif is_elementwise(op):
                    self.elementwise(op)
                else:
                    for i in undecided:
                        self.assign(op.inputs[i], None, f"used by `{op.name}`, which the planner does not split: replicated")
            landed: list[tuple[object, frozenset[int]]] = []
            for pos, value in enumerate(op.inputs):
                s = self.effective(value)
                if s is None or s is _UNDECIDED:
                    continue
                if op.name == "gather" and pos == 0 and s not in op.params["dimension_numbers"].collapsed_slice_dims:
                    # A table split along its rows' width (the vocabulary did not
                    # divide): the looked-up rows are gathered once, and the rest
                    # of the model sees them whole, as with a vocabulary split.
                    continue
                where = follow(op, pos, s)
                blame = self.blame_of(value)
                if isinstance(where, Kept):
                    landed.append((tuple(j for _, j in where.outputs), blame))
                    for out, j in where.outputs:
                        self.split.setdefault(out, j)
                        if blame:
                            self.blame[out] = self.blame.get(out, frozenset()) | blame
                elif where is CONTRACTED:
                    landed.append(("contracted", blame))
            if len({where for where, _ in landed}) > 1:
                # Two operands split differently meet here (say attention
                # probabilities split over heads and values over the head
                # dimension): XLA would gather one of them.
                for _, blame in landed:
                    self.conflicts |= blame
        self.use = "contract"
        for value in self.graph.params:
            self.unused(value)
        return self.decided

    def blame_of(self, value: Value) -> frozenset[int]:
        """The second-choice splits behind `value`'s split."""
        if value in self.origin:
            return frozenset(p for p, _ in self.origin[value] if p in self.alternates)
        return self.blame.get(value, frozenset())

    def unused(self, value: Value) -> None:
        """A variable the forward pass never reads (e.g. an untied output head of a backbone).

        No computation here pairs with it, so no split costs communication in
        this pass; it is split along its largest dimension the axis divides
        (the last of equals: the output features of a kernel), which is where
        a later column-parallel use (logits over the vocabulary) splits it.
        """
        shape, param = value.shape, value.param
        if param is None:  # not a variable
            return
        dims = [d for d in range(len(shape)) if shape[d] > 1 and shape[d] % self.n == 0]
        if not dims:
            self.decide(param, None, "not used by the traced forward pass, and no dimension divides: replicated")
            return
        dim = max(dims, key=lambda d: (shape[d], d))
        self.decide(
            param,
            dim,
            "not used by the traced forward pass (nothing to pair with): split along its largest dimension",
        )


def plan_splits(graph: Graph, axis_size: int) -> dict[int, Decision]:
    """Decides the model-axis split of every variable in `graph`.

    Args:
        graph: The traced forward graph (`trace.trace_model`).
        axis_size: Devices along the model axis.

    Returns:
        A `Decision` per variable index (the model's `variables` order).
    """
    banned: frozenset[int] = frozenset()
    while True:
        planner = _Planner(graph, axis_size, banned)
        decided = planner.run()
        if not planner.conflicts - banned:
            return decided
        # Plan again without the second-choice splits that met another split.
        banned |= planner.conflicts
