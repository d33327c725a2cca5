"""Sharding: find the sums over data rows in a rewritten graph, and split it at them.

A PyMC model's log-density over N observed rows is a sum over rows, and so is its
gradient (``dlogp/dbeta = X.T @ g`` contracts over the rows).  :func:`find_shards` reads a
rewritten ``FunctionGraph`` and, when this structure can be proved from the graph, returns
a :class:`ShardPlan`: a *partial graph* that a shard of the rows (a contiguous range of
every data input) turns into *partial values*, and a *combine graph* that turns the totals
of these values over all shards into the function's outputs.  Otherwise it returns
:class:`NotSharded` with the reason.  This module is pure: it builds graphs, runs nothing.

Data and statuses
-----------------
*Data* are the constants and shared variables of the graph with exactly one axis of
length N, their *row axis* (N >= ``min_rows``, the same N for all; a constant ``X.T``
folded by the rewrites is data with row axis 1).  Every variable gets a status, in one
pass in topological order: *row-aligned* along an axis, *non-row* (it depends on no data:
parameters, other constants), or *total* (it depends on a reduction over rows).  Only
nodes with a row-aligned input need a rule (:mod:`dasktensor.sharding._rules`); any other
use of a row-aligned value (an Op without a rule, a slice or sort of rows, a Cholesky over
them, a function output) rejects the whole function.  A node may not mix row-aligned
and total inputs, and no output may be row-aligned.

Why the split is exact
----------------------
Write ``v[S]`` for the rows ``S`` of a row-aligned ``v`` and ``G(S)`` for what the same
nodes compute from the data's rows ``S`` (and the non-row values).  Every rule keeps the
invariant ``v[S] = G(S)`` for every row-aligned ``v``: it holds for the data themselves,
and elementwise functions of row-aligned values (with non-row values broadcast along the
row axis), axis permutations that keep the row axis, reductions over other axes, matrix
products with the rows on a kept axis (``(X @ b)[S] = X[S] @ b``), gathers by a
row-aligned index (``a[idx][S] = a[idx[S]]``) and Blockwise Ops batched over rows all
act on each row separately.  The length of the row axis is N whatever the shard: a
``Shape_i`` of it is replaced by the constant N.  An *accumulation* is where rows end:
a reduction over the row axis by an associative and commutative operation (``sum``,
``prod``, ``all``, ``any``, ``max``, ``min``), a matrix product contracting over it
(``X.T @ g``) and a scatter-add by a row-aligned index (``zeros[idx] += g``).  For
shards ``S_1 .. S_K`` partitioning the rows, such a value is the combination of its
values on the shards: ``sum(v) = sum_k sum(v[S_k])``, ``X.T @ g = sum_k X[S_k].T @ g[S_k]``
and ``z[idx] += g`` adds ``sum_k zeros[idx[S_k]] += g[S_k]`` to ``z``.  Terms added
once, outside the sum (``beta * z`` of a BLAS ``gemv``/``gemm``, the target ``z`` of a
scatter-add) are left out of the partial value and added by the combine graph.  All other
nodes depend on totals and non-row values only (checked), so the combine graph computes
them from the totals exactly as the function does.  In exact arithmetic the split is
exact; in floating point only the order of additions (and multiplications) changes, and
``max``, ``min``, ``all``, ``any`` are unchanged bit for bit.

One kind of total may reach the rows: a boolean flag of size 1, as PyMC's parameter
checks make (``switch(all(0 <= p), logp, -inf)`` row by row, where ``p`` has a value per
row).  Such a flag becomes an *assumption*: an input of the partial graph, and an extra
output of the combine graph, which computes its true value from totals that do not
depend on any assumption (checked).  With the true values as inputs, every shard
computes what the function computes, so the plan is exact when guess and truth agree;
:class:`ShardPlan` says how to evaluate again when they do not.

Non-row nodes that a shard needs (``exp(log_sigma)``) are computed again in every shard;
they depend on parameters only.  The rewritten graph may hold backend-specific fused Ops
(PyTensor 3's ``FusedElemwise``, ``Scalarized*``): they are finalized ``OpFromGraph``s
whose inner graphs compute the same values, and are inlined before the analysis.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from pytensor.compile.sharedvalue import SharedVariable
from pytensor.graph.basic import Apply, Constant, Variable
from pytensor.graph.fg import FunctionGraph
from pytensor.tensor.type import TensorType

from dasktensor.engine import work_of
from dasktensor.sharding._rules import (
    TOTAL,
    Outcome,
    Reject,
    Row,
    expand,
    no_inplace,
    propagate,
    rebuild,
    toposort,
)

_UFUNCS = {
    "add": np.add,
    "mul": np.multiply,
    "and": np.bitwise_and,
    "or": np.bitwise_or,
    "max": np.maximum,
    "min": np.minimum,
}


@dataclass(frozen=True)
class NotSharded:
    """:func:`find_shards`'s answer for a graph that cannot be split; it is falsy.

    Examples
    --------
    >>> NotSharded("no data input with >= 10000 rows")
    NotSharded(reason='no data input with >= 10000 rows')
    """

    reason: str

    def __bool__(self) -> Literal[False]:  # (so that `if not found` narrows the type)
        return False


@dataclass(frozen=True)
class RowData:
    """A data input of the graph (a constant or shared variable) and its row axis."""

    variable: Variable
    axis: int
    shape: tuple[int, ...]  # when the plan was made

    @property
    def name(self) -> str:
        """The variable's name, or a description of a constant."""
        return _label(self.variable)

    def value(self) -> np.ndarray:
        """The current value: a constant's data, a shared variable's value (not copied)."""
        if isinstance(self.variable, Constant):
            return self.variable.data
        return self.variable.get_value(borrow=True)

    def take(self, value: np.ndarray, rows: slice) -> np.ndarray:
        """The rows ``rows`` of ``value``, along this input's row axis (a view)."""
        return take_rows(value, self.axis, rows)


