"""Shared fixtures: real distributed clusters, started once per session."""

from __future__ import annotations

import os

import pytest

# keep BLAS single-threaded in workers and in the test process: the machines have 2 cores
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")


def _cluster(**kwargs):
    from distributed import LocalCluster

    kwargs.setdefault("n_workers", 2)
    kwargs.setdefault("threads_per_worker", 1)
    kwargs.setdefault("processes", True)
    # no dashboard, and the scheduler's HTTP server on a free loopback port, not 8787
    kwargs.setdefault("dashboard_address", None)
    kwargs.setdefault("scheduler_kwargs", {"dashboard": False, "dashboard_address": "127.0.0.1:0"})
    return LocalCluster(host="127.0.0.1", **kwargs)


@pytest.fixture(scope="session")
def process_cluster():
    """A LocalCluster with 2 worker processes (pickling, failover and placement are real)."""
    cluster = _cluster()
    yield cluster
    cluster.close()


@pytest.fixture
def client(process_cluster):
    """A Client of the session's process cluster, not set as the default client."""
    from distributed import Client

    with Client(process_cluster, set_as_default=False) as c:
        yield c


@pytest.fixture(scope="module")
def mixed_cluster():
    """Two worker processes: one offers {"GPU": 1}, the other no resources."""
    from _clusters import mixed_spec_cluster

    cluster = mixed_spec_cluster()
    yield cluster
    cluster.close()
