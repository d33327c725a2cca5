"""The caller's view of a model's replicas: found or built through Dask, refreshed, dropped.

* **Placement.**  A replica is built by an ordinary task (``build-<name>`` on the
  dashboard, body ``dasktensor_worker.tasks.build_replica``) pinned to a worker that
  offers the model's ``resources`` (the scheduler's view of the workers): on each such
  worker (``replicas=None``) or on ``replicas`` of them: the model's preferred
  ``workers`` first (in their order, those alive), then starting at a worker that
  depends on the model's key, so that models spread over the workers.  ``factory()``
  runs once per worker (the worker's ``ModelHost`` builds each key once).  The build
  asks for no resources when the replica holds them (``dasktensor.remote._leases``): it
  would wait behind the holder of a replica another process built there meanwhile.
* **Discovery asks the workers** (``client.run(endpoint, key)``): which hold a replica,
  and where their call servers listen; so another process (a sampler child, an
  unpickled copy) finds the replicas this one built.  Workers that do not answer a probe
  are not asked (``dasktensor.remote._probes``).
* **Dropping.**  A replica whose worker failed, or that answered that it no longer holds
  the model, is dropped from the list (and its pooled connections closed); with none
  left, the next call finds or builds replicas again where Dask has workers.
* **Refreshing.**  Every ``dasktensor.remote.refresh-interval`` of use the list is matched
  to the cluster again, in a background thread, so new or restarted workers get replicas.
* **Lifetime.**  The replicas of a model created in this process live as long as its
  ``RemoteModel`` (:func:`owned`; the leases are ``dasktensor.remote._leases``).
* **Choosing.**  :meth:`ReplicaSet.pick` applies the pure policy of
  ``dasktensor.remote._policy`` to this process's state: the model's home (from numbers
  the scheduler hands out) and the calls in flight per worker, over all models.

Everything here is per process (:mod:`dasktensor._runtime`: a forked child starts with
none of it) and keyed by the model's key, never stored on the ``RemoteModel``: the model
pickles without it.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
import weakref
from collections import OrderedDict

from dasktensor import _config
from dasktensor._placement import Placement
from dasktensor._runtime import ProcessState, runtime
from dasktensor.cluster import (
    SchedulerLostError,
    carrying,
    check_resources,
    lost_scheduler,
    memory_restart,
    offers,
    run_on_workers,
    scheduler_workers,
    show_calls_page,
    submit,
    task_slot_released,
)
from dasktensor.remote._channel import get_channel
from dasktensor.remote._leases import (
    drop,
    drop_hold,
    give_back,
    hold_lease,
    hold_resources,
    lease_key,
    lease_of,
    let_go,
    own,
    release_in_background,
    share,
)
from dasktensor.remote._policy import choose_replica, home_replica
from dasktensor.remote._probes import answering, answers, some_answering, suspects
from dasktensor.remote._spec import ModelSpec, RemoteModelError
from dasktensor_worker import tasks


class ReplicaSet:
    """What this process knows of one model's replicas, and how it keeps that current."""

    def __init__(self, spec: ModelSpec):
        self.spec = spec
        self.lock = threading.Lock()
        # One build at a time (looks go on meanwhile, see _find_or_build): a call's
        # rebuild and a background refresh that both found a replica missing would
        # otherwise build it twice.
        self.building = threading.Lock()
        self.addresses: list[str] = []  # sorted: the same order in every process
        self.endpoints: dict[str, tuple] = {}  # address -> its call server (host, port, tls)
        #: address -> the scheduler's info on the worker when the replicas were last
        #: looked for (its memory limit names a nanny's memory restart, see _calls)
        self.worker_info: dict[str, dict] = {}
        self.number = 0  # the model's number on the cluster (see _number)
        self.process_number = 0  # this process's, likewise
        self.leased: set[str] = set()  # workers where this process's lease keeps a shared model
        #: what build tasks carry for the factory, and the modules a worker must import
        #: to load it (see shipped_factory and check_loadable)
        self.factory = spec.factory
        self.modules: list[str] | None = None
        self.security = None  # the client's distributed.Security (TLS clusters)
        self.checked = 0.0  # time.monotonic() of the last look at the cluster
        self.interval = 0.0  # dasktensor.remote.refresh-interval, read at each look
        self.probe_after = self.probe_timeout = 1.0  # dasktensor.remote.probe-*, likewise
        self.refreshing = False
        #: digest of a forward call's inputs -> the replica that answered it (the last
        #: 256), for its vjp's call (see ``dasktensor.remote._calls.call``)
        self.solutions: OrderedDict[bytes, str] = OrderedDict()

    def solved(self, key: bytes, address: str) -> None:
        """The replica at ``address`` answered the forward call keyed ``key``."""
        with self.lock:
            self.solutions[key] = address
            self.solutions.move_to_end(key)
            while len(self.solutions) > 256:
                self.solutions.popitem(last=False)

    def solved_at(self, key: bytes) -> str | None:
        """The replica that answered the forward call keyed ``key``, if remembered."""
        return self.solutions.get(key)

    def pick(self, prefer: str | None = None) -> str:
        """The worker the next call goes to, counted as busy until :func:`done`;
        ``prefer``, when it still holds a replica and is not suspected."""
        with self.lock:
            if not self.addresses:
                self._ensure()
            elif time.monotonic() - self.checked > self.interval:
                self._refresh_in_background()
            addresses = self.addresses
            suspected = suspects()
            if suspected:  # workers that did not answer a probe: not while others are there
                addresses = [a for a in addresses if a not in suspected] or addresses
            home = home_replica(self.number, self.process_number, len(addresses))
        state = runtime.state(_Replicas)
        with state.inflight_lock:
            if prefer is not None and prefer in addresses:
                address = prefer
            else:
                address = addresses[choose_replica(addresses, home, state.inflight)]
            state.inflight[address] = state.inflight.get(address, 0) + 1
        return address

    def endpoint(self, address: str) -> tuple:
        """Where the call server of the worker at ``address`` listens."""
        found = self.endpoints.get(address)
        if found is None:  # dropped and refreshed away meanwhile: a lost replica
            raise ConnectionError(f"{address} holds no replica of {self.spec!r} any more")
        return found

    def alive(self, address: str) -> bool:
        """Whether the scheduler still has the worker at ``address`` (True when it cannot
        be asked: the call's own failure will tell)."""
        try:
            client = self.spec.client()
            if lost_scheduler(client):  # its workers close with it; asking would wait
                return False  # for the client to reconnect
            return address in scheduler_workers(client)
        except Exception:
            return True

    def answers(self, address: str, timeout: float) -> bool:
        """Whether the worker at ``address`` answers a probe within ``timeout`` seconds;
        one that does not becomes a suspect: no replica of any model is looked for or
        built there until it answers again (see :mod:`dasktensor.remote._probes`)."""
        endpoint = self.endpoints.get(address)
        if endpoint is None:
            return True  # nothing to probe: the call's own outcome will tell
        return answers(address, endpoint, self.security, timeout)

    def start(self) -> list[str]:
        """Find or build the replicas now; their workers."""
        with self.lock:
            self._ensure()
            return list(self.addresses)

    def drop(self, address: str) -> None:
        """Forget the replica at ``address`` (its worker failed, or no longer holds it)."""
        with self.lock:  # a new list: other threads may be reading the old one
            self.addresses = [a for a in self.addresses if a != address]
        drop_hold(self.spec.key, address)
        get_channel().forget(address)

    def _ensure(self) -> None:
        """Find or build the replicas (called with ``self.lock`` held)."""
        client = self.spec.client()
        show_calls_page(client)
        hold_lease(self.spec, client)
        self._use(self._find_or_build(client))
        self.checked = time.monotonic()
        self.interval = _config.seconds("remote.refresh-interval")
        self.probe_after = _config.seconds("remote.probe-after")
        self.probe_timeout = _config.seconds("remote.probe-timeout")
        self.security = getattr(client, "security", None)
        state = runtime.state(_Replicas)
        if state.process_number is None:
            state.process_number = _number(client, "process", None)
        self.process_number = state.process_number
        self.number = _number(client, "model", self.spec.key)

    def _refresh_in_background(self) -> None:
        if self.refreshing:
            return
        self.refreshing = True
        self.checked = time.monotonic()

        def refresh():
            try:
                found = self._find_or_build(self.spec.client())
                with self.lock:
                    self._use(found)
            except Exception:  # the next call's own failure reports the problem
                pass
            finally:
                self.refreshing = False

        threading.Thread(target=refresh, name="dasktensor-refresh", daemon=True).start()

    def _use(self, found: dict[str, tuple]) -> None:
        self.endpoints = {**self.endpoints, **found}
        self.addresses = sorted(found)

    def _find_or_build(self, client) -> dict[str, tuple]:
        """The replicas' workers and their call servers, ``{address: endpoint}``.

        Looking takes no lock: a worker can fall silent between its probe and the
        question then asked through Dask (:func:`_endpoints`), which waits for Dask's
        connect timeout (30 s); a background refresh caught so must not hold up a call
        that needs the replica it lost built elsewhere meanwhile (when looks took the
        builds' lock, a cut link's evaluation took 25-32 s instead of 2.5).  Builds
        take turns (``self.building``), and each asks again first: a call's rebuild and
        a refresh that both found a replica missing would otherwise build it twice."""
        workers, eligible = self._look(client)
        held = _endpoints(client, self.spec.key, eligible)
        if len(held) < self._wanted(eligible):
            with self.building:
                held = self._build_missing(client, workers, eligible)
        if self.spec.shared:  # replicas another process built: this process's lease keeps them too
            found = [a for a in held if a not in self.leased]
            share(self.spec, client, found)
            self.leased.update(found)
        return held

    def _wanted(self, eligible: list[str]) -> int:
        replicas = self.spec.replicas
        return len(eligible) if replicas is None else min(replicas, len(eligible))

    def _look(self, client) -> tuple[dict[str, dict], list[str]]:
        """The workers that answer a probe (``{address: the scheduler's info}``) and,
        among them, those the model may be built on."""
        spec = self.spec
        if lost_scheduler(client):  # asking it would wait for the client to reconnect
            raise SchedulerLostError(
                f"{spec!r}: the client lost its scheduler at {client.scheduler.address} "
                f"(it is {client.status}; Dask's workers close with their scheduler): once "
                "the cluster runs again, dt.connect(...) and call again"
            )
        if spec.resources:
            check_resources(client, [Placement(resources=spec.resources)])
        listed = scheduler_workers(client)
        workers = some_answering(listed, self.endpoints, self.security)
        self.worker_info = {**self.worker_info, **workers}
        eligible = [a for a, w in workers.items() if offers(w.get("resources"), spec.resources)]
        if spec.only_workers:
            eligible = [a for a in eligible if a in _named(spec, eligible, workers)]
            if not eligible:
                raise RemoteModelError(
                    f"{spec!r}: expected one of its workers {list(spec.workers)} (it may run "
                    f"on these alone), the cluster at {client.scheduler.address} has "
                    f"{sorted(workers) or 'no workers'}"
                )
        if not eligible and listed and not workers:
            raise RemoteModelError(
                f"{spec!r}: expected workers to build the model on, the cluster at "
                f"{client.scheduler.address} lists {sorted(listed)} but none of their call "
                "servers answered a probe in Dask's connect timeout "
                "(distributed.comm.timeouts.connect): frozen, or cut off the network"
            )
        if not eligible:
            raise RemoteModelError(
                f"{spec!r}: expected workers to build the model on, the cluster at "
                f"{client.scheduler.address} has none; start some (`dask worker ADDRESS`)"
            )
        return workers, eligible

    def _build_missing(
        self, client, workers: dict[str, dict], eligible: list[str], tries: int = 3
    ) -> dict[str, tuple]:
        """Build the replicas ``eligible`` lacks (called with ``self.building`` held); the
        holders and their call servers."""
        spec = self.spec
        held = _endpoints(client, spec.key, eligible)  # (another look may have built them)
        holders = list(held)
        wanted = self._wanted(eligible)
        if len(holders) < wanted:
            free = [a for a in eligible if a not in holders]
            targets = _in_order(spec, free, workers)[: wanted - len(holders)]
            if self.modules is None:
                self.factory, self.modules = shipped_factory(spec.factory)
            check_loadable(client, spec, self.modules, targets)
            # Placed on the chosen worker only; with no resources when the replica holds
            # them (see hold_resources): a build asking for them would wait behind the
            # holder of a replica another process built there meanwhile.
            hold = bool(spec.resources) and spec.hold_resources
            started = time.time()  # (the scheduler stamps events with its clock)
            shipped = _sent_ahead(
                client, self.factory, getattr(spec.factory, "nbytes", 0), targets
            )
            with carrying(getattr(spec.factory, "nbytes", 0) if not shipped else 0):
                futures = {
                    a: submit(
                        client,
                        tasks.build_replica,
                        spec.key,
                        spec.name,
                        shipped.get(a, self.factory),
                        spec.concurrency,
                        lease_of(spec, client),
                        spec.replicas is None,  # scalable: a replica on each worker
                        key=f"build-{spec.name}-{uuid.uuid4().hex}",
                        placement=Placement(
                            resources=None if hold else spec.resources or None, workers=[a]
                        ),
                    )
                    for a in targets
                }
            with task_slot_released():  # (called from a task: see there)
                built = _gather_builds(client, futures)  # a factory's error is raised here
            del shipped  # (the workers drop their copies: the replicas hold what they need)
            if hold:
                hold_resources(spec, client, [a for a, new in built if new])
            self.leased.update(a for a, new in built if new)  # (built with the lease)
            held.update(_endpoints(client, spec.key, [a for a, _ in built if a not in held]))
            if not held:
                why = memory_restart(client, {a: workers[a] for a in targets}, started - 5)
                if not why and tries > 1:  # the workers left (a worker killed a moment
                    # before, still listed and answering when they were chosen): others
                    workers, eligible = self._look(client)
                    return self._build_missing(client, workers, eligible, tries - 1)
                raise RemoteModelError(
                    f"{spec!r}: expected replicas on {targets}, none was built: "
                    + (f"{why}" if why else "the workers left while building it (see their logs)")
                )
        return held