def take_rows(value: np.ndarray, axis: int, rows: slice) -> np.ndarray:
    """The rows ``rows`` of ``value`` along ``axis`` (a view).

    >>> take_rows(np.arange(6).reshape(2, 3), 1, slice(1, 3))
    array([[1, 2],
           [4, 5]])
    """
    return value[(slice(None),) * axis + (rows,)]


@dataclass(frozen=True)
class Partial:
    """One output of the partial graph: a value computed per shard, then combined.

    ``kind`` says how shard values combine (``"add"`` for sums and contractions, or
    ``"mul"``, ``"and"``, ``"or"``, ``"max"``, ``"min"``).  The total stands for
    ``variable`` of the analysed graph; when ``offset`` is true, ``variable`` is a term
    added once (``beta * z``, a scatter target) plus the total, and the combine graph adds
    that term itself.
    """

    variable: Variable
    kind: str
    offset: bool = False


@dataclass(frozen=True, eq=False)
class ShardPlan:
    """How a graph splits into a per-shard partial graph and a combine graph.

    Built by :func:`find_shards`; the module docstring argues why the split is exact.
    ``data`` are the row-data inputs (each of length ``n_rows`` along its row axis),
    ``partials`` the values computed per shard and combined over shards, ``shard_nodes``
    the analysed nodes with a row-aligned input (each shard computes them on its rows),
    ``param_inputs`` the graph inputs the partial graph takes after the data slices,
    ``rest_inputs`` those the combine graph takes before the totals.

    ``assumptions`` are boolean flags over all rows that the shards need (PyMC's
    parameter checks: ``switch(all(0 <= p <= 1), logp, -inf)`` row by row).  The partial
    graph takes a value for each after its other inputs, the combine graph returns the
    true values after the function's outputs.  Evaluate with :meth:`guesses` (all true);
    if a true value differs from its guess, evaluate again with the true values, which do
    not depend on the guesses: the second round is consistent, and outputs are exact
    only when guesses and true values agree.

    Examples
    --------
    >>> import numpy as np, pytensor, pytensor.tensor as pt
    >>> from pytensor.graph.fg import FunctionGraph
    >>> y = pt.constant(np.arange(6.0), name="y")
    >>> mu = pt.dscalar("mu")
    >>> plan = find_shards(FunctionGraph([mu], [((y - mu) ** 2).sum()]), min_rows=4)
    >>> plan.n_rows, [d.name for d in plan.data], [p.kind for p in plan.partials]
    (6, ['y'], ['add'])
    >>> plan.slices(4)
    [slice(0, 2, None), slice(2, 4, None), slice(4, 5, None), slice(5, 6, None)]
    >>> part, comb = plan.partial_graph(), plan.combine_graph()
    >>> f = pytensor.function(part.inputs, part.outputs)
    >>> g = pytensor.function(comb.inputs, comb.outputs)
    >>> [value] = plan.data_values()
    >>> per_shard = [f(plan.data[0].take(value, rows), 1.0) for rows in plan.slices(2)]
    >>> g(*plan.reduce(per_shard))  # sum((y - 1) ** 2)
    [array(31.)]
    """

    fgraph: FunctionGraph
    n_rows: int
    data: tuple[RowData, ...]
    partials: tuple[Partial, ...]
    shard_nodes: tuple[Apply, ...]
    param_inputs: tuple[Variable, ...]
    rest_inputs: tuple[Variable, ...]
    assumptions: tuple[Variable, ...]
    _graphs: tuple = field(repr=False)
    #: estimated element operations of an evaluation over all rows (``_weights.work_of``)
    work: float = 0.0

    def partial_graph(self) -> FunctionGraph:
        """Inputs: a slice of each data input (row axis of unknown length), then
        ``param_inputs``, then a value per assumption; outputs: the partial values, one
        per :attr:`partials`."""
        inputs, outputs = self._graphs[0]
        return FunctionGraph(inputs, outputs, clone=True)

    def combine_graph(self) -> FunctionGraph:
        """Inputs: ``rest_inputs``, then the total of each partial value over shards;
        outputs: the original graph's outputs, then the true value of each assumption."""
        inputs, outputs = self._graphs[1]
        return FunctionGraph(inputs, outputs, clone=True)

    def slices(self, n_shards: int) -> list[slice]:
        """``n_shards`` contiguous ranges of rows, of lengths differing by one at most."""
        if not 1 <= n_shards <= self.n_rows:
            raise ValueError(f"n_shards must be in [1, {self.n_rows}], not {n_shards}")
        size, extra = divmod(self.n_rows, n_shards)
        ends = np.cumsum([size + (k < extra) for k in range(n_shards)])
        return [slice(int(e - size - (k < extra)), int(e)) for k, e in enumerate(ends)]

    def data_values(self) -> list[np.ndarray]:
        """The data inputs' current values; raises if a shape differs from the plan's
        (a shared variable set to data of another shape: find the shards again)."""
        values = [d.value() for d in self.data]
        for d, v in zip(self.data, values, strict=True):
            if v.shape != d.shape:
                raise ValueError(
                    f"{d.name} has shape {v.shape}, the plan {d.shape}: find the shards again"
                )
        return values

    def guesses(self) -> list[np.ndarray]:
        """First values of the assumptions: all true."""
        return [np.ones((1,) * v.type.ndim, dtype=bool) for v in self.assumptions]

    def reduce(self, per_shard: Sequence[Sequence[np.ndarray]]) -> list[np.ndarray]:
        """Totals of the partial values: ``per_shard[k][j]`` is partial ``j`` of shard k."""
        return combine([p.kind for p in self.partials], per_shard)

    def __str__(self) -> str:
        data = ", ".join(f"{d.name} (axis {d.axis})" for d in self.data)
        parts = ", ".join(f"{p.kind}{p.variable.type.shape}" for p in self.partials)
        return (
            f"ShardPlan: {self.n_rows} rows of {data}; {len(self.shard_nodes)} nodes "
            f"per shard; partials: {parts}"
        )


