"""The DASK linker and mode.

PyTensor compiles a function by rewriting its graph and handing it to a linker, which
returns a thunk that PyTensor's ``Function`` calls with no arguments after filling the
input storage.  ``DaskLinker`` plans the rewritten graph (``_plan``) and then:

* for a single-stage plan, hands the graph to the line's own backend linker (C VM on
  PyTensor 2.38, Numba on 3.x): the function is exactly as fast as PyTensor's default mode;
* otherwise returns a thunk that runs the plan through ``_execute.PlanExecutor``;
* and when the outputs are sums over the rows of large data (``_shard.find_shards``),
  wraps that thunk so that, on a distributed client, the rows are split into shards kept
  on the workers (``_sharded``); ``plan.sharding`` says how, or why not.

``DaskLinker`` subclasses the backend linker's class, so that rewrites which ask which
backend they target (inner graphs of ``OpFromGraph`` and ``Scan``, elemwise fusion) prepare
the graph for the backend that compiles the stages.  The linker keeps no live Client and no
compiled code across pickling: ``Function`` re-links after unpickling.
"""

from __future__ import annotations

import copy
import dataclasses
import numbers

from pytensor.compile.mode import Mode, register_mode
from pytensor.graph.fg import FunctionGraph
from pytensor.link.basic import Container

from dasktensor import _compat
from dasktensor.cluster import SchedulerRef
from dasktensor.engine import Plan, PlanExecutor, plan_graph
from dasktensor.sharding import ShardedExecutor, ShardedThunk, analyse, check_shards, describe

_BACKEND_LINKER = _compat.backend_mode().linker


# the class is the line's backend linker's, known only when PyTensor is imported
class DaskLinker(type(_BACKEND_LINKER)):  # type: ignore[misc]
    """Linker that plans a graph into coarse tasks and runs them on Dask.

    Parameters
    ----------
    scheduler : Client, str or callable, optional
        Where multi-task plans run: a distributed ``Client``, a scheduler address, a
        local scheduler name (``"threads"``, ``"sync"``) or a Dask scheduler ``get``
        function.  By default Dask's own choice at call time (the default ``Client`` if
        there is one, else the threaded scheduler).
    heavy_flops : float, optional
        Threshold of the planner's cost rule (``dasktensor.planner.heavy-flops``).
    shards : int or bool, optional
        Sharding of sums over data rows (``dasktensor.sharding._executor``): None (the default)
        makes one shard per worker of a distributed client, an int K makes K shards,
        ``False`` or 0 turns it off.  Only graphs with data of at least
        ``dasktensor.shard.min-rows`` rows whose outputs are exact sums over them qualify.

    Examples
    --------
    >>> import pytensor, pytensor.tensor as pt
    >>> from pytensor.compile.mode import Mode
    >>> import dasktensor as dt
    >>> x = pt.vector("x")
    >>> f = pytensor.function([x], pt.exp(x).sum(), mode=Mode(linker=dt.DaskLinker()))
    >>> float(f([0.0, 0.0]))
    2.0
    """

    required_rewrites = _BACKEND_LINKER.required_rewrites
    # PyTensor 3 moves IfElse branches into inner graphs ("lazy_ifelse"); a heavy node in a
    # branch would then vanish from the plan into a stage.  Branches stay in the outer graph.
    # Calls of dasktensor's callable Ops stay separate nodes: each is a Dask task.
    incompatible_rewrites = (
        *_BACKEND_LINKER.incompatible_rewrites,
        "introduce_lazy_ifelse",
        "dasktensor_parallel_calls",
    )

    def __init__(self, scheduler=None, heavy_flops: float | None = None, shards=None, **_ignored):
        # the backend linker's own settings do not apply: stages use a fresh backend linker
        super().__init__()
        self.scheduler = (
            scheduler if isinstance(scheduler, SchedulerRef) else SchedulerRef(scheduler)
        )
        if heavy_flops is not None and not (
            isinstance(heavy_flops, numbers.Real)
            and not isinstance(heavy_flops, bool)
            and heavy_flops >= 0
        ):
            raise ValueError(
                "DaskLinker(heavy_flops=...) expected a number of flops >= 0 (None: "
                f"dasktensor.planner.heavy-flops), got {heavy_flops!r}"
            )
        self.heavy_flops = heavy_flops
        self.shards = check_shards(shards, "DaskLinker(shards=...)")
        self.fgraph: FunctionGraph | None = None
        self.plan: Plan | None = None
        self.executor: PlanExecutor | None = None
        self.sharded: ShardedExecutor | None = None
        self._updated_vars = None

    def __getstate__(self):
        state = self.__dict__.copy()
        state.update(plan=None, executor=None, sharded=None)  # rebuilt by make_thunk
        return state

    def clone(self, allow_gc=None):
        return DaskLinker(self.scheduler, self.heavy_flops, self.shards)

    def accept(self, fgraph, no_recycling=None, profile=None):
        if self.fgraph is not None and self.fgraph is not fgraph:
            return self.clone().accept(fgraph, no_recycling, profile)
        self.fgraph = fgraph
        self.no_recycling = list(no_recycling or [])
        self.profile = profile
        return self

    def accept_var_updates(self, updated_vars):
        self._updated_vars = updated_vars

    def _accepted(self) -> FunctionGraph:
        if self.fgraph is None:
            raise RuntimeError("DaskLinker: no graph accepted (call accept(fgraph) first)")
        return self.fgraph

    def make_thunk(self, input_storage=None, output_storage=None, storage_map=None, **kwargs):
        fgraph = self._accepted()
        plan = plan_graph(fgraph, heavy_flops=self.heavy_flops)
        found = analyse(fgraph, self.shards)
        self.plan = plan = dataclasses.replace(plan, sharding=describe(found, self.shards))
        if plan.single_stage:
            made = self._backend_thunk(input_storage, output_storage, storage_map, **kwargs)
        else:
            made = self._plan_thunk(plan, input_storage, output_storage)
        self.sharded = None
        if not found:
            return made
        self.sharded = ShardedExecutor(
            fgraph, found, self.shards, self.scheduler, on_change=self._sharding_changed
        )
        thunk, inputs, outputs = made
        return ShardedThunk(thunk, self.sharded, inputs, outputs), inputs, outputs

    def located_plan(self) -> Plan | None:
        """The plan, with where its cluster tasks ran (``Plan.ran``: workers and their
        devices) once the function was called on a cluster; asks the cluster, so it is
        what ``f.plan`` gives, not what a call reads."""
        plan = self.plan
        if plan is None or self.executor is None:
            return plan
        ran = self.executor.where_ran()
        return dataclasses.replace(plan, ran=ran) if ran else plan

    def _sharding_changed(self, text: str) -> None:
        if self.plan is not None:  # (set by make_thunk, before sharding can change)
            self.plan = dataclasses.replace(self.plan, sharding=text)

    def _plan_thunk(self, plan: Plan, input_storage, output_storage):
        fgraph = self._accepted()
        self.executor = executor = PlanExecutor(plan, self.scheduler)
        if input_storage is None:
            input_storage = [[None] for _ in fgraph.inputs]
        if output_storage is None:
            output_storage = [[None] for _ in fgraph.outputs]
        for var, storage in zip(fgraph.inputs, input_storage, strict=True):
            if storage[0] is None and hasattr(var, "data"):  # constants
                storage[0] = var.data
        thunk = _PlanThunk(
            executor,
            tuple(input_storage),
            tuple(output_storage),
            storage_map={
                **dict(zip(fgraph.inputs, input_storage, strict=True)),
                **dict(zip(fgraph.outputs, output_storage, strict=True)),
            },
        )
        return (
            thunk,
            [Container(v, s) for v, s in zip(fgraph.inputs, input_storage, strict=True)],
            [
                Container(v, s, readonly=True)
                for v, s in zip(fgraph.outputs, output_storage, strict=True)
            ],
        )

    def _backend_thunk(self, input_storage, output_storage, storage_map, **kwargs):
        backend = copy.copy(_compat.backend_mode().linker)
        backend = backend.accept(
            self._accepted(), no_recycling=self.no_recycling, profile=self.profile
        )
        if self._updated_vars is not None and hasattr(backend, "accept_var_updates"):
            backend.accept_var_updates(self._updated_vars)
        return backend.make_thunk(
            input_storage=input_storage,
            output_storage=output_storage,
            storage_map=storage_map,
            **kwargs,
        )

    def __repr__(self) -> str:
        return "DaskLinker()"