#: a factory carrying at least this many bytes of data (``factory.nbytes``: a data
#: shard's rows) is sent to its workers ahead of its build task (see :func:`_sent_ahead`)
SEND_AHEAD_BYTES = 2**20


def _sent_ahead(client, factory, nbytes: int, targets: list[str]) -> dict:
    """``{worker address: Future}`` of copies of a factory that carries ``nbytes`` of data,
    sent straight to each of ``targets`` (``client.scatter(direct=True)``), for its build
    task to take as argument; empty for a small factory, or when a worker cannot be
    reached directly (the task then carries the factory, through the scheduler).

    A task's arguments travel through the scheduler, which unpickles and pickles them
    again on its event loop: for the 56 MB shards of the P9 regression that was 1.0-1.4 s
    before the build task started (``docs/performance.md``).  A copy sent ahead goes
    straight to its worker, its arrays as out-of-band frames, and the build task, placed
    there, reads it from the worker's memory.  A rebuild (the worker lost) sends it again.
    """
    if not isinstance(nbytes, int) or nbytes < SEND_AHEAD_BYTES:
        return {}
    try:
        with task_slot_released():  # (called from a task: see there)
            return {
                a: client.scatter(factory, workers=[a], direct=True, hash=False) for a in targets
            }
    except Exception:  # the workers are not reachable from here: through the scheduler
        return {}


