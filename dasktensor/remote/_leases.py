"""How long replicas live: leases held by the process that made a model, and resource holders.

* **Leases.**  The process that created a model (its ``RemoteModel``) holds a *lease* for
  its replicas: a tiny Dask task (``dasktensor-lease-<key>-<n>``) its client keeps
  wanted, named in the builds it makes.  Each worker's ``ModelHost`` asks the scheduler
  every ``dasktensor.remote.lease-check`` whether the leases of its replicas still exist,
  and drops the replicas of a lease that is gone: the ``RemoteModel`` was
  garbage-collected here (a finalizer drops the lease and releases the replicas, see
  ``dasktensor.remote._replicas.owned``), or this process or its client went away, killed
  included, which makes the scheduler forget its keys.  Other processes (sampler
  children, unpickled copies) hold no lease: what they rebuild lives until ``close()`` or
  the owner's finalizer.
* **Shared models** (``RemoteModel(key=...)``: one key in several processes) have a
  lease per process on each replica, added when a process finds the replicas built
  (:func:`share`); letting go gives back this process's lease only
  (``dasktensor_worker.tasks.unlease``), and a worker drops the replica when none is left.
* **Resources held.**  Dask counts a task's resources only while it runs, and a replica is
  not a task.  So while a replica lives, a seceded task on its worker (``hold-<name>``,
  body ``dasktensor_worker.tasks.hold_resources``) holds the model's ``resources``: Dask
  runs no other task asking for them beside the replica.  It ends when the worker drops
  the replica; this process keeps its future wanted until then.

A forked child holds neither: its parent does (:mod:`dasktensor._runtime` keeps the
parent's futures alive, untouched: releasing them in the child would wake the parent's
event loop through the pipe the two share).
"""

from __future__ import annotations

import threading
import uuid
import weakref

from dasktensor._placement import Placement
from dasktensor._runtime import ProcessState, runtime
from dasktensor.cluster import run_on_workers, submit
from dasktensor.remote._probes import answering
from dasktensor.remote._spec import ModelSpec
from dasktensor_worker import tasks


class _Leases(ProcessState):
    """The models created in this process, the leases it holds for them (key -> Future)
    and the tasks holding the resources of the replicas it built (key -> {address:
    Future})."""

    def __init__(self):
        self.owned: weakref.WeakSet[ModelSpec] = weakref.WeakSet()
        self.leases: dict[str, object] = {}
        self.holds: dict[str, dict[str, object]] = {}
        #: shared models: how many objects of this process hold each key
        self.holders: dict[str, int] = {}


def own(spec: ModelSpec) -> None:
    """This process created a model of ``spec``: it holds the lease of its replicas (a
    shared model's, as long as one of its objects here holds it)."""
    state = runtime.state(_Leases)
    state.owned.add(spec)
    if spec.shared:
        state.holders[spec.key] = state.holders.get(spec.key, 0) + 1


def let_go(key: str) -> bool:
    """An object of this process holding the shared model ``key`` lets go; whether it
    was the last (its lease is then to be given back).  No locks (finalizers call it)."""
    holders = runtime.state(_Leases).holders
    left = holders.get(key, 1) - 1
    if left > 0:
        holders[key] = left
        return False
    holders.pop(key, None)
    return True


def hold_lease(spec: ModelSpec, client) -> None:
    """Make sure this process holds a lease for the replicas of a model it created, on
    ``client`` (a new one if the last was taken on a client since closed)."""
    state = runtime.state(_Leases)
    if spec not in state.owned:
        return
    lease = state.leases.get(spec.key)
    if lease is not None and lease.client is client and lease.status != "cancelled":
        return
    key = f"dasktensor-lease-{spec.key}-{uuid.uuid4().hex[:8]}"
    state.leases[spec.key] = client.submit(tasks.lease, key=key, pure=False)


def lease_of(spec: ModelSpec, client) -> str | None:
    """The key of the lease this process holds for ``spec`` on ``client``, if any."""
    lease = runtime.state(_Leases).leases.get(spec.key)
    return lease.key if lease is not None and lease.client is client else None


def lease_key(key: str) -> str | None:
    """The key of the lease this process holds for model ``key``, if any (no locks)."""
    lease = runtime.state(_Leases).leases.get(key)
    return None if lease is None else lease.key


def share(spec: ModelSpec, client, addresses: list[str]) -> None:
    """This process's lease keeps the shared model's replicas at ``addresses`` (built by
    another process) too."""
    lease = lease_of(spec, client)
    if lease is not None and addresses:
        run_on_workers(
            client, tasks.add_lease, spec.key, lease, workers=addresses, on_error="ignore"
        )


def hold_resources(spec: ModelSpec, client, addresses: list[str]) -> None:
    """Take the model's ``resources`` on each of ``addresses`` (workers that have just
    built a replica) for as long as the replica lives there: one seceded task each
    (``hold-<name>``, see ``dasktensor_worker.tasks.hold_resources``), kept wanted by
    this process until the replica is dropped."""
    held = runtime.state(_Leases).holds.setdefault(spec.key, {})
    for address in addresses:
        held[address] = submit(
            client,
            tasks.hold_resources,
            spec.key,
            key=f"hold-{spec.name}-{uuid.uuid4().hex}",
            placement=Placement(resources=spec.resources, workers=[address]),
        )


def drop_hold(key: str, address: str) -> None:
    """The replica of model ``key`` at ``address`` is gone: cancel its holder, if any."""
    hold = runtime.state(_Leases).holds.get(key, {}).pop(address, None)
    if hold is not None:  # its worker is gone, or it ended with the replica
        hold.cancel()


def drop(key: str) -> None:
    """Drop this process's lease and holders of model ``key`` (no locks: called from
    finalizers too, which may run in a thread holding any lock)."""
    state = runtime.state(_Leases)
    state.leases.pop(key, None)
    state.holds.pop(key, None)


def release_in_background(key: str, scheduler, lease: str | None = None) -> None:
    """Release the replicas of ``key`` from the workers (or, with ``lease``, give back
    that lease of a shared model), in a thread of its own (see
    ``dasktensor.engine.release_in_background``: a finalizer may run on Dask's event
    loop, where a blocking client call would wait for that loop for ever)."""
    try:
        threading.Thread(
            target=_release_key,
            args=(key, scheduler, lease),
            name="dasktensor-release",
            daemon=True,
        ).start()
    except RuntimeError:  # at interpreter shutdown: the client's closing drops the lease
        pass


def give_back(client, key: str, lease: str | None) -> None:
    """Give back ``lease`` on the shared model ``key``: the workers drop their replica
    when no lease is left (nothing to do without a lease: this process never held it).
    A worker that does not answer a probe is not asked (``client.run`` to a frozen worker
    never returns): it drops the replica at its next ``lease-check`` after it wakes, the
    lease gone."""
    if lease is not None:
        client.run(tasks.unlease, key, lease, workers=answering(client), on_error="ignore")


def _release_key(key: str, scheduler, lease: str | None) -> None:
    """Release ``key`` through the model's client if it still runs; never through a new
    one (a client gone took the lease with it: the workers drop the replicas anyway)."""
    try:
        client = scheduler.running_client()
        if client is None:
            return
        if lease is not None:
            give_back(client, key, lease)
        else:
            client.run(tasks.release, key, workers=answering(client), on_error="ignore")
    except Exception:  # the cluster is gone already: nothing left to release
        pass
