"""Execution: run a plan's tasks on a Dask scheduler, or on the caller and a cluster.

The executor holds the plan's translation (:class:`~dasktensor.engine._translate.TaskGraph`: the
runners, where each input comes from, the Dask graph of a call) and chooses, per call, how
to run it, from the function's ``scheduler`` or Dask's own resolution (``scheduler=``
argument, then ``dask.config`` ``scheduler``, then the default distributed ``Client``):

* **A local scheduler** (the threaded one by default, or any ``dask.typing``
  scheduler-get callable such as ``dask.get``): the whole task graph goes to it.
* **A distributed Client, the channel path** (``dasktensor.execute.path: channel``, the
  default): the
  graph runs on the caller's threads, and each cluster task is a *resident stage*
  (:mod:`dasktensor.engine._resident`): compiled once on the workers and called through the
  remote-call channel, a fraction of a millisecond a call instead of a task's ~13 ms.
* **A distributed Client, the task path** (``tasks``, every call in Dask's task stream):
  cheap stages whose inputs are on the caller run on the caller;
  cluster tasks (heavy and costly work, and cheap stages between two of them) are submitted
  at once with their placement; their results are gathered once, and the cheap stages
  after them run on the caller.  One evaluation costs one round of concurrent remote work,
  not one scheduler round trip per stage.
  On this path, a plan with remote-model calls (tasks of role ``remote``, made from the
  caller straight to the workers holding their models) runs on the caller's threads as
  with a local scheduler, and its cluster tasks are submitted from there, each as its
  inputs are ready.

Every task that is submitted goes through :func:`dasktensor.cluster.submit`.  Every call
uses fresh task keys (``<name>-<task>-<call token>``): keys reused across calls can return
the previous call's results.

Nothing here holds a live ``Client`` across pickling or ``fork``: a function keeps a
:class:`~dasktensor.cluster.SchedulerRef` and reconnects lazily in each process.
"""

from __future__ import annotations

import os
import uuid
import weakref
from collections.abc import Sequence
from typing import Any

import dask.threaded
from dask.task_spec import Task as DaskTask
from pytensor.compile.sharedvalue import SharedVariable

from dasktensor import _config
from dasktensor._placement import Placement
from dasktensor.cluster import (
    SchedulerRef,
    check_resources,
    scheduler_workers,
    submit,
    worker_devices,
)
from dasktensor.engine._plan import Plan
from dasktensor.engine._resident import ResidentStages, resident_stages
from dasktensor.engine._translate import TaskGraph, _run, picked

_PATHS = ("channel", "tasks")

_SCATTER_BYTES = 1 << 18