def _gather_builds(client, futures: dict) -> list[tuple[str, bool]]:
    """The results of the build tasks ``futures`` (worker address -> Future) whose
    workers stayed: a build pinned to a worker that left would wait for it for ever."""
    pending, results = dict(futures), []
    while pending:
        address, future = next(iter(pending.items()))
        try:
            results.append(future.result(timeout=1))
            del pending[address]
        except TimeoutError:
            if future.status == "error":  # the factory's own TimeoutError
                raise
            alive = scheduler_workers(client)
            for gone in [a for a in pending if a not in alive]:
                pending.pop(gone).cancel()
    return results


def shipped_factory(factory) -> tuple[object, list[str]]:
    """What a build task carries for ``factory``, and the modules a worker must import to
    load it.

    Dask pickles a task's arguments with ``pickle`` first, so a factory from a module
    registered with ``cloudpickle.register_pickle_by_value`` (a script beside the
    caller, absent on the workers) would still travel by reference; such a factory
    travels as cloudpickle's bytes instead (``build_replica`` loads them).  Large buffers
    stay out of band while the references are read from the pickle's opcodes (no copy,
    nothing loaded).

    >>> import collections
    >>> shipped_factory(collections.OrderedDict)
    (<class 'collections.OrderedDict'>, ['collections'])
    """
    import cloudpickle
    from distributed.protocol import pickle as dask_pickle

    # inside a task's arguments, as Dask pickles them (alone, a factory of a module
    # registered by value would be pickled with cloudpickle by Dask too)
    modules = _modules_in(lambda **kw: dask_pickle.dumps([factory], **kw))
    if set(modules) & set(cloudpickle.list_registry_pickle_by_value()):
        payload = cloudpickle.dumps(factory)
        return payload, _modules_in(lambda **kw: cloudpickle.dumps(factory, **kw))
    return factory, modules


