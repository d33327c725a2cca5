"""dt.connect: embedded cluster on loopback, existing clusters, unreachable schedulers."""

from __future__ import annotations

import sys
import threading
import time

import dask
import numpy as np
import pytensor.tensor as pt
import pytest
from _clusters import channel_calls, local_cluster
from _ops import Scale

import dasktensor as dt
from dasktensor.cluster import scheduler_workers


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
        workers = scheduler_workers(client)
        assert workers and all(a.startswith("tcp://127.0.0.1:") for a in workers)
        x = pt.vector("x")
        f = dt.function([x], Scale(2.0)(x).sum())  # no scheduler given: the default client
        assert float(f(np.ones(3))) == 6.0
        assert channel_calls(client)["scale-heavy"] == 1  # a resident stage on the worker
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


def test_remote_models_on_a_tls_cluster(tls_cluster):
    """Calls to a RemoteModel go over TLS with the client's certificates."""
    from _models import Probe

    cluster, security = tls_cluster
    with dt.connect(cluster.scheduler_address, security=security, set_as_default=False) as c:
        model = dt.RemoteModel(Probe, name="probe", scheduler=c)
        pid, _ = model.call("where")
        assert pid in c.run(__import__("os").getpid).values()
        lp, gx, gmu = model.call("logp_grad", np.ones(2), 0.5)
        assert lp == -0.25 and np.allclose(gx, -0.5)
        model.close()


def test_the_call_servers_of_a_tls_cluster_speak_tls_only(tls_cluster):
    """Calls go over TLS with the cluster's certificates; a plain connection to a worker's
    call server gets no answer, and a caller without (or with other) certificates is
    refused with an error that says so, not retried as a lost worker."""
    import socket

    from _models import Probe
    from distributed.security import Security

    from dasktensor.remote import RemoteModelError
    from dasktensor.remote._channel import get_channel
    from dasktensor.remote._replicas import replica_set
    from dasktensor_worker import tasks, wire

    cluster, security = tls_cluster
    with dt.connect(cluster.scheduler_address, security=security, set_as_default=False) as c:
        model = dt.RemoteModel(Probe, name="probe", scheduler=c)
        assert model.call("scale", np.ones(2), 3.0).tolist() == [3.0, 3.0]
        ((host, port, tls),) = [e for e in c.run(tasks.endpoint, model.key).values()]
        assert tls is True and host == "127.0.0.1"
        with socket.create_connection((host, port), timeout=10) as plain:
            wire.send(plain, (model.key, "scale", (np.ones(2), 3.0)))
            try:
                answer = plain.recv(1024)
            except ConnectionResetError:
                answer = b""
        assert answer == b"" or answer[:1] == b"\x15"  # closed, or a TLS alert record
        replicas = replica_set(model._spec)
        (worker,) = replicas.addresses
        for other, message in [
            (None, "serves calls over TLS only"),
            (Security.temporary(), "TLS handshake"),
        ]:
            replicas.security = other
            get_channel().forget(worker)  # no idle connection: the next call opens one
            with pytest.raises(RemoteModelError, match=message):
                model.call("scale", np.ones(2), 3.0)
        replicas.security = security
        assert model.call("scale", np.ones(2), 2.0).tolist() == [2.0, 2.0]
        assert sorted(model.workers()) == sorted(c.run(lambda: 0))  # no replica was dropped
        model.close()


def test_the_workers_are_asked_afresh_not_read_from_the_clients_cache():
    """The client refreshes its cached identity on a timer, asking for no workers; a look
    at the workers taken from that cache found none now and then (a 'cluster without
    workers' on a loaded machine).  With the timer at 2 ms the race comes often."""
    from distributed import Client

    with dask.config.set({"distributed.client.scheduler-info-interval": "2ms"}):
        with local_cluster() as cluster, Client(cluster) as client:
            seen = [sorted(scheduler_workers(client)) for _ in range(300)]
            workers = sorted(cluster.scheduler.workers)
    assert len(workers) == 2
    assert all(s == workers for s in seen), [s for s in seen if s != workers][:3]


@pytest.mark.timeout(60)  # a hang instead of the error fails here
def test_unreachable_scheduler_fails_within_the_timeout_with_advice():
    with pytest.raises(ConnectionError, match="dask scheduler") as info:
        dt.connect("tcp://127.0.0.1:9", timeout=1)
    assert "tcp://127.0.0.1:9" in str(info.value)