class PlanExecutor:
    """Runs a :class:`Plan` on the scheduler its function was given (see module docstring)."""

    def __init__(self, plan: Plan, scheduler: SchedulerRef):
        self.plan = plan
        self.graph = TaskGraph(plan)
        self.scheduler = scheduler
        self.shared_inputs = [
            i for i, v in enumerate(plan.fgraph.inputs) if isinstance(v, SharedVariable)
        ]
        self.has_remote_calls = any(t.role == "remote" for t in plan.tasks)
        # (client id, input position) -> (value, future of it on the cluster)
        self._resident: dict[tuple[int, int | None], tuple[Any, Any]] = {}
        # client id -> the resident stages of this function on that cluster
        self._stages: dict[int, ResidentStages] = {}
        # the client of the stages made last, and they (what where_ran reports)
        self._last_stages: tuple[weakref.ref, ResidentStages] | None = None

    def __call__(self, *values):
        kind, scheduler = self.scheduler.resolve()
        if kind == "get":
            return self._run_graph(scheduler, self.graph.graph(values), values)
        if execution_path() == "channel":
            return self._run_graph_calling(scheduler, values)
        if self.has_remote_calls:
            return self._run_graph_submitting(scheduler, values)
        return self._run_on_client(scheduler, values)

    def where_ran(self) -> dict[int, tuple[str, ...]]:
        """Where the cluster tasks ran: per task index, the workers holding its resident
        stage, each as ``"NAME (ADDRESS): DEVICE"`` (the device ``"GPU 0 (NAME)"`` or
        ``"cpu"``, :func:`dasktensor.cluster.worker_devices`).

        It asks the cluster (the workers holding each stage, then their devices, which
        each worker finds once), so it is read with the plan (``f.plan``), never on a
        call.  Empty before a call on a distributed client, on the ``tasks`` path (whose
        tasks go where the scheduler puts each), and when the cluster cannot say (its
        client closed, a worker not answering).
        """
        if self._last_stages is None:
            return {}
        ref, stages = self._last_stages
        client = ref()
        if client is None or client.status != "running":
            return {}
        try:
            held = stages.holders()
            addresses = sorted({a for found in held.values() for a in found})
            devices = worker_devices(client, addresses) if addresses else {}
            names = {a: str(w.get("name", a)) for a, w in scheduler_workers(client).items()}
        except Exception:  # the plan prints without it (the cluster is going, or gone)
            return {}
        return {
            index: tuple(
                f"{names.get(a, a)} ({a}): {devices.get(a, '?')}"
                if names.get(a, a) != a
                else f"{a}: {devices.get(a, '?')}"
                for a in found
            )
            for index, found in held.items()
            if found
        }

    # -- a local scheduler ----------------------------------------------------------------

    def _run_graph(self, get, graph: tuple[dict, list[str]], values, waiting: int | None = None):
        """The whole graph on ``get``; ``waiting`` tasks wait on the network (a thread each)."""
        dsk, keys = graph
        needed = sorted(self.graph.task_outputs_needed())
        kwargs = {}
        if waiting is None:
            waiting = sum(t.role == "remote" for t in self.plan.tasks)
        if waiting and get is dask.threaded.get:
            # remote calls wait on the network, not on a core: one thread for each
            kwargs["num_workers"] = max(os.cpu_count() or 1, waiting)
        got = get(dsk, [keys[i] for i in needed], **kwargs)
        results: list = [None] * len(keys)
        for i, r in zip(needed, got, strict=True):
            results[i] = r
        return self.graph.outputs(values, results)

    # -- a client: resident stages called through the channel ------------------------------

    def _run_graph_calling(self, client, values):
        """The graph on the caller's threads; cluster tasks called as resident stages."""
        dsk, keys = self.graph.graph(values)
        cluster = [t for t in self.plan.tasks if t.role == "cluster"]
        check_resources(client, [t.placement for t in cluster])
        stages = self._stages.get(id(client))
        if stages is None:
            stages = resident_stages(cluster, self.graph.runners, client)
            self._stages[id(client)] = stages
            self._last_stages = (weakref.ref(client), stages)
        for t in cluster:
            key = keys[t.index]
            _, picks, *deps = dsk[key].args  # (runner, picks, *deps)
            dsk[key] = DaskTask(key, _call_stage, stages, t.index, picks, *deps)
        waiting = len(cluster) + sum(t.role == "remote" for t in self.plan.tasks)
        return self._run_graph(dask.threaded.get, (dsk, keys), values, waiting)

    # -- a client, with remote-model calls made from here ----------------------------------

    def _run_graph_submitting(self, client, values):
        """The graph on the caller's threads; cluster tasks submitted from there."""
        dsk, keys = self.graph.graph(values)
        cluster = [t for t in self.plan.tasks if t.role == "cluster"]
        check_resources(client, [t.placement for t in cluster])
        for t in cluster:
            key = keys[t.index]
            body = dsk[key]
            dsk[key] = DaskTask(key, _submit_and_wait, client, key, t.placement, *body.args)
        return self._run_graph(dask.threaded.get, (dsk, keys), values)

    # -- a client ---------------------------------------------------------------------------

    def _run_on_client(self, client, values):
        tasks = self.plan.tasks
        keys = self.graph.keys(uuid.uuid4().hex)
        computed: list = [None] * len(tasks)  # outputs of tasks run on the caller
        futures: list = [None] * len(tasks)
        cluster = [t for t in tasks if t.role == "cluster"]
        check_resources(client, [t.placement for t in cluster])

        def run_here(role):
            for t in tasks:
                if t.role == role:
                    picks, deps = self.graph.arguments(t.index, values, futures, computed)
                    computed[t.index] = _run(self.graph.runners[t.index], picks, *deps)

        # 1. cheap stages feeding the cluster, on the caller
        run_here("before")
        # 2. cluster tasks, submitted at once (one batch of messages); the arguments of
        #    every cluster task are built once, _Pending standing for a cluster task's
        #    future until it is submitted; large arrays go to the workers once
        pending = [_Pending(i) for i in range(len(tasks))]
        args = {t.index: self.graph.arguments(t.index, values, pending, computed) for t in cluster}
        scattered = self._scatter_large(client, [deps for _, deps in args.values()], values)
        for t in cluster:
            picks, deps = args[t.index]
            deps = [
                futures[d.index] if isinstance(d, _Pending) else scattered.get(id(d), d)
                for d in deps
            ]
            futures[t.index] = submit(
                client,
                _run,
                self.graph.runners[t.index],
                picks,
                *deps,
                key=keys[t.index],
                placement=t.placement,
            )
        # 3. caller stages independent of the cluster, while it works
        run_here("beside")
        # 4. gather what the caller needs, once
        wanted = {d for t in tasks if t.role == "after" for d in t.deps}
        wanted |= self.graph.task_outputs_needed()
        wanted = sorted(i for i in wanted if futures[i] is not None)
        if wanted:
            for i, value in zip(wanted, client.gather([futures[i] for i in wanted]), strict=True):
                computed[i] = value
        # 5. cheap stages after the cluster work, on the caller
        run_here("after")
        return self.graph.outputs(values, computed)

    def _scatter_large(self, client, deps_per_task: list[list], values: Sequence) -> dict:
        """Send arrays of 256 KiB or more to the workers once; returns ``{id: future}``.

        Embedded in the tasks, an array would travel through the scheduler once per task
        that reads it, on every call.  An array read by several tasks goes to every worker
        (otherwise the tasks would crowd on the worker that holds it); one read by a single
        task goes to one worker, spread round-robin, and its task follows it.

        Values of shared variables (weights, data) stay on the workers between calls for as
        long as the variable holds the same object: ``set_value`` and updates put a new
        object there, which is sent again.  (Arrays changed in place through
        ``get_value(borrow=True)`` are not seen, as PyTensor's borrow semantics allow.)
        """
        readers: dict[int, int] = {}  # id(array) -> number of cluster tasks reading it
        large: dict[int, Any] = {}
        for deps in deps_per_task:
            for d in {id(d): d for d in deps if not isinstance(d, _Pending)}.values():
                if getattr(d, "nbytes", 0) >= _SCATTER_BYTES:
                    readers[id(d)] = readers.get(id(d), 0) + 1
                    large[id(d)] = d
        if not large:
            return {}
        shared_pos = {id(values[i]): i for i in self.shared_inputs}
        out: dict = {}
        fresh: dict[bool, list[int]] = {True: [], False: []}  # broadcast? -> ids
        for key, value in large.items():
            cached = self._resident.get((id(client), shared_pos.get(key)))
            if cached is not None and cached[0] is value and cached[1].status == "finished":
                out[key] = cached[1]
            else:
                fresh[readers[key] > 1].append(key)
        for broadcast, keys in fresh.items():
            if not keys:
                continue
            futures = client.scatter([large[k] for k in keys], hash=False, broadcast=broadcast)
            for key, future in zip(keys, futures, strict=True):
                out[key] = future
                if key in shared_pos:
                    self._resident[(id(client), shared_pos[key])] = (large[key], future)
        return out


def execution_path() -> str:
    """``dasktensor.execute.path``, checked: ``"channel"`` or ``"tasks"``."""
    path = _config.get("execute.path")
    if path not in _PATHS:
        raise ValueError(
            f"dask.config 'dasktensor.execute.path' expected one of {', '.join(_PATHS)}, "
            f"got {path!r}"
        )
    return path


def _call_stage(stages: ResidentStages, index: int, picks, *deps):
    """Task body on the caller: call a resident stage and wait for its outputs."""
    return stages.call(index, picked(picks, deps))


def _submit_and_wait(client, key: str, placement: Placement, runner, picks, *deps):
    """Task body on the caller: run a task on the cluster and wait for its result."""
    return submit(client, _run, runner, picks, *deps, key=key, placement=placement).result()


class _Pending:
    """Placeholder for the future of cluster task ``index`` while arguments are built."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index
