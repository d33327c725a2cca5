"""The row-alignment rules of the sharding analysis, and the graph surgery it needs.

:func:`propagate` is called for every node that has a row-aligned input (see
:mod:`dasktensor.sharding._analysis` for the argument why these rules are exact).  It returns an
:class:`Outcome`: the status of each output (a :class:`Row`, ``None`` for a value that does
not depend on rows, or :data:`TOTAL` for a total over rows), and, when a shard must compute
the node differently from the node itself, how.  A node that no rule accepts raises
:class:`Reject` with the reason shown to the user.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pytensor.tensor as pt
from pytensor.graph.basic import Apply, Constant, Variable
from pytensor.graph.fg import FunctionGraph
from pytensor.scalar import basic as ps
from pytensor.tensor import blas
from pytensor.tensor import subtensor as st
from pytensor.tensor.basic import Alloc
from pytensor.tensor.blockwise import Blockwise
from pytensor.tensor.elemwise import CAReduce, DimShuffle, Elemwise
from pytensor.tensor.math import Dot
from pytensor.tensor.shape import Shape, Shape_i, SpecifyShape
from pytensor.tensor.type import TensorType
from pytensor.tensor.type_other import SliceType

from dasktensor import _compat

try:  # PyTensor 3: fused and scalarized Ops wrapping ordinary inner graphs
    from pytensor.compile.builders import FinalizedOpFromGraph as _Finalized
except ImportError:  # pragma: no cover - PyTensor 2.38 has none
    _Finalized = ()

#: status of a value that depends on a total over rows (an accumulation or after one)
TOTAL = "total"
#: how the partial values of a reduction over rows combine, by the reduction's scalar op
KINDS = {
    ps.Add: "add",
    ps.Mul: "mul",
    ps.AND: "and",
    ps.OR: "or",
    ps.Maximum: "max",
    ps.Minimum: "min",
}
_ADV1 = tuple(getattr(st, n) for n in ("AdvancedSubtensor1",) if hasattr(st, n))
_ADVINC1 = tuple(getattr(st, n) for n in ("AdvancedIncSubtensor1",) if hasattr(st, n))


class Reject(Exception):
    """A node makes the function not shardable; the message says why."""


@dataclass(frozen=True)
class Row:
    """Status of a row-aligned value: ``axis`` is its row axis, ``origin`` a data label."""

    axis: int
    origin: str


@dataclass(frozen=True)
class Build:
    """A node's replacement: ``fn(*new values of inputs)`` returns its new outputs."""

    inputs: tuple[Variable, ...]
    fn: Callable[..., list[Variable]]


@dataclass(frozen=True)
class Outcome:
    """What a rule says of one node.

    ``shard`` builds the node in a shard (``None``: the node itself, on the shard's
    values).  An *accumulation* has a ``kind`` (how its shard values combine) and its
    single output is a total; ``finish`` builds that output from ``finish.inputs`` and
    the total (``None``: the output is the total).  ``replace`` is a constant that stands
    for the node's single output everywhere.
    """

    statuses: tuple
    shard: Build | None = None
    kind: str | None = None
    finish: Build | None = None
    replace: Variable | None = None


def _name(node: Apply) -> str:
    text = str(node.op)
    return text if len(text) <= 60 else text[:57] + "..."


def _row(status) -> Row | None:
    return status if isinstance(status, Row) else None


def is_zero(var: Variable) -> bool:
    """Whether ``var`` is a constant zero, or an ``Alloc``, ``fill`` or view of one."""
    if isinstance(var, Constant):
        return bool(np.all(np.asarray(var.data) == 0))
    op = var.owner.op if var.owner is not None else None
    if isinstance(op, Elemwise) and isinstance(op.scalar_op, ps.Second):
        return is_zero(var.owner.inputs[1])
    if isinstance(op, DimShuffle):
        return is_zero(var.owner.inputs[0])
    return isinstance(op, Alloc) and is_zero(var.owner.inputs[0])


