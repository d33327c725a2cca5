"""Sharded execution: a function whose outputs are sums over data rows, split over workers.

PyMC's log-density and its gradient are sums over the observed rows.  When
:func:`dasktensor.sharding._analysis.find_shards` proves this of a DASK-mode function's rewritten
graph (data with at least ``dasktensor.shard.min-rows`` rows, or as ``shards=`` says), the
linker wraps its thunk in a :class:`ShardedThunk`, and on a distributed client:

* **K shards.**  ``shards=K`` gives K.  By default K comes from the workers and a cost
  estimate (:mod:`dasktensor.sharding._policy`): one shard per worker when the shards are
  built, but no more than the estimated work holds ``dasktensor.shard.min-work`` in
  each; a small model, or a single worker, is not sharded.  Shard ``i`` holds rows
  ``ShardPlan.slices(K)[i]`` of every data input.
* **One resident stage per shard** (:class:`ShardStages`): a remote model
  (``dasktensor.remote``) with one replica, built first on worker ``i`` (workers in
  address order), whose factory (:class:`ShardFactory`) carries the compiled partial
  graph (a :class:`~dasktensor.engine._runners.TaskRunner`: a token and a payload, compiled once
  per worker) *and the shard's rows*.  Building the stage sends the rows once; a worker
  lost with its shard costs a rebuild on another worker -- the rows go with the factory
  -- and the call is made again (the channel's failover).
* **Per call** only the parameters (``ShardPlan.param_inputs``) and the assumptions'
  guesses travel, to every shard at once (``RemoteMethod.call_together``: one wait); the
  partial values are summed here (``ShardPlan.reduce``) and the combine graph runs here.
  If an assumption (a parameter check over all rows) comes back false, the shards run
  again with the true values, which makes the outputs exact (see
  ``dasktensor.sharding._analysis``).
* **Data that changes.**  A shared variable holding data (``pm.Data``) that holds a new
  object (``set_value``, ``pm.set_data``) gets new shards (the old stages are released);
  a new shape first runs ``find_shards`` again, which may also say no.  An array changed
  in place through ``get_value(borrow=True)`` is not seen (PyTensor's borrow rules).

**Without a distributed client** the function runs in this process exactly as planned
without sharding (one backend stage, or the plan's tasks on the local scheduler), as it
also does with one worker.  Shards on Dask's threaded scheduler would compete for the
same cores and, mostly, for the GIL (the C VM and Numba stages hold it for much of their
work), and the split costs passes of its own; the unsharded function is also the default
mode's computation exactly.

**Processes.**  Stages are kept per scheduler address.  A forked child (``pm.sample(
cores=2)``) keeps its parent's stages and finds their replicas on the workers (the
remote package's per-process state is reset at fork); a pickled function re-links in
the other process and builds its own.  Stages are released when their executor is
garbage-collected, only by the process that built them.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from dask.base import tokenize
from pytensor.compile.sharedvalue import SharedVariable

from dasktensor import _config
from dasktensor._runtime import ProcessState, runtime
from dasktensor.cluster import SchedulerRef, holding, scheduler_workers, task_slot_released
from dasktensor.engine import TaskRunner
from dasktensor.engine import release_in_background as release_stages
from dasktensor.remote import RemoteMethod, RemoteModel
from dasktensor.sharding._analysis import NotSharded, ShardPlan, combine, find_shards, take_rows
from dasktensor.sharding._policy import (
    block_rows,
    describe,
    min_rows,
    min_work,
    n_shards,
    worth_it,
)
from dasktensor_worker.batching import batched

# ----------------------------------------------------------------------------- workers


class ShardServer:
    """On a worker: a shard's rows and the compiled partial graph that reads them.

    With ``blocks`` (a :class:`Blocks`), the rows are run through the partial graph a
    block at a time and the blocks' partial values combined as the shards' are: a block
    of ~10^5 rows keeps the graph's intermediate arrays in the processor's caches, which
    a shard of 10^6 rows does not (measured here: one pass over 10^6 rows of the P9
    linear regression took 20.6 ms, the same rows in blocks of 131,072 rows 14.6 ms).

    Examples
    --------
    >>> import numpy as np
    >>> server = ShardServer(lambda rows, mu: (((rows - mu) ** 2).sum(),), [np.arange(3.0)])
    >>> server.run(np.float64(1.0))
    [np.float64(2.0)]
    >>> server.calls, server.received, server.held
    (1, 8, 24)
    >>> blocks = Blocks(axes=(0,), kinds=("add", "max"), rows=2)  # rows [0:2], [2:4], [4:5]
    >>> blocked = ShardServer(lambda r: (r.sum(), r.max()), [np.arange(5.0)], blocks)
    >>> blocked.ranges[-1], blocked.run()
    (slice(4, 5, None), [np.float64(10.0), np.float64(4.0)])
    """

    def __init__(self, runner, rows, blocks: Blocks | None = None, warm: list | None = None):
        # rows unpickled from a network frame may be read-only, unaligned or strided (a
        # shard of X.T's columns): one C-ordered copy, so that blocks are contiguous runs
        self.rows = [np.require(r, requirements=["C", "A", "W"]) for r in rows]
        self.runner = runner
        self.calls = 0
        #: bytes of arguments received by calls (the rows came with the build)
        self.received = 0
        self.held = sum(r.nbytes for r in self.rows)
        self.blocks = blocks
        n = self.rows[0].shape[blocks.axes[0]] if blocks and self.rows else 0
        step = blocks.rows if blocks else 0
        #: the row ranges run one at a time (empty: all rows at once)
        self.ranges = [slice(a, min(a + step, n)) for a in range(0, n, step)] if n > step else []
        if warm is not None:
            self._warm(warm)

    def _warm(self, args) -> None:
        """Run the partial graph once over the first block of rows with ``args`` (the
        first call's arguments): its compilation (Numba's, on first call: 1.5-1.8 s for
        the P9 regression) is then part of the build, not of the first evaluation.  A
        failure is the first call's to report."""
        axes = self.blocks.axes if self.ranges else None
        block = (
            [take_rows(r, ax, self.ranges[0]) for r, ax in zip(self.rows, axes, strict=True)]
            if axes is not None
            else self.rows
        )
        try:
            self.runner(*block, *args)
        except Exception:
            pass

    def run(self, *args) -> list:
        """The partial values of this shard for these parameters and guesses."""
        return self.run_together(*([a] for a in args))[0]

    @batched(stack=False, wait=0)  # (the work per call is the same batched: no waiting)
    def run_together(self, *columns) -> list[list]:
        """The partial values for several calls at once: ``columns[i][c]`` is argument
        ``i`` of call ``c`` (the calls that waited for this shard, see
        ``dasktensor_worker.batching``); a list of partial values per call.

        Each call's values are what it gets alone, bit for bit: in each block of rows the
        unchanged kernel runs once per call, and each call's blocks combine in the same
        order.  The calls share the wake-up of this shard and each block of rows while it
        is in the processor's caches.
        """
        calls = list(zip(*columns, strict=True)) if columns else [()]
        self.calls += len(calls)
        self.received += sum(getattr(a, "nbytes", 0) for c in calls for a in c)
        if not self.ranges:
            return [list(self.runner(*self.rows, *args)) for args in calls]
        axes = self.blocks.axes
        per_call: list[list] = [[] for _ in calls]
        for rows in self.ranges:
            block = [take_rows(r, ax, rows) for r, ax in zip(self.rows, axes, strict=True)]
            for c, args in enumerate(calls):
                # np.array: the runner may reuse its output buffers
                per_call[c].append([np.array(v) for v in self.runner(*block, *args)])
        return [combine(self.blocks.kinds, per_block) for per_block in per_call]


