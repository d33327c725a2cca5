"""The caller's view of a model's replicas: found or built through Dask, refreshed, dropped.

* **Placement.**  A replica is built by an ordinary task (``build-<name>`` on the
  dashboard, body ``dasktensor_worker.tasks.build_replica``) pinned to a worker that
  offers the model's ``resources`` (the scheduler's view of the workers): on each such
  worker (``replicas=None``) or on ``replicas`` of them: the model's preferred
  ``workers`` first (in their order, those alive), then starting at a worker that
  depends on the model's key, so that models spread over the workers.  ``factory()``
  runs once per worker (the worker's ``ModelHost`` builds each key once).
* **Resources held.**  While a replica lives, a seceded task on its worker
  (``hold-<name>``, body ``dasktensor_worker.tasks.hold_resources``) holds the model's
  ``resources``: Dask runs no other task asking for them beside the replica.  It ends
  when the worker drops the replica.  The build task asks for none (it would wait
  behind the holder of a replica another process built there meanwhile).
* **Discovery asks the workers** (``client.run(endpoint, key)``): which hold a replica,
  and where their call servers listen; so another process (a sampler child, an
  unpickled copy) finds the replicas this one built.
* **Dropping.**  A replica whose worker failed, or that answered that it no longer holds
  the model, is dropped from the list (and its pooled connections closed); with none
  left, the next call finds or builds replicas again where Dask has workers.
* **Refreshing.**  Every ``dasktensor.remote.refresh-interval`` of use the list is matched
  to the cluster again, in a background thread, so new or restarted workers get replicas.
* **Lifetime.**  The process that created a model (its ``RemoteModel``) holds a *lease*
  for its replicas: a tiny Dask task (``dasktensor-lease-<key>-<n>``) its client keeps
  wanted, named in the builds it makes.  The workers' ``ModelHost`` asks the scheduler
  every second whether the leases of its replicas still exist, and drops the replicas
  of a lease that is gone: the ``RemoteModel`` was garbage-collected here (a finalizer
  releases the lease and the replicas; see :func:`owned`), or this process or its
  client went away, killed included, which makes the scheduler forget its keys.  Other processes (sampler
  children, unpickled copies) hold no lease: what they rebuild lives until ``close()``
  or the owner's finalizer.
* **Choosing.**  :meth:`ReplicaSet.pick` applies the pure policy of
  ``dasktensor.remote._policy`` to this process's state: the model's home (from numbers
  the scheduler hands out) and the calls in flight per worker, over all models.

Everything here is per process and keyed by the model's key (module globals, reset after
``fork``), never stored on the ``RemoteModel``: the model pickles without it.
"""

from __future__ import annotations

import os
import random
import threading
import time
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor

from dasktensor import _config
from dasktensor._cluster import (
    SchedulerLostError,
    carrying,
    check_resources,
    lost_scheduler,
    offers,
    scheduler_workers,
    show_calls_page,
    submit,
    task_slot_released,
)
from dasktensor._placement import Placement
from dasktensor.remote._channel import get_channel
from dasktensor.remote._policy import choose_replica, home_replica
from dasktensor.remote._spec import ModelSpec, RemoteModelError
from dasktensor_worker import tasks


