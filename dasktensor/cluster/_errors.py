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


def memory_restart(client, workers: dict, since: float, wait_s: float = 1.0) -> str | None:
    """Why a worker of ``workers`` left, when its nanny restarted it for memory after
    ``since`` (a ``time.time()``): a sentence naming the worker, its memory limit, what it
    used and how to raise the limit; None when no nanny said so within ``wait_s``.

    A nanny that sees its worker pass ``distributed.worker.memory.terminate`` (95 % of
    the limit) logs the event ``worker-restart-memory`` (worker, pid, rss) on the
    scheduler, then terminates the worker; the event may reach the scheduler after the
    worker's departure, hence the short wait.

    Parameters
    ----------
    client : distributed.Client
    workers : dict
        ``{address: the scheduler's info on it}`` (its ``memory_limit``), as listed
        before the work started.
    since : float
        When the work started (events before it are not about it).
    wait_s : float
        How long to wait for the event.
    """
    import time

    from dask.utils import format_bytes

    deadline = time.monotonic() + wait_s
    while True:
        try:
            events = client.get_events("worker-restart-memory")
        except Exception:  # noqa: BLE001 - the scheduler gone too: nothing to say
            return None
        for stamp, msg in events:
            address = msg.get("worker") if isinstance(msg, dict) else None
            if stamp >= since and address in workers:
                limit = (workers[address] or {}).get("memory_limit") or 0
                used = msg.get("rss") or 0
                of = (
                    f"({used / limit:.0%}) of its {format_bytes(limit)} memory limit"
                    if limit
                    else "of a memory limit not known here"
                )
                return (
                    f"the nanny of worker {address} restarted it for memory: it used "
                    f"{format_bytes(used)} {of} "
                    "(the nanny restarts a worker at distributed.worker.memory.terminate, "
                    "95 % of it). Raise the limit where the worker starts (`dask worker "
                    "--memory-limit 32GiB`, 0 for none; dt.connect(memory_limit=...)); GPU "
                    "workers of dt.connect(gpus=...) and `dasktensor worker --gpus` have "
                    "none by default (dasktensor.gpu.memory-limit)"
                )
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.1)