@dataclass(frozen=True)
class Blocks:
    """How a shard runs its rows: ``rows`` at a time along each data input's ``axes``,
    the partial values combined by ``kinds`` (``Partial.kind``)."""

    axes: tuple[int, ...]
    kinds: tuple[str, ...]
    rows: int


class ShardFactory:
    """A shard stage's factory: the partial graph's runner and the shard's rows.

    Examples
    --------
    >>> import numpy as np
    >>> factory = ShardFactory(lambda rows: (rows.sum(),), [np.ones(4)])
    >>> factory.nbytes, factory().run()
    (32, [np.float64(4.0)])
    """

    def __init__(self, runner, rows, blocks: Blocks | None = None, warm: list | None = None):
        self.runner = runner
        self.rows = list(rows)
        self.blocks = blocks
        #: arguments of a first call, run once at build (see ``ShardServer._warm``)
        self.warm = warm

    @property
    def nbytes(self) -> int:
        """Bytes of data this factory carries (sent with each build of the stage)."""
        return int(sum(r.nbytes for r in self.rows))

    def __call__(self) -> ShardServer:
        return ShardServer(self.runner, self.rows, self.blocks, self.warm)


# ----------------------------------------------------------------------------- caller


class Split:
    """A :class:`ShardPlan`, its compiled graphs, and where their inputs come from."""

    def __init__(self, plan: ShardPlan, fgraph):
        self.plan = plan
        part, comb = plan.partial_graph(), plan.combine_graph()
        self.partial = TaskRunner(part.inputs, part.outputs, backend="inner", name="shard")
        self.combine = _shared_runner(
            TaskRunner(comb.inputs, comb.outputs, backend="inner", name="combine")
        )
        #: the combine graph's inputs' types (for a warm-up, see :meth:`warm_combine`)
        self.combine_types = [v.type for v in comb.inputs]
        where = {v: i for i, v in enumerate(fgraph.inputs)}
        self.params = [where[v] for v in plan.param_inputs]
        self.rest = [where[v] for v in plan.rest_inputs]
        self.data = [where.get(d.variable) for d in plan.data]  # None: a constant
        self.total_dtypes = [v.type.dtype for v in comb.inputs[len(plan.rest_inputs) :]]
        self.n_out = len(fgraph.outputs)
        rows = block_rows()  # the setting when the function was linked
        axes, kinds = tuple(d.axis for d in plan.data), tuple(p.kind for p in plan.partials)
        self.blocks = Blocks(axes, kinds, rows) if rows else None

    def data_values(self, values) -> list:
        """The data inputs' values in this call (constants: their data)."""
        return [
            d.value() if p is None else values[p]
            for p, d in zip(self.data, self.plan.data, strict=True)
        ]

    def fits(self, data) -> bool:
        """Whether data of these shapes is split by this plan."""
        return all(np.shape(v) == d.shape for v, d in zip(data, self.plan.data, strict=True))

    def warm_combine(self) -> threading.Thread | None:
        """Run the combine graph once on zeros in a thread, while the shards are built:
        its compilation (Numba's, on first call: ~0.6 s for the P9 regression) is then
        done when the first evaluation's partial values arrive.  None when this process
        ran it already (copies of a function share the runner, see ``_shared_runner``).
        The values are thrown away; Numba compiles for the inputs' types (dtype,
        dimensions), whatever their shapes, before running."""
        if self.combine.compiled_functions:
            return None
        zeros = [
            np.zeros([1 if d is None else d for d in t.shape], t.dtype) for t in self.combine_types
        ]

        def run():
            try:
                self.combine(*zeros)
            except Exception:  # (the first evaluation reports a real problem)
                pass

        thread = threading.Thread(target=run, name="dasktensor-warm-combine", daemon=True)
        thread.start()
        return thread


