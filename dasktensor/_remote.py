"""Remote models: an object built once per worker and called over Dask's comm layer.

``RemoteModel(factory)`` keeps a model (a simulator, a solver, a network on a GPU) alive on
the workers of a Dask cluster and turns its methods into Ops.  Dask places the model, and
the calls then go straight to the workers that hold it:

* **Placement is Dask's.**  A replica is built by an ordinary task (``build-<name>`` on the
  dashboard) that carries the model's ``resources``, so only workers offering them build
  one; ``factory()`` runs once per worker and the object stays there.
* **Calls skip the scheduler.**  A ``client.submit(...).result()`` round trip costs about
  10 ms on loopback (the client batches its messages), far too much for a sampler making
  10^5 calls.  The first build installs a handler on the worker (``dasktensor_call``); a
  call is one request and one reply on a connection kept open by a
  ``distributed.core.ConnectionPool`` that each process creates on first use and drives
  from an event loop of its own (one thread, reset after ``fork``).  The worker runs the
  method on the replica's own thread, so its event loop keeps answering the scheduler.
* **Load is spread over replicas** without coordination between callers: each call goes
  to its model's *home* replica for this process (different models, and different
  processes such as the chains of ``pm.sample(cores=4)``, get different homes), or, when
  this process is already busy there, to the worker where it has the fewest calls.
* **Failover.**  A call whose connection breaks (the worker died, or was replaced) drops
  that replica and runs again on another one; when none is left, new replicas are built
  where Dask has workers.  Every few seconds of use the replica set is refreshed in the
  background, so workers that joined (or came back) get a replica too.
* **Errors** raised by the model reach the caller with their type and the remote traceback;
  ``retries`` re-runs a call that raised, ``timeout`` bounds one call.

Nothing here holds a live Client, Future or loop across pickling: a ``RemoteModel`` pickles
as its factory, its options and its identity (``key``), so that its Ops can go into
``pm.sample(cores=2)`` (fork or spawn) and reach the same replicas from there.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
import random
import re
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dasktensor import _config

_CALL = "dasktensor_call"


# ----------------------------------------------------------------------------- messages

# Arrays travel as (dtype, shape, bytes): msgpack packs the bytes as they are, about
# 0.25 ms per round trip faster than the pickling Dask applies to ndarrays in messages
# (measured on loopback with a 10-float logp+grad).  Non-contiguous arrays are packed in
# C order; anything else (object arrays, other Python objects) goes as Dask sends it.
_ND = "__dasktensor_nd__"


def _pack(value):
    if isinstance(value, np.ndarray | np.generic) and value.dtype.kind in "biufc":
        arr = np.asarray(value)
        return {_ND: (arr.dtype.str, arr.shape, arr.tobytes(), isinstance(value, np.generic))}
    if isinstance(value, tuple | list):
        return type(value)(_pack(v) for v in value)
    return value


def _unpack(value):
    if isinstance(value, dict) and _ND in value:
        dtype, shape, data, scalar = value[_ND]
        # a writeable copy: the caller, or the model, may write into it
        arr = np.frombuffer(data, dtype=dtype).reshape(shape).copy()
        return arr[()] if scalar else arr
    if isinstance(value, tuple | list):
        return tuple(_unpack(v) for v in value)
    return value


# ----------------------------------------------------------------------------- worker side


class _Replica:
    """One model object on one worker, with the thread(s) its calls run on.

    A call normally runs on the replica's own thread(s), so that the worker's event loop
    keeps answering the scheduler while the model works.  Handing a call to a thread and
    back costs about 0.2 ms, which is most of a round trip for a fast model; so while
    the replica's calls take less than ``dasktensor.remote.inline-below`` (1 ms), and
    none is running, a call runs directly on the event loop.  A call that takes longer
    sends the next ones back to the thread.
    """

    def __init__(self, model, concurrency: int, name: str, inline_below: float):
        self.model = model
        self.executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=concurrency, thread_name_prefix=f"dasktensor-{name}"
        )
        self.inline_below = inline_below if concurrency == 1 else 0.0
        self.recent = float("inf")  # duration of the last call, in seconds
        self.running = 0  # calls being run (changed on the event loop only)

    def invoke(self, method: str | None, args: list):
        target = self.model if method is None else getattr(self.model, method)
        t0 = time.perf_counter()
        try:
            return _pack(target(*_unpack(args)))
        finally:
            self.recent = time.perf_counter() - t0

    async def run(self, method: str | None, args: list):
        if self.running == 0 and self.recent < self.inline_below:
            return self.invoke(method, args)
        self.running += 1
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self.executor, self.invoke, method, args)
        finally:
            self.running -= 1


class _ModelHost:
    """The replicas one worker holds, by model key; installed by the first build there."""

    def __init__(self, worker):
        self.replicas: dict[str, _Replica] = {}
        self.builds: dict[str, int] = {}
        self.lock = threading.Lock()
        worker.handlers[_CALL] = self.handle_call

    def build(self, key: str, name: str, factory: Callable, concurrency: int) -> None:
        with self.lock:  # one build per key, however many tasks ask at once
            if key in self.replicas:
                return
            model = factory()
            inline_below = _config.seconds("remote.inline-below")
            self.replicas[key] = _Replica(model, concurrency, name, inline_below)
            self.builds[key] = self.builds.get(key, 0) + 1

    async def handle_call(self, key: str, method: str | None, args: list) -> dict:
        from distributed.core import error_message

        replica = self.replicas.get(key)
        if replica is None:
            return {"status": "missing"}
        try:
            result = await replica.run(method, args)
        except Exception as e:  # the model's own error: sent to the caller, not raised here
            return error_message(e)
        return {"status": "OK", "result": result}


_host_lock = threading.Lock()


def _host(worker) -> _ModelHost:
    with _host_lock:  # build tasks may run in several threads of one worker
        host = getattr(worker, "_dasktensor_models", None)
        if host is None:
            host = worker._dasktensor_models = _ModelHost(worker)
        return host


def _build_replica(key: str, name: str, factory: Callable, concurrency: int) -> str:
    """Task body: build the model on this worker (once) and return the worker's address."""
    from distributed import get_worker

    worker = get_worker()
    _host(worker).build(key, name, factory, concurrency)
    return worker.address