def common_axis(
    node: Apply, vars_: Sequence[Variable], status, ndim: int, dims: Sequence[int] | None = None
) -> Row:
    """The row axis of ``vars_`` broadcast together (right-aligned) to ``ndim`` dimensions.

    Only the leading ``dims[i]`` dimensions of ``vars_[i]`` broadcast (all by default).
    Every row-aligned value must put its row axis at the same place, and every other one
    must broadcast along it (a static length 1 there, or too few dimensions to reach it).
    """
    dims = [v.type.ndim for v in vars_] if dims is None else dims
    rows = [(d, r) for v, d in zip(vars_, dims, strict=True) if (r := _row(status(v))) is not None]
    places = {r.axis + ndim - d if r.axis < d else -1 for d, r in rows}
    if len(places) != 1 or -1 in places:
        raise Reject(
            f"{_name(node)} mixes rows: it combines values whose row axes differ "
            f"(from '{rows[0][1].origin}')"
        )
    [place] = places
    for v, d in zip(vars_, dims, strict=True):
        j = place - (ndim - d)
        if _row(status(v)) is None and j >= 0 and not v.type.broadcastable[j]:
            raise Reject(
                f"{_name(node)} combines a row-aligned value (from "
                f"'{rows[0][1].origin}') with a non-row value that does not "
                "broadcast along the row axis"
            )
    return Row(place, rows[0][1].origin)


def _dot(node, status):
    """Dot, Dot22, Dot22Scalar and Blockwise Dot (matmul): keep the rows, or contract them.

    The rows are an axis of the core ``(m, n) @ (n, p)`` product (or a batch axis of a
    Blockwise one: then each row is a batch item).
    """
    a, b = node.inputs[:2]
    batch = node.op.batch_ndim(node) if isinstance(node.op, Blockwise) else 0
    ra, rb = _row(status(a)), _row(status(b))
    ca = ra.axis - (a.type.ndim - 2) if ra else None
    cb = rb.axis - (b.type.ndim - 2) if rb else None
    if (ca is not None and ca < 0) or (cb is not None and cb < 0):
        return _blockwise(node, status)
    if ca == 1 and cb == 0:
        return Outcome((TOTAL,), kind="add")
    if ca == 0 and not rb:
        return Outcome((Row(batch, ra.origin),))
    if cb == 1 and not ra:
        return Outcome((Row(batch + 1, rb.origin),))
    origin = (ra or rb).origin
    raise Reject(f"{_name(node)} mixes rows of a row-aligned value (from '{origin}')")


def _blas(node, status):
    """Gemv and Gemm, ``beta * z + alpha * dot(a, b)``: rebuilt from ``dot`` in a shard.

    A contraction over rows accumulates ``alpha * dot(a, b)`` per shard; ``beta * z`` is
    added once, when the totals are finished.  Otherwise ``z`` must be row-aligned like
    the product (or ignored: ``beta == 0``).
    """
    z, alpha, a, b, beta = node.inputs
    ra, rb, rz = (_row(status(v)) for v in (a, b, z))
    keep_z = not is_zero(beta)

    def product(alpha_, a_, b_, *zb):
        out = alpha_ * pt.dot(a_, b_)
        return [(out + zb[1] * zb[0]) if zb else out]

    if ra and rb and ra.axis == 1 and rb.axis == 0:
        if rz is not None:
            raise Reject(f"{_name(node)} adds a row-aligned value to a sum over rows")
        finish = Build((z, beta), lambda z_, b_, t: [b_ * z_ + t]) if keep_z else None
        return Outcome((TOTAL,), shard=Build((alpha, a, b), product), kind="add", finish=finish)
    axis = 0 if ra and not rb and ra.axis == 0 else 1 if rb and not ra and rb.axis == 1 else None
    if axis is None or (keep_z and (rz is None or rz.axis != axis)):
        origin = (ra or rb or rz).origin
        raise Reject(f"{_name(node)} mixes rows of a row-aligned value (from '{origin}')")
    inputs = (alpha, a, b, z, beta) if keep_z else (alpha, a, b)
    return Outcome((Row(axis, (ra or rb).origin),), shard=Build(inputs, product))


def _subtensor(node, status):
    """Basic indexing that takes every row (``x[:, 0]``, ``X[:, :2]``) keeps them."""
    row = _row(status(node.inputs[0]))
    entries = node.op.idx_list
    if not row or (row.axis < len(entries) and entries[row.axis] != slice(None)):
        _unknown(node, status, "Subtensor")
    dropped = sum(not isinstance(e, slice) for e in entries[: row.axis])
    return Outcome((Row(row.axis - dropped, row.origin),))