class ShardStages:
    """K resident stages on the cluster, stage ``i`` holding shard ``i`` of ``data``.

    Stage ``i`` is built first on ``workers[i % len(workers)]``, then on the next ones
    (``RemoteModel(workers=...)``), with one replica.  The stages are shared models
    (``RemoteModel(key=...)``) whose key is ``token`` (see :func:`shared_stages`): every
    process making the same stages finds and holds the same replicas.
    """

    def __init__(
        self,
        split: Split,
        data: list,
        client,
        k: int,
        workers: list[str],
        token: str,
        warm: list | None = None,
    ):
        self.split, self.data, self.pid = split, list(data), os.getpid()
        self.models = []
        for i, rows in enumerate(split.plan.slices(k)):
            order = [workers[(i + j) % len(workers)] for j in range(len(workers))]
            parts = [d.take(v, rows) for d, v in zip(split.plan.data, data, strict=True)]
            self.models.append(
                RemoteModel(
                    ShardFactory(split.partial, parts, split.blocks, warm),
                    name="shard",
                    replicas=1,
                    workers=order or None,
                    scheduler=client,
                    key=tokenize(token, i),
                )
            )
        # (batched: the calls of several chains that wait for a shard run together; the
        # chains of this process send theirs as one message per shard)
        self.targets = [m.method("run_together") for m in self.models]
        self.together = RemoteMethod.combined(self.targets)
        self.built: list[str] = []
        self.client = client
        #: seconds spent making these stages: ``"hash"`` (the data's token, see
        #: :func:`shared_stages`), ``"build"`` (sending the rows, each shard's build and
        #: compilation, all at once)
        self.timings: dict[str, float] = {}
        weakref.finalize(self, _release, list(self.models), self.pid, client)

    def start(self) -> list[str]:
        """Build every stage now (concurrently); the worker of each."""
        t0 = time.perf_counter()
        with task_slot_released(), ThreadPoolExecutor(len(self.models)) as pool:
            found = list(pool.map(lambda m: m.start(), self.models))
        self.built = [w[0] if w else "?" for w in found]
        self.timings["build"] = time.perf_counter() - t0
        return self.built

    def holds(self, data) -> bool:
        """Whether these stages were cut from exactly these data values."""
        return len(data) == len(self.data) and all(
            a is b for a, b in zip(data, self.data, strict=True)
        )

    def call(self, args: list) -> list:
        """Every shard's partial values for ``args``, from calls sent at once (with those
        of the other threads calling meanwhile)."""
        return self.together(tuple(args))

    def close(self) -> None:
        """Release the stages from the workers (only in the process that built them)."""
        _release(self.models, self.pid, self.client)