def test_options_for_an_embedded_cluster_are_refused_with_an_address():
    with pytest.raises(TypeError, match="dask worker ADDRESS --resources"):
        dt.connect("tcp://127.0.0.1:9", resources={"GPU": 1})


# ------------------------------------------------------------------------------- TLS


@pytest.fixture(scope="module")
def tls_cluster():
    """A LocalCluster speaking tls:// on 127.0.0.1, one worker process, throw-away certificates."""
    from distributed.security import Security

    security = Security.temporary()  # needs `cryptography`
    cluster = local_cluster(n_workers=1, protocol="tls://", security=security)
    yield cluster, security
    cluster.close()


def scale_twice_sum(client) -> float:
    """A dasktensor function with a heavy op, run on ``client``'s cluster."""
    x = pt.vector("x")
    f = dt.function([x], Scale(2.0)(x).sum(), scheduler=client)
    result = float(f(np.ones(3)))
    assert channel_calls(client)["scale-heavy"] >= 1  # the heavy op ran on the cluster
    return result


def test_tls_cluster_runs_functions_for_a_client_with_its_certificates(tls_cluster):
    cluster, security = tls_cluster
    address = cluster.scheduler_address
    assert address.startswith("tls://127.0.0.1:")
    with dt.connect(address, security=security, set_as_default=False) as c:
        workers = scheduler_workers(c)
        assert workers and all(a.startswith("tls://127.0.0.1:") for a in workers)
        assert scale_twice_sum(c) == 6.0


@pytest.mark.timeout(60)  # a hang instead of the error fails here
@pytest.mark.parametrize(
    "credentials, message",
    [
        ("none", "no certificates to connect with"),  # distributed: a TypeError, wrapped
        ("other", "TLS certificate does not match"),  # certificates of another cluster
        # tcp:// to the tls:// port: the TLS listener drops the connection
        ("plain tcp", "Connection reset by peer|Stream is closed|did not answer as a Dask"),
    ],
)
def test_tls_cluster_refuses_a_client_without_its_certificates(tls_cluster, credentials, message):
    import time

    from distributed.security import Security

    cluster, _ = tls_cluster
    address = cluster.scheduler_address
    security = Security.temporary() if credentials == "other" else None
    if credentials == "plain tcp":
        address = address.replace("tls://", "tcp://")
    t0 = time.perf_counter()
    with pytest.raises(ConnectionError, match=message) as info:
        dt.connect(address, security=security, timeout=2, set_as_default=False)
    assert time.perf_counter() - t0 < 5
    assert repr(address) in str(info.value)
    if credentials != "plain tcp":  # the advice names what to give
        assert "certificates" in str(info.value).split(message)[-1]


