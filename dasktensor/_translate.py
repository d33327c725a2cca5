"""Translation: a plan plus input values becomes a Dask task graph.

Each task of the plan becomes one ``dask.task_spec.Task`` calling ``_run(runner, picks,
*deps)``: the runner is the task's compiled subgraph, ``deps`` the values (or task
references) it reads, and ``picks`` says which output of which dependency feeds which
input of the runner.  A task returns the tuple of its outputs.

Keys are ``<name>-<task index>-<call token>``: ``dask.utils.key_split`` reduces them to the
name (``stage-elemwise``, ``logp-remote``), so the dashboard reads like the model, while the
per-call token keeps every call's keys fresh.

:meth:`TaskGraph.delayed` builds a ``HighLevelGraph`` with one layer per task, annotated
with the task's resources, retries and priority, so that ``dask.compute`` on a distributed
client places the tasks as the annotations say.
"""

from __future__ import annotations

import operator
import uuid
from collections.abc import Sequence

from dask.delayed import Delayed, delayed
from dask.highlevelgraph import HighLevelGraph, MaterializedLayer
from dask.task_spec import Task as DaskTask
from dask.task_spec import TaskRef
from pytensor.graph.basic import Constant

from dasktensor._plan import Plan
from dasktensor._runners import TaskRunner


def _run(runner: TaskRunner, picks: tuple, *deps):
    """Task body: pick the runner's inputs out of its dependencies' values and run it.

    ``picks[i]`` is ``(position, output)``: input ``i`` is ``deps[position][output]``, or
    ``deps[position]`` itself when ``output`` is ``None`` (a value given by the caller).
    """
    return runner(*[deps[p] if j is None else deps[p][j] for p, j in picks])


class TaskGraph:
    """A plan's tasks with their runners and data sources, ready to become Dask graphs."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.runners = [TaskRunner.for_task(t) for t in plan.tasks]
        fgraph = plan.fgraph
        in_pos = {v: i for i, v in enumerate(fgraph.inputs)}
        produced = {}
        for t in plan.tasks:
            for j, v in enumerate(t.outputs):
                produced[v] = (t.index, j)

        def source(v):
            if v in produced:
                return ("task", *produced[v])
            if v in in_pos:
                return ("input", in_pos[v])
            if isinstance(v, Constant):
                return ("const", v.data)
            raise AssertionError(f"dasktensor planner lost the producer of {v}")

        self.sources = [tuple(source(v) for v in t.inputs) for t in plan.tasks]
        self.output_sources = [source(v) for v in fgraph.outputs]

    # -- the Dask graph -----------------------------------------------------------------

    def keys(self, token: str) -> list[str]:
        return [f"{t.name}-{t.index}-{token}" for t in self.plan.tasks]

    def _args(
        self, index: int, values: Sequence, refs: Sequence, computed: Sequence = ()
    ) -> tuple[tuple, list]:
        """``picks`` and dependency arguments of one task.

        ``refs[t]`` stands for the (tuple) result of task ``t``: a ``TaskRef`` or a Future.
        Where ``computed[t]`` holds task ``t``'s outputs already (run on the caller), the
        task gets just the outputs it reads, not the whole tuple.
        """
        picks, deps, where = [], [], {}
        for src in self.sources[index]:
            if src[0] == "task" and not (computed and computed[src[1]] is not None):
                _, t, j = src
                if ("task", t) not in where:
                    where[("task", t)] = len(deps)
                    deps.append(refs[t])
                picks.append((where[("task", t)], j))
                continue
            if src[0] == "task":
                value = computed[src[1]][src[2]]
            elif src[0] == "input":
                value = values[src[1]]
            else:
                value = src[1]
            if id(value) not in where:
                where[id(value)] = len(deps)
                deps.append(value)
            picks.append((where[id(value)], None))
        return tuple(picks), deps

    def graph(self, values: Sequence, token: str | None = None) -> tuple[dict, list[str]]:
        """The whole task graph for one call (``dask.task_spec`` Tasks) and its task keys."""
        token = token or uuid.uuid4().hex
        keys = self.keys(token)
        refs = [TaskRef(k) for k in keys]
        dsk = {}
        for t in self.plan.tasks:
            picks, deps = self._args(t.index, values, refs)
            dsk[keys[t.index]] = DaskTask(keys[t.index], _run, self.runners[t.index], picks, *deps)
        return dsk, keys

    def _outputs(self, values: Sequence, results: Sequence) -> list:
        out = []
        for src in self.output_sources:
            if src[0] == "task":
                out.append(results[src[1]][src[2]])
            elif src[0] == "input":
                out.append(values[src[1]])
            else:
                out.append(src[1])
        return out

    def delayed(self, values: Sequence) -> list[Delayed]:
        """One ``Delayed`` per output of the graph, annotated per task."""
        token = uuid.uuid4().hex
        dsk, keys = self.graph(values, token)
        layers, dependencies = {}, {}
        for t in self.plan.tasks:
            key = keys[t.index]
            ann = {k: v for k, v in t.annotations.items() if v is not None}
            layers[key] = MaterializedLayer({key: dsk[key]}, annotations=ann or None)
            dependencies[key] = {keys[d] for d in t.deps}
        out = []
        for i, src in enumerate(self.output_sources):
            if src[0] != "task":
                out.append(delayed(values[src[1]] if src[0] == "input" else src[1]))
                continue
            task_key = keys[src[1]]
            key = f"output-{i}-{token}"
            layer = MaterializedLayer(
                {key: DaskTask(key, operator.getitem, TaskRef(task_key), src[2])}
            )
            hlg = HighLevelGraph({**layers, key: layer}, {**dependencies, key: {task_key}})
            out.append(Delayed(key, hlg))
        return out