def _holds(key: str, dask_worker=None) -> bool:
    host = getattr(dask_worker, "_dasktensor_models", None)
    return host is not None and key in host.replicas


def _build_count(key: str, dask_worker=None) -> int:
    host = getattr(dask_worker, "_dasktensor_models", None)
    return 0 if host is None else host.builds.get(key, 0)


# ----------------------------------------------------------------------------- caller side


class _Channel:
    """This process's route to the workers: an event loop thread and connection pools
    (one per set of TLS credentials; plain TCP clusters share one)."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_forever, name="dasktensor-channel", daemon=True
        )
        self.thread.start()
        self.pools: dict = {}
        self.lock = threading.Lock()

    def pool(self, security) -> object:
        """The pool for a cluster with this ``distributed.Security`` (None: plain TCP)."""
        key = _security_key(security)
        with self.lock:
            pool = self.pools.get(key)
            if pool is None:
                args = security.get_connection_args("client") if security is not None else {}
                pool = self.pools[key] = self.run(self._make_pool(args)).result()
            return pool

    @staticmethod
    async def _make_pool(connection_args: dict):
        from distributed.core import ConnectionPool

        return await ConnectionPool(
            limit=512,
            timeout=_config.seconds("remote.connect-timeout"),
            connection_args=connection_args,
        )

    def run(self, coro) -> concurrent.futures.Future:
        if threading.current_thread() is self.thread:  # pragma: no cover - a misuse guard
            raise RuntimeError("a remote model was called from dasktensor's own channel thread")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    @staticmethod
    async def call(pool, address: str, key: str, method: str | None, args: list) -> dict:
        return await pool(address).dasktensor_call(key=key, method=method, args=args)

    def forget(self, address: str) -> None:
        """Drop pooled connections to a worker that failed."""
        for pool in list(self.pools.values()):
            self.loop.call_soon_threadsafe(pool.remove, address)


def _security_key(security):
    """What identifies a cluster's client credentials (None for plain TCP)."""
    if (
        security is None
        or not getattr(security, "require_encryption", False)
        and not any(getattr(security, f, None) for f in ("tls_ca_file", "tls_client_cert"))
    ):
        return None
    names = getattr(type(security), "__slots__", None) or vars(security)
    fields = ((k, getattr(security, k, None)) for k in names)
    return tuple(sorted((k, v) for k, v in fields if isinstance(v, str | bool)))