def combine(kinds: Sequence[str], parts: Sequence[Sequence[np.ndarray]]) -> list[np.ndarray]:
    """Partial values of several parts of the rows combined: ``parts[k][j]`` is partial
    ``j`` of part ``k``, combined by ``kinds[j]`` (``Partial.kind``).

    Examples
    --------
    >>> combine(["add", "max"], [[1.0, 2.0], [3.0, 1.0]])
    [np.float64(4.0), np.float64(2.0)]
    """
    return [
        functools.reduce(_UFUNCS[kind], [np.asarray(part[j]) for part in parts])
        for j, kind in enumerate(kinds)
    ]


def _label(var: Variable) -> str:
    if var.name:
        return var.name
    return f"a constant of shape {np.shape(var.data)}" if isinstance(var, Constant) else str(var)


def _candidates(fgraph, nodes, min_rows):
    """Data candidates (constants and shared variables with an axis >= min_rows)."""
    found = [v for v in fgraph.inputs if isinstance(v, SharedVariable)]
    found += [v for n in nodes for v in n.inputs if isinstance(v, Constant)]
    out = {}
    for v in found:
        if isinstance(v.type, TensorType) and v not in out:
            shape = np.shape(RowData(v, 0, ()).value())
            if any(s >= min_rows for s in shape):
                out[v] = shape
    return out