_STRINGS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING",
            "BINSTRING", "STRING"}  # fmt: skip
_GETS = {"GET", "BINGET", "LONG_BINGET"}
_PUTS = {"PUT", "BINPUT", "LONG_BINPUT"}
_QUIET = {"MEMOIZE", "FRAME", "PROTO", "MARK", "STOP"} | _PUTS  # leave the stack's top


def _modules_in(dumps) -> list[str]:
    """The modules the pickle ``dumps(protocol=, buffer_callback=)`` makes refers to, read
    from its opcodes (``GLOBAL``, and ``STACK_GLOBAL`` after its two strings, memoized or
    not): nothing is loaded here."""
    import pickletools

    buffers: list = []
    try:
        data = dumps(protocol=5, buffer_callback=buffers.append)
    except Exception:  # it does not pickle: Dask's own error will say so
        return []
    found: dict[str, None] = {}
    memo: dict[int, object] = {}
    pushed: list = []  # the values pushed lately: strings, or None for anything else
    after_subimport = False
    try:
        for op, arg, _ in pickletools.genops(data):
            name = op.name
            value = None  # what the op pushes, when it is a string
            if name == "GLOBAL":
                found[str(arg).split(" ", 1)[0]] = None
            elif name == "STACK_GLOBAL":
                if len(pushed) >= 2 and isinstance(pushed[-2], str):
                    found[pushed[-2]] = None
                    # cloudpickle's subimport("numpy"): an import of a module by value;
                    # its argument is the next value pushed (a string, or memoized)
                    after_subimport = (pushed[-2].startswith("cloudpickle")
                                       and pushed[-1] == "subimport")  # fmt: skip
                    pushed.append(None)
                    continue
            elif name in _STRINGS:
                value = arg if isinstance(arg, str) else None
            elif name in _GETS:
                value = memo.get(arg)
            elif name == "MEMOIZE":
                memo[len(memo)] = pushed[-1] if pushed else None
                continue
            elif name in _PUTS:
                memo[arg] = pushed[-1] if pushed else None
                continue
            elif name in _QUIET:
                continue
            if after_subimport and isinstance(value, str):
                found[value] = None
            after_subimport = False
            pushed.append(value)
            del pushed[:-2]
    except Exception:  # not a pickle this reader knows: the workers' own error will say
        pass
    return sorted(found)


