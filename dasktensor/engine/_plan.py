"""Planning: partition a rewritten ``FunctionGraph`` into a few coarse tasks.

This module is pure: it reads a graph and returns a :class:`Plan`, a small dataclass that
can be printed and tested without Dask.

The policy
----------
Each node is one of three weights (a :class:`~dasktensor.engine._weights.Weight`):

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

Otherwise heavy and costly nodes are *anchors*, and :func:`plan_graph` runs four steps.
Each asks of a DAG (of nodes, or of blocks of nodes) which anchors lie among the ancestors
and which among the descendants of every item; :func:`anchors_around` answers that in one
pass.

1. :func:`colour`: every other node is coloured by the set of anchors among its ancestors
   and the set of anchors among its descendants, and nodes of one colour form one stage.
   Along any path of the graph the first set only grows and the second only shrinks, and
   the first grows strictly when the path passes an anchor; so a path between two nodes of
   one colour passes through nodes of that colour only, and the stages and anchors form an
   acyclic task graph.  Stages that hold only cheap nodes are *cheap stages*; the cheap
   work before, between and after heavy calls thus becomes a handful of stages however
   many nodes it has.
2. :func:`fuse_chains`: a task whose only consumer is a task whose only producer it is, is
   merged into it, unless either is a heavy node (which must stay alone).  The edge between
   them is the only path from one to the other, so the task graph stays acyclic.  A branch
   ``dot -> tanh -> dot -> tanh`` thereby becomes one task, so independent branches run in
   parallel while each costs one task.  If this leaves a single costly task and no heavy
   one, the plan falls back to one stage.
3. :func:`fuse_caller_stages`: the cheap stages that run on the caller are fused by role:
   those that feed the cluster (run before submitting), those independent of it (run while
   it works) and those after it.  Each union is acyclic: a path between two "feeding"
   stages only passes through nodes without cluster ancestors that lead to the cluster,
   i.e. "feeding" stages; a path between two "after" stages only passes through nodes with
   cluster ancestors and no cluster descendants, i.e. "after" stages; and a path between
   two independent stages only passes through stages without cluster ancestors or
   descendants.
4. :func:`make_plan`: every block becomes a :class:`Task`, in topological order, and is
   placed.  Heavy and costly tasks run on the cluster's workers; cheap stages run on the
   caller, except those between two cluster tasks, which run on the cluster too (sending
   their inputs back and forth would cost more than the stage).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, TypeVar

from pytensor.graph.basic import Apply, Constant, Variable
from pytensor.graph.fg import FunctionGraph

from dasktensor import _config, _display
from dasktensor._placement import Placement
from dasktensor.engine._weights import _HEAVY_TYPES as _HEAVY_TYPES

if TYPE_CHECKING:
    from _typeshed import SupportsGetItem
from dasktensor.engine._weights import Weight, dominant_label, is_remote, node_weight
from dasktensor.engine._weights import is_heavy as is_heavy
from dasktensor.engine._weights import mark_heavy as mark_heavy
from dasktensor.engine._weights import op_label as op_label

#: the nodes of one task, in topological order
Block = list[Apply]
#: the weight of every node of the graph, keyed in topological order
Weights = dict[Apply, Weight]
T = TypeVar("T", bound=Hashable)


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
    #: whether the function is split into data shards on a cluster, over which data, into
    #: how many shards and why, or why not (``dasktensor.sharding._executor``); None: not looked at
    sharding: str | None = None
    #: where the cluster tasks ran, once the function was called on a cluster: per task
    #: index, the workers holding its resident stage, each with the device it runs on
    #: (``"gpu-1 (tcp://10.0.0.5:40431): GPU 1 (NVIDIA H200)"``; see ``f.plan``)
    ran: Mapping[int, tuple[str, ...]] = field(default_factory=dict)

    @property
    def single_stage(self) -> bool:
        """True when the whole graph runs as one in-process stage (nothing to parallelise)."""
        return len(self.tasks) == 1 and self.tasks[0].kind == "stage"

    def describe(self, nodes: bool = False) -> str:
        """The plan as text: one line per task, where it ran (after a call on a cluster),
        then its op types (or, with ``nodes=True``, every node)."""
        lines = [f"Plan: {len(self.fgraph.apply_nodes)} nodes -> {len(self.tasks)} task(s)"]
        if self.sharding:
            lines.extend(f"  {line}" for line in self.sharding.splitlines())
        for t in self.tasks:
            deps = ",".join(map(str, t.deps)) or "-"
            ann = f" {t.placement}" if t.placement else ""
            lines.append(
                f"  [{t.index}] {t.name:<24} {t.kind:<6} on {t.where:<7} "
                f"{len(t.nodes):>5} node(s)  deps: {deps:<8} {t.reason}{ann}"
            )
            if self.ran.get(t.index):
                lines.append(f"        ran on: {'; '.join(self.ran[t.index])}")
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
    # Jupyter draws the plan (dasktensor._display); visualize writes the picture to a file
    _repr_html_, _repr_svg_, visualize = _display.plan_html, _display.plan_svg, _display.visualize


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
    kinds = Counter(w.kind for w in weights.values())
    if kinds["heavy"] == 0 and kinds["costly"] < 2:
        return _single_stage(fgraph, nodes, "nothing to run in parallel")

    blocks = fuse_chains(colour(weights), weights)
    costly_blocks = sum(any(weights[n].kind == "costly" for n in block) for block in blocks)
    if kinds["heavy"] == 0 and costly_blocks < 2:
        return _single_stage(fgraph, nodes, "costly work lies on one chain")
    blocks = fuse_caller_stages(blocks, weights)
    return make_plan(fgraph, blocks, weights)


# ----------------------------------------------------------------------------- the steps


def anchors_around(
    order: Sequence[T],
    preds: SupportsGetItem[T, Iterable[T]],
    is_anchor: Callable[[T], bool],
) -> tuple[dict[T, frozenset[T]], dict[T, frozenset[T]]]:
    """The anchors among the ancestors and among the descendants of every item of a DAG.

    Parameters
    ----------
    order : sequence
        The items of the DAG (nodes, or indices of blocks) in topological order.
    preds : mapping or sequence
        ``preds[item]``: the items that ``item`` reads from directly.
    is_anchor : callable
        ``is_anchor(item)``: whether an item is an anchor.

    Returns
    -------
    above, below : dict
        ``above[item]`` (``below[item]``): the anchors among the ancestors (descendants) of
        ``item``, as a frozenset that never holds ``item`` itself.

    Examples
    --------
    >>> above, below = anchors_around("abc", {"a": "", "b": "a", "c": "b"}, "b".__eq__)
    >>> sorted(above["c"]), sorted(above["b"]), sorted(below["a"]), sorted(below["c"])
    (['b'], [], ['b'], [])
    """
    succs: dict[T, list[T]] = {item: [] for item in order}
    for item in order:
        for p in preds[item]:
            succs[p].append(item)

    def reach(items: Iterable[T], edges) -> dict[T, frozenset[T]]:
        found: dict[T, frozenset[T]] = {}
        for item in items:
            anchors: set[T] = set()
            for other in edges[item]:
                anchors |= found[other]
                if is_anchor(other):
                    anchors.add(other)
            found[item] = frozenset(anchors)
        return found

    return reach(order, preds), reach(reversed(order), succs)


def colour(weights: Weights) -> list[Block]:
    """Step 1: every anchor alone, the other nodes grouped by their anchors above and below.

    Parameters
    ----------
    weights : dict
        The :class:`~dasktensor.engine._weights.Weight` of every node, in topological order.

    Returns
    -------
    list of Block
        The groups, in the order of their first node.
    """
    return colour_by(list(weights), lambda n: weights[n].anchor)


def colour_by(nodes: Sequence[Apply], is_anchor: Callable[[Apply], bool]) -> list[Block]:
    """Every anchor alone, the other ``nodes`` (in topological order) grouped by the
    anchors among their ancestors and among their descendants: the groups form a DAG (see
    the module docstring).  Step 1 of the planner, and how ``dt.pmap`` cuts a graph at
    its annotated blocks."""
    inside = set(nodes)
    preds = {n: [i.owner for i in n.inputs if i.owner in inside] for n in nodes}
    above, below = anchors_around(nodes, preds, is_anchor)
    groups: dict[object, Block] = {}
    for node in nodes:
        key = node if is_anchor(node) else (above[node], below[node])
        groups.setdefault(key, []).append(node)
    return list(groups.values())


def fuse_chains(blocks: list[Block], weights: Weights) -> list[Block]:
    """Step 2: fuse linear chains of blocks, never across a heavy node.

    A block whose only consumer is a block whose only producer it is, is merged into it.
    Merging such a pair changes neither the other pairs nor the number of producers and
    consumers of any other block, so one pass over the block graph finds every merge.
    ``blocks`` are the groups made by :func:`colour`, ``weights`` every node's weight in
    topological order (kept inside merged blocks); returns the fused blocks in the order
    of their first node.
    """
    preds, succs = block_dag(blocks)
    heavy = [any(weights[n].kind == "heavy" for n in block) for block in blocks]
    pairs = []
    for a, consumers in enumerate(succs):
        if len(consumers) == 1:
            (b,) = consumers
            if len(preds[b]) == 1 and not heavy[a] and not heavy[b]:
                pairs.append((a, b))
    return _merged(weights, blocks, pairs)


def fuse_caller_stages(blocks: list[Block], weights: Weights) -> list[Block]:
    """Step 3: fuse the cheap stages that run on the caller into one per role.

    The roles: feeding the cluster (cluster work among the descendants only), after it
    (among the ancestors only) and beside it (neither).  Stages between cluster work stay
    as they are; :func:`make_plan` places them on the cluster.  Takes and returns blocks
    as :func:`fuse_chains` does.
    """
    preds, _ = block_dag(blocks)
    order = toposort_blocks(preds)
    cluster = [any(weights[n].anchor for n in block) for block in blocks]
    above, below = anchors_around(order, preds, cluster.__getitem__)
    sides: dict[tuple[bool, bool], list[int]] = {}
    for b in order:
        if not cluster[b] and not (above[b] and below[b]):
            sides.setdefault((bool(above[b]), bool(below[b])), []).append(b)
    return _merged(weights, blocks, [(side[0], b) for side in sides.values() for b in side[1:]])


def make_plan(fgraph: FunctionGraph, blocks: list[Block], weights: Weights) -> Plan:
    """Step 4: the blocks as tasks in topological order, each named, explained and placed.

    Parameters
    ----------
    fgraph : FunctionGraph
        The graph that ``blocks`` partition.
    blocks : list of Block
        Convex blocks of nodes, in the order of their first node.
    weights : dict
        The :class:`~dasktensor.engine._weights.Weight` of every node, in topological order.

    Returns
    -------
    Plan
    """
    preds, _ = block_dag(blocks)
    order = toposort_blocks(preds)
    renumber = {old: new for new, old in enumerate(order)}
    blocks = [blocks[old] for old in order]
    deps = [sorted(renumber[d] for d in preds[old]) for old in order]
    remote = [any(is_remote(n) for n in block) for block in blocks]
    # cheap stages between two cluster tasks run on the cluster
    on_cluster = [
        any(weights[n].anchor for n in b) and not r for b, r in zip(blocks, remote, strict=True)
    ]
    above, below = anchors_around(range(len(blocks)), deps, on_cluster.__getitem__)

    task_of_node = {n: i for i, block in enumerate(blocks) for n in block}
    fgraph_outputs = set(fgraph.outputs)
    clients = fgraph.clients
    tasks = []
    for i, block in enumerate(blocks):
        in_block = set(block)
        entering = (v for n in block for v in n.inputs if v.owner not in in_block)
        inputs = dict.fromkeys(v for v in entering if not isinstance(v, Constant))
        outputs = [
            o
            for n in block
            for o in n.outputs
            if o in fgraph_outputs
            or any(task_of_node.get(c, i) != i for c, _ in clients.get(o, ()))
        ]
        tasks.append(
            Task(
                index=i,
                nodes=tuple(block),
                inputs=tuple(inputs),
                outputs=tuple(outputs),
                deps=tuple(deps[i]),
                **_describe(block, weights, remote[i], on_cluster[i], above[i], below[i]),
            )
        )
    return Plan(fgraph=fgraph, tasks=tuple(tasks))


# ----------------------------------------------------------------------------- helpers


#: the role and reason of a cheap stage by (cluster work above it, cluster work below it)
_CHEAP_ROLES = {
    (True, True): ("cluster", "cheap nodes between cluster tasks"),
    (True, False): ("after", "cheap nodes after heavy work"),
    (False, True): ("before", "cheap nodes before heavy work"),
    (False, False): ("beside", "cheap nodes beside heavy work (run while it runs)"),
}


def _describe(
    block: Block,
    weights: Weights,
    remote: bool,
    on_cluster: bool,
    above: frozenset,
    below: frozenset,
) -> dict:
    """The name, kind, role, reason and placement of the task made of ``block``."""
    heavy = [n for n in block if weights[n].kind == "heavy"]
    if heavy:
        (node,) = heavy  # heavy nodes are never fused
        placement = getattr(node.op, "dasktensor_placement", None) or Placement()
        role = "remote" if remote else "cluster"
        name, reason = op_label(node.op), weights[node].reason
        return dict(name=name, kind="heavy", role=role, reason=reason, placement=placement)
    if on_cluster:
        costly = [n for n in block if weights[n].kind == "costly"]
        name = "work-" + dominant_label(costly)
        reason = f"{len(costly)} costly node(s): {weights[costly[0]].reason}"
        return dict(name=name, kind="stage", role="cluster", reason=reason)
    role, reason = _CHEAP_ROLES[bool(above), bool(below)]
    return dict(name="stage-" + dominant_label(block), kind="stage", role=role, reason=reason)


def _single_stage(fgraph: FunctionGraph, nodes: list[Apply], reason: str) -> Plan:
    task = Task(
        index=0,
        name="stage-" + dominant_label(nodes),
        kind="stage",
        role="beside",
        nodes=tuple(nodes),
        inputs=tuple(fgraph.inputs),
        outputs=tuple(fgraph.outputs),
        deps=(),
        reason=f"one in-process stage: {reason}",
    )
    return Plan(fgraph=fgraph, tasks=(task,))


def block_dag(blocks: Sequence[Block]) -> tuple[list[set[int]], list[set[int]]]:
    """Predecessors and successors of every block, by index in ``blocks``."""
    block_of = {n: b for b, block in enumerate(blocks) for n in block}
    preds = [
        {block_of[i.owner] for n in block for i in n.inputs if i.owner is not None} - {b}
        for b, block in enumerate(blocks)
    ]
    succs: list[set[int]] = [set() for _ in blocks]
    for b, producers in enumerate(preds):
        for a in producers:
            succs[a].add(b)
    return preds, succs


def _merged(nodes: Iterable[Apply], blocks: list[Block], pairs) -> list[Block]:
    """``blocks`` with the blocks of every pair of indices united, in the order of ``nodes``."""
    parent = list(range(len(blocks)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for a, b in pairs:
        parent[find(b)] = find(a)
    block_of = {n: find(b) for b, block in enumerate(blocks) for n in block}
    members: dict[int, Block] = {}
    for node in nodes:
        members.setdefault(block_of[node], []).append(node)
    return list(members.values())


def toposort_blocks(preds: Sequence[Iterable[int]]) -> list[int]:
    """Block indices in topological order: level by level, each level in index order."""
    remaining = {i: set(d) for i, d in enumerate(preds)}
    done: list[int] = []
    while remaining:
        ready = sorted(i for i, d in remaining.items() if not d)
        if not ready:  # pragma: no cover - the colouring argument rules this out
            raise RuntimeError("dasktensor planner produced a cyclic task graph")
        for i in ready:
            del remaining[i]
            done.append(i)
        for d in remaining.values():
            d.difference_update(ready)
    return done
