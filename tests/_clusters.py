"""Clusters the tests share: a worker offering {"GPU": 1} beside one offering nothing."""

from __future__ import annotations


def mixed_spec_cluster():
    """Two worker processes, ``cpu`` (no resources) and ``gpu`` (``{"GPU": 1}``)."""
    from distributed import Nanny, Scheduler, SpecCluster

    worker = {"cls": Nanny, "options": {"nthreads": 1, "host": "127.0.0.1"}}
    gpu = {"cls": Nanny, "options": {"nthreads": 1, "host": "127.0.0.1", "resources": {"GPU": 1}}}
    return SpecCluster(
        scheduler={"cls": Scheduler, "options": {"host": "127.0.0.1", "dashboard_address": None}},
        workers={"cpu": worker, "gpu": gpu},
    )


def gpu_worker_address(client) -> str:
    """The address of the worker that offers resources."""
    (address,) = [
        a for a, w in client.scheduler_info(n_workers=-1)["workers"].items() if w["resources"]
    ]
    return address