def check_loadable(client, spec: ModelSpec, modules: list[str], workers: list[str]) -> None:
    """Raise :class:`RemoteModelError` if some of ``workers`` cannot import one of
    ``modules`` (those of :func:`shipped_factory`): sent anyway, its build task
    would cut those workers off the scheduler for good (``distributed`` drops a worker's
    scheduler connection when the worker cannot load a task's function, and the worker
    does not come back)."""
    if not modules:
        return
    found = run_on_workers(client, tasks.missing_modules, modules, workers=workers)
    missing = {a: m for a, m in found.items() if isinstance(m, list) and m}
    if missing:
        names = sorted({n for m in missing.values() for n in m})
        raise RemoteModelError(
            f"{spec!r}: expected the workers to import what its factory refers to; "
            f"{sorted(missing)} cannot import {names}. Install it there, "
            "client.upload_file(path), or cloudpickle.register_pickle_by_value(module) "
            "before making the model (a module of this process only: a script beside it)"
        )


def _endpoints(client, key: str, among: list[str]) -> dict[str, tuple]:
    """``{address: endpoint}`` of the workers among ``among`` that hold model ``key``."""
    if not among:
        return {}
    found = run_on_workers(client, tasks.endpoint, key, workers=among)
    return {a: tuple(e) for a, e in found.items() if isinstance(e, tuple | list)}


def _in_order(spec: ModelSpec, free: list[str], workers: dict[str, dict]) -> list[str]:
    """The workers to build on, best first: the model's preferred ``workers`` (addresses
    or names) in their order, then the others starting at a worker that depends on the
    model's key, so that models spread over the workers."""
    start = int(spec.key.rsplit("-", 1)[1], 16) % len(free)
    others = free[start:] + free[:start]
    return list(dict.fromkeys(_named(spec, free, workers) + others))


def _named(spec: ModelSpec, among: list[str], workers: dict[str, dict]) -> list[str]:
    """The addresses among ``among`` of the model's ``workers`` (addresses or names), in
    the order the model names them."""
    names = {a: workers.get(a, {}).get("name") for a in among}
    return [a for w in spec.workers or () for a in among if w == a or str(w) == str(names[a])]