_channel: _Channel | None = None
_channel_lock = threading.Lock()


def _get_channel() -> _Channel:
    global _channel
    with _channel_lock:
        if _channel is None:
            _channel = _Channel()
        return _channel


class _Replicas:
    """What this process knows of one model's replicas."""

    def __init__(self):
        self.lock = threading.Lock()
        self.addresses: list[str] = []  # sorted: the same order in every process
        self.number = 0  # the model's number on the cluster (see _number)
        self.pool = None  # the channel's connection pool for this cluster
        self.checked = 0.0  # time.monotonic() of the last look at the cluster
        self.refreshing = False


_states: dict[str, _Replicas] = {}
_states_lock = threading.Lock()
# calls this process has in flight per worker, over all models: independent calls of
# different models go to different workers too
_inflight: dict[str, int] = {}
_inflight_lock = threading.Lock()


_process_number: int | None = None
# a parent's channel, kept from the garbage collector in a forked child: its connections
# belong to the parent (closing them here would warn, or worse, talk on the parent's socket)
_inherited: list = []


def _reset_after_fork() -> None:  # pragma: no cover - runs in forked children
    global _channel, _channel_lock, _states_lock, _inflight_lock, _process_number
    if _channel is not None:
        _inherited.append(_channel)
    _channel, _channel_lock = None, threading.Lock()
    _process_number = None
    _states.clear()
    _states_lock = threading.Lock()
    _inflight.clear()
    _inflight_lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)


class RemoteModelError(RuntimeError):
    """A remote model could not be reached: its workers kept failing, or none can hold it."""


def _label(text: str) -> str:
    """Letters and dashes only (see ``dasktensor._plan.op_label``)."""
    label = re.sub(r"[^a-z]+", "-", text.lower()).strip("-")
    return label or "model"