def _index_entries(node, first: int) -> list[Variable | None]:
    """The indices of an advanced (inc)subtensor: a variable per advanced index, None
    for a slice, on both lines (PyTensor 3 keeps an ``idx_list``, 2.38 slice variables).
    """
    rest = list(node.inputs[first:])
    if isinstance(node.op, _ADV1 + _ADVINC1):
        return rest
    if hasattr(node.op, "idx_list"):
        return [rest[e] if isinstance(e, int) else None for e in node.op.idx_list]
    entries = []
    for v in rest:
        if isinstance(v.type, SliceType):
            entries.append(None)
        elif isinstance(v.type, TensorType):
            entries.append(v)
        else:
            raise Reject(f"{_name(node)} indexes with {v.type}")
    return entries


def _gather_axis(node, x, entries, status) -> tuple[Row, int]:
    """Row status of ``x[entries]`` and its number of dimensions; ``x`` is not row-aligned.

    The advanced indices broadcast together into a block placed where the first of them
    is (at the front if they are not adjacent), as in NumPy.
    """
    if _row(status(x)):
        raise Reject(
            f"{_name(node)} indexes a row-aligned value (from '{status(x).origin}'): it mixes rows"
        )
    adv = [i for i, e in enumerate(entries) if e is not None]
    if not any(_row(status(entries[i])) for i in adv):
        _unknown(node, status, "Subtensor")  # rows in the increment, not in the index
    if any(entries[i].type.dtype == "bool" for i in adv):
        raise Reject(f"{_name(node)} indexes with a boolean mask over rows")
    width = max(entries[i].type.ndim for i in adv)
    row = common_axis(node, [entries[i] for i in adv], status, width)
    start = adv[0] if adv == list(range(adv[0], adv[-1] + 1)) else 0
    return Row(start + row.axis, row.origin), x.type.ndim - len(adv) + width


def _gather(node, status):
    row, _ = _gather_axis(node, node.inputs[0], _index_entries(node, 1), status)
    return Outcome((row,))


def _scatter(node, status):
    """``x[idx] += y`` with row-aligned indices: a sum over rows, added to ``x`` once."""
    op = node.op
    if op.set_instead_of_inc or getattr(op, "ignore_duplicates", False):
        raise Reject(f"{_name(node)} sets values by row index: not a sum over rows")
    x, y = node.inputs[:2]
    row, ndim = _gather_axis(node, x, _index_entries(node, 2), status)
    yrow, j = _row(status(y)), row.axis - (ndim - y.type.ndim)
    if yrow and yrow.axis != j:
        raise Reject(f"{_name(node)} mixes rows (its increment and index disagree)")
    if not yrow and j >= 0 and not y.type.broadcastable[j]:
        raise Reject(f"{_name(node)} adds a non-row value along the rows")
    inc = type(op)(**{**op._props_dict(), "inplace": False})
    if is_zero(x):
        return Outcome((TOTAL,), shard=Build(tuple(node.inputs), lambda *v: [inc(*v)]), kind="add")
    shape = x.type.shape
    if None not in shape:
        zeros_of = (), lambda: pt.zeros(shape, dtype=x.dtype)
    elif status(x) is None:
        zeros_of = (x,), pt.zeros_like
    else:
        raise Reject(f"{_name(node)} increments a total of unknown shape by row index")
    deps, zeros = zeros_of
    rest = tuple(node.inputs[1:])
    return Outcome(
        (TOTAL,),
        kind="add",
        shard=Build(deps + rest, lambda *v: [inc(zeros(*v[: len(deps)]), *v[len(deps) :])]),
        finish=Build((x,), lambda x_, t: [x_ + t]),
    )


def reduction_kind(op) -> str | None:
    """How the partial reductions of ``CAReduce(op)`` combine, or None.

    PyTensor 2.38 fuses ``sum(f(x))`` into ``CAReduce(Composite(acc, x: acc + f(x)))``:
    its partial values combine as the outer operation's do.
    """
    if isinstance(op, ps.Composite) and len(op.inputs) == 2:
        acc, out = op.fgraph.inputs[0], op.fgraph.outputs[0]
        if out.owner is not None and isinstance(out.owner.op, ps.Cast):
            out = out.owner.inputs[0]
        if out.owner is None or len(op.fgraph.clients[acc]) != 1 or acc not in out.owner.inputs:
            return None
        op = out.owner.op
    return next((k for t, k in KINDS.items() if isinstance(op, t)), None)


