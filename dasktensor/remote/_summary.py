"""What the workers hold and answered: :func:`cluster_summary`, and one model's share of it.

Each worker's ``ModelHost`` knows the replicas it holds, how often it built each model and
the calls it answered per model name (its call log, ``dasktensor_worker.calllog``).  One
``client.run`` of ``dasktensor_worker.tasks.summary`` collects that from every worker into
a :class:`ClusterSummary`, a snapshot that Jupyter shows as a table.  Remote models and
the resident stages of DASK-mode functions (their cluster tasks, named after the task)
are both models to a worker, so the summary shows where either lives and where its calls
ran, which Dask's task stream does not (``dt.calls_link`` gives the live page).

``RemoteModel._repr_html_`` is :func:`model_html`: the model's options, then a row per
worker of the cluster (holds a replica or not, builds, calls, errors, mean time).
Calls are counted by model name, as the calls page counts them, from every process that
calls the model.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from html import escape

from dasktensor._display import items, table
from dasktensor.cluster import SchedulerRef, scheduler_workers
from dasktensor.remote._probes import answering
from dasktensor_worker import tasks


@dataclass(frozen=True)
class WorkerModels:
    """One worker's models: those it holds, how often it built them, the calls it answered."""

    name: str  #: the worker's name (``LocalCluster`` numbers them; ``dask worker --name``)
    address: str
    models: dict  #: ``{model key: model name}`` of the replicas it holds now
    builds: dict  #: ``{model key: times built}`` of every model it built
    #: ``{model name: (calls, errors, seconds, records)}`` it answered (records: calls
    #: alone and batches of a batched method, whose seconds count once)
    calls: dict


@dataclass(frozen=True, repr=False)
class ClusterSummary:
    """What a cluster's workers held and had answered when :func:`cluster_summary` asked.

    Jupyter shows it as a table, a row per worker; ``str()`` and ``repr()`` give the same
    table as text.
    """

    workers: tuple[WorkerModels, ...]

    def rows(self) -> list[list[str]]:
        """Per worker: its name, the models it holds (``name xN``), the calls it answered."""
        out = []
        for w in self.workers:
            held = [
                f"{n} x{k}" if k > 1 else n for n, k in sorted(Counter(w.models.values()).items())
            ]
            calls = [
                f"{n}: {c[0]}" + (f" ({c[1]} failed)" if c[1] else "")
                for n, c in sorted(w.calls.items())
            ]
            out.append([w.name, ", ".join(held) or "-", ", ".join(calls) or "-"])
        return out

    def _repr_html_(self) -> str:
        total = sum(c[0] for w in self.workers for c in w.calls.values())
        return (
            f'<div class="dasktensor-cluster"><p><b>dasktensor on {len(self.workers)} '
            f"worker(s)</b>: {total} call(s) answered so far</p>"
            + table(["worker", "models held", "calls answered"], self.rows())
            + "</div>"
        )

    def __str__(self) -> str:
        rows = [["worker", "models held", "calls answered"], *self.rows()]
        w0, w1 = (max(len(r[i]) for r in rows) for i in (0, 1))
        return "\n".join(f"{r[0]:<{w0}}  {r[1]:<{w1}}  {r[2]}".rstrip() for r in rows)

    __repr__ = __str__


def cluster_summary(client=None) -> ClusterSummary:
    """Ask the workers which models they hold and how many calls they answered.

    Remote models and the resident stages of DASK-mode functions (their cluster tasks,
    each named after its task) are both models to a worker: the summary shows where they
    live and where their calls ran, which Dask's task stream does not show
    (``dt.calls_link`` gives the live page of the same calls).

    Parameters
    ----------
    client : distributed.Client, optional
        The cluster; by default Dask's default client (``dt.connect()`` makes one).

    Returns
    -------
    ClusterSummary
        A snapshot, which Jupyter shows as a table.

    Examples
    --------
    >>> import numpy as np
    >>> import dasktensor as dt
    >>> client = dt.connect(n_workers=2, processes=False, dashboard_address=False)
    >>> # one replica, on the worker named "1" (LocalCluster names its workers 0, 1...)
    >>> model = dt.RemoteModel(lambda: np.sqrt, name="root", replicas=1, workers=["1"])
    >>> float(model.call(None, 16.0))
    4.0
    >>> print(dt.cluster_summary(client))  # doctest: +NORMALIZE_WHITESPACE
    worker  models held  calls answered
    0       -            -
    1       root         root: 1
    >>> model.close()
    >>> client.shutdown()
    """
    kind, found = SchedulerRef(client).resolve()
    if kind != "client":
        raise ValueError(
            "cluster_summary expected a distributed Client, found none: call dt.connect() "
            "first, or pass the client (dt.cluster_summary(client))"
        )
    info = scheduler_workers(found)
    replies = found.run(tasks.summary, workers=answering(found), on_error="return")
    workers = []
    for address, worker in info.items():
        got = replies.get(address)
        got = got if isinstance(got, dict) else {"models": {}, "builds": {}, "calls": {}}
        calls = {n: tuple(c) for n, c in got["calls"].items()}
        name = str(worker.get("name", address))
        workers.append(WorkerModels(name, address, got["models"], got["builds"], calls))
    return ClusterSummary(tuple(sorted(workers, key=lambda w: (w.name, w.address))))


def model_html(model, summary) -> str:
    """A remote model for Jupyter: its options, the workers holding it, its calls so far.

    ``summary()`` returns the cluster's :class:`ClusterSummary`; when it fails (no cluster,
    a closed client) the options are shown with the reason.
    """
    options = [
        ("resources", ", ".join(items(model.resources)) or "none"),
        ("replicas", "every eligible worker" if model.replicas is None else str(model.replicas)),
        ("concurrency", str(model.concurrency)),
        ("retries", str(model.retries)),
        ("timeout", "none" if model.timeout is None else f"{model.timeout:g} s"),
    ]
    html = f'<div class="dasktensor-model"><p><b>RemoteModel {escape(model.name)}</b>: '
    html += "; ".join(f"{k} {escape(v)}" for k, v in options) + "</p>"
    try:
        cluster = summary()
    except Exception as e:  # noqa: BLE001  (a repr must not fail: it says why instead)
        reason = escape(f"{type(e).__name__}: {e}")
        return html + f"<p>cluster not reachable ({reason})</p></div>"
    rows, classes = [], []
    for w in cluster.workers:
        calls, errors, seconds, records = w.calls.get(model.name, (0, 0, 0.0, 0))
        mean = f"{1000 * seconds / records:.2f} ms" if records else "-"
        holds = model.key in w.models
        classes.append("holds" if holds else "other")
        builds = str(w.builds.get(model.key, 0))
        rows.append([w.name, "yes" if holds else "no", builds, str(calls), str(errors), mean])
    head = [
        "worker",
        "holds a replica",
        "builds",
        "calls",
        "errors",
        "mean time per call or batch",
    ]
    return (
        html + f"<p>held by {classes.count('holds')} of {len(rows)} worker(s), "
        f"{sum(int(r[3]) for r in rows)} call(s) answered so far</p>"
        + table(head, rows, classes)
        + "</div>"
    )
