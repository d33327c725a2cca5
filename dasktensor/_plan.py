"""Planning: partition a rewritten ``FunctionGraph`` into a few coarse tasks.

This module is pure: it reads a graph and returns a :class:`Plan`, a small dataclass that
can be printed and tested without Dask.

The policy
----------
Each node is one of three weights:

* **heavy** -- the Op says so (``op.dasktensor_heavy`` is true, as for remote model calls
  and :func:`dasktensor.annotate` subgraphs) or its type was registered with
  :func:`mark_heavy`.  A heavy node is always a task of its own, because it may carry its
  own placement (resources, retries, priority) and its own name on the dashboard.
* **costly** -- the cost rule estimates at least ``dasktensor.planner.heavy-flops``
  floating-point operations (matrix products with static shapes, very large elementwise
  work).  Costly nodes are worth running in parallel, but may be fused with their
  neighbours.
* **cheap** -- everything else.

If there is no heavy node and fewer than two costly ones, nothing can run in parallel and
the whole graph is **one in-process stage**: the DASK mode then costs what PyTensor's own
mode costs.

Otherwise heavy and costly nodes are *anchors*.  Every other node is coloured by the set of
anchors among its ancestors and the set of anchors among its descendants, and nodes of one
colour form one stage.  Along any path of the graph the first set only grows and the
second only shrinks, and the first grows strictly when the path passes an anchor; so a
path between two nodes of one colour passes through nodes of that colour only, and the
stages and anchors form an acyclic task graph.  Stages that hold only cheap nodes are
*cheap stages*; the cheap work before, between and after heavy calls thus becomes a handful
of stages however many nodes it has.

Then linear chains are fused: a task whose only consumer is a task whose only producer
it is, is merged into it, unless either is a heavy node (which must stay alone).  A branch
``dot -> tanh -> dot -> tanh`` thereby becomes one task, so independent branches run in
parallel while each costs one task.  If this leaves a single costly task and no heavy
one, the plan falls back to one stage.

Finally, the cheap stages that run on the caller are fused by role: those that feed the
cluster (run before submitting), those independent of it (run while it works) and those
after it.  Each union is acyclic: a path between two "feeding" stages only passes through
nodes without cluster ancestors that lead to the cluster, i.e. "feeding" stages; a path
between two "after" stages only passes through nodes with cluster ancestors and no cluster
descendants, i.e. "after" stages; and a path between two independent stages only passes
through stages without cluster ancestors or descendants.

Where tasks run: heavy and costly tasks run on the cluster's workers; cheap stages run on
the caller, except those between two cluster tasks, which run on the cluster too (sending
their inputs back and forth would cost more than the stage).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from pytensor.graph.basic import Apply, Constant, Variable
from pytensor.graph.fg import FunctionGraph

from dasktensor import _config
from dasktensor._placement import Placement

Weight = Literal["heavy", "costly", "cheap"]

_HEAVY_TYPES: dict[type, str | None] = {}


def mark_heavy(op_type: type, name: str | None = None) -> type:
    """Plan every node of an Op type as a task of its own.

    Use it for Ops you do not own (a third-party solver Op, say).  Ops you write can
    instead set the class attribute ``dasktensor_heavy = True`` (and optionally
    ``dasktensor_name`` and ``dasktensor_placement``, a :class:`~dasktensor.Placement`).

    Parameters
    ----------
    op_type : type
        A subclass of ``pytensor.graph.op.Op``.
    name : str, optional
        Prefix of the task keys on the dashboard; letters and dashes, such as
        ``"ode-solve"``.  Defaults to the Op's class name.

    Returns
    -------
    type
        ``op_type``, so that ``mark_heavy`` also works as a class decorator.

    Examples
    --------
    >>> import dasktensor as dt
    >>> from pytensor.graph.op import Op
    >>> @dt.mark_heavy
    ... class Simulate(Op):
    ...     def make_node(self, x): ...
    ...     def perform(self, node, inputs, outputs): ...
    >>> dt.is_heavy(Simulate())
    True
    """
    from pytensor.graph.op import Op

    if not (isinstance(op_type, type) and issubclass(op_type, Op)):
        raise TypeError(f"mark_heavy expected a subclass of pytensor Op, got {op_type!r}")
    _HEAVY_TYPES[op_type] = name
    return op_type


def is_heavy(op) -> bool:
    """Whether the planner gives every node of ``op`` a task of its own.

    Examples
    --------
    >>> import pytensor.tensor as pt
    >>> import dasktensor as dt
    >>> dt.is_heavy(pt.exp(pt.vector()).owner.op)
    False
    """
    return bool(getattr(op, "dasktensor_heavy", False)) or isinstance(op, tuple(_HEAVY_TYPES))


def op_label(op) -> str:
    """A short dashboard-friendly name: lowercase letters and dashes only.

    ``dask.utils.key_split`` keeps the leading words of a key that are pure letters, so a
    key ``f"{op_label(op)}-3-{token}"`` shows on the dashboard as ``op_label(op)``.
    """
    name = getattr(op, "dasktensor_name", None)
    if name is None:
        for typ, registered in _HEAVY_TYPES.items():
            if isinstance(op, typ) and registered:
                name = registered
                break
    if name is None:
        core_op = getattr(op, "core_op", None)  # Blockwise: name it after what it maps
        name = type(core_op if core_op is not None else op).__name__
    name = _READABLE.get(str(name), str(name))
    words = re.findall(r"[a-z]+", re.sub(r"(?<=[a-z])(?=[A-Z])", " ", name).lower())
    # key_split drops an 8-letter word that starts with a-f (it takes it for a hex token)
    words = [w + "-op" if len(w) == 8 and w[0] in "abcdef" else w for w in words]
    return "-".join(words) or "op"


_READABLE = {"Elemwise": "elementwise", "CAReduce": "reduce", "DimShuffle": "dimshuffle"}


# ----------------------------------------------------------------------------- cost rule

_PRODUCT_OPS = re.compile(r"Dot|Gemm|Gemv|Ger|MatMul|Matmul|BatchedDot|Dot22", re.ASCII)


def estimated_flops(node: Apply) -> float:
    """Floating-point work of ``node`` estimated from static shapes (``nan`` if unknown).

    Matrix products count ``2 * prod(output shape) * k`` with ``k`` the contracted length;
    every other node counts one operation per output element and input.
    """

    def size(var) -> float:
        shape = getattr(var.type, "shape", None)
        if shape is None or any(s is None for s in shape):
            return math.nan
        return float(math.prod(shape))

    op = node.op
    core = getattr(op, "core_op", op)
    if _PRODUCT_OPS.search(type(core).__name__) or _PRODUCT_OPS.search(type(op).__name__):
        out = max((size(o) for o in node.outputs), default=math.nan)
        k = math.nan
        for inp in node.inputs:
            shape = getattr(inp.type, "shape", None)
            if shape and len(shape) >= 2 and shape[-1] is not None:
                k = float(shape[-1])
                break
        return 2.0 * out * k
    out = sum(size(o) for o in node.outputs)
    return out * max(1, len(node.inputs))


def node_weight(node: Apply, heavy_flops: float) -> tuple[Weight, str]:
    """The weight of one node and the reason, as :meth:`Plan.describe` shows it."""
    if is_heavy(node.op):
        return "heavy", "marked heavy"
    flops = estimated_flops(node)
    if flops >= heavy_flops:  # nan compares False
        return "costly", f"~{flops:.1e} flops >= heavy-flops"
    return "cheap", "cheap"


# ----------------------------------------------------------------------------- the plan


@dataclass(frozen=True, eq=False)
class Task:
    """One task of a :class:`Plan`: a heavy node, or a stage of fused nodes."""

    index: int
    name: str
    kind: Literal["stage", "heavy"]
    #: when and where the task runs: on the cluster, or on the caller before submitting
    #: the cluster's work, beside it (while the cluster works) or after it
    #: (``"remote"``: a remote-model call, made from the caller straight to its worker)
    role: Literal["cluster", "remote", "before", "beside", "after"]
    nodes: tuple[Apply, ...]
    inputs: tuple[Variable, ...]
    outputs: tuple[Variable, ...]
    deps: tuple[int, ...]
    reason: str
    #: where and how the task runs (resources, retries, ..., the compiling mode)
    placement: Placement = field(default_factory=Placement)

    @property
    def where(self) -> Literal["caller", "cluster"]:
        """Where the task runs when a distributed client executes the plan."""
        return "cluster" if self.role == "cluster" else "caller"

    @property
    def destroyed_inputs(self) -> tuple[int, ...]:
        """Positions of inputs that a node of this task overwrites in place.

        An input counts when a node destroys it directly or destroys a view of it made
        inside the task (``x[1:]`` updated in place overwrites ``x``).  The executor copies
        these inputs before running the task, so that no task can corrupt a value that
        another task (or the caller) also reads.
        """
        positions = {v: i for i, v in enumerate(self.inputs)}
        in_task = set(self.nodes)
        out = set()
        for node in self.nodes:
            for idx in getattr(node.op, "destroy_map", {}).values():
                for i in idx:
                    var = node.inputs[i]
                    # walk up the views made inside the task to the buffer's owner
                    while var not in positions and var.owner in in_task:
                        viewed = getattr(var.owner.op, "view_map", {}).get(
                            var.owner.outputs.index(var)
                        )
                        if not viewed:
                            break
                        var = var.owner.inputs[viewed[0]]
                    if var in positions:
                        out.add(positions[var])
        return tuple(sorted(out))


@dataclass(frozen=True, eq=False)
class Plan:
    """The partition of a graph into tasks.

    ``str(plan)`` prints which nodes went into which task and why.
    """

    fgraph: FunctionGraph
    tasks: tuple[Task, ...]

    @property
    def single_stage(self) -> bool:
        """True when the whole graph runs as one in-process stage (nothing to parallelise)."""
        return len(self.tasks) == 1 and self.tasks[0].kind == "stage"

    def describe(self, nodes: bool = False) -> str:
        """The plan as text: one line per task, then its op types (or, with ``nodes=True``,
        every node)."""
        lines = [f"Plan: {len(self.fgraph.apply_nodes)} nodes -> {len(self.tasks)} task(s)"]
        for t in self.tasks:
            deps = ",".join(map(str, t.deps)) or "-"
            ann = f" {t.placement}" if t.placement else ""
            lines.append(
                f"  [{t.index}] {t.name:<24} {t.kind:<6} on {t.where:<7} "
                f"{len(t.nodes):>5} node(s)  deps: {deps:<8} {t.reason}{ann}"
            )
            if nodes:
                lines.extend(f"        {n}" for n in t.nodes)
                continue
            ops = Counter(type(n.op).__name__ for n in t.nodes)
            shown = ", ".join(f"{k} x{v}" if v > 1 else k for k, v in ops.most_common(6))
            more = f", ... ({len(ops) - 6} more op types)" if len(ops) > 6 else ""
            lines.append(f"        {shown}{more}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()

    __repr__ = __str__


def plan_graph(
    fgraph: FunctionGraph,
    heavy_flops: float | None = None,
    order: Callable[[FunctionGraph], Sequence[Apply]] | None = None,
) -> Plan:
    """Partition ``fgraph`` into tasks (see the module docstring for the policy).

    Parameters
    ----------
    fgraph : FunctionGraph
        A rewritten graph, as a linker receives it.
    heavy_flops : float, optional
        Threshold of the cost rule; defaults to ``dasktensor.planner.heavy-flops``.
    order : callable, optional
        Scheduling function returning the nodes in a valid order (default: toposort).

    Returns
    -------
    Plan

    Examples
    --------
    >>> import pytensor.tensor as pt
    >>> from pytensor.graph.fg import FunctionGraph
    >>> from dasktensor import plan_graph
    >>> x = pt.vector("x")
    >>> plan = plan_graph(FunctionGraph([x], [pt.exp(x).sum()]))
    >>> plan.single_stage
    True
    """
    if heavy_flops is None:
        heavy_flops = float(_config.get("planner.heavy-flops"))
    nodes = list(order(fgraph) if order is not None else fgraph.toposort())
    weights = {n: node_weight(n, heavy_flops) for n in nodes}
    n_heavy = sum(w == "heavy" for w, _ in weights.values())
    n_costly = sum(w == "costly" for w, _ in weights.values())

    if n_heavy == 0 and n_costly < 2:
        return _single_stage(fgraph, nodes, "nothing to run in parallel")

    # 1. colour: the anchors among each node's ancestors, and among its descendants
    anchors_above: dict[Apply, frozenset[Apply]] = {}
    for node in nodes:
        above: set[Apply] = set()
        for inp in node.inputs:
            owner = inp.owner
            if owner is not None:
                above |= anchors_above[owner]
                if weights[owner][0] != "cheap":
                    above.add(owner)
        anchors_above[node] = frozenset(above)

    anchors_below: dict[Apply, frozenset[Apply]] = {}
    clients = fgraph.clients
    for node in reversed(nodes):
        below: set[Apply] = set()
        for out in node.outputs:
            for client, _ in clients.get(out, ()):
                if client in weights:  # skips the graph's output markers
                    below |= anchors_below[client]
                    if weights[client][0] != "cheap":
                        below.add(client)
        anchors_below[node] = frozenset(below)

    # 2. groups: one per anchor, one per colour of the other nodes (in topological order)
    group_of: dict[Apply, int] = {}
    groups: list[list[Apply]] = []
    colour_group: dict[tuple[frozenset[Apply], frozenset[Apply]], int] = {}
    for node in nodes:
        if weights[node][0] != "cheap":
            group_of[node] = len(groups)
            groups.append([node])
        else:
            key = (anchors_above[node], anchors_below[node])
            if key not in colour_group:
                colour_group[key] = len(groups)
                groups.append([])
            group_of[node] = colour_group[key]
            groups[group_of[node]].append(node)

    # 3. fuse linear chains (never across a heavy node)
    parent = list(range(len(groups)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def is_heavy_group(i: int) -> bool:
        return any(weights[n][0] == "heavy" for n in groups[i])

    changed = True
    while changed:
        changed = False
        preds, succs = _block_dag(nodes, lambda n: find(group_of[n]))
        for a, out in succs.items():
            if len(out) != 1:
                continue
            (b,) = out
            if len(preds[b]) == 1 and not is_heavy_group(a) and not is_heavy_group(b):
                parent[b] = a
                changed = True
                break

    # 4. the caller runs its cheap stages one after another anyway: fuse them into one
    #    stage that feeds the cluster, one that runs beside it (while the cluster works) and
    #    one after it.  Each union stays acyclic: a path between two stages of one kind only
    #    passes through stages of that kind (see the module docstring).
    preds, succs = _block_dag(nodes, lambda n: find(group_of[n]))
    order = _toposort_blocks(preds, key=lambda r: r)
    cluster = {r: False for r in preds}
    for node in nodes:
        if weights[node][0] != "cheap":
            cluster[find(group_of[node])] = True
    above = {r: False for r in preds}
    for r in order:
        above[r] = any(cluster[p] or above[p] for p in preds[r])
    below = {r: False for r in preds}
    for r in reversed(order):
        below[r] = any(cluster[s] or below[s] for s in succs[r])
    feeding = [r for r in order if not cluster[r] and not above[r] and below[r]]
    aside = [r for r in order if not cluster[r] and not above[r] and not below[r]]
    after = [r for r in order if not cluster[r] and above[r] and not below[r]]
    for same_side in (feeding, aside, after):
        for r in same_side[1:]:
            parent[find(r)] = find(same_side[0])

    members: dict[int, list[Apply]] = {}
    for node in nodes:  # keeps topological order inside every task
        members.setdefault(find(group_of[node]), []).append(node)
    blocks = list(members.values())

    n_costly_blocks = sum(
        any(weights[n][0] == "costly" for n in block)
        and not any(weights[n][0] == "heavy" for n in block)
        for block in blocks
    )
    if n_heavy == 0 and n_costly_blocks < 2:
        return _single_stage(fgraph, nodes, "costly work lies on one chain")

    return _make_plan(fgraph, blocks, weights)


def _single_stage(fgraph: FunctionGraph, nodes: list[Apply], reason: str) -> Plan:
    task = Task(
        index=0,
        name="stage-" + _dominant_label(nodes),
        kind="stage",
        role="beside",
        nodes=tuple(nodes),
        inputs=tuple(fgraph.inputs),
        outputs=tuple(fgraph.outputs),
        deps=(),
        reason=f"one in-process stage: {reason}",
    )
    return Plan(fgraph=fgraph, tasks=(task,))


def _dominant_label(nodes: Sequence[Apply]) -> str:
    if not nodes:
        return "identity"
    counts = Counter(op_label(n.op) for n in nodes)
    return counts.most_common(1)[0][0]


def _make_plan(fgraph: FunctionGraph, blocks: list[list[Apply]], weights) -> Plan:
    # order blocks topologically by their first node's position (blocks are convex)
    position = {n: i for i, n in enumerate(n for block in blocks for n in block)}
    task_of_node: dict[Apply, int] = {}
    for b, block in enumerate(blocks):
        for n in block:
            task_of_node[n] = b
    deps_of = []
    for block in blocks:
        deps = set()
        for n in block:
            for inp in n.inputs:
                if inp.owner is not None and task_of_node[inp.owner] != task_of_node[n]:
                    deps.add(task_of_node[inp.owner])
        deps_of.append(deps)
    order = _toposort_blocks(deps_of, key=lambda b: position[blocks[b][0]])
    renumber = {old: new for new, old in enumerate(order)}

    fgraph_outputs = set(fgraph.outputs)
    clients = fgraph.clients
    remote = [any(_is_remote(n) for n in blocks[old]) for old in order]
    heavy_or_costly = [
        any(weights[n][0] != "cheap" for n in blocks[old]) and not remote[new]
        for new, old in enumerate(order)
    ]
    deps_new = [sorted(renumber[d] for d in deps_of[old]) for old in order]

    # cheap stages between two cluster tasks run on the cluster
    above_cluster = [False] * len(order)
    for i in range(len(order)):
        above_cluster[i] = any(heavy_or_costly[d] or above_cluster[d] for d in deps_new[i])
    below_cluster = [False] * len(order)
    succ_new: list[list[int]] = [[] for _ in order]
    for i, deps in enumerate(deps_new):
        for d in deps:
            succ_new[d].append(i)
    for i in reversed(range(len(order))):
        below_cluster[i] = any(heavy_or_costly[s] or below_cluster[s] for s in succ_new[i])

    tasks = []
    for new, old in enumerate(order):
        block = blocks[old]
        in_block = set(block)
        inputs: list[Variable] = []
        seen: set[Variable] = set()
        for n in block:
            for inp in n.inputs:
                if isinstance(inp, Constant) or inp in seen:
                    continue
                if inp.owner is None or inp.owner not in in_block:
                    seen.add(inp)
                    inputs.append(inp)
        outputs = [
            o
            for n in block
            for o in n.outputs
            if o in fgraph_outputs
            or any(task_of_node.get(c, old) != old for c, _ in clients.get(o, ()))
        ]
        heavy_nodes = [n for n in block if weights[n][0] == "heavy"]
        if heavy_nodes:
            (node,) = heavy_nodes  # heavy nodes are never fused
            kind, role = "heavy", "remote" if remote[new] else "cluster"
            name = op_label(node.op)
            reason = weights[node][1]
            placement = getattr(node.op, "dasktensor_placement", None) or Placement()
        elif heavy_or_costly[new]:
            kind, role = "stage", "cluster"
            costly = [n for n in block if weights[n][0] == "costly"]
            name = "work-" + _dominant_label(costly)
            reason = f"{len(costly)} costly node(s): {weights[costly[0]][1]}"
            placement = Placement()
        else:
            kind = "stage"
            name = "stage-" + _dominant_label(block)
            if above_cluster[new] and below_cluster[new]:
                role, reason = "cluster", "cheap nodes between cluster tasks"
            elif above_cluster[new]:
                role, reason = "after", "cheap nodes after heavy work"
            elif below_cluster[new]:
                role, reason = "before", "cheap nodes before heavy work"
            else:
                role, reason = "beside", "cheap nodes beside heavy work (run while it runs)"
            placement = Placement()
        tasks.append(
            Task(
                index=new,
                name=name,
                kind=kind,
                role=role,
                nodes=tuple(block),
                inputs=tuple(inputs),
                outputs=tuple(outputs),
                deps=tuple(deps_new[new]),
                reason=reason,
                placement=placement,
            )
        )
    return Plan(fgraph=fgraph, tasks=tuple(tasks))


def _is_remote(node: Apply) -> bool:
    """A call that reaches its model itself (``RemoteModel`` Ops): made from the caller."""
    return bool(getattr(node.op, "dasktensor_remote", False))


def _block_dag(nodes, block_of) -> tuple[dict[int, set[int]], dict[int, set[int]]]:
    """Predecessors and successors of the blocks that ``block_of`` assigns nodes to."""
    preds: dict[int, set[int]] = {}
    succs: dict[int, set[int]] = {}
    for node in nodes:
        b = block_of(node)
        preds.setdefault(b, set())
        succs.setdefault(b, set())
    for node in nodes:
        b = block_of(node)
        for inp in node.inputs:
            if inp.owner is not None:
                a = block_of(inp.owner)
                if a != b:
                    preds[b].add(a)
                    succs[a].add(b)
    return preds, succs


def _toposort_blocks(deps_of, key) -> list:
    """Topological order of blocks given as ``{block: dependencies}`` or a list of them."""
    if isinstance(deps_of, list):
        deps_of = dict(enumerate(deps_of))
    remaining = {i: set(d) for i, d in deps_of.items()}
    done: list[int] = []
    while remaining:
        ready = sorted((i for i, d in remaining.items() if not d), key=key)
        if not ready:  # pragma: no cover - the colouring argument rules this out
            raise RuntimeError("dasktensor planner produced a cyclic task graph")
        for i in ready:
            del remaining[i]
            done.append(i)
        for d in remaining.values():
            d.difference_update(ready)
    return done