class _SharedStages(ProcessState):
    """The shard stages of this process, by cluster and content: copies of a function
    (thread copies, ``logp_dlogp_function`` copies held by samplers) share one set."""

    def __init__(self):
        self.stages: weakref.WeakValueDictionary[tuple, ShardStages] = (
            weakref.WeakValueDictionary()
        )
        self.lock = threading.Lock()


def shared_stages(
    split: Split, data: list, client, k: int, workers: list[str], warm: list | None = None
) -> ShardStages:
    """The stages of ``split``'s shards of ``data`` on ``client``, K of them, built unless
    this process has them already; ``warm``: a first call's arguments, run once by each
    shard as it is built (see ``ShardServer._warm``).

    Their identity on the cluster is a token of what defines them -- the partial graph
    (its runner's identity), the data's bytes, K and the blocks -- so that other processes
    (a pickled copy, a sampler child, ``dt.sample``'s segments on the workers) find the
    same replicas instead of building their own, and the calls of all of them reach the
    same shards, where they run together (``ShardServer.run_together``).  The data is
    hashed once per build and copy (114 ms for the 112 MB of the P9 regression here).
    """
    address = client.scheduler.address
    t0 = time.perf_counter()
    token = tokenize(split.partial.identity, *data, k, split.blocks, address)
    hashed = time.perf_counter() - t0
    key = (address, token)
    state = runtime.state(_SharedStages)
    # one build for copies asking at once; a segment waiting for another segment's build
    # in this worker leaves its thread slot, which the builder needs back (see holding)
    with holding(state.lock):
        found = state.stages.get(key)
        if found is None:
            found = ShardStages(split, data, client, k, workers, token, warm)
            found.timings["hash"] = hashed
            found.start()
            state.stages[key] = found
        return found


class _SharedRunners(ProcessState):
    """Combine graphs' runners of this process, by identity: copies of a sharded function
    (``logp_dlogp_function`` copies held by a sampler's chains, pickled or not) compile
    their combine graph once, not once each."""

    def __init__(self):
        self.runners: weakref.WeakValueDictionary[str, TaskRunner] = weakref.WeakValueDictionary()
        self.lock = threading.Lock()


def _shared_runner(runner: TaskRunner) -> TaskRunner:
    """The runner of this process computing what ``runner`` computes (``runner`` if none)."""
    state = runtime.state(_SharedRunners)
    identity = runner.identity
    with state.lock:
        found = state.runners.get(identity)
        if found is None:
            state.runners[identity] = found = runner
        return found