class ReplicaSet:
    """What this process knows of one model's replicas, and how it keeps that current."""

    def __init__(self, spec: ModelSpec):
        self.spec = spec
        self.lock = threading.Lock()
        # One look-and-build at a time: a call's rebuild and a background refresh that
        # both found a replica missing would otherwise build it twice.
        self.building = threading.Lock()
        self.addresses: list[str] = []  # sorted: the same order in every process
        self.endpoints: dict[str, tuple] = {}  # address -> its call server (host, port, tls)
        self.number = 0  # the model's number on the cluster (see _number)
        self.security = None  # the client's distributed.Security (TLS clusters)
        self.checked = 0.0  # time.monotonic() of the last look at the cluster
        self.interval = 0.0  # dasktensor.remote.refresh-interval, read at each look
        self.probe_after = self.probe_timeout = 1.0  # dasktensor.remote.probe-*, likewise
        self.refreshing = False

    def pick(self) -> str:
        """The worker the next call goes to, counted as busy until :func:`done`."""
        with self.lock:
            if not self.addresses:
                self._ensure()
            elif time.monotonic() - self.checked > self.interval:
                self._refresh_in_background()
            addresses = self.addresses
            if _suspects:  # workers that did not answer a probe: not while others are there
                addresses = [a for a in addresses if a not in _suspects] or addresses
            home = home_replica(self.number, _process_number, len(addresses))
        with _inflight_lock:
            address = addresses[choose_replica(addresses, home, _inflight)]
            _inflight[address] = _inflight.get(address, 0) + 1
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
        built there until it answers again (see :func:`_answering`)."""
        endpoint = self.endpoints.get(address)
        if endpoint is None:
            return True  # nothing to probe: the call's own outcome will tell
        if get_channel().probe(address, endpoint, self.security, timeout):
            return True
        with _inflight_lock:
            _suspects[address] = (endpoint, self.security)
        return False

    def start(self) -> list[str]:
        """Find or build the replicas now; their workers."""
        with self.lock:
            self._ensure()
            return list(self.addresses)

    def drop(self, address: str) -> None:
        """Forget the replica at ``address`` (its worker failed, or no longer holds it)."""
        with self.lock:  # a new list: other threads may be reading the old one
            self.addresses = [a for a in self.addresses if a != address]
        hold = _holds.get(self.spec.key, {}).pop(address, None)
        if hold is not None:  # its worker is gone, or it ended with the replica
            hold.cancel()
        get_channel().forget(address)

    def _ensure(self) -> None:
        """Find or build the replicas (called with ``self.lock`` held)."""
        global _process_number
        client = self.spec.client()
        show_calls_page(client)
        _hold_lease(self.spec, client)
        self._use(self._find_or_build(client))
        self.checked = time.monotonic()
        self.interval = _config.seconds("remote.refresh-interval")
        self.probe_after = _config.seconds("remote.probe-after")
        self.probe_timeout = _config.seconds("remote.probe-timeout")
        self.security = getattr(client, "security", None)
        if _process_number is None:
            _process_number = _number(client, "process", None)
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
        """The replicas' workers and their call servers, ``{address: endpoint}``."""
        with self.building:
            return self._find_or_build_alone(client)

    def _find_or_build_alone(self, client) -> dict[str, tuple]:
        spec = self.spec
        if lost_scheduler(client):  # asking it would wait for the client to reconnect
            raise SchedulerLostError(
                f"{spec!r}: the client lost its scheduler at {client.scheduler.address} "
                f"(it is {client.status}; Dask's workers close with their scheduler): once "
                "the cluster runs again, dt.connect(...) and call again"
            )
        if spec.resources:
            check_resources(client, [Placement(resources=spec.resources)])
        workers = _answering(scheduler_workers(client), self.endpoints, self.security)
        eligible = [a for a, w in workers.items() if offers(w.get("resources"), spec.resources)]
        if spec.only_workers:
            eligible = [a for a in eligible if a in _named(spec, eligible, workers)]
            if not eligible:
                raise RemoteModelError(
                    f"{spec!r}: expected one of its workers {list(spec.workers)} (it may run "
                    f"on these alone), the cluster at {client.scheduler.address} has "
                    f"{sorted(workers) or 'no workers'}"
                )
        if not eligible:
            raise RemoteModelError(
                f"{spec!r}: expected workers to build the model on, the cluster at "
                f"{client.scheduler.address} has none; start some (`dask worker ADDRESS`)"
            )
        held = _endpoints(client, spec.key, eligible)
        holders = list(held)
        wanted = len(eligible) if spec.replicas is None else min(spec.replicas, len(eligible))
        if len(holders) < wanted:
            free = [a for a in eligible if a not in holders]
            targets = _in_order(spec, free, workers)[: wanted - len(holders)]
            # Placed on the chosen worker only; with no resources when the replica holds
            # them (see _hold_resources): a build asking for them would wait behind the
            # holder of a replica another process built there meanwhile.
            hold = bool(spec.resources) and spec.hold_resources
            with carrying(getattr(spec.factory, "nbytes", 0)):
                futures = {
                    a: submit(
                        client,
                        tasks.build_replica,
                        spec.key,
                        spec.name,
                        spec.factory,
                        spec.concurrency,
                        _lease_of(spec, client),
                        key=f"build-{spec.name}-{uuid.uuid4().hex}",
                        placement=Placement(
                            resources=None if hold else spec.resources or None, workers=[a]
                        ),
                    )
                    for a in targets
                }
            with task_slot_released():  # (called from a task: see there)
                built = _gather_builds(client, futures)  # a factory's error is raised here
            if hold:
                _hold_resources(spec, client, [a for a, new in built if new])
            held.update(_endpoints(client, spec.key, [a for a, _ in built if a not in held]))
        return held


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