def test_info_reaches_a_tls_cluster_with_certificate_files(tls_cluster, tmp_path, capsys):
    from dasktensor.cli import main

    cluster, security = tls_cluster
    address = cluster.scheduler_address
    files = {}
    for option, pem in [
        ("--tls-ca-file", security.tls_ca_file),  # Security.temporary() holds PEM text
        ("--tls-cert", security.tls_client_cert),
        ("--tls-key", security.tls_client_key),
    ]:
        path = tmp_path / (option.strip("-") + ".pem")
        path.write_text(pem)
        files[option] = str(path)
    assert main(["info", "--scheduler", address, *[a for kv in files.items() for a in kv]]) == 0
    out = capsys.readouterr().out
    assert f"Scheduler:  {address}\n" in out and "Workers:    1 (1 thread(s)" in out
    assert "Versions match" in out

    assert main(["info", "--scheduler", address, "--timeout", "2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(
        f"dasktensor info: Could not connect to the TLS scheduler at {address!r}"
    )


def test_embedded_tls_cluster_on_loopback_runs_functions_and_refuses_plain_clients():
    import os

    from distributed.security import Security

    client = dt.connect(
        security=Security.temporary(), n_workers=1, dashboard_address=False, set_as_default=False
    )
    try:
        address = client.scheduler.address
        assert address.startswith("tls://127.0.0.1:")
        workers = scheduler_workers(client)
        assert workers and all(a.startswith("tls://127.0.0.1:") for a in workers)
        assert listening_addresses(os.getpid()) <= {"127.0.0.1"}
        assert scale_twice_sum(client) == 6.0
        with pytest.raises(ConnectionError, match="no certificates to connect with"):
            dt.connect(address, timeout=2, set_as_default=False)
    finally:
        client.shutdown()
        client.close()


def test_embedded_cluster_settings_accept_underscores_as_environment_variables_give_them():
    """DASK_DASKTENSOR__CLUSTER__N_WORKERS=1 arrives as the key 'n_workers'."""
    import dask

    with dask.config.set({"dasktensor.cluster.n_workers": 1}):
        with dt.connect(dashboard_address=False, set_as_default=False) as c:
            assert len(scheduler_workers(c)) == 1
            c.shutdown()


# ----------------------------------------------------------------------- workers' malloc


def _page_faults_per_temporary(n: int = 100) -> float:
    """On a worker: minor page faults per evaluation of an expression whose temporary is
    1 MiB (a model's NumPy temporaries).  An allocator that reuses freed memory faults
    about never; one that maps every such temporary afresh faults once per 4 KiB page."""
    import resource

    x = np.ones(1 << 17)  # 1 MiB
    for _ in range(10):
        (x * 2.0).sum()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(n):
        (x * 2.0).sum()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / n


@pytest.fixture
def environ_restored():
    """Dask's nannies write their pre-spawn environment into this process's; undo it."""
    import os

    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def _malloc_variable():
    """On a worker: its MALLOC_TRIM_THRESHOLD_ (read there: ``os.environ.get`` itself would
    pickle the caller's environment along)."""
    import os

    return os.environ.get("MALLOC_TRIM_THRESHOLD_")


def _malloc_of_workers(client) -> list[tuple]:
    variables = client.run(_malloc_variable)
    faults = client.run(_page_faults_per_temporary)
    return [(variables[w], faults[w]) for w in sorted(variables)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc, Linux rusage")
def test_embedded_workers_reuse_freed_memory_where_dasks_default_workers_fault_afresh(
    environ_restored,
):
    """Dask's nanny sets MALLOC_TRIM_THRESHOLD_=65536, which turns off glibc's adaptive
    mmap threshold: each 1 MiB temporary is a fresh mapping, 256 page faults.  The
    embedded cluster's workers run with glibc's own thresholds, also after a Dask cluster
    of the same process left the variable in its environment."""
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=1, processes=True, dashboard_address=None) as cluster:
        with Client(cluster, set_as_default=False) as plain:
            [(variable, faults)] = _malloc_of_workers(plain)
    assert variable == "65536" and faults > 128, (variable, faults)  # Dask's default
    with dt.connect(n_workers=1, dashboard_address=False, set_as_default=False) as client:
        [(variable, faults)] = _malloc_of_workers(client)
        client.shutdown()
    assert variable is None and faults < 16, (variable, faults)


def test_the_malloc_setting_gives_the_embedded_workers_dasks_threshold_or_refuses_nonsense(
    environ_restored,
):
    with dask.config.set({"dasktensor.cluster.malloc-trim-threshold": 65536}):
        with dt.connect(n_workers=1, dashboard_address=False, set_as_default=False) as c:
            [(variable, faults)] = _malloc_of_workers(c)
            c.shutdown()
    assert variable == "65536" and faults > 128, (variable, faults)
    with dask.config.set({"dasktensor.cluster.malloc-trim-threshold": "lots"}):
        with pytest.raises(ValueError, match=r"malloc-trim-threshold expected null .* got 'lots'"):
            dt.connect(n_workers=1, dashboard_address=False, set_as_default=False)


# A lock and a signal shared by two tasks of one in-process worker (module globals: the
# tasks' functions travel by reference and find them here).
_HELD = threading.Lock()
_SECEDED = threading.Event()


def _holder() -> str:
    from dasktensor.cluster import holding, task_slot_released

    with holding(_HELD), task_slot_released():  # as a segment building shards
        _SECEDED.set()
        time.sleep(1.0)  # the other task gets the slot this one left meanwhile
    return "holder"


def _waiter() -> str:
    from dasktensor.cluster import holding

    _SECEDED.wait(30)
    with holding(_HELD):  # a plain `with _HELD:` here waits for ever
        return "waiter"


def test_a_task_waiting_for_a_lock_leaves_its_slot_to_the_holder():
    """Two tasks on a worker with one thread: the first holds a lock and leaves its slot
    to wait (as a segment building shards), the second takes that slot and waits for the
    lock; the first needs a slot back to go on (``rejoin``).  ``holding`` makes the
    waiter leave the slot while it waits, so both end."""
    from distributed import Client, LocalCluster

    _SECEDED.clear()
    with (
        LocalCluster(
            n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0"
        ) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        first = client.submit(_holder, pure=False)
        second = client.submit(_waiter, pure=False)
        assert [first.result(timeout=60), second.result(timeout=60)] == ["holder", "waiter"]
