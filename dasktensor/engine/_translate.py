"""Translation: a plan plus input values becomes a Dask task graph.

Each task of the plan becomes one ``dask.task_spec.Task`` calling ``_run(runner, picks,
*deps)``: the runner is the task's compiled subgraph, ``deps`` the values (or task
references) it reads, and ``picks`` says which output of which dependency feeds which
input of the runner.  A task returns the tuple of its outputs.

Where a task's inputs come from is one of three small values: :class:`FromTask` (an
output of another task), :class:`FromInput` (an input of the function) or
:class:`FromConstant`.

Keys are ``<name>-<task index>-<call token>``: ``dask.utils.key_split`` reduces them to the
name (``stage-elementwise``, ``logp-remote``), so the dashboard reads like the model, while
the per-call token keeps every call's keys fresh.

:meth:`TaskGraph.delayed` builds a ``HighLevelGraph`` with one layer per task, annotated
with the task's placement (resources, retries, priority, workers), so that ``dask.compute``
on a distributed client places the tasks as they say.
"""

from __future__ import annotations

import operator
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dask.delayed import Delayed, delayed
from dask.highlevelgraph import HighLevelGraph, MaterializedLayer
from dask.task_spec import Task as DaskTask
from dask.task_spec import TaskRef
from pytensor.graph.basic import Constant

from dasktensor.engine._plan import Plan
from dasktensor.engine._runners import TaskRunner


def picked(picks: tuple, deps: Sequence) -> list:
    """A runner's inputs, picked out of its dependencies' values.

    ``picks[i]`` is ``(position, output)``: input ``i`` is ``deps[position][output]``, or
    ``deps[position]`` itself when ``output`` is ``None`` (a value given by the caller).
    """
    return [deps[p] if j is None else deps[p][j] for p, j in picks]


def _run(runner: TaskRunner, picks: tuple, *deps):
    """Task body: run the runner on the inputs picked out of its dependencies' values."""
    return runner(*picked(picks, deps))


@dataclass(frozen=True)
class FromTask:
    """Output ``output`` of task ``task``."""

    task: int
    output: int

    def value(self, values: Sequence, results: Sequence):
        return results[self.task][self.output]


@dataclass(frozen=True)
class FromInput:
    """Input ``position`` of the function."""

    position: int

    def value(self, values: Sequence, results: Sequence):
        return values[self.position]


@dataclass(frozen=True, eq=False)
class FromConstant:
    """A constant of the graph."""

    data: Any

    def value(self, values: Sequence, results: Sequence):
        return self.data


Source = FromTask | FromInput | FromConstant


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
                produced[v] = FromTask(t.index, j)

        def source(v) -> Source:
            if v in produced:
                return produced[v]
            if v in in_pos:
                return FromInput(in_pos[v])
            if isinstance(v, Constant):
                return FromConstant(v.data)
            raise AssertionError(f"dasktensor planner lost the producer of {v}")

        #: per task, where each of its inputs comes from
        self.sources = [tuple(source(v) for v in t.inputs) for t in plan.tasks]
        #: where each output of the function comes from
        self.output_sources = [source(v) for v in fgraph.outputs]

    # -- the Dask graph -----------------------------------------------------------------

    def keys(self, token: str) -> list[str]:
        """The task keys of one call."""
        return [f"{t.name}-{t.index}-{token}" for t in self.plan.tasks]

    def arguments(
        self, index: int, values: Sequence, refs: Sequence, computed: Sequence = ()
    ) -> tuple[tuple, list]:
        """``picks`` and dependency arguments of ``_run`` for task ``index``.

        ``refs[t]`` stands for the (tuple) result of task ``t``: a ``TaskRef`` or a Future.
        Where ``computed[t]`` holds task ``t``'s outputs already (run on the caller), the
        task gets just the outputs it reads, not the whole tuple.
        """
        picks, deps, where = [], [], {}
        for src in self.sources[index]:
            if isinstance(src, FromTask) and not (computed and computed[src.task] is not None):
                if ("task", src.task) not in where:
                    where[("task", src.task)] = len(deps)
                    deps.append(refs[src.task])
                picks.append((where[("task", src.task)], src.output))
                continue
            value = src.value(values, computed)
            if id(value) not in where:
                where[id(value)] = len(deps)
                deps.append(value)
            picks.append((where[id(value)], None))
        return tuple(picks), deps

    def task_outputs_needed(self) -> set[int]:
        """Tasks whose results are outputs of the function."""
        return {s.task for s in self.output_sources if isinstance(s, FromTask)}

    def graph(self, values: Sequence, token: str | None = None) -> tuple[dict, list[str]]:
        """The whole task graph for one call (``dask.task_spec`` Tasks) and its task keys."""
        token = token or uuid.uuid4().hex
        keys = self.keys(token)
        refs = [TaskRef(k) for k in keys]
        dsk = {}
        for t in self.plan.tasks:
            picks, deps = self.arguments(t.index, values, refs)
            dsk[keys[t.index]] = DaskTask(keys[t.index], _run, self.runners[t.index], picks, *deps)
        return dsk, keys

    def outputs(self, values: Sequence, results: Sequence) -> list:
        """The function's outputs, from its inputs and the tasks' results."""
        return [src.value(values, results) for src in self.output_sources]

    def delayed(self, values: Sequence) -> list[Delayed]:
        """One ``Delayed`` per output of the graph, annotated per task."""
        token = uuid.uuid4().hex
        dsk, keys = self.graph(values, token)
        layers, dependencies = {}, {}
        for t in self.plan.tasks:
            key = keys[t.index]
            ann = t.placement.annotations()
            layers[key] = MaterializedLayer({key: dsk[key]}, annotations=ann or None)
            dependencies[key] = {keys[d] for d in t.deps}
        out = []
        for i, src in enumerate(self.output_sources):
            if not isinstance(src, FromTask):
                out.append(delayed(src.value(values, ())))
                continue
            task_key = keys[src.task]
            key = f"output-{i}-{token}"
            layer = MaterializedLayer(
                {key: DaskTask(key, operator.getitem, TaskRef(task_key), src.output)}
            )
            hlg = HighLevelGraph({**layers, key: layer}, {**dependencies, key: {task_key}})
            out.append(Delayed(key, hlg))
        return out
