"""Pipelines: a vectorised graph with ``dt.annotate`` blocks, as a chain of placed stages.

A graph for one chunk whose ``dt.annotate`` blocks ask for their own placement (a
surrogate on a GPU worker, a simulator on a CPU worker) cannot run as one task: one task
runs on one worker, against the blocks' placement.  :class:`Pipeline` cuts it into
*stages*, one task each per chunk, so that Dask places each stage as its block says and
chunks stream through the stages: chunk ``i + 1``'s first stage runs while chunk ``i`` is
in its second, and intermediates move worker to worker (Dask's data movement), never
through the caller.

The cut
-------
Blocks (``Placed`` nodes) are anchors.  Every other node is coloured by the blocks among
its ancestors and among its descendants (:func:`dasktensor.engine.colour_by`):
nodes of one colour form a stage that runs on any worker, and stages and blocks form an
acyclic graph (the argument of the planner's step 1).  Then stages of one *key* are fused
whenever fusing keeps the graph acyclic: blocks of equal placement (resources, workers,
retries, priority and compiling mode) become one stage -- two JAX blocks in a row on one
GPU worker are one JAX function, whose intermediate never leaves the device -- and the
unplaced stages fuse as far as they can (typically one before the blocks and one after).
Each stage is compiled as one :class:`~dasktensor.engine.TaskRunner`, its blocks inlined,
with its placement's mode (the line's backend by default).

Backpressure
------------
Stage ``s`` of chunk ``i`` waits until the stages that read its outputs have finished
chunk ``i - inflight`` (``dasktensor.pmap.inflight``), through a small marker task on the
reader's worker (its result is ``None``: only the fact travels).  So at most ``inflight``
chunks' outputs of any stage wait for the next stage: a slow GPU stage does not fill the
CPU workers' memory with finished first stages.  The bound is in the graph, so it holds
on any scheduler, and the chunks' values do not depend on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pytensor.graph.basic import Apply, Constant, Variable
from pytensor.graph.traversal import io_toposort

from dasktensor import _compat
from dasktensor._placement import Placement
from dasktensor.engine import (
    FromInput,
    FromTask,
    Placed,
    TaskRunner,
    block_dag,
    colour_by,
    toposort_blocks,
)

#: where the graph has no placement: the stages that run on any worker
_ANYWHERE = Placement()


@dataclass(frozen=True, eq=False)
class Stage:
    """One stage of a :class:`Pipeline`: one task per chunk."""

    index: int
    #: the stage's part of its task keys: its blocks' names, or ``pre``/``mid``/``post``
    name: str
    placement: Placement
    #: names of the ``dt.annotate`` blocks fused into this stage (none: unplaced nodes)
    blocks: tuple[str, ...]
    #: the stage's subgraph, its blocks inlined, compiled with the placement's mode
    runner: TaskRunner
    #: per value input of the runner: an input of the graph, or an output of a stage
    sources: tuple[FromInput | FromTask, ...]
    #: positions, among the graph's random generators, of those this stage draws from
    rngs: tuple[int, ...]
    #: the stages whose outputs this one reads, and those that read this one's
    deps: tuple[int, ...]
    consumers: tuple[int, ...]
    n_nodes: int


class Pipeline:
    """A vectorised graph cut into placed stages (see the module docstring).

    Parameters
    ----------
    values : sequence of Variable
        The graph's inputs that take arrays (batched and fixed ones), in order.
    rngs : sequence of Variable
        The graph's random generator inputs.
    outputs : sequence of Variable
        The graph's outputs.
    name : str
        The pmap's name: the prefix of every stage's task keys.

    Attributes
    ----------
    stages : list of Stage
        In topological order; each has its ``name``, ``placement``, ``blocks`` (the
        annotate blocks fused into it) and ``deps`` (the stages it reads).
    output_sources : list
        Where each output of the graph comes from (a stage's output, or an input).

    Examples
    --------
    A pmap builds one for a graph with ``dt.annotate`` blocks; ``g.plan`` is the latest:

    >>> import numpy as np, pytensor.tensor as pt
    >>> import dasktensor as dt
    >>> def fn(x):
    ...     with dt.annotate(resources={"GPU": 1}, name="surrogate"):
    ...         y = pt.tanh(x) * 2
    ...     return y.sum()
    >>> g = dt.pmap(fn, chunks=2)
    >>> y = g(np.ones((4, 3)))
    >>> [(s.name, s.placement.resources) for s in g.plan.stages]
    [('surrogate', {'GPU': 1}), ('post', None)]
    >>> np.round(y.compute(), 4)  # on a local scheduler resources are not enforced
    array([4.5696, 4.5696, 4.5696, 4.5696])
    """

    def __init__(self, values: Sequence, rngs: Sequence, outputs: Sequence, name: str):
        self.name = name
        values, rngs, outputs = list(values), list(rngs), list(outputs)
        nodes = io_toposort(values + rngs, outputs)
        groups = _fused(colour_by(nodes, _is_block))
        rank = {n: i for i, n in enumerate(nodes)}
        groups = [sorted(g, key=rank.__getitem__) for g in groups]
        preds, _ = block_dag(groups)
        order = toposort_blocks(preds)
        groups = [groups[i] for i in order]
        stage_of = {o: s for s, g in enumerate(groups) for n in g for o in n.outputs}
        # what each stage hands on: outputs read by other stages or by the caller
        wanted: list[list[Variable]] = [[] for _ in groups]
        for s, group in enumerate(groups):
            for n in group:
                for i in n.inputs:
                    t = stage_of.get(i)
                    if t is not None and t != s and i not in wanted[t]:
                        wanted[t].append(i)
        for o in outputs:
            t = stage_of.get(o)
            if t is not None and o not in wanted[t]:
                wanted[t].append(o)
        rng_pos = {r: j for j, r in enumerate(rngs)}
        value_pos = {v: j for j, v in enumerate(values)}
        self.stages: list[Stage] = []
        for s, group in enumerate(groups):
            inside = {o for n in group for o in n.outputs}
            reads: list[Variable] = []
            for n in group:
                for i in n.inputs:
                    if i not in inside and i not in reads and not isinstance(i, Constant):
                        reads.append(i)
            ins = [v for v in reads if v not in rng_pos]
            its_rngs = [v for v in reads if v in rng_pos]
            sources = tuple(
                FromInput(value_pos[v]) if v in value_pos
                else FromTask(stage_of[v], wanted[stage_of[v]].index(v))
                for v in ins
            )  # fmt: skip
            placement = _key(group)
            blocks = tuple(dict.fromkeys(n.op.dasktensor_name for n in group if _is_block(n)))
            deps = tuple(sorted({src.task for src in sources if isinstance(src, FromTask)}))
            self.stages.append(
                Stage(
                    index=s,
                    name="",  # named below, once the graph of stages is known
                    placement=placement,
                    blocks=blocks,
                    runner=TaskRunner(
                        ins + its_rngs,
                        _inlined(ins + its_rngs, wanted[s]),
                        backend="inner",
                        name=f"{name}-stage-{s}",
                        mode=placement.mode,
                    ),
                    sources=sources,
                    rngs=tuple(rng_pos[v] for v in its_rngs),
                    deps=deps,
                    consumers=(),
                    n_nodes=len(group),
                )
            )
        consumers: list[set[int]] = [set() for _ in self.stages]
        for st in self.stages:
            for d in st.deps:
                consumers[d].add(st.index)
        names = _names(self.stages, consumers)
        self.stages = [
            Stage(**{**st.__dict__, "name": names[st.index], "consumers": tuple(sorted(c))})
            for st, c in zip(self.stages, consumers, strict=True)
        ]
        self.output_sources: list[FromInput | FromTask] = [
            FromTask(stage_of[o], wanted[stage_of[o]].index(o)) if o in stage_of
            else FromInput(value_pos[o])
            for o in outputs
        ]  # fmt: skip

    @staticmethod
    def needed(inputs: Sequence, outputs: Sequence) -> bool:
        """Whether the graph between ``inputs`` and ``outputs`` holds an annotated block."""
        return any(_is_block(n) for n in io_toposort(list(inputs), list(outputs)))

    @property
    def placements(self) -> list[Placement]:
        """The placement of every stage, in order."""
        return [st.placement for st in self.stages]

    def describe(self, inflight: int | None = None) -> str:
        """The stages, their placement and where their inputs come from, as text."""
        from dasktensor import _config

        inflight = inflight if inflight is not None else _config.get("pmap.inflight")
        head = (
            f"pmap {self.name!r}: {len(self.stages)} stage(s) per chunk, chunks streaming "
            f"through them; at most {inflight} chunk(s) in flight per stage "
            "(dasktensor.pmap.inflight)"
        )
        lines = [head]
        for st in self.stages:
            where = str(st.placement) if st.placement else "any worker"
            mode = "" if st.placement.mode is not None else ", the line's backend"
            reads = sorted(
                {f"stage {src.task}" if isinstance(src, FromTask) else "the inputs"
                 for src in st.sources}
            )  # fmt: skip
            blocks = f"blocks {', '.join(st.blocks)}" if st.blocks else "unplaced nodes"
            lines.append(
                f"  {st.index}. {self.name}-{st.name}: {blocks} ({st.n_nodes} node(s)); "
                f"{where}{mode}; reads {', '.join(reads) or 'nothing'}"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()

    __repr__ = __str__


# --------------------------------------------------------------------------------- the cut


def _is_block(node: Apply) -> bool:
    return isinstance(node.op, Placed)


def _key(group: Sequence[Apply]) -> Placement:
    """A group's placement: its blocks' (all equal), or none for unplaced nodes."""
    for n in group:
        if _is_block(n):
            return n.op.dasktensor_placement
    return _ANYWHERE


def _fused(groups: list[list[Apply]]) -> list[list[Apply]]:
    """Groups of one placement fused wherever that keeps the graph of groups acyclic.

    Fusing ``a`` and ``b`` makes a cycle exactly when a path leads from one to the other
    through a third group; the groups are few (blocks, and a few colours), so the graph is
    simply rebuilt after every fusion.
    """
    groups = [list(g) for g in groups]
    while True:
        preds, succs = block_dag(groups)
        order = toposort_blocks(preds)
        reach: dict[int, set[int]] = {}
        for g in reversed(order):
            reach[g] = set(succs[g]).union(*(reach[c] for c in succs[g]))
        keys = [_key(g) for g in groups]
        pair = next(
            (
                (a, b)
                for i, a in enumerate(order)
                for b in order[i + 1 :]
                if keys[a] == keys[b] and not any(b in reach[c] for c in succs[a] if c != b)
            ),
            None,
        )
        if pair is None:
            return groups
        a, b = pair
        groups[a] = groups[a] + groups[b]
        del groups[b]


def _names(stages: list[Stage], consumers: list[set[int]]) -> list[str]:
    """Task-key names: a placed stage after its blocks, an unplaced one after its place
    in the pipeline (``pre`` before any block, ``post`` after them, ``mid`` between;
    never ``out``, the name of a pmap's output keys)."""
    above: list[set[int]] = [set() for _ in stages]  # stages before each, transitively
    for st in stages:
        for d in st.deps:
            above[st.index] |= above[d] | {d}
    below: list[set[int]] = [set() for _ in stages]
    for st in reversed(stages):
        for c in consumers[st.index]:
            below[st.index] |= below[c] | {c}
    names = []
    for st in stages:
        if st.blocks:
            name = "-".join(st.blocks)
            name = "out-block" if name == "out" else name
        else:
            placed_above = any(stages[d].blocks for d in above[st.index])
            placed_below = any(stages[c].blocks for c in below[st.index])
            name = "mid" if placed_above and placed_below else "post" if placed_above else "pre"
        names.append(name)
    seen: dict[str, int] = {}
    for i, name in enumerate(names):
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1:
            names[i] = f"{name}-{'abcdefghijklmnopqrstuvwxyz'[(seen[name] - 2) % 26]}"
    return names


def _inlined(inputs: Sequence[Variable], outputs: Sequence[Variable]) -> list[Variable]:
    """``outputs`` rebuilt on ``inputs`` with every block replaced by its inner graph (a
    stage compiles as one function: fused blocks share it, and a JAX stage's
    intermediates stay JAX arrays)."""
    memo: dict[Variable, Variable] = {v: v for v in inputs}
    for node in io_toposort(list(inputs), list(outputs)):
        args = [memo.get(i, i) for i in node.inputs]
        if _is_block(node):  # (a block inside a block is inlined by the recursion)
            outs = _inlined(args, _compat.inner_graph_on(node.op, args))
        else:
            outs = node.clone_with_new_inputs(args, strict=False).outputs
        for old, new in zip(node.outputs, outs, strict=True):
            memo[old] = new
    return [memo.get(o, o) for o in outputs]