def _hold_resources(spec: ModelSpec, client, addresses: list[str]) -> None:
    """Take the model's ``resources`` on each of ``addresses`` (workers that have just
    built a replica) for as long as the replica lives there: one seceded task each
    (``hold-<name>``, see ``dasktensor_worker.tasks.hold_resources``), kept wanted by
    this process until the replica is dropped."""
    held = _holds.setdefault(spec.key, {})
    for address in addresses:
        held[address] = submit(
            client,
            tasks.hold_resources,
            spec.key,
            key=f"hold-{spec.name}-{uuid.uuid4().hex}",
            placement=Placement(resources=spec.resources, workers=[address]),
        )


def _answering(workers: dict[str, dict], known: dict[str, tuple], security) -> dict:
    """``workers`` without those whose call server does not answer a probe: asking a
    silent worker through Dask (``client.run``) would wait for Dask's connect timeout
    (30 s), holding up every call that waits for this look.  Probed: the suspects, and
    the workers whose call servers this replica set knows (``known``, address ->
    endpoint: a few sub-millisecond round trips when all is well); a worker never seen
    cannot be probed.  A suspect that answers is one no more; one the scheduler dropped
    is forgotten."""
    with _inflight_lock:
        for gone in set(_suspects) - set(workers):
            del _suspects[gone]
        probes = {a: (e, security) for a, e in known.items() if a in workers}
        probes.update((a, s) for a, s in _suspects.items())
    if not probes:
        return workers
    timeout = _config.seconds("remote.probe-timeout")

    def probe(item):
        address, (endpoint, creds) = item
        return address, get_channel().probe(address, endpoint, creds, timeout)

    with ThreadPoolExecutor(min(8, len(probes)), thread_name_prefix="dasktensor-probe") as pool:
        answered = dict(pool.map(probe, probes.items()))
    with _inflight_lock:
        for address, yes in answered.items():
            if yes:
                _suspects.pop(address, None)
            else:
                _suspects[address] = probes[address]
        return {a: w for a, w in workers.items() if a not in _suspects}


def _endpoints(client, key: str, among: list[str]) -> dict[str, tuple]:
    """``{address: endpoint}`` of the workers among ``among`` that hold model ``key``."""
    if not among:
        return {}
    found = client.run(tasks.endpoint, key, workers=among, on_error="return")
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


def owned(model, spec: ModelSpec) -> None:
    """``model`` (a ``RemoteModel`` with ``spec``) was created in this process: hold its
    lease here, and release its replicas when ``model`` is garbage-collected.

    The ``RemoteModel``, not the spec its Ops hold: PyTensor's rewriters keep every Op
    they have seen (``OpToRewriterTracker.get_trackers`` is a ``functools.cache``), so
    an Op, once compiled, lives as long as the process.  An Op called after its model
    was collected builds the model again, held for the rest of the process's life."""
    _owned.add(spec)
    weakref.finalize(model, _forget, spec.key, spec.scheduler)


def _hold_lease(spec: ModelSpec, client) -> None:
    """Make sure this process holds a lease for the replicas of a model it created, on
    ``client`` (a new one if the last was taken on a client since closed)."""
    if spec not in _owned:
        return
    lease = _leases.get(spec.key)
    if lease is not None and lease.client is client and lease.status != "cancelled":
        return
    key = f"dasktensor-lease-{spec.key}-{uuid.uuid4().hex[:8]}"
    _leases[spec.key] = client.submit(tasks.lease, key=key, pure=False)


