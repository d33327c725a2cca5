"""What the modules of ``dasktensor.remote`` share about one model: :class:`ModelSpec`.

``RemoteModel`` validates its options once and keeps them in a ``ModelSpec``; the replica
set, the call protocol and the Ops' call targets take the spec, never the ``RemoteModel``,
so that none of them needs the public front (and the front needs none of their insides).

A spec is a value: it pickles as its factory, options, key and scheduler (a
``SchedulerRef``, which pickles as an address), and compares by ``key``, the model's
identity on the cluster, which copies made by pickling share.  Per-process state
(replica lists, calls in flight, connections) is never kept on it (see
``dasktensor.remote._replicas``), so that a spec copied into a sampler process reaches
the same replicas from there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dasktensor.cluster import SchedulerLostError, SchedulerRef


class RemoteModelError(RuntimeError):
    """A remote model could not be reached: its workers kept failing, or none can hold it."""


@dataclass(frozen=True, eq=False)
class ModelSpec:
    """A remote model's identity and options (validated by ``RemoteModel``).

    Attributes
    ----------
    key : str
        Identity of the model on the cluster (``<name>-<16 hex digits>``).
    name : str
        Shown on the dashboard (``build-<name>``) and in error messages.
    factory : callable
        ``factory() -> model``, run on the workers.
    resources : dict
        Worker resources a replica needs (empty: none).
    replicas : int or None
        How many workers hold the model (None: every eligible worker).
    concurrency : int
        Calls one replica runs at once.
    retries : int
        Times a call that raised (or timed out) runs again.
    timeout : float or None
        Seconds one call may take.
    scheduler : SchedulerRef
        The cluster.
    workers : tuple of str or None
        Workers to build replicas on first, in order (None: any eligible worker).
    only_workers : bool
        Replicas live on ``workers`` alone (``allow_other_workers=False``).
    hold_resources : bool
        Each replica holds ``resources`` while it lives (else only its build does).
    shared : bool
        The key was given (``RemoteModel(key=...)``): every process that makes the model
        shares its replicas and holds a lease on them; letting go drops this process's
        lease only, and the workers drop a replica when no lease is left.
    """

    key: str
    name: str
    factory: Callable[[], Any]
    resources: dict
    replicas: int | None
    concurrency: int
    retries: int
    timeout: float | None
    scheduler: SchedulerRef
    workers: tuple[str, ...] | None = None
    only_workers: bool = False
    hold_resources: bool = True
    shared: bool = False

    def __eq__(self, other) -> bool:
        return isinstance(other, ModelSpec) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:  # error messages name the model as its user knows it
        return f"RemoteModel({self.name!r}, key={self.key!r})"

    def client(self):
        """The distributed Client of the model's cluster, or :class:`RemoteModelError`."""
        try:
            kind, client = self.scheduler.resolve()
        except OSError as e:  # a client to its address could not connect
            raise SchedulerLostError(
                f"{self!r}: no scheduler answers at {self.scheduler.address} ({e}); once "
                "the cluster runs again, call again"
            ) from e
        if kind != "client" and (gone := self.scheduler.closed_client()) is not None:
            raise SchedulerLostError(
                f"{self!r}: the client of the scheduler at {gone} it used is closed (by "
                "this program, or after losing its scheduler: Dask's workers close with "
                "it); once the cluster runs again, dt.connect(...) and call again"
            )
        if kind != "client":
            raise RemoteModelError(
                f"{self!r} needs a Dask cluster: call dt.connect() first (an embedded cluster "
                "on this machine, or dt.connect('tcp://host:8786')), or pass "
                "RemoteModel(..., scheduler=...)"
            )
        return client