def find_shards(fgraph: FunctionGraph, min_rows: int = 10_000) -> ShardPlan | NotSharded:
    """Split a rewritten graph into per-shard partial values and a combine graph.

    Parameters
    ----------
    fgraph : FunctionGraph
        The graph as the DASK linker receives it (``function.maker.fgraph``); it is
        not modified.
    min_rows : int
        The least number of rows worth sharding.

    Returns
    -------
    ShardPlan or NotSharded
        A plan, or the reason why the graph cannot be split exactly.

    Examples
    --------
    >>> import numpy as np, pytensor.tensor as pt
    >>> from pytensor.graph.fg import FunctionGraph
    >>> X = pt.constant(np.ones((8, 2)), name="X")
    >>> b = pt.dvector("b")
    >>> print(find_shards(FunctionGraph([b], [pt.exp(X @ b).sum()]), min_rows=5))
    ShardPlan: 8 rows of X (axis 0); 4 nodes per shard; partials: add()
    >>> print(find_shards(FunctionGraph([b], [pt.cumsum(X @ b).sum()]), min_rows=5).reason)
    Cum... uses a row-aligned value (input 0, from 'X'): it accumulates along the rows
    """
    outputs = expand(fgraph)
    nodes = toposort(outputs)
    candidates = _candidates(fgraph, nodes, min_rows)
    counts: dict[int, int] = {}
    for shape in candidates.values():
        for n in {s for s in shape if s >= min_rows}:
            counts[n] = counts.get(n, 0) + 1
    if not counts:
        return NotSharded(f"no data input with >= {min_rows} rows")
    first = None
    for n in sorted(counts, key=lambda n: (-counts[n], -n)):
        data = {
            v: RowData(v, shape.index(n), shape)
            for v, shape in candidates.items()
            if shape.count(n) == 1
        }
        result = _Analysis(fgraph, outputs, nodes, n, data, candidates).plan()
        if result:
            return result
        first = result if first is None else first
    return first