def _lease_of(spec: ModelSpec, client) -> str | None:
    """The key of the lease this process holds for ``spec`` on ``client``, if any."""
    lease = _leases.get(spec.key)
    return lease.key if lease is not None and lease.client is client else None


def _forget(key: str, scheduler) -> None:
    """Finalizer of a model created here: drop its lease (the workers then drop its
    replicas within a second) and release them at once, in a thread (see
    ``dasktensor._resident._release``).  No locks: the collector may run anywhere,
    also in a thread that holds one of this module's."""
    _sets.pop(key, None)
    _leases.pop(key, None)
    _holds.pop(key, None)
    try:
        threading.Thread(
            target=_release_key, args=(key, scheduler), name="dasktensor-release", daemon=True
        ).start()
    except RuntimeError:  # at interpreter shutdown: the client's closing drops the lease
        pass


def _release_key(key: str, scheduler) -> None:
    """Release ``key`` through the model's client if it still runs; never through a new
    one (a client gone took the lease with it: the workers drop the replicas anyway)."""
    try:
        client = scheduler.running_client()
        if client is not None:
            client.run(tasks.release, key, on_error="ignore")
    except Exception:  # the cluster is gone already: nothing left to release
        pass


def replica_set(spec: ModelSpec) -> ReplicaSet:
    """This process's :class:`ReplicaSet` of the model (created on first use)."""
    with _sets_lock:
        found = _sets.get(spec.key)
        if found is None:
            found = _sets[spec.key] = ReplicaSet(spec)
        return found


def done(address: str) -> None:
    """A call to ``address`` picked by :meth:`ReplicaSet.pick` has ended (in any way)."""
    with _inflight_lock:
        _inflight[address] = _inflight.get(address, 1) - 1


# -- the cluster's view (asks the workers) --------------------------------------------------


def answering(client) -> list[str]:
    """The scheduler's workers but those that did not answer a probe (suspects, probed
    again now): ``client.run`` on a silent worker waits for Dask's connect timeout."""
    workers = _answering(scheduler_workers(client), {}, getattr(client, "security", None))
    return list(workers)


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
    """Drop the model's replicas from the workers, and this process's state of them."""
    _leases.pop(spec.key, None)
    _holds.pop(spec.key, None)
    spec.client().run(tasks.release, spec.key)
    with _sets_lock:
        _sets.pop(spec.key, None)


def _number(client, kind: str, key: str | None) -> int:
    """A number from the scheduler, distinct per process (or per model key) on the cluster
    (see ``dasktensor.remote._policy``)."""
    try:
        return client.run_on_scheduler(tasks.next_number, kind, key)
    except Exception:  # a scheduler that cannot import dasktensor_worker: spread at random
        return random.randrange(1 << 30) if key is None else hash(key)


# -- per-process state ----------------------------------------------------------------------

_sets: dict[str, ReplicaSet] = {}
_sets_lock = threading.Lock()
# the specs created in this process, and the leases it holds for them (key -> Future)
_owned: weakref.WeakSet[ModelSpec] = weakref.WeakSet()
_leases: dict = {}
# the tasks holding the resources of the replicas this process built: key -> {address: Future}
_holds: dict[str, dict] = {}
_inherited: list = []
# calls this process has in flight per worker, over all models: independent calls of
# different models go to different workers too
_inflight: dict[str, int] = {}
_inflight_lock = threading.Lock()  # also guards _suspects
# workers that did not answer a probe: address -> (endpoint, security) to probe again
_suspects: dict[str, tuple] = {}
_process_number: int | None = None


def _reset_after_fork() -> None:  # pragma: no cover - runs in forked children
    global _sets_lock, _inflight_lock, _process_number
    _process_number = None
    _sets.clear()
    _sets_lock = threading.Lock()
    _owned.clear()  # a forked sampler is not the owner: its parent holds the leases
    _inherited.extend(_leases.values())  # kept: releasing them here would wake the
    _leases.clear()  # parent's event loop through the pipe the two share
    _inherited.extend(f for held in _holds.values() for f in held.values())
    _holds.clear()
    _inflight.clear()
    _inflight_lock = threading.Lock()
    _suspects.clear()


os.register_at_fork(after_in_child=_reset_after_fork)
