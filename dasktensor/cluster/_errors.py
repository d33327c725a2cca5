"""The errors of a cluster that dasktensor raises, and how a lost scheduler is recognised."""

from __future__ import annotations


class NoWorkerWithResourcesError(RuntimeError):
    """No worker of the cluster offers the resources that a task asks for."""


class SchedulerLostError(ConnectionError):
    """The client lost its scheduler (killed, restarted, out of reach) mid-run.

    Dask's workers close when they lose their scheduler, and a client gives up
    reconnecting after its ``timeout`` (``distributed.comm.timeouts.connect``): the
    cluster must be started again (``dt.sample(..., resume=True)`` then continues a run
    that had a ``store=``).
    """


def lost_scheduler(client, error: BaseException | None = None) -> bool:
    """Whether ``error`` (raised by Dask while running work on ``client``) comes from
    losing the scheduler: the client is reconnecting or closed, or Dask says so.

    >>> class Client:
    ...     status = "running"
    >>> lost = RuntimeError("x cancelled for reason: scheduler-connection-lost.")
    >>> lost_scheduler(Client(), lost)
    True
    >>> lost_scheduler(Client(), ValueError("the model's own error"))
    False
    """
    if getattr(client, "status", "running") in ("connecting", "closing", "closed", "failed"):
        return True
    return "scheduler-connection-lost" in str(error or "")
