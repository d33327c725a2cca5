"""dasktensor on a cluster of separate hosts, started as users start one, and network faults.

The hosts are Linux network namespaces on a bridge (``tests/_hosts.py``): the scheduler
on one, a worker (``dask worker``, with its nanny) on each of two others, each with its
own address; this process, the client, stays outside them, as a laptop does.  A host's
link can be cut while its processes live on: the silent network that a killed process on
one machine never shows (its kernel resets the connections at once).

Needs root (CAP_NET_ADMIN); CI runs as root, and ``.ci/run`` installs ``iproute2``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pymc as pm
import pytensor
import pytensor.tensor as pt
import pytest
from _hosts import Hosts, no_packet_loss, unavailable
from _models import Probe
from _sample_models import PICKLED, RUN, assert_same_draws, hierarchical, regression

import dasktensor as dt
from dasktensor.cli import _demo
from dasktensor.cluster import scheduler_workers

WHY = unavailable()
pytestmark = [
    pytest.mark.skipif(WHY is not None, reason=f"multi-host tests: {WHY}"),
    pytest.mark.slow,
]
# what the processes in the hosts import: this interpreter's packages and tests/
ENV = {"PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}


def start_cluster(hosts: Hosts, *options: str) -> str:
    """``dask scheduler`` on host 0, ``dask worker`` on each other host; the address."""
    address = hosts.scheduler(0, *options, env=ENV)  # it unpickles the task graphs
    for i in range(1, len(hosts.names)):
        hosts.worker(i, address, *options, env=ENV)
    return address


@pytest.fixture(scope="module")
def hosts():
    with Hosts(3) as made:
        made.address = start_cluster(made)
        yield made


@pytest.fixture(scope="module")
def client(hosts):
    from distributed import Client

    with Client(hosts.address, timeout=60, set_as_default=False) as c:
        c.wait_for_workers(2, timeout=120)
        yield c


def host_of(address: str) -> str:
    return address.split("://")[1].rsplit(":", 1)[0]


def sharded_regression(client):
    """(logp+dlogp of a 4,000-row regression in 2 shards on ``client``, the same in
    PyTensor's default mode)."""
    import dask

    model = regression(rows=4000)
    settings = {"dasktensor.shard.min-rows": 1000, "dasktensor.shard.min-work": 0}
    with dask.config.set(settings):
        mode = dt.dask_mode(scheduler=client, shards=2)
        f = model.logp_dlogp_function(ravel_inputs=True, mode=mode)._pytensor_function
    assert f.maker.linker.sharded is not None
    return f, model.logp_dlogp_function(ravel_inputs=True)._pytensor_function


def test_two_runs_at_once_never_share_hosts():
    """A host tag (names and subnet) that another live process holds is not taken, even
    where this process's PID points at it: two runs at once (``.ci/run`` runs both lines'
    suites together) once drew the same one, and the second removed the first's hosts
    as leftovers.  A holder that ended frees its tag."""
    from _hosts import _claim_tag

    holder = subprocess.Popen(
        [sys.executable, "-c", "from _hosts import _claim_tag; import sys; "
         "tag, claim = _claim_tag(1234); print(tag, flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        cwd=os.path.dirname(__file__),
    )  # fmt: skip
    try:
        taken = int(holder.stdout.readline())
        mine, claim = _claim_tag(taken)
        claim.release()
        assert mine != taken
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    again, claim = _claim_tag(taken)
    claim.release()
    assert again == taken


def test_the_workers_are_on_their_own_hosts(hosts, client):
    workers = sorted(host_of(a) for a in scheduler_workers(client))
    assert workers == hosts.addresses[1:]
    assert host_of(hosts.address) == hosts.addresses[0]


def test_info_and_the_demo_from_the_command_line(hosts):
    dasktensor = [sys.executable, "-m", "dasktensor"]
    info = subprocess.run([*dasktensor, "info", "--scheduler", hosts.address],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert info.returncode == 0, info.stdout + info.stderr
    for address in hosts.addresses:
        assert address in info.stdout, info.stdout
    demo = subprocess.run(
        [*dasktensor, "demo", "--scheduler", hosts.address, "--draws", "15", "--tune", "15",
         "--delay", "0.002", "--seed", "3"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "identical draws: True" in demo.stdout, demo.stdout
    assert "Warning" not in demo.stdout + demo.stderr, demo.stdout + demo.stderr


def test_a_dask_mode_function_runs_on_both_hosts(client):
    import dask
    from distributed import get_task_stream

    x = pt.matrix("x", shape=(60, 60))
    branches = []
    for k in range(4):
        with dt.annotate(name="branch"):
            h = x * (k + 1)
            for _ in range(3):
                h = pt.tanh(h @ x)
        branches.append(h.sum())
    out = sum(branches)
    value = np.random.default_rng(0).normal(size=(60, 60)) * 0.05
    want = pytensor.function([x], out)(value)
    with dask.config.set({"dasktensor.execute.path": "tasks"}), get_task_stream(client) as ts:
        f = dt.function([x], out, scheduler=client)
        np.testing.assert_allclose(f(value), want, rtol=1e-12)
    ran = {host_of(r["worker"]) for r in ts.data if "branch" in r["key"]}
    assert len(ran) == 2, ran
    resident = dt.function([x], out, scheduler=client)  # the default path: the channel
    for _ in range(3):
        np.testing.assert_allclose(resident(value), want, rtol=1e-12)


def test_remote_model_calls_reach_both_hosts(client):
    model = dt.RemoteModel(Probe, name="probe", scheduler=client)
    op = model.logp_grad_op("logp_grad", [pt.dvector, pt.dscalar])
    x, mu = pt.dvector("x"), pt.dscalar("mu")
    f = pytensor.function([x, mu], op(x, mu)[0])
    assert float(f(np.ones(3), 0.0)) == -1.5
    workers = scheduler_workers(client)
    assert sorted(model.workers()) == sorted(workers)
    pids: list = []
    threads = [  # calls at once spread over both replicas
        threading.Thread(target=lambda: pids.append(model.call("where", 0.2)[0])) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(pids) == set(client.run(os.getpid).values())
    model.close()


def test_a_sharded_likelihood_spreads_over_the_hosts(client):

    f, ref = sharded_regression(client)
    q = np.array([0.3, -0.2, 0.1])
    for got, want in zip(f(q), ref(q)):
        np.testing.assert_allclose(got, want, rtol=1e-10)
    holders = {host_of(a) for s in f.maker.linker.sharded.stages() for m in s.models
               for a in m.workers()}  # fmt: skip
    assert len(holders) == 2, holders


def test_posterior_predictive_and_pmap_across_hosts(client):
    from _pymc_models import group_of, trace

    model, idata = trace("linear-regression")
    kwargs = dict(model=model, random_seed=7, chunks=150, compute=True, progressbar=False)
    here = dt.sample_posterior_predictive(idata, **kwargs)
    there = dt.sample_posterior_predictive(idata, client=client, **kwargs)
    np.testing.assert_array_equal(
        np.asarray(group_of(there)["y"]), np.asarray(group_of(here)["y"])
    )
    g = dt.pmap(lambda v, w: pt.tanh(v @ w).sum(), in_axes=(0, None), chunks=2)
    values, w = np.arange(12.0).reshape(4, 3) * 0.1, np.full((3, 2), 0.1)
    got = g(values, w).compute(scheduler=client)
    np.testing.assert_allclose(got, np.tanh(values @ w).sum(axis=1), rtol=1e-12)


def test_dt_sample_across_hosts_draws_as_pm_sample(client):
    runs = dict(RUN, chains=2, draws=20, tune=20)
    with hierarchical():
        got = dt.sample(**runs, client=client, checkpoint_every=10)
    with hierarchical():
        expected = pm.sample(**runs, **PICKLED)
    assert_same_draws(got, expected)


# ----------------------------------------------------------------------------- TLS


def write_credentials(directory) -> dict[str, str]:
    """Throw-away TLS credentials (one CA, one certificate) as files, for the CLIs."""
    from distributed.security import Security

    made = Security.temporary()
    ca, cert = directory / "ca.pem", directory / "cert.pem"
    ca.write_text(made.tls_ca_file)
    cert.write_text(made.tls_worker_cert + "\n" + made.tls_worker_key)
    return {"ca": str(ca), "cert": str(cert)}


def test_tls_between_hosts(tmp_path):
    from distributed import Client
    from distributed.security import Security

    files = write_credentials(tmp_path)
    options = ("--tls-ca-file", files["ca"], "--tls-cert", files["cert"],
               "--tls-key", files["cert"])  # fmt: skip
    with Hosts(2) as hosts:
        address = hosts.scheduler(0, "--protocol", "tls", *options, env=ENV)
        assert address.startswith("tcp://")
        address = "tls://" + address.split("://")[1]
        hosts.worker(1, address, *options, env=ENV)
        security = Security(tls_ca_file=files["ca"], tls_client_cert=files["cert"],
                            tls_client_key=files["cert"], require_encryption=True)  # fmt: skip
        with Client(address, security=security, timeout=60, set_as_default=False) as client:
            client.wait_for_workers(1, timeout=120)
            (worker,) = scheduler_workers(client)
            assert worker.startswith("tls://") and host_of(worker) == hosts.addresses[1]
            model = dt.RemoteModel(Probe, name="probe", scheduler=client)
            pid, _ = model.call("where", 0.0)
            assert pid == client.run(os.getpid)[worker]
            model.close()


# ----------------------------------------------------------------------------- faults


def test_a_cut_link_moves_the_remote_calls_and_the_draws_stay_the_same():
    """pm.sample whose likelihood calls two remote models, each with a replica on both
    worker hosts; one host's link is cut mid-run (its processes live on, silent): the
    calls it held move to the other host (a probe unanswered for 1 s), and the draws are
    those of the run without the fault.  The link restored, the host serves again."""
    import dask
    from distributed import Client

    from dasktensor_worker import tasks

    with Hosts(3) as hosts, dask.config.set({"dasktensor.remote.refresh-interval": "1s"}):
        address = start_cluster(hosts)
        with Client(address, timeout=60, set_as_default=False) as client:
            client.wait_for_workers(2, timeout=120)
            (cut,) = [a for a in scheduler_workers(client)
                      if host_of(a) == hosts.addresses[1]]  # fmt: skip
            models = _demo.remote_sites(2, 0.01, seed=3, scheduler=client)
            for m in models:
                assert len(m.start()) == 2
            settings = dict(draws=60, tune=60, chains=1, cores=1, random_seed=5,
                            progressbar=False, compute_convergence_checks=False)  # fmt: skip
            with _demo.build_model(_demo.site_ops(models)):
                calm = pm.sample(**settings)

            ticks: list[float] = []
            cutter = threading.Timer(1.5, hosts.cut, args=(1,))
            cutter.start()
            try:
                with _demo.build_model(_demo.site_ops(models)):
                    faulty = pm.sample(
                        **settings, callback=lambda **_: ticks.append(time.monotonic())
                    )
            finally:
                cutter.join()
            assert cutter.finished.is_set()
            stall = max(np.diff(ticks))
            assert ticks[-1] - ticks[0] > 1.5, "the cut came after the run"
            for name in ("mu", "log_sigma"):
                np.testing.assert_array_equal(faulty.posterior[name], calm.posterior[name])
            print(f"cut link: longest gap between draws {stall:.2f} s "
                  f"(run {ticks[-1] - ticks[0]:.1f} s)")  # fmt: skip
            assert stall < 15, stall  # probes: ~1.5 s; without them Dask's 30 s

            hosts.restore(1)

            def served_there() -> int:
                found = client.run(tasks.summary, workers=[cut])[cut]["calls"]
                return sum(found.get(m.name, [0])[0] for m in models)

            before, deadline = served_there(), time.monotonic() + 30
            while served_there() == before and time.monotonic() < deadline:
                for m in models:  # the suspect answers at the next refresh, and is used
                    for _ in range(5):
                        m.call("logp_grad", np.array([1.0, 0.0]))
                time.sleep(0.2)
            assert served_there() > before, "the restored host served no call"
            for m in models:
                m.close()


@pytest.mark.skipif(no_packet_loss() is not None, reason=f"packet loss: {no_packet_loss()}")
def test_lost_packets_delay_results_but_never_change_them(hosts, client):
    """5 % of a worker host's packets dropped, both ways (TCP resends them): remote-model
    calls (to a replica on that host first) and a sharded log-density give exactly what
    they give without loss."""
    (lossy,) = [a for a in scheduler_workers(client)
                if host_of(a) == hosts.addresses[1]]  # fmt: skip
    model = dt.RemoteModel(Probe, name="lossy", replicas=1, workers=[lossy], scheduler=client)
    assert model.start() == [lossy]
    f, ref = sharded_regression(client)
    here = Probe()
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=50) for _ in range(400)]
    points = [np.array([0.3, -0.2, 0.1]) * k for k in np.linspace(-1, 1, 20)]

    def run() -> float:
        t0 = time.monotonic()
        for x in xs:
            got, want = model.call("logp_grad", x, 0.5), here.logp_grad(x, 0.5)
            assert got[0] == want[0] and np.array_equal(got[1], want[1])
        for q in points:
            for got, want in zip(f(q), ref(q)):
                np.testing.assert_allclose(got, want, rtol=1e-10)
        return time.monotonic() - t0

    run()  # connections made, everything warm
    calm = run()
    hosts.lose(1, 5)
    try:
        lossy = run()
        dropped = hosts.dropped(1)
    finally:
        hosts.lose(1, 0)
    print(f"5 % packet loss on a worker host ({dropped} packets dropped): {len(xs)} calls "
          f"and {len(points)} sharded evaluations took {lossy:.2f} s ({calm:.2f} s "
          "without)")  # fmt: skip
    assert dropped > 0, "no packet was dropped"
    model.close()


def test_a_cut_link_moves_a_shard_and_the_sums_stay_the_same():
    """A sharded log-density with a shard on each worker host; one host's link is cut
    while a background refresh of the shards' replicas asks that host through Dask (its
    probe answered just before): the next evaluation's call to that shard gets no answer
    to its probe, the shard is built again on the other host from the caller's rows
    without waiting for the refresh, and the sums are unchanged."""
    import dask
    from distributed import Client

    with Hosts(3) as hosts, dask.config.set({"dasktensor.remote.refresh-interval": "1s"}):
        address = start_cluster(hosts)
        with Client(address, timeout=60, set_as_default=False) as client:
            client.wait_for_workers(2, timeout=120)
            (cut,) = [a for a in scheduler_workers(client)
                      if host_of(a) == hosts.addresses[1]]  # fmt: skip
            f, ref = sharded_regression(client)
            points = [np.array([0.3, -0.2, 0.1]) * k for k in (1.0, 0.5, -1.0)]
            for got, want in zip(f(points[0]), ref(points[0])):
                np.testing.assert_allclose(got, want, rtol=1e-10)
            # The cut host's event loop busy for a while (its call server, a thread of
            # its own, still answers probes): the refresh that the next evaluation starts
            # (the last look is a refresh-interval old) asks it through Dask and waits,
            # and the link is cut before it answers.
            client.run(lambda dask_worker: dask_worker.loop.add_callback(time.sleep, 4),
                       workers=[cut])  # fmt: skip
            time.sleep(1.2)
            f(points[0])
            time.sleep(0.5)
            refreshing = [t for t in threading.enumerate() if t.name == "dasktensor-refresh"]
            assert refreshing, "no refresh was waiting on the cut host"
            hosts.cut(1)
            t0 = time.monotonic()
            for got, want in zip(f(points[1]), ref(points[1])):
                np.testing.assert_allclose(got, want, rtol=1e-10)
            took = time.monotonic() - t0
            print(f"cut link: the evaluation that moved a shard took {took:.2f} s")
            assert took < 15, took  # probes (1.5 s) and a build, not Dask's 30 s
            for got, want in zip(f(points[2]), ref(points[2])):
                np.testing.assert_allclose(got, want, rtol=1e-10)


def test_a_cut_link_runs_its_segments_elsewhere_and_the_draws_stay_the_same():
    """dt.sample with a chain on each worker host; one host's link is cut mid-run: the
    scheduler stops hearing from it (its heartbeats), its segment runs again on the other
    host after ``dasktensor.sample.silent-worker`` (5 s), not after ``worker-ttl``
    (5 min), and the draws are those of the run without the fault."""
    from distributed import Client

    runs = dict(RUN, chains=2, draws=150, tune=150)  # seconds of sampling: time to cut
    with Hosts(3) as hosts:
        address = start_cluster(hosts)
        with Client(address, timeout=60, set_as_default=False) as client:
            client.wait_for_workers(2, timeout=120)
            t0 = time.monotonic()
            with hierarchical():
                calm = dt.sample(**runs, client=client, checkpoint_every=10)
            calm_took = time.monotonic() - t0
            ticks: dict[int, list[float]] = {0: [], 1: []}

            # once the chains run (the step method installed: its registration goes
            # through every worker), cut the host of a worker that runs a segment
            def cut_a_busy_host():
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    busy = [a for a, keys in client.processing().items()
                            if any("chain_" in str(k) for k in keys)]  # fmt: skip
                    if busy:
                        cut_at.append(hosts.addresses.index(host_of(busy[0])))
                        hosts.cut(cut_at[-1])
                        return
                    time.sleep(0.02)

            cut_at: list[int] = []
            cutter = threading.Timer(0.2, cut_a_busy_host)

            def tick(draw, **_):
                ticks[draw.chain].append(time.monotonic())
                if not cutter.is_alive() and not cutter.finished.is_set():
                    cutter.start()

            t0 = time.monotonic()
            try:
                with hierarchical():
                    faulty = dt.sample(**runs, client=client, checkpoint_every=10, callback=tick)
            finally:
                cutter.join()
            took = time.monotonic() - t0
            stall = max(max(np.diff(t)) for t in ticks.values())
            print(f"cut link: dt.sample took {took:.1f} s ({calm_took:.1f} s without the "
                  f"cut); a chain waited at most {stall:.1f} s for a segment")  # fmt: skip
            assert cutter.finished.is_set() and cut_at, "no host was cut"
            # a chain usually waits ~6 s here for the segment the silent host held; once
            # on CI the cut came as that segment ended (no chain waited): the draws and
            # the bound below are what must hold either way
            assert max(t[-1] for t in ticks.values()) - min(t[0] for t in ticks.values()) > 0.5
            assert_same_draws(faulty, calm)
            assert took < calm_took + 60, (took, calm_took)  # not worker-ttl's 5 min


def test_a_host_cut_before_dt_sample_starts_leaves_the_chains_to_the_others():
    """A worker's host is silent from before the run: installing the step method (Dask's
    registration goes through every worker) would wait for Dask's connect timeout and
    then fail; the chains start on the worker that has it after ``silent-worker``.

    Both runs are on one cluster, the calm one first: the cut run compares with a run
    whose workers had imported PyMC and filled their caches, as its own had.  Dask's
    connect timeout is 120 s on that cluster, far from the bound, so that a wait for it
    cannot pass for a slow machine (on CI the workers' first run took 4x its time here).
    """
    from distributed import Client

    from dasktensor import _config

    runs = dict(RUN, chains=2, draws=40, tune=40)
    slow_dask = {**ENV, "DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT": "120s"}
    with Hosts(3) as hosts:
        address = hosts.scheduler(0, env=slow_dask)
        for i in (1, 2):
            hosts.worker(i, address, env=slow_dask)
        with Client(address, timeout=60, set_as_default=False) as other:
            other.wait_for_workers(2, timeout=120)
            t0 = time.monotonic()
            with hierarchical():
                calm = dt.sample(**runs, client=other, checkpoint_every=10)
            calm_took = time.monotonic() - t0
            hosts.cut(2)
            t0 = time.monotonic()
            with hierarchical():
                got = dt.sample(**runs, client=other, checkpoint_every=10)
            took = time.monotonic() - t0
    print(f"a host cut before dt.sample: the run took {took:.1f} s ({calm_took:.1f} s "
          "without the cut)")  # fmt: skip
    assert_same_draws(got, calm)
    # the chains on one worker (at most twice the calm run), silent-worker's waits to
    # install and to release, and a margin; not Dask's connect timeout (120 s here)
    silent = _config.seconds("sample.silent-worker")
    assert took < 2 * calm_took + 2 * silent + 30, (took, calm_took)


# ----------------------------------------------------------------------------- the dashboard


def test_a_scheduler_started_with_the_preload_shows_the_page_and_the_metrics():
    """``dask scheduler --preload dasktensor_worker.dashboard`` on its own host: the page
    is among the dashboard's plots before any client connects; the metrics count the
    calls a client then makes on a worker host; the old address redirects."""
    import json
    import urllib.request

    with Hosts(2) as hosts:
        host = hosts.addresses[0]
        dashboard = f"http://{host}:8787"
        address = hosts.scheduler(0, "--dashboard", "--dashboard-address", f"{host}:8787",
                                  "--preload", "dasktensor_worker.dashboard", env=ENV)  # fmt: skip
        hosts.worker(1, address, env=ENV)

        def get(path: str) -> tuple[str, bytes]:
            with urllib.request.urlopen(dashboard + path, timeout=30) as reply:
                return reply.geturl(), reply.read()

        plots = json.loads(get("/individual-plots.json")[1])
        assert plots.get("Individual Dasktensor Calls") == "/individual-dasktensor-calls"
        url, page = get("/dasktensor/calls")
        assert url == dashboard + "/individual-dasktensor-calls" and b"Bokeh" in page
        with dt.connect(address, timeout=60, set_as_default=False) as client:
            client.wait_for_workers(1, timeout=120)
            model = dt.RemoteModel(Probe, name="preloaded", scheduler=client)
            for _ in range(5):
                model.call("where", 0.0)
            deadline = time.monotonic() + 15
            counted = ""
            while time.monotonic() < deadline and "} 5.0" not in counted:
                time.sleep(0.5)
                metrics = get("/metrics")[1].decode()
                counted = "".join(
                    line for line in metrics.splitlines()
                    if line.startswith('dasktensor_calls_total{method="where",model="preloaded"')
                )  # fmt: skip
            assert f'worker="tcp://{hosts.addresses[1]}:' in counted, metrics
            assert counted.endswith("} 5.0"), counted
            model.close()


# ----------------------------------------------------------------------------- a lost scheduler


def restart_cluster(hosts: Hosts) -> None:
    """Kill every process of the cluster (scheduler, nannies, workers), start it again
    at the same addresses."""
    for proc in list(hosts.processes):
        hosts.stop(proc)
    start_cluster(hosts)


def test_a_killed_scheduler_stops_dt_sample_clearly_and_the_run_resumes(tmp_path):
    """The scheduler killed mid-run (Dask's workers close with it): dt.sample raises
    SchedulerLostError at once, naming the store to resume from; with the cluster
    started again, ``resume=True`` finishes the run with the draws of a run without
    the fault."""
    from distributed import Client

    runs = dict(RUN, chains=2, draws=100, tune=100)
    store = tmp_path / "run.zarr"
    with Hosts(3) as hosts:
        address = start_cluster(hosts)
        with Client(address, timeout=60, set_as_default=False) as client:
            client.wait_for_workers(2, timeout=120)
            with hierarchical():
                calm = dt.sample(**runs, client=client, checkpoint_every=10)
            scheduler = hosts.processes[0]
            done: list[int] = []

            def kill_midway(draw, **_):
                done.append(draw.chain)
                if len(done) == 120:  # some segments stored, most of the run to go
                    killed_at.append(time.monotonic())
                    hosts.stop(scheduler)

            killed_at: list[float] = []
            with pytest.raises(dt.SchedulerLostError) as info, hierarchical():
                dt.sample(**runs, client=client, checkpoint_every=10, store=str(store),
                          callback=kill_midway)  # fmt: skip
            waited = time.monotonic() - killed_at[0]
        message = str(info.value)
        assert address in message and f"store='{store}', resume=True" in message, message
        print(f"killed scheduler: dt.sample raised after {waited:.2f} s")
        assert waited < 30, waited  # not a hang: Dask reports the lost connection

        restart_cluster(hosts)
        with Client(address, timeout=60, set_as_default=False) as client:
            client.wait_for_workers(2, timeout=120)
            with hierarchical():
                resumed = dt.sample(**runs, client=client, checkpoint_every=10,
                                    store=str(store), resume=True)  # fmt: skip
    assert_same_draws(resumed, calm)


def test_a_killed_scheduler_fails_remote_calls_clearly():
    """Calls of a remote model while its scheduler is killed: the workers close with it,
    and the next call raises SchedulerLostError naming the scheduler, within the
    client's reconnection timeout, never hangs."""
    from distributed import Client

    with Hosts(3) as hosts:
        address = start_cluster(hosts)
        with Client(address, timeout=10, set_as_default=False) as client:
            client.wait_for_workers(2, timeout=120)
            model = dt.RemoteModel(Probe, name="probe", scheduler=client)
            assert len(model.start()) == 2
            hosts.stop(hosts.processes[0])
            t0, answered = time.monotonic(), 0
            with pytest.raises(dt.SchedulerLostError, match=address.replace(".", r"\.")):
                for answered in range(10**6):  # noqa: B007  (counted)
                    model.call("logp_grad", np.ones(2), 0.0)
            waited = time.monotonic() - t0
            print(f"killed scheduler: {answered} calls answered, then one raised after "
                  f"{waited:.2f} s")  # fmt: skip
            assert waited < 60, waited
