"""``dt.info()``: a cluster's workers, what they offer and the GPUs each one sees.

One ``client.run`` of :func:`~dasktensor.cluster._gpus.worker_view` asks every worker
what it sees of the GPUs (its ``CUDA_VISIBLE_DEVICES``, the devices with their memory
total and used, the memory variables it was started with); the scheduler says the rest
(threads, memory limit, resources).  ``dasktensor info`` prints the same table.
"""

from __future__ import annotations

from dataclasses import dataclass

from dasktensor._display import table as html_table
from dasktensor.cluster._client import default_client
from dasktensor.cluster._gpus import MEMORY_VARIABLES, Device, worker_view
from dasktensor.cluster._workers import scheduler_workers


@dataclass(frozen=True)
class WorkerInfo:
    """One worker: as the scheduler lists it, the GPUs it sees, and the models and placed
    blocks it holds (so the device a block or replica ran on is its worker's)."""

    address: str
    name: str
    nthreads: int
    memory_limit: int | None  #: bytes; None or 0: no limit
    resources: dict
    #: the devices it can use; empty when it sees none
    devices: tuple[Device, ...]
    #: its CUDA_VISIBLE_DEVICES and memory variables (None: not set)
    env: dict
    #: why it sees no device, or where its devices came from; "?" when it did not answer
    how: str
    #: the remote models and resident stages (placed blocks, by their name) it holds
    holds: tuple[str, ...] = ()
    #: the calls it answered so far, by model or block name
    calls: dict | None = None

    def row(self) -> list[str]:
        """Its line of the table: name, address, threads, memory limit, resources, GPUs."""
        from dask.utils import format_bytes

        resources = ", ".join(f"{k}={v:g}" for k, v in sorted(self.resources.items()))
        if self.devices:
            gpus = "; ".join(d.describe() for d in self.devices)
            memory = [f"{k}={v}" for k, v in self.env.items() if k in MEMORY_SHOWN and v]
            gpus += f" ({', '.join(memory)})" if memory else ""
        elif self.env.get("CUDA_VISIBLE_DEVICES") == "":
            gpus = 'none visible (CUDA_VISIBLE_DEVICES="")'
        else:
            gpus = "none" if self.how != "?" else "? (did not answer)"
        calls = self.calls or {}
        holds = ", ".join(f"{n} ({calls.get(n, 0)})" for n in self.holds)
        return [
            self.name,
            self.address,
            str(self.nthreads),
            format_bytes(self.memory_limit) if self.memory_limit else "no limit",
            resources or "-",
            holds or "-",
            gpus,
        ]


MEMORY_SHOWN = tuple(MEMORY_VARIABLES.values())
HEADER = ["name", "address", "threads", "memory limit", "resources", "holds (calls)", "GPUs"]


@dataclass(frozen=True, repr=False)
class ClusterInfo:
    """What :func:`info` found: the scheduler's address and a :class:`WorkerInfo` per
    worker.  Jupyter shows it as a table; ``str()`` gives the same table as text."""

    scheduler: str
    workers: tuple[WorkerInfo, ...]

    def gpu_workers(self) -> tuple[WorkerInfo, ...]:
        """The workers that see at least one device."""
        return tuple(w for w in self.workers if w.devices)

    def lines(self) -> list[str]:
        rows = [HEADER, *(w.row() for w in self.workers)]
        widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
        return [
            "  ".join(c.ljust(n) for c, n in zip(r, widths, strict=True)).rstrip() for r in rows
        ]

    def __str__(self) -> str:
        head = f"Scheduler {self.scheduler}: {len(self.workers)} worker(s)"
        if not self.workers:
            return head + " (start some with `dask worker ADDRESS`)"
        return "\n".join([head, *self.lines()])

    __repr__ = __str__

    def _repr_html_(self) -> str:
        return (
            f'<div class="dasktensor-info"><p><b>Scheduler {self.scheduler}</b>: '
            f"{len(self.workers)} worker(s)</p>"
            + html_table(HEADER, [w.row() for w in self.workers])
            + "</div>"
        )


def info(client=None) -> ClusterInfo:
    """The workers of a cluster: threads, memory limit, resources, what each holds, and
    the GPUs each sees.

    Each worker reports its ``CUDA_VISIBLE_DEVICES`` and the devices it can use with
    their name and memory (total and used, from ``nvidia-smi``), so that a GPU worker
    shows its device and a CPU worker beside GPU workers shows none; and the remote
    models and resident stages it holds (a placed block of a DASK-mode function is a
    resident stage named after the block) with the calls it answered: the device a block
    or a replica ran on is that of the worker holding it.

    Parameters
    ----------
    client : distributed.Client, optional
        Dask's default client when not given.

    Returns
    -------
    ClusterInfo
        A table in Jupyter and as ``str()``; ``.workers`` holds a :class:`WorkerInfo`
        per worker.

    Raises
    ------
    ValueError
        No client given and no default Dask client.

    Examples
    --------
    >>> import dasktensor as dt
    >>> client = dt.connect(n_workers=1, gpus="all")  # doctest: +SKIP
    >>> print(dt.info(client))  # doctest: +SKIP
    Scheduler tcp://127.0.0.1:40123: 2 worker(s)
    name   address                threads  memory limit  resources  holds (calls)  GPUs
    0      tcp://127.0.0.1:40431  1        15.6 GiB      -          -              none visible...
    gpu-0  tcp://127.0.0.1:41235  1        no limit      GPU=1      surrogate (40) 0: NVIDIA...
    """
    if client is None:
        client = default_client()
        if client is None:
            raise ValueError(
                "dt.info expected a distributed Client (dt.info(client)) or a default one "
                "(dt.connect() makes it), found none"
            )
    workers = scheduler_workers(client)
    try:
        views = client.run(worker_view, workers=list(workers), on_error="return")
    except OSError:
        views = {}
    out = []
    for address, w in sorted(workers.items(), key=lambda kv: str(kv[1].get("name", ""))):
        view = views.get(address)
        if not isinstance(view, dict):
            view = {"env": {}, "devices": [], "how": "?", "holds": [], "calls": {}}
        out.append(
            WorkerInfo(
                address=address,
                name=str(w.get("name", "")),
                nthreads=int(w.get("nthreads", 0)),
                memory_limit=w.get("memory_limit") or None,
                resources=dict(w.get("resources") or {}),
                devices=tuple(Device(**d) for d in view["devices"]),
                env=dict(view["env"]),
                how=view["how"],
                holds=tuple(view["holds"]),
                calls=dict(view["calls"]),
            )
        )
    return ClusterInfo(scheduler=client.scheduler.address, workers=tuple(out))
