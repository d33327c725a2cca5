"""``dt.function``: ``pytensor.function`` in the DASK mode, plus plan, Dask graph and async."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytensor
from dask.delayed import Delayed
from pytensor.tensor.type import TensorType

from dasktensor._linker import DaskLinker, dask_mode
from dasktensor.engine import Plan, TaskGraph


class DaskFunction:
    """A compiled PyTensor function whose plan runs on Dask.

    Calls behave as calls of the ``pytensor.compile.function.types.Function`` it wraps
    (``f.maker``, ``f.input_storage`` and friends are reachable as attributes); in
    addition it is safe to call from several threads at once, and offers
    :attr:`plan`, :meth:`to_dask` and :meth:`acall`.
    """

    def __init__(self, fn):
        self._fn = fn
        self._idle: list = [fn]  # list.pop/append are atomic: no lock on the hot path

    # -- calls --------------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        try:
            fn = self._idle.pop()
        except IndexError:
            # every copy is in use by another thread: make one more (shared variables
            # stay shared between copies)
            fn = self._fn.copy(name=self._fn.name)
        try:
            return fn(*args, **kwargs)
        except (TypeError, ValueError) as e:
            self._check_values(args, e)
            raise
        finally:
            self._idle.append(fn)

    def _check_values(self, args: tuple, error: Exception) -> None:
        """Too many values, or None for a tensor: say what the function takes (PyTensor
        says 'Too many parameter', or fails on None inside a stage)."""
        inputs = [i.variable for i in self._fn.maker.inputs if not i.implicit]
        if len(args) > len(inputs):
            raise TypeError(
                f"DaskFunction expected at most {len(inputs)} input value(s) "
                f"({', '.join(map(str, inputs))}), got {len(args)}"
            ) from error
        for var, arg in zip(inputs, args, strict=False):  # (fewer values than inputs: checked)
            if arg is None and isinstance(var.type, TensorType):
                raise TypeError(
                    f"DaskFunction expected an array for input {var} ({var.type}), got None"
                ) from error

    async def acall(self, *args, **kwargs):
        """Call the function without blocking the running event loop.

        Examples
        --------
        >>> import asyncio, pytensor.tensor as pt
        >>> import dasktensor as dt
        >>> x = pt.scalar("x")
        >>> f = dt.function([x], x + 1)
        >>> float(asyncio.run(f.acall(1.0)))
        2.0
        """
        return await asyncio.to_thread(self.__call__, *args, **kwargs)

    # -- inspection ---------------------------------------------------------------------

    @property
    def plan(self) -> Plan:
        """The partition of the compiled graph into tasks; ``print(f.plan)`` explains it.

        Once the function was called on a distributed cluster, the plan also says where
        each cluster task (a ``dt.annotate`` block, a heavy Op) ran: the workers holding
        it, each with its device (``ran on: gpu-0 (tcp://...): GPU 0 (NVIDIA H200)``, or
        ``cpu``); reading it then asks the cluster (a few milliseconds).
        """
        return self._fn.maker.linker.located_plan()

    def to_dask(self, *args) -> list[Delayed] | Delayed:
        """The Dask graph of one call, as ``Delayed`` objects (one per output).

        The task graph is what the function would run, annotated per task with resources,
        retries and priority; compute it with ``dask.compute`` on any scheduler, or compose
        it with other Dask collections.  Shared variables contribute their current values;
        updates are not applied.

        Examples
        --------
        >>> import dask, pytensor.tensor as pt
        >>> import dasktensor as dt
        >>> x = pt.vector("x")
        >>> f = dt.function([x], [x.sum(), x.max()])
        >>> total, top = f.to_dask([1.0, 2.0])
        >>> [float(v) for v in dask.compute(total, top)]
        [3.0, 2.0]
        """
        fn = self._fn
        maker = fn.maker
        explicit = [i for i, inp in enumerate(maker.inputs) if not inp.implicit]
        if len(args) != len(explicit):
            raise TypeError(
                f"to_dask expected {len(explicit)} input value(s) "
                f"({', '.join(str(maker.inputs[i].variable) for i in explicit)}), "
                f"got {len(args)}"
            )
        values = [c.data for c in fn.input_storage]
        for i, arg in zip(explicit, args, strict=True):
            inp = maker.inputs[i]
            values[i] = inp.variable.type.filter(
                arg, strict=inp.strict, allow_downcast=inp.allow_downcast
            )
        graph = TaskGraph(self._fn.maker.linker.plan)
        delayed = graph.delayed(values)[: len(maker.outputs)]
        return delayed[0] if fn.unpack_single and len(delayed) == 1 else delayed

    # -- copies and pickling --------------------------------------------------------------

    def copy(self, **kwargs) -> DaskFunction:
        """A copy, as ``Function.copy`` (same keyword arguments)."""
        return DaskFunction(self._fn.copy(**kwargs))

    def __getstate__(self):
        return {"fn": self._fn}

    def __setstate__(self, state):
        type(self).__init__(self, state["fn"])

    def __getattr__(self, name):
        if name.startswith("__") or name in ("_fn", "_idle"):
            raise AttributeError(name)
        return getattr(self._fn, name)

    def __repr__(self) -> str:
        tasks = self._fn.maker.linker.plan.tasks
        return f"<DaskFunction {self._fn.name or ''} with {len(tasks)} task(s)>"


def function(
    inputs: Sequence,
    outputs=None,
    *,
    scheduler=None,
    heavy_flops: float | None = None,
    shards=None,
    **kwargs,
) -> DaskFunction:
    """Compile a PyTensor graph whose independent heavy parts run in parallel on Dask.

    Same semantics as ``pytensor.function`` (inputs, outputs, ``updates``, ``givens``,
    shared variables, random generators, ``no_default_updates``...), in the ``"DASK"``
    mode: the rewritten graph is planned into coarse tasks (``f.plan``); a graph with
    nothing to parallelise runs as one in-process stage, as fast as the default mode.

    Parameters
    ----------
    inputs, outputs
        As for ``pytensor.function``.
    scheduler : distributed.Client, str or callable, optional
        Where multi-task plans run: a ``Client`` (heavy tasks go to its workers, cheap
        stages run here), a scheduler address, ``"threads"``/``"sync"``, or any Dask
        scheduler ``get``.  Default: Dask's choice at call time (the default ``Client``,
        e.g. the one made by :func:`dasktensor.connect`, else the threaded scheduler).
    heavy_flops : float, optional
        Threshold of the planner's cost rule (``dasktensor.planner.heavy-flops``).
    shards : int or bool, optional
        When the outputs are sums over the rows of data (constants or shared variables)
        of at least ``dasktensor.shard.min-rows`` rows, a distributed client splits the
        rows into shards kept on its workers, one per worker (None, the default), ``K``
        (an int), or none (``False``).  ``print(f.plan)`` says whether and why.
    **kwargs
        Passed to ``pytensor.function`` (but not ``mode``).

    Returns
    -------
    DaskFunction

    Examples
    --------
    >>> import numpy as np, pytensor.tensor as pt
    >>> import dasktensor as dt
    >>> x = pt.vector("x")
    >>> f = dt.function([x], (x**2).sum())
    >>> float(f(np.array([1.0, 2.0])))
    5.0
    >>> f.plan.single_stage
    True

    A sum over the rows of data is split into shards on a distributed client (without
    one, as here, it runs in this process unsharded):

    >>> import dask
    >>> y = pt.constant(np.arange(8.0), name="y")
    >>> mu = pt.dscalar("mu")
    >>> with dask.config.set({"dasktensor.shard.min-rows": 4}):
    ...     g = dt.function([mu], ((y - mu) ** 2).sum(), shards=2)
    >>> print(g.plan.sharding.splitlines()[0])
    sharded: into 2 shards (shards=2), over the 8 rows of y (axis 0)
    >>> float(g(1.0))
    92.0
    """
    if "mode" in kwargs:
        raise TypeError(
            "dt.function compiles in the DASK mode and takes no mode=; use "
            "pytensor.function(..., mode='DASK') or mode=dt.dask_mode(...) to combine "
            "the DASK mode with other pytensor.function options"
        )
    mode = dask_mode(scheduler=scheduler, heavy_flops=heavy_flops, shards=shards)
    fn = pytensor.function(inputs, outputs, mode=mode, **kwargs)
    assert isinstance(fn.maker.linker, DaskLinker)
    return DaskFunction(fn)