def _release(models, pid: int, client) -> None:
    if os.getpid() != pid:  # a forked child: the stages are its parent's
        return
    if getattr(client, "status", None) != "running":  # the cluster is gone: nothing held
        return
    release_stages(models)  # in a thread (see there: finalizers may run on Dask's loop)


class _Entry:
    """What one cluster runs for the data ``key`` (:meth:`ShardedExecutor.key`): stages,
    or nothing until ``recheck`` (``time.monotonic()``; None: until the key changes)."""

    def __init__(self, key, stages=None, recheck=None, split=None):
        self.key, self.stages, self.recheck = key, stages, recheck
        #: this function's own split (the stages may be another copy's)
        self.split = split


class ShardedExecutor:
    """Evaluates a sharded function on a distributed client (see the module docstring).

    Parameters
    ----------
    fgraph : FunctionGraph
        The rewritten graph the linker received.
    plan : ShardPlan
        ``find_shards(fgraph, ...)``.
    shards : int or None
        K, or None for one shard per worker.
    scheduler : SchedulerRef
        The function's scheduler choice.
    on_change : callable, optional
        ``on_change(text)`` with a new :func:`describe` text when the shards change.
    """

    def __init__(self, fgraph, plan: ShardPlan, shards, scheduler: SchedulerRef, on_change=None):
        self.fgraph, self.shards, self.scheduler = fgraph, shards, scheduler
        # the settings when the function was linked
        self.min_rows, self.min_work = min_rows(), min_work()
        self.on_change = on_change
        self.split: Split | None = Split(plan, fgraph)
        self.result: ShardPlan | NotSharded = plan
        self.shared = [i for i, v in enumerate(fgraph.inputs) if isinstance(v, SharedVariable)]
        self._entries: dict[str, _Entry] = {}  # by scheduler address
        self._lock = runtime.lock()  # the executor outlives a fork (a sampler child's)
        #: calls made sharded, rounds of shard calls, bytes of arguments sent, builds
        self.stats = {"calls": 0, "rounds": 0, "bytes_sent": 0, "builds": 0}
        #: a list to trace evaluations in (None: no trace): ``(called, sent, answered,
        #: done)`` per evaluation, ``time.time()`` when the thunk was called, before the
        #: shards' calls were sent, when their last reply was read and when the outputs
        #: were ready (``benchmarks/bench_p9_sharding.py`` breaks an evaluation down with
        #: it and the workers' call logs)
        self.trace: list | None = None

    def __call__(self, values) -> list | None:
        """The outputs, or None when this call is not sharded (no client, one worker)."""
        called = time.time() if self.trace is not None else 0.0
        kind, client = self.scheduler.resolve()
        if kind != "client":
            return None
        entry = self.entry_for(client, values)
        if entry.stages is None:
            return None
        return self._evaluate(entry, values, called)

    def key(self, values) -> tuple:
        """What decides the shards: the values of the shared variables that are data
        (compared by identity); when not sharded, the shapes of all shared values."""
        if self.split is not None:
            return tuple(values[p] for p in self.split.data if p is not None)
        return tuple(np.shape(values[i]) for i in self.shared)

    def entry_for(self, client, values) -> _Entry:
        """What runs this call's data on ``client`` (stages, built if needed, or none)."""
        address = client.scheduler.address
        key = self.key(values)
        entry = self._entries.get(address)
        if entry is not None and _same(entry.key, key):
            if entry.stages is not None or entry.recheck is None:
                return entry
            if time.monotonic() < entry.recheck:
                return entry
        with self._lock:
            key = self.key(values)
            entry = self._entries.get(address)
            if entry is not None and _same(entry.key, key) and entry.stages is not None:
                return entry
            # (stages of other data are released when no copy of the function uses them)
            self._entries[address] = entry = self._build(client, values)
            return entry

    def _build(self, client, values) -> _Entry:
        address = client.scheduler.address
        split = self.split
        data = split.data_values(values) if split is not None else None
        if split is None or not split.fits(data):
            found = find_shards(self.fgraph, min_rows=self.min_rows)
            self.result = worth_it(found, self.shards, self.min_work)
            self.split = split = Split(self.result, self.fgraph) if self.result else None
            self._changed()
            if split is None:
                return _Entry(self.key(values))
            data = split.data_values(values)
        workers = sorted(scheduler_workers(client))
        k = n_shards(split.plan, self.shards, len(workers), self.min_work)
        if k < 2 and not self.shards:  # one worker: look again after a while
            self._changed(f"unsharded, the cluster at {address} has {len(workers)} worker(s)")
            later = time.monotonic() + _config.seconds("remote.refresh-interval")
            return _Entry(self.key(values), recheck=later)
        warming = split.warm_combine()  # (while the shards are built)
        warm = [*(values[p] for p in split.params), *split.plan.guesses()]
        try:
            stages = shared_stages(split, data, client, k, workers, warm)
        finally:
            if warming is not None:
                warming.join()
        built = stages.built
        self.stats["builds"] += 1
        self._changed(f"{k} shards of ~{split.plan.n_rows // k} rows on {', '.join(built)}")
        return _Entry(self.key(values), stages, split=split)

    def _changed(self, now=None) -> None:
        if self.on_change is not None:
            self.on_change(describe(self.result, self.shards, now))

    def _evaluate(self, entry: _Entry, values, called: float = 0.0) -> list:
        stages, split = entry.stages, entry.split
        plan = split.plan
        params = [values[p] for p in split.params]
        rest = [values[p] for p in split.rest]
        guesses = plan.guesses()
        for _ in range(2):
            args = [*params, *guesses]
            sent = time.time() if self.trace is not None else 0.0
            per_shard = stages.call(args)
            answered = time.time() if self.trace is not None else 0.0
            self.stats["rounds"] += 1
            self.stats["bytes_sent"] += len(per_shard) * sum(getattr(a, "nbytes", 0) for a in args)
            totals = [
                np.asarray(t, dtype=dtype)
                for t, dtype in zip(plan.reduce(per_shard), split.total_dtypes, strict=True)
            ]
            out = split.combine(*rest, *totals)
            truth = out[split.n_out :]
            if all(np.array_equal(t, g) for t, g in zip(truth, guesses, strict=True)):
                self.stats["calls"] += 1
                if self.trace is not None:
                    self.trace.append((called, sent, answered, time.time()))
                return list(out[: split.n_out])
            guesses = [np.asarray(t, dtype=bool) for t in truth]
        raise RuntimeError(  # pragma: no cover - the true values do not depend on guesses
            "internal: the assumptions of a sharded function did not settle in two rounds"
        )

    def stages(self) -> list[ShardStages]:
        """The stages built so far, one set per cluster."""
        return [e.stages for e in self._entries.values() if e.stages is not None]


