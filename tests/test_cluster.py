"""dt.connect: embedded cluster on loopback, existing clusters, unreachable schedulers."""

from __future__ import annotations

import dask
import numpy as np
import pytensor.tensor as pt
import pytest
from _ops import Scale

import dasktensor as dt


def listening_addresses(pid: int) -> set[str]:
    import psutil

    process = psutil.Process(pid)
    found = set()
    for p in [process, *process.children(recursive=True)]:
        for conn in p.net_connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN:
                found.add(conn.laddr.ip)
    return found


@pytest.mark.parametrize("dashboard", ["127.0.0.1:0", False])
def test_embedded_cluster_listens_on_loopback_only(dashboard):
    import os

    client = dt.connect(n_workers=1, dashboard_address=dashboard, set_as_default=False)
    try:
        assert listening_addresses(os.getpid()) <= {"127.0.0.1"}
    finally:
        client.shutdown()
        client.close()


def test_embedded_cluster_becomes_the_default_client():
    client = dt.connect(n_workers=1, dashboard_address=False)
    try:
        assert client.scheduler.address.startswith("tcp://127.0.0.1:")
        workers = client.scheduler_info(n_workers=-1)["workers"]
        assert workers and all(a.startswith("tcp://127.0.0.1:") for a in workers)
        x = pt.vector("x")
        f = dt.function([x], Scale(2.0)(x).sum())  # no scheduler given: the default client
        assert float(f(np.ones(3))) == 6.0
        prefixes = client.run_on_scheduler(
            lambda dask_scheduler: list(dask_scheduler.task_prefixes)
        )
        assert "scale-heavy" in prefixes
    finally:
        client.shutdown()
        client.close()


def test_connect_to_a_running_cluster_by_address_and_by_config(process_cluster):
    address = process_cluster.scheduler_address
    with dt.connect(address, set_as_default=False) as c:
        assert c.scheduler.address == address
    with dask.config.set({"dasktensor.scheduler-address": address}):
        with dt.connect(set_as_default=False) as c:
            assert c.scheduler.address == address


@pytest.mark.timeout(60)  # a hang instead of the error fails here
def test_unreachable_scheduler_fails_within_the_timeout_with_advice():
    with pytest.raises(ConnectionError, match="dask scheduler") as info:
        dt.connect("tcp://127.0.0.1:9", timeout=1)
    assert "tcp://127.0.0.1:9" in str(info.value)


def test_options_for_an_embedded_cluster_are_refused_with_an_address():
    with pytest.raises(TypeError, match="dask worker ADDRESS --resources"):
        dt.connect("tcp://127.0.0.1:9", resources={"GPU": 1})