def _reduce(node, status):
    row = _row(status(node.inputs[0]))
    axes = node.op.axis
    axes = range(node.inputs[0].type.ndim) if axes is None else axes
    if row.axis not in axes:
        return Outcome((Row(row.axis - sum(a < row.axis for a in axes), row.origin),))
    kind = reduction_kind(node.op.scalar_op)
    if kind is None:
        raise Reject(
            f"{_name(node)} reduces over rows (from '{row.origin}') with an "
            "operation that does not combine across shards"
        )
    return Outcome((TOTAL,), kind=kind)


def _shape(node, status, n_rows, data_shape):
    """Lengths of a row-aligned value (Shape, Shape_i): ``n_rows`` on the row axis, the
    others from the static type or the data's value; a constant in every shard."""
    x = node.inputs[0]
    row = _row(status(x))
    axes = [node.op.i] if isinstance(node.op, Shape_i) else range(x.type.ndim)
    lengths = [n_rows if i == row.axis else x.type.shape[i] for i in axes]
    if None in lengths and data_shape(x) is not None:
        lengths = [n_rows if i == row.axis else data_shape(x)[i] for i in axes]
    if None in lengths:
        raise Reject(
            f"{_name(node)} reads a length of a row-aligned value (from "
            f"'{row.origin}') that is not known before the call"
        )
    value = lengths[0] if isinstance(node.op, Shape_i) else lengths
    return Outcome((None,), replace=pt.constant(np.asarray(value, node.outputs[0].dtype)))


def _blockwise(node, status):
    """A Blockwise node whose row axis is a batch axis: each row is a batch item."""
    dims = [v.type.ndim - len(sig) for v, sig in zip(node.inputs, node.op.inputs_sig, strict=True)]
    if any(r.axis >= d for v, d in zip(node.inputs, dims, strict=True) if (r := _row(status(v)))):
        _unknown(node, status, type(node.op.core_op).__name__)
    row = common_axis(node, node.inputs, status, node.op.batch_ndim(node), dims)
    return Outcome((row,) * len(node.outputs))


def propagate(node: Apply, status, n_rows: int, data_shape) -> Outcome:
    """The outcome of a node with at least one row-aligned input, or :class:`Reject`."""
    op = node.op
    if isinstance(op, Elemwise):
        row = common_axis(node, node.inputs, status, node.outputs[0].type.ndim)
        return Outcome((row,) * len(node.outputs))
    if isinstance(op, DimShuffle):  # the row axis is never dropped: it is not broadcastable
        row = _row(status(node.inputs[0]))
        return Outcome((Row(list(op.new_order).index(row.axis), row.origin),))
    if isinstance(op, CAReduce):
        return _reduce(node, status)
    if isinstance(op, Dot | blas.Dot22 | blas.Dot22Scalar) or (
        isinstance(op, Blockwise) and isinstance(op.core_op, Dot)
    ):
        return _dot(node, status)
    if isinstance(op, blas.Gemv | blas.Gemm):
        return _blas(node, status)
    if type(op) is st.Subtensor:
        return _subtensor(node, status)
    if isinstance(op, _ADV1 + (st.AdvancedSubtensor,)):
        return _gather(node, status)
    if isinstance(op, _ADVINC1 + (st.AdvancedIncSubtensor,)):
        return _scatter(node, status)
    if isinstance(op, Shape | Shape_i):
        return _shape(node, status, n_rows, data_shape)
    if isinstance(op, SpecifyShape) and _row(status(node.inputs[0])):
        return Outcome((status(node.inputs[0]),), shard=Build(node.inputs[:1], lambda x: [x]))
    if isinstance(op, Blockwise) and hasattr(op, "inputs_sig"):
        return _blockwise(node, status)
    _unknown(node, status, type(op).__name__)