class RemoteModel:
    """A model built once per worker by ``factory()``, whose methods become Ops.

    The factory runs on the workers, once per worker that serves the model: load data,
    weights or a GPU context there.  Calls go straight to a worker holding a replica
    (about a millisecond on a local network), spread over the replicas; Dask chooses
    the workers (honouring ``resources``) and shows each build as a ``build-<name>``
    task; a replica lost with its worker is rebuilt where Dask has workers.

    Parameters
    ----------
    factory : callable
        ``factory() -> model``, run on a worker.  It travels there with cloudpickle.
    name : str
        Shown on the dashboard (``build-<name>``) and in error messages.
    resources : dict, optional
        Worker resources a replica needs, e.g. ``{"GPU": 1}``.
    replicas : int, optional
        How many workers hold the model.  By default every worker offering
        ``resources`` does, including workers that join later.
    concurrency : int
        Calls one replica runs at once (each replica has this many threads); 1 by
        default, so the model needs not be thread-safe.
    retries : int
        Times a call that raised is run again before its error reaches the caller.
    timeout : float, optional
        Seconds after which a call fails with ``TimeoutError``.
    scheduler : str or distributed.Client, optional
        The cluster.  By default the process's default Dask client
        (``dt.connect()`` makes one); a forked or unpickled copy reconnects by address.

    Examples
    --------
    >>> import numpy as np, pytensor, pytensor.tensor as pt
    >>> import dasktensor as dt
    >>> class Normal:
    ...     def __init__(self):
    ...         self.mu = np.zeros(3)  # data, weights... loaded once per worker
    ...     def logp_grad(self, x):
    ...         return -0.5 * float((x - self.mu) @ (x - self.mu)), self.mu - x
    >>> client = dt.connect(n_workers=2, processes=False, dashboard_address=False)
    >>> model = dt.RemoteModel(Normal, name="normal")
    >>> model.call("logp_grad", np.ones(3))
    (-1.5, array([-1., -1., -1.]))
    >>> len(model.start())  # a replica on each worker
    2
    >>> op = model.logp_grad_op("logp_grad", [pt.dvector])
    >>> x = pt.dvector("x")
    >>> f = pytensor.function([x], pytensor.grad(op(x)[0], x))
    >>> f(np.full(3, 2.0))
    array([-2., -2., -2.])
    >>> model.close()
    >>> client.shutdown()
    """

    def __init__(
        self,
        factory: Callable[[], Any],
        *,
        name: str = "model",
        resources: dict | None = None,
        replicas: int | None = None,
        concurrency: int = 1,
        retries: int = 0,
        timeout: float | None = None,
        scheduler=None,
    ):
        from dasktensor._cluster import SchedulerRef
        from dasktensor._placement import Placement, check_name

        if not callable(factory):
            raise TypeError(f"RemoteModel expected a callable factory, got {factory!r}")
        check_name(name, "RemoteModel(name=...)", "it prefixes Dask keys and names the model's Ops")
        Placement.of("RemoteModel", resources=resources)
        for option, value, low in (("replicas", replicas, 1), ("concurrency", concurrency, 1)):
            if value is not None and not (isinstance(value, int) and value >= low):
                raise ValueError(
                    f"RemoteModel({option}=...) expected an int >= {low}, got {value!r}"
                )
        if not (isinstance(retries, int) and retries >= 0):
            raise ValueError(f"RemoteModel(retries=...) expected an int >= 0, got {retries!r}")
        if timeout is not None and not (isinstance(timeout, int | float) and timeout > 0):
            raise ValueError(
                f"RemoteModel(timeout=...) expected a number of seconds > 0, got {timeout!r}"
            )
        self.factory = factory
        self.name = name
        self.resources = dict(resources or {})
        self.replicas = replicas
        self.concurrency = concurrency
        self.retries = retries
        self.timeout = timeout
        self._scheduler = SchedulerRef(scheduler)
        #: identity of the model on the cluster; copies made by pickling share it
        self.key = f"{self.name}-{uuid.uuid4().hex[:16]}"

    def __repr__(self) -> str:
        return f"RemoteModel({self.name!r}, key={self.key!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, RemoteModel) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)

    # -- Ops --------------------------------------------------------------------------------

    def logp_grad_op(self, method: str, itypes: Sequence, *, name: str | None = None):
        """A :class:`~dasktensor.LogpGradOp` calling ``model.<method>(*arrays) -> (logp, *grads)``.

        Examples
        --------
        >>> import pytensor.tensor as pt
        >>> import dasktensor as dt
        >>> model = dt.RemoteModel(dict, name="normal")
        >>> op = model.logp_grad_op("logp_grad", [pt.dvector])
        >>> op.dasktensor_remote, op.dasktensor_name
        (True, 'normal-logp-grad')
        """
        from dasktensor._callable_ops import LogpGradOp

        return LogpGradOp(_RemoteMethod(self, method), itypes, name=self._op_name(method, name))

    def logp_op(self, method: str, itypes: Sequence, *, name: str | None = None):
        """A :class:`~dasktensor.LogpOp` calling ``model.<method>(*arrays) -> float``."""
        from dasktensor._callable_ops import LogpOp

        return LogpOp(_RemoteMethod(self, method), itypes, name=self._op_name(method, name))

    def arrays_to_arrays_op(
        self, method: str, itypes: Sequence, otypes: Sequence, *, name: str | None = None
    ):
        """An :class:`~dasktensor.ArraysToArraysOp` calling ``model.<method>(*arrays)``."""
        from dasktensor._callable_ops import ArraysToArraysOp

        return ArraysToArraysOp(
            _RemoteMethod(self, method), itypes, otypes, name=self._op_name(method, name)
        )

    def _op_name(self, method: str, name: str | None) -> str:
        if not isinstance(method, str) or not method.isidentifier():
            raise TypeError(f"{self!r}: expected a method name, got {method!r}")
        return _label(name) if name is not None else f"{self.name}-{_label(method)}"

    # -- calls ------------------------------------------------------------------------------

    def call(self, method: str | None, *args):
        """Run ``model.<method>(*args)`` on a replica and return its result.

        ``method=None`` calls the model object itself.  Works from any thread, also while
        an event loop runs in this one (its loop is not used).
        """
        return self._call(method, args, self.retries)

    def _call(self, method: str | None, args: tuple, retries_left: int):
        from distributed.core import clean_exception

        channel = _get_channel()
        state = self._state()
        lost = 0
        while True:
            address = self._pick(state)
            packed = _pack(list(args))
            future = channel.run(channel.call(state.pool, address, self.key, method, packed))
            # the worker counts as busy until the call really ends, also after a timeout
            future.add_done_callback(functools.partial(_done, address))
            try:
                reply = future.result(self.timeout)
            except concurrent.futures.TimeoutError:
                # the call goes on on the worker (its thread cannot be stopped); its result
                # will be dropped
                if retries_left:
                    retries_left -= 1
                    continue
                raise TimeoutError(
                    f"{self!r}: {method or 'call'} did not return within {self.timeout:g} s "
                    f"on {address}"
                ) from None
            except Exception as e:  # the connection failed: the worker is gone or replaced
                lost += 1
                self._drop(state, address)
                if lost > _config.get("remote.allowed-failures"):
                    raise RemoteModelError(
                        f"{self!r}: {lost} workers failed while calling {method!r}; the last "
                        f"was {address} ({type(e).__name__}: {e})"
                    ) from e
                continue
            status = reply.get("status")
            if status == "OK":
                return _unpack(reply["result"])
            if status == "missing":  # the worker lost the replica (it was released)
                self._drop(state, address)
                continue
            _, exc, tb = clean_exception(**reply)
            if retries_left:
                retries_left -= 1
                continue
            raise exc.with_traceback(tb)

    async def acall(self, method: str | None, *args):
        """``await`` form of :meth:`call`, for code running in an event loop."""
        return await asyncio.to_thread(self.call, method, *args)

    def start(self) -> list[str]:
        """Build the replicas now (else the first call does); returns their workers."""
        state = self._state()
        with state.lock:
            self._ensure(state)
            return list(state.addresses)

    def close(self) -> None:
        """Drop the model's replicas from the workers (and this process's connections)."""
        client = self._client()
        client.run(_release_on_worker, self.key)
        with _states_lock:
            _states.pop(self.key, None)

    def workers(self) -> list[str]:
        """Addresses of the workers that hold a replica now (asks the cluster)."""
        held = self._client().run(_holds, self.key, on_error="return")
        return sorted(a for a, h in held.items() if h is True)

    def build_counts(self) -> dict[str, int]:
        """How many times ``factory()`` ran on each worker that ever built the model."""
        counts = self._client().run(_build_count, self.key, on_error="return")
        return {a: n for a, n in counts.items() if isinstance(n, int) and n}

    # -- replicas -----------------------------------------------------------------------------

    def _client(self):
        kind, client = self._scheduler.resolve()
        if kind != "client":
            raise RemoteModelError(
                f"{self!r} needs a Dask cluster: call dt.connect() first (an embedded cluster "
                "on this machine, or dt.connect('tcp://host:8786')), or pass "
                "RemoteModel(..., scheduler=...)"
            )
        return client

    def _state(self) -> _Replicas:
        with _states_lock:
            state = _states.get(self.key)
            if state is None:
                state = _states[self.key] = _Replicas()
            return state

    def _pick(self, state: _Replicas) -> str:
        with state.lock:
            if not state.addresses:
                self._ensure(state)
            elif time.monotonic() - state.checked > _config.seconds("remote.refresh-interval"):
                self._refresh_in_background(state)
            addresses = state.addresses
            home = (state.number + _process_number) % len(addresses)
        # the model's home worker for this process (see _number); when this process has
        # calls in flight there, the worker with the fewest, the home's neighbours first
        n = len(addresses)
        with _inflight_lock:
            i = min(range(n), key=lambda i: (_inflight.get(addresses[i], 0), (i - home) % n))
            _inflight[addresses[i]] = _inflight.get(addresses[i], 0) + 1
        return addresses[i]

    def _drop(self, state: _Replicas, address: str) -> None:
        with state.lock:  # a new list: other threads may be reading the old one
            state.addresses = [a for a in state.addresses if a != address]
        _get_channel().forget(address)

    def _ensure(self, state: _Replicas) -> None:
        """Find or build the replicas (called with ``state.lock`` held)."""
        global _process_number
        client = self._client()
        state.addresses = self._find_or_build(client)
        state.checked = time.monotonic()
        state.pool = _get_channel().pool(getattr(client, "security", None))
        if _process_number is None:
            _process_number = _number(client, "process", None)
        state.number = _number(client, "model", self.key)

    def _refresh_in_background(self, state: _Replicas) -> None:
        if state.refreshing:
            return
        state.refreshing = True
        state.checked = time.monotonic()

        def refresh():
            try:
                found = self._find_or_build(self._client())
                with state.lock:
                    state.addresses = found
            except Exception:  # the next call's own failure reports the problem
                pass
            finally:
                state.refreshing = False

        threading.Thread(target=refresh, name="dasktensor-refresh", daemon=True).start()

    def _find_or_build(self, client) -> list[str]:
        from dasktensor._cluster import Placement, check_resources

        if self.resources:
            check_resources(client, [Placement(resources=self.resources)])
        info = _scheduler_workers(client)
        eligible = [
            a
            for a, w in info.items()
            if all((w.get("resources") or {}).get(k, 0) >= v for k, v in self.resources.items())
        ]
        if not eligible:  # pragma: no cover - _check_resources waits for such workers
            raise RemoteModelError(f"{self!r}: the cluster has no workers")
        held = client.run(_holds, self.key, workers=eligible, on_error="return")
        holders = [a for a in eligible if held.get(a) is True]
        wanted = len(eligible) if self.replicas is None else min(self.replicas, len(eligible))
        if len(holders) < wanted:
            # start at a worker that depends on the model, so models spread over workers
            free = [a for a in eligible if a not in holders]
            start = int(self.key.rsplit("-", 1)[1], 16) % len(free)
            targets = (free[start:] + free[:start])[: wanted - len(holders)]
            futures = [
                client.submit(
                    _build_replica,
                    self.key,
                    self.name,
                    self.factory,
                    self.concurrency,
                    key=f"build-{self.name}-{uuid.uuid4().hex}",
                    workers=[a],
                    allow_other_workers=True,
                    resources=self.resources or None,
                    pure=False,
                )
                for a in targets
            ]
            for address in client.gather(futures):  # a factory's error is raised here
                if address not in holders:
                    holders.append(address)
        return sorted(holders)