class _PlanThunk:
    """The thunk of a multi-stage plan, which PyTensor's ``Function`` calls with no
    arguments after filling the input storage."""

    allow_gc = True
    need_update_inputs = True

    def __init__(self, executor: PlanExecutor, inputs: tuple, outputs: tuple, storage_map):
        self.executor = executor
        self.inputs, self.outputs = inputs, outputs
        self.storage_map = storage_map

    def __call__(self):
        values = self.executor(*[s[0] for s in self.inputs])
        for s, v in zip(self.outputs, values, strict=True):
            s[0] = v
        return values


def dask_mode(scheduler=None, heavy_flops: float | None = None, shards=None) -> Mode:
    """A PyTensor ``Mode`` that plans graphs into coarse tasks and runs them on Dask.

    The registered ``"DASK"`` mode is ``dask_mode()``.  Its rewrites are those of
    PyTensor's default mode for the installed line.

    Parameters
    ----------
    scheduler : Client, str or callable, optional
        See :class:`DaskLinker`.
    heavy_flops : float, optional
        Threshold of the planner's cost rule.
    shards : int or bool, optional
        See :class:`DaskLinker`: None one shard per worker, K shards, False none.

    Returns
    -------
    pytensor.compile.mode.Mode

    Examples
    --------
    >>> import pytensor, pytensor.tensor as pt
    >>> import dasktensor as dt
    >>> x = pt.vector("x")
    >>> f = pytensor.function([x], 2 * x, mode=dt.dask_mode(scheduler="sync"))
    >>> f([1.0, 2.0]).tolist()
    [2.0, 4.0]
    """
    backend = _compat.backend_mode()
    linker = DaskLinker(scheduler, heavy_flops, shards)
    return Mode(linker=linker, optimizer=backend.provided_optimizer)


DASK = dask_mode()
register_mode("DASK", DASK)