class _Replicas(ProcessState):
    """This process's replica sets (by model key), the calls it has in flight per worker
    over all models (independent calls of different models go to different workers
    too), and its number on the cluster (see ``dasktensor.remote._policy``)."""

    def __init__(self):
        self.sets: dict[str, ReplicaSet] = {}
        self.lock = threading.Lock()
        self.inflight: dict[str, int] = {}
        self.inflight_lock = threading.Lock()
        self.process_number: int | None = None


def replica_set(spec: ModelSpec) -> ReplicaSet:
    """This process's :class:`ReplicaSet` of the model (created on first use)."""
    state = runtime.state(_Replicas)
    with state.lock:
        found = state.sets.get(spec.key)
        if found is None or _elsewhere(found.spec, spec):
            found = state.sets[spec.key] = ReplicaSet(spec)
        return found


def _elsewhere(known: ModelSpec, spec: ModelSpec) -> bool:
    """Whether two specs of one key name different clusters (a shared model's key made
    again for another cluster): the replica set of one is not the other's."""
    a, b = known.scheduler.address, spec.scheduler.address
    return a is not None and b is not None and a != b


def done(address: str) -> None:
    """A call to ``address`` picked by :meth:`ReplicaSet.pick` has ended (in any way)."""
    state = runtime.state(_Replicas)
    with state.inflight_lock:
        state.inflight[address] = state.inflight.get(address, 1) - 1


def calls_in_flight() -> dict[str, int]:
    """The calls this process has in flight, by worker address."""
    state = runtime.state(_Replicas)
    with state.inflight_lock:
        return {a: n for a, n in state.inflight.items() if n}


def owned(model, spec: ModelSpec) -> weakref.finalize:
    """``model`` (a ``RemoteModel`` with ``spec``) was created in this process: hold its
    lease here, and release its replicas when ``model`` is garbage-collected.

    The ``RemoteModel``, not the spec its Ops hold: PyTensor's rewriters keep every Op
    they have seen (``OpToRewriterTracker.get_trackers`` is a ``functools.cache``), so
    an Op, once compiled, lives as long as the process.  An Op called after its model
    was collected builds the model again, held for the rest of the process's life."""
    own(spec)
    return weakref.finalize(model, _forget, spec.key, spec.scheduler, spec.shared)


def _forget(key: str, scheduler, shared: bool) -> None:
    """Finalizer of a model created here: drop its lease (the workers then drop its
    replicas within a second) and release them at once, in a thread (a shared model's:
    give back its lease, if no other object of this process holds it).  No locks: the
    collector may run anywhere, also in a thread that holds one of this module's."""
    if shared and not let_go(key):
        return
    runtime.state(_Replicas).sets.pop(key, None)
    lease = lease_key(key) if shared else None
    drop(key)
    if not shared or lease is not None:
        release_in_background(key, scheduler, lease)


# -- the cluster's view (asks the workers) --------------------------------------------------


def holders(spec: ModelSpec) -> list[str]:
    """Addresses of the workers that hold a replica now."""
    client = spec.client()
    held = client.run(tasks.holds, spec.key, workers=answering(client), on_error="return")
    return sorted(a for a, h in held.items() if h is True)


def build_counts(spec: ModelSpec) -> dict[str, int]:
    """How many times ``factory()`` ran on each worker that ever built the model."""
    client = spec.client()
    counts = client.run(tasks.build_count, spec.key, workers=answering(client), on_error="return")
    return {a: n for a, n in counts.items() if isinstance(n, int) and n}


def release(spec: ModelSpec) -> None:
    """Drop the model's replicas from the workers, and this process's state of them (a
    shared model: give back this process's lease).  Workers that do not answer a probe
    are not asked: ``client.run`` to a frozen worker never returns.  The lease dropped
    here takes their replicas when they wake (their next ``lease-check``)."""
    client = spec.client()
    lease = lease_of(spec, client) if spec.shared else None
    drop(spec.key)
    if spec.shared:
        give_back(client, spec.key, lease)
    else:
        client.run(tasks.release, spec.key, workers=answering(client))
    state = runtime.state(_Replicas)
    with state.lock:
        state.sets.pop(spec.key, None)


def _number(client, kind: str, key: str | None) -> int:
    """A number from the scheduler, distinct per process (or per model key) on the cluster
    (see ``dasktensor.remote._policy``)."""
    try:
        return client.run_on_scheduler(tasks.next_number, kind, key)
    except Exception:  # a scheduler that cannot import dasktensor_worker: spread at random
        return random.randrange(1 << 30) if key is None else hash(key)