def _same(a: tuple, b: tuple) -> bool:
    """Keys are equal: the same objects (data values) or equal shapes (tuples)."""
    return len(a) == len(b) and all(
        x is y or (type(x) is tuple and type(y) is tuple and x == y)
        for x, y in zip(a, b, strict=True)
    )


class ShardedThunk:
    """The thunk PyTensor's ``Function`` calls: sharded when the executor says so, else the
    function's own thunk (``fallback``), to which every other attribute is delegated."""

    def __init__(self, fallback, executor: ShardedExecutor, inputs, outputs):
        self.fallback = fallback
        self.executor = executor
        self.inputs = [c.storage for c in inputs]
        self.outputs = [c.storage for c in outputs]
        self.sharded_last = False

    def __call__(self, output_subset=None):
        out = self.executor([s[0] for s in self.inputs])
        self.sharded_last = out is not None
        if out is None:
            if output_subset is None:
                return self.fallback()
            return self.fallback(output_subset=output_subset)
        for storage, value in zip(self.outputs, out, strict=True):
            storage[0] = value
        return out

    def __getattr__(self, name):
        if name.startswith("__") or name in ("fallback", "sharded_last"):
            raise AttributeError(name)
        if name == "position_of_error" and self.sharded_last:
            raise AttributeError(name)  # the error is not the fallback's: raise it as is
        return getattr(self.fallback, name)