def _done(address: str, _future=None) -> None:
    with _inflight_lock:
        _inflight[address] = _inflight.get(address, 1) - 1


def _number(client, kind: str, key: str | None) -> int:
    """A number from the scheduler, distinct per process (or per model key) on the cluster.

    A call goes to its model's *home* replica, ``(model number + process number) mod
    replicas``.  Within a process, models get different homes; across processes (chains
    of ``pm.sample(cores=4)``), one model gets different homes: independent calls from
    many processes spread over the workers without talking to each other, and never
    queue at one replica while another is idle.
    """
    try:
        return client.run_on_scheduler(_next_number, kind, key)
    except Exception:  # a scheduler that cannot import dasktensor: spread at random
        return random.randrange(1 << 30) if key is None else hash(key)


def _next_number(kind: str, key: str | None, dask_scheduler=None) -> int:
    numbers = getattr(dask_scheduler, "_dasktensor_numbers", None)
    if numbers is None:
        numbers = dask_scheduler._dasktensor_numbers = {"process": 0, "model": {}}
    if kind == "process":
        numbers["process"] += 1
        return numbers["process"] - 1
    return numbers["model"].setdefault(key, len(numbers["model"]))


def _release_on_worker(key: str, dask_worker=None) -> bool:
    host = getattr(dask_worker, "_dasktensor_models", None)
    if host is None:
        return False
    replica = host.replicas.pop(key, None)
    if replica is not None:
        replica.executor.shutdown(wait=False)
    return replica is not None