class _Analysis:
    """Statuses of a graph's variables for one row count, and the plan they give."""

    def __init__(self, fgraph, outputs, nodes, n_rows, data, shapes):
        self.fgraph, self.outputs, self.nodes, self.n_rows = fgraph, outputs, nodes, n_rows
        self.data, self.shapes = data, shapes
        self.status = {v: Row(d.axis, d.name) for v, d in data.items()}
        self.outcomes: dict[Apply, Outcome] = {}
        self.cases: dict[Variable, None] = {}  # assumed totals, in order
        self.assumed: set[Variable] = set()  # values that depend on an assumption

    def plan(self) -> ShardPlan | NotSharded:
        try:
            for node in self.nodes:
                self._visit(node)
            for i, out in enumerate(self.outputs):
                row = self.status.get(out)
                if isinstance(row, Row):
                    via = f" (through {out.owner.op})" if out.owner else ""
                    raise Reject(
                        f"the row axis of '{row.origin}' reaches output {i} "
                        f"without a sum over it{via}"
                    )
            return self._split()
        except Reject as exc:
            return NotSharded(str(exc))

    def _visit(self, node: Apply) -> None:
        get = self.status.get
        if any(v in self.assumed or v in self.cases for v in node.inputs):
            self.assumed.update(node.outputs)
        if not any(isinstance(get(v), Row) for v in node.inputs):
            if any(get(v) == TOTAL for v in node.inputs):
                self.status.update(dict.fromkeys(node.outputs, TOTAL))
            return
        out = propagate(node, get, self.n_rows, lambda v: self.shapes.get(v))
        if out.finish and any(isinstance(get(v), Row) for v in out.finish.inputs):
            raise Reject(f"{node.op} adds a row-aligned value to a total over rows")
        for v in out.shard.inputs if out.shard else node.inputs:
            if get(v) != TOTAL:
                continue
            if not (v.type.dtype == "bool" and all(v.type.broadcastable)) or v in self.assumed:
                raise Reject(f"{node.op} uses a row-aligned value and a total over rows together")
            self.cases.setdefault(v)  # a flag over all rows, e.g. PyMC's parameter checks
            self.assumed.update(node.outputs)
        self.outcomes[node] = out
        self.status.update(zip(node.outputs, out.statuses, strict=True))

    def _how(self, node, default):
        out = self.outcomes.get(node)
        if out is not None and out.replace is not None:
            return (), lambda: [out.replace]
        return default(node, out) or (node.inputs, lambda *ins: no_inplace(node, ins))

    def _split(self) -> ShardPlan:
        order = {node: i for i, node in enumerate(self.nodes)}
        totals, rest_roots, param_roots, slices, visited = {}, {}, {}, {}, []

        def combine(node, out):
            if out is None or not out.kind:
                return None
            total = totals.setdefault(node, node.outputs[0].type())
            if out.finish is None:
                return (), lambda: [total]
            return out.finish.inputs, lambda *ins: out.finish.fn(*ins, total)

        def shard(node, out):
            return None if out is None or out.shard is None else (out.shard.inputs, out.shard.fn)

        def fresh(store):
            def root(var):
                if isinstance(var, Constant) and var not in self.data:
                    return var
                if var in self.data:
                    raise Reject(f"internal: data {_label(var)} is left after the sums")
                return store.setdefault(var, var.type(name=var.name))

            return root

        def shard_root(var):
            if var not in self.data:
                return fresh(param_roots)(var)
            shape = list(var.type.shape)
            shape[self.data[var].axis] = None
            return slices.setdefault(
                var,
                TensorType(var.type.dtype, shape=tuple(shape))(
                    name=f"{self.data[var].name}[rows]"
                ),
            )

        def shard_how(node):
            visited.append(node)
            return self._how(node, shard)

        cases = list(self.cases)
        combine_out = rebuild(
            self.outputs + cases, {}, lambda n: self._how(n, combine), fresh(rest_roots)
        )
        accs = sorted(totals, key=order.get)
        for j, acc in enumerate(accs):
            totals[acc].name = f"total{j}"
        if not accs:
            raise Reject(
                f"nothing is summed over the rows of "
                f"{', '.join(d.name for d in self.data.values())}"
            )
        assumed = {v: v.type(name=f"assume{i}") for i, v in enumerate(cases)}
        partial_out = rebuild([a.outputs[0] for a in accs], dict(assumed), shard_how, shard_root)
        data = sorted(slices, key=list(self.data).index)
        params = [v for v in self.fgraph.inputs if v in param_roots]
        rest = [v for v in self.fgraph.inputs if v in rest_roots]
        graphs = (
            (
                [slices[v] for v in data]
                + [param_roots[v] for v in params]
                + list(assumed.values()),
                partial_out,
            ),
            ([rest_roots[v] for v in rest] + [totals[a] for a in accs], combine_out),
        )
        for inputs, outs in graphs:  # the graphs must be valid (no in-place Op, no input
            FunctionGraph(inputs, outs, clone=True)  # missing) before the plan is given
        shard_nodes = tuple(sorted({n for n in visited if n in self.outcomes}, key=order.get))
        return ShardPlan(
            fgraph=self.fgraph,
            n_rows=self.n_rows,
            data=tuple(self.data[v] for v in data),
            partials=tuple(
                Partial(a.outputs[0], self.outcomes[a].kind, self.outcomes[a].finish is not None)
                for a in accs
            ),
            shard_nodes=shard_nodes,
            param_inputs=tuple(params),
            rest_inputs=tuple(rest),
            assumptions=tuple(cases),
            _graphs=graphs,
            work=sum(work_of(n, self._elements) for n in shard_nodes),
        )

    def _elements(self, var: Variable) -> float:
        """Elements of a row-aligned value over all rows (unknown lengths count 1), or 0."""
        row = self.status.get(var)
        if not isinstance(row, Row):
            return 0.0
        shape = self.shapes.get(var) or var.type.shape
        return self.n_rows * math.prod(
            d if d is not None else 1 for i, d in enumerate(shape) if i != row.axis
        )