#: why common Ops without a rule mix rows, by a part of their class name
_HINTS = {
    "Subtensor": "it selects or shifts rows (like x[1:] - x[:-1])",
    "Cum": "it accumulates along the rows",
    "Scan": "it loops over the rows",
    "Sort": "it reorders the rows",
    "Reshape": "it reshapes the row axis",
    "Join": "it joins values along the rows",
    **dict.fromkeys(
        ("Solve", "Cholesky", "Inv", "Det"),
        "it couples the rows (a multivariate density like MvNormal?)",
    ),
}


def _unknown(node, status, name):
    i = next(i for i, v in enumerate(node.inputs) if _row(status(v)))
    hint = next((h for k, h in _HINTS.items() if k in name), "it may mix rows")
    raise Reject(
        f"{_name(node)} uses a row-aligned value (input {i}, from "
        f"'{status(node.inputs[i]).origin}'): {hint}"
    )


def rebuild(outputs, memo: dict, how: Callable, root: Callable) -> list[Variable]:
    """New values of ``outputs``: ``how(node)`` gives ``(inputs, fn)``, ``fn`` the node's
    new outputs from its inputs' new values; ``root(var)`` the new value of a variable
    without owner.  ``memo`` maps old variables to new ones, and is filled in."""
    stack = list(outputs)
    while stack:
        var = stack[-1]
        if var in memo:
            stack.pop()
            continue
        if var.owner is None:
            memo[var] = root(var)
            continue
        deps, fn = how(var.owner)
        missing = [d for d in deps if d not in memo]
        if missing:
            stack.extend(missing)
            continue
        stack.pop()
        memo.update(zip(var.owner.outputs, fn(*[memo[d] for d in deps]), strict=True))
    return [memo[o] for o in outputs]


def no_inplace(node: Apply, inputs) -> list[Variable]:
    """``node`` on new inputs, without in-place Ops (``pytensor.function`` refuses them)."""
    op = node.op
    if getattr(op, "destroy_map", None):
        props = op._props_dict()
        key = next((k for k in ("inplace", "inplace_pattern", "destructive") if k in props), None)
        if key is None:
            raise Reject(f"{op} works in place and has no known out-of-place form")
        op = type(op)(**{**props, key: {} if key == "inplace_pattern" else False})
        return op.make_node(*inputs).outputs
    return _clone(node, inputs)


def expand(fgraph: FunctionGraph) -> list[Variable]:
    """The outputs of ``fgraph`` with PyTensor 3's finalized OpFromGraph nodes inlined.

    ``fill(x, y)`` of a 0-d ``x`` (``pytensor.grad``'s seed ``fill(cost, 1)``, before
    rewriting) is ``y``: it depends on no value of ``x``, although it names it.
    """

    def how(node):
        if _Finalized and isinstance(node.op, _Finalized):

            def inline(*ins):
                new = node if list(ins) == node.inputs else node.clone_with_new_inputs(ins)
                outs = _compat.inline_op_from_graph(new)
                return rebuild(outs, dict(zip(ins, ins, strict=True)), how, _missing)

            return node.inputs, inline
        if (
            isinstance(node.op, Elemwise)
            and isinstance(node.op.scalar_op, ps.Second)
            and node.inputs[0].type.ndim == 0
            and node.inputs[1].type == node.outputs[0].type
        ):
            return node.inputs[1:], lambda y: [y]
        return (
            node.inputs,
            lambda *ins: node.outputs if list(ins) == node.inputs else _clone(node, ins),
        )

    return rebuild(fgraph.outputs, {v: v for v in fgraph.inputs}, how, _missing)


def _clone(node, ins):
    return node.clone_with_new_inputs(list(ins), strict=False).outputs


def _missing(var):
    if isinstance(var, Constant):
        return var
    raise KeyError(f"graph input {var} is not an input of the function graph")


def toposort(outputs) -> list[Apply]:
    """The nodes computing ``outputs``, in topological order."""
    order, seen, stack = [], set(), [o.owner for o in outputs if o.owner is not None]
    while stack:
        node = stack[-1]
        if node in seen:
            stack.pop()
            continue
        todo = [i.owner for i in node.inputs if i.owner is not None and i.owner not in seen]
        if todo:
            stack.extend(todo)
            continue
        stack.pop()
        seen.add(node)
        order.append(node)
    return order
