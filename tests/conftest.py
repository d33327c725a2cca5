"""Shared fixtures: real distributed clusters, started once per session."""

from __future__ import annotations

import os

import pytest
from _clusters import local_cluster, mixed_spec_cluster

# keep BLAS single-threaded in workers and in the test process: the machines have 2 cores
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def process_cluster():
    """A LocalCluster with 2 worker processes (pickling, failover and placement are real).

    A module whose tests need a cluster of their own (they kill workers, count replicas
    or need four workers) overrides this fixture with a module-scoped one: ``client`` and
    ``default_client`` are then of that cluster."""
    with local_cluster() as cluster:
        yield cluster


@pytest.fixture
def client(process_cluster):
    """A Client of ``process_cluster``, not set as the default client."""
    from distributed import Client

    with Client(process_cluster, set_as_default=False) as c:
        yield c


@pytest.fixture
def default_client(process_cluster):
    """A Client of ``process_cluster``, the default client while the test runs (what
    ``dt.RemoteModel``, ``dt.function`` and pmap use without ``scheduler=``)."""
    from distributed import Client

    with Client(process_cluster) as c:
        yield c


@pytest.fixture(scope="module")
def mixed_cluster():
    """Two worker processes: one offers {"GPU": 1}, the other no resources."""
    cluster = mixed_spec_cluster()
    yield cluster
    cluster.close()