def _scheduler_workers(client) -> dict[str, dict]:
    try:
        info = client.scheduler_info(n_workers=-1)
    except TypeError:  # distributed before n_workers=
        info = client.scheduler_info()
    return dict(info.get("workers", {}))


def call_many(calls: Sequence[tuple[_RemoteMethod, tuple]]) -> list:
    """Make several remote calls at once from this thread; their results, in order.

    All requests leave together through the channel, and this thread waits once: no
    thread per call (each would cost a hand-off, ~0.3 ms with 4 calls here).  A call
    that fails to reach its model, or raised with ``retries`` left, runs again on its own
    through :meth:`RemoteModel.call`; the first error left is raised once all calls are
    done.  Models with a ``timeout`` are called on their own.
    """
    from distributed.core import clean_exception

    channel = _get_channel()
    picked = []
    for remote, args in calls:
        model = remote.model
        state = model._state()
        picked.append((model, state, model._pick(state), remote.method, args))

    async def all_at_once():
        return await asyncio.gather(
            *(
                channel.call(state.pool, a, m.key, meth, _pack(list(args)))
                for m, state, a, meth, args in picked
            ),
            return_exceptions=True,
        )

    future = channel.run(all_at_once())
    future.add_done_callback(lambda _: [_done(p[2]) for p in picked])
    replies = future.result()
    results, error = [], None
    for (model, state, address, method, args), reply in zip(picked, replies):
        status = reply.get("status") if isinstance(reply, dict) else None
        try:
            if status == "OK":
                results.append(_unpack(reply["result"]))
            elif status == "error" and not model.retries:
                _, exc, tb = clean_exception(**reply)
                raise exc.with_traceback(tb)
            elif status == "error":
                results.append(model._call(method, args, model.retries - 1))
            else:  # the connection failed, or the replica is gone: as RemoteModel.call does
                model._drop(state, address)
                results.append(model._call(method, args, model.retries))
        except Exception as e:
            results.append(None)
            error = error or e
    if error is not None:
        raise error
    return results


class _RemoteMethod:
    """``model.<method>`` as the function of a callable Op; compares by model and method."""

    dasktensor_remote = True

    def __init__(self, model: RemoteModel, method: str):
        self.model = model
        self.method = method
        self.__name__ = method

    def __call__(self, *args):
        return self.model.call(self.method, *args)

    def __eq__(self, other) -> bool:
        return (
            isinstance(other, _RemoteMethod)
            and other.model == self.model
            and other.method == self.method
        )

    def __hash__(self) -> int:
        return hash((self.model.key, self.method))

    def __repr__(self) -> str:
        return f"{self.model.name}.{self.method}"
