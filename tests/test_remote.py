"""RemoteModel: built once per worker, called straight on its workers, robust to failures."""

from __future__ import annotations

import asyncio
import functools
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

import dask
import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from _clusters import cluster_with_a_bare_worker, eventually, freeze, local_cluster
from _models import Probe, broken_factory, record_then_sleep
from pytensor.gradient import verify_grad

import dasktensor as dt
from dasktensor.cluster import scheduler_workers
from dasktensor_worker import tasks


@pytest.fixture(scope="module")
def process_cluster():
    """This module's own cluster of 4 worker processes, for conftest's ``default_client``."""
    with local_cluster(n_workers=4) as cluster:
        yield cluster


def builds(log) -> list[int]:
    return [int(line) for line in log.read_text().split()]


def test_factory_runs_once_per_worker(default_client, tmp_path):
    log = tmp_path / "builds"
    model = dt.RemoteModel(functools.partial(Probe, str(log)), name="probe")
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: model.call("where"), range(32)))
    copy = pickle.loads(pickle.dumps(model))  # a copy reaches the same replicas
    assert copy.call("where")[0] in builds(log)
    worker_pids = set(default_client.run(os.getpid).values())
    assert sorted(builds(log)) == sorted(worker_pids)  # every worker once, no more
    assert set(model.build_counts().values()) == {1}
    assert sorted(model.workers()) == sorted(default_client.run(os.getpid))
    model.close()
    assert model.workers() == []


def test_eight_concurrent_calls_spread_over_four_workers(default_client):
    model = dt.RemoteModel(Probe, name="probe")
    model.start()
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: model.call("where", 0.3), range(8)))
    pids = [pid for pid, _ in results]
    assert set(pids) == set(default_client.run(os.getpid).values())
    assert all(pids.count(p) == 2 for p in set(pids))  # fewest calls in flight first
    model.close()


@pytest.mark.parametrize("path", ["tasks", "channel"])
def test_eight_concurrent_tasks_spread_over_four_workers(default_client, path):
    """The DASK mode's tasks (callable Ops, not remote models) spread over the workers: as
    Dask places them (task path), or as the channel spreads calls (resident stages)."""
    from _clusters import channel_calls
    from _ops import Scale
    from dask.utils import key_split
    from distributed import get_task_stream

    x = pt.dvector("x")
    out = sum(Scale(float(k + 1), delay=0.3)(x).sum() for k in range(8))
    f = dt.function([x], out, scheduler=default_client)
    with dask.config.set({"dasktensor.execute.path": path}):
        if path == "channel":
            f(np.ones(2))  # builds the stages: then the calls spread over their replicas
        before = channel_calls(default_client, by_worker=True)
        with get_task_stream(client=default_client) as ts:
            assert float(f(np.ones(2))) == 2 * sum(range(1, 9))
        after = channel_calls(default_client, by_worker=True)
    if path == "tasks":
        workers = {r["worker"] for r in ts.data if key_split(r["key"]) == "scale-heavy"}
    else:
        workers = {
            w
            for w, calls in after.items()
            if calls.get("scale-heavy", 0) > before.get(w, {}).get("scale-heavy", 0)
        }
    assert workers == set(scheduler_workers(default_client))


def test_replicas_limits_the_workers_that_hold_the_model(default_client, tmp_path):
    log = tmp_path / "builds"
    model = dt.RemoteModel(functools.partial(Probe, str(log)), name="two", replicas=2)
    assert len(model.start()) == 2
    with ThreadPoolExecutor(4) as pool:
        pids = {pid for pid, _ in pool.map(lambda _: model.call("where", 0.1), range(8))}
    assert pids == set(builds(log)) and len(pids) == 2
    model.close()


def test_gradient_of_a_remote_logp_grad_op(default_client):
    model = dt.RemoteModel(Probe, name="normal")
    op = model.logp_grad_op("logp_grad", [pt.dvector, pt.dscalar])
    rng = np.random.default_rng(1)
    verify_grad(lambda x, mu: op(x, mu)[0], [rng.normal(size=3), np.array(0.2)], rng=rng)
    model.close()


@pytest.mark.parametrize("mode", ["DASK", None])
def test_independent_remote_calls_run_concurrently(default_client, mode):
    model = dt.RemoteModel(Probe, name="probe")
    where = model.arrays_to_arrays_op("where", [pt.dscalar], [pt.lscalar, pt.dvector])
    s = pt.dscalar("s")
    outs = [where(s * (1 + 1e-6 * k))[1] for k in range(4)]  # four independent calls
    f = pytensor.function([s], pt.stack(outs), mode=mode)
    # in either mode a rewrite made one node of the four calls (in the DASK mode one task,
    # made from the caller)
    (node,) = [n for n in f.maker.fgraph.toposort() if isinstance(n.op, dt.ParallelCallsOp)]
    assert len(node.op.ops) == 4
    if mode == "DASK":
        assert [t.role for t in f.maker.linker.plan.tasks].count("remote") == 1
    intervals = f(0.4)
    assert max(intervals[:, 0]) < min(intervals[:, 1])  # all four were running at once
    model.close()


def test_dask_mode_mixes_remote_calls_with_cluster_tasks(default_client):
    from _ops import Scale

    model = dt.RemoteModel(Probe, name="probe")
    scale = model.arrays_to_arrays_op("scale", [pt.dvector, pt.dscalar], [pt.dvector])
    x = pt.dvector("x")
    remote = scale(Scale(2.0)(x), 3.0)  # a cluster task feeds a remote call
    out = remote.sum() + Scale(5.0)(remote).sum()
    f = dt.function([x], out)
    assert {t.role for t in f.plan.tasks} >= {"remote", "cluster"}
    assert float(f(np.ones(3))) == pytest.approx(6 * 6 * 3)
    model.close()


def test_a_remote_output_returned_in_a_list_is_told_what_to_return(default_client):
    model = dt.RemoteModel(Probe, name="probe")
    op = model.arrays_to_arrays_op("scale_in_a_list", [pt.dvector, pt.dscalar], [pt.dvector])
    f = pytensor.function([x := pt.dvector("x")], op(x, 2.0))
    with pytest.raises(ValueError, match=r"shape \(1, 3\).*return the array itself"):
        f(np.ones(3))
    model.close()


def test_strided_and_non_contiguous_inputs(default_client):
    model = dt.RemoteModel(Probe, name="probe")
    op = model.arrays_to_arrays_op("sum_and_corner", [pt.dmatrix], [pt.dvector])
    m = pt.dmatrix("m")
    f = pytensor.function([m], op(m))
    base = np.arange(24.0).reshape(4, 6)
    for value in (base[:, ::2], base.T, np.asfortranarray(base), base[::-2, 1:]):
        np.testing.assert_allclose(f(value), [value.sum(), value[0, -1]])
        np.testing.assert_allclose(
            model.call("sum_and_corner", value), [value.sum(), value[0, -1]]
        )
    model.close()


@pytest.mark.parametrize("calls", [1, 3], ids=["one-call", "merged-calls"])
def test_remote_exception_has_its_type_and_traceback_and_the_next_call_works(
    default_client, calls
):
    model = dt.RemoteModel(Probe, name="probe")
    refuse = model.logp_op("refuse", [pt.dvector])
    x = pt.dvector("x")
    f = pytensor.function([x], sum(refuse(x + k) for k in range(calls)))
    with pytest.raises(FloatingPointError, match=r"the model refuses \[\d.0, \d.0\]") as info:
        f(np.array([1.0, 2.0]))
    text = "".join(traceback.format_tb(info.value.__traceback__))
    assert "_models.py" in text and "in refuse" in text  # the remote frame
    assert model.call("where")[0] in default_client.run(os.getpid).values()
    model.close()


def test_a_failing_factory_reaches_the_caller():
    from distributed import Client

    with local_cluster(n_workers=1) as cluster, Client(cluster, set_as_default=False) as client:
        model = dt.RemoteModel(broken_factory, name="broken", scheduler=client)
        with pytest.raises(RuntimeError, match="weights file not found") as info:
            model.call("anything")
        assert "broken_factory" in "".join(traceback.format_tb(info.value.__traceback__))


def test_a_transient_failure_succeeds_with_retries(default_client, tmp_path):
    marker = str(tmp_path / "failed-once")
    model = dt.RemoteModel(Probe, name="probe", retries=1)
    assert model.call("fails_first_time", np.ones(2), marker) == 2.0
    assert os.path.exists(marker)  # the first attempt did fail
    once = dt.RemoteModel(Probe, name="probe")
    with pytest.raises(ConnectionError, match="transient failure"):
        once.call("fails_first_time", np.ones(2), str(tmp_path / "again"))
    model.close()
    once.close()


def test_a_call_that_does_not_return_in_time_fails_and_the_next_one_works(default_client):
    model = dt.RemoteModel(Probe, name="probe", timeout=0.5)
    with pytest.raises(TimeoutError, match=r"did not return within 0.5 s"):
        model.call("where", 3.0)
    assert model.call("where", 0.0)[0] in default_client.run(os.getpid).values()
    model.close()


def test_a_late_reply_is_never_read_as_the_answer_to_another_call(default_client):
    """A timed-out call's connection is not reused: its reply is read and dropped in a
    thread, and its worker counts as busy until then."""
    from dasktensor.remote._replicas import calls_in_flight

    model = dt.RemoteModel(Probe, name="probe", timeout=0.5, replicas=1, concurrency=2)
    (address,) = model.start()
    idle(address)  # late calls of earlier tests on this worker have ended
    with pytest.raises(TimeoutError, match=r"did not return within 0.5 s"):
        model.call("where", 2.0)
    assert calls_in_flight().get(address) == 1  # the late call still runs there
    for k in (2.0, 3.0, 4.0):  # answered while it runs (concurrency=2), each its own answer
        assert model.call("scale", np.ones(1), k).tolist() == [k]
    idle(address)
    model.close()


def idle(address: str) -> None:
    """Wait until this process counts no call in flight at ``address`` (at most 10 s)."""
    from dasktensor.remote._replicas import calls_in_flight

    deadline = time.monotonic() + 10
    while calls_in_flight().get(address, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert calls_in_flight().get(address, 0) == 0, calls_in_flight()


def test_an_interrupted_call_is_not_counted_as_running_nor_its_connection_reused(default_client):
    """Ctrl-C in the middle of a call (here: a signal handler raising KeyboardInterrupt)."""
    from dasktensor.remote._replicas import calls_in_flight

    def interrupt(*_):
        raise KeyboardInterrupt

    model = dt.RemoteModel(Probe, name="probe", replicas=1, concurrency=2)
    (address,) = model.start()
    idle(address)
    old = signal.signal(signal.SIGUSR1, interrupt)
    try:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        with pytest.raises(KeyboardInterrupt):
            model.call("where", 1.5)
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert calls_in_flight().get(address, 0) == 0  # at once: the interrupted call is not counted
    for k in (2.0, 3.0):  # not the late reply of the interrupted call
        assert model.call("scale", np.ones(1), k).tolist() == [k]
    model.close()


def test_a_factory_the_workers_cannot_load_fails_clearly_and_loses_nothing(tmp_path):
    """A factory from a module only the caller has: a worker that cannot load a task's
    function drops its scheduler connection for good (distributed 2026.8), so the build
    is not sent; the error names the module and what to do, and the cluster serves on."""
    import importlib

    from distributed import Client

    module = f"only_here_{os.getpid()}"
    (tmp_path / f"{module}.py").write_text(
        "class Thing:\n    def where(self):\n        return 1\n"
    )
    with local_cluster(n_workers=1) as cluster, Client(cluster, set_as_default=False) as client:
        sys.path.insert(0, str(tmp_path))  # here, after the worker started: not there
        try:
            thing = importlib.import_module(module).Thing
        finally:
            sys.path.remove(str(tmp_path))
        model = dt.RemoteModel(thing, name="only-here", scheduler=client)
        with pytest.raises(
            dt.RemoteModelError, match=rf"cannot import \['{module}'\].*register_pickle_by_value"
        ):
            model.call("where")
        fine = dt.RemoteModel(Probe, name="probe", scheduler=client)
        assert fine.call("where", 0.0)[0] in client.run(os.getpid).values()
        fine.close()
        model.close()


def test_a_factory_of_a_module_registered_by_value_travels_by_value(tmp_path):
    """Dask pickles a task's arguments with pickle first, by reference, whatever
    cloudpickle was told: such a factory travels as cloudpickle's bytes, and what the
    workers must import is what its code imports (read from the pickle, not loaded)."""
    import importlib

    import cloudpickle

    from dasktensor.remote._replicas import shipped_factory

    module = f"by_value_{os.getpid()}"
    (tmp_path / f"{module}.py").write_text(
        "import time\n\nclass Thing:\n    def __init__(self):\n        self.t = time.time()\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        thing = importlib.import_module(module).Thing
    finally:
        sys.path.remove(str(tmp_path))
    shipped, modules = shipped_factory(thing)
    assert shipped is thing and module in modules  # by reference: the workers need it
    cloudpickle.register_pickle_by_value(sys.modules[module])
    try:
        shipped, modules = shipped_factory(thing)
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[module])
    assert isinstance(shipped, bytes)
    assert "time" in modules and module not in modules and "__init__" not in modules
    assert type(pickle.loads(shipped)()).__name__ == "Thing"


def test_no_worker_with_the_resource_fails_clearly(default_client):
    model = dt.RemoteModel(Probe, name="gpu-model", resources={"GPU": 1})
    with dask.config.set({"dasktensor.placement.resource-timeout": "0.5s"}):
        with pytest.raises(dt.NoWorkerWithResourcesError, match=r"\{'GPU': 1\}"):
            model.call("where")


def test_without_a_cluster_the_error_says_how_to_get_one():
    model = dt.RemoteModel(Probe, name="probe")
    with pytest.raises(dt.RemoteModelError, match=r"needs a Dask cluster: call dt.connect\(\)"):
        model.call("where")


def test_bad_options_fail_naming_what_was_expected():
    with pytest.raises(TypeError, match="expected a callable factory, got 3"):
        dt.RemoteModel(3)
    with pytest.raises(ValueError, match=r"name=...\) expected letters and dashes .* 'site-0'"):
        dt.RemoteModel(Probe, name="site-0")
    with pytest.raises(ValueError, match=r"replicas=...\) expected an int >= 1, got 0"):
        dt.RemoteModel(Probe, replicas=0)
    with pytest.raises(ValueError, match=r"timeout=...\) expected a number of seconds > 0"):
        dt.RemoteModel(Probe, timeout=-1)
    with pytest.raises(TypeError, match="expected a method name, got 'not a name'"):
        dt.RemoteModel(Probe).logp_op("not a name", [pt.dvector])


def test_calls_from_threads_after_asyncio_run_and_inside_a_running_loop(default_client):
    model = dt.RemoteModel(Probe, name="probe")
    op = model.logp_grad_op("logp_grad", [pt.dvector, pt.dscalar])
    x, mu = pt.dvector("x"), pt.dscalar("mu")
    f = pytensor.function([x, mu], op(x, mu)[0])
    want = -0.5 * 2.0

    async def main():
        assert float(f(np.ones(2), 0.0)) == want  # blocking call inside a running loop
        got = await model.acall("logp_grad", np.ones(2), 0.0)
        return got[0]

    assert asyncio.run(main()) == want
    assert float(f(np.ones(2), 0.0)) == want  # after asyncio.run()
    with ThreadPoolExecutor(4) as pool:
        assert set(pool.map(lambda _: float(f(np.ones(2), 0.0)), range(16))) == {want}
    model.close()


@pytest.mark.parametrize("calls", [1, 2], ids=["one-call", "merged-calls"])
def test_a_killed_worker_mid_call_is_replaced_and_the_call_returns(tmp_path, calls):
    from distributed import Client

    pidfile = tmp_path / "pids"
    with local_cluster(n_workers=2) as cluster, Client(cluster, set_as_default=False) as client:
        model = dt.RemoteModel(
            functools.partial(record_then_sleep, str(pidfile), 1.0),
            name="sleeper",
            scheduler=client,
        )
        assert len(model.start()) == 2
        op = model.arrays_to_arrays_op("work", [pt.dvector], [pt.dvector])
        x = pt.dvector("x")
        f = pytensor.function([x], sum(op(x * (k + 1)) for k in range(calls)))

        def kill_the_first_caller():
            while not pidfile.exists():
                threading.Event().wait(0.05)
            os.kill(int(pidfile.read_text().split()[0]), signal.SIGKILL)

        killer = threading.Thread(target=kill_the_first_caller)
        killer.start()
        want = np.arange(3.0) * 2 * sum(range(1, calls + 1))
        np.testing.assert_array_equal(f(np.arange(3.0)), want)
        killer.join()
        assert len(set(pidfile.read_text().split())) == 2  # it ran again elsewhere


def test_ops_and_functions_pickle_into_another_process(default_client, tmp_path):
    model = dt.RemoteModel(Probe, name="probe", scheduler=default_client)
    op = model.logp_grad_op("logp_grad", [pt.dvector, pt.dscalar])
    x, mu = pt.dvector("x"), pt.dscalar("mu")
    f = pytensor.function([x, mu], op(x, mu)[0])
    (tmp_path / "f.pkl").write_bytes(pickle.dumps(f))
    before = model.start()
    script = textwrap.dedent(
        f"""
        import pickle, numpy as np
        f = pickle.loads(open({str(tmp_path / "f.pkl")!r}, "rb").read())
        print(float(f(np.ones(3), 0.0)))
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert float(out.stdout.split()[-1]) == -1.5
    assert sorted(model.build_counts()) == sorted(before)  # the same replicas served it
    model.close()


def test_a_slow_call_is_probed_not_moved(default_client):
    """A call that takes several probe intervals stays where it runs: the probes are
    answered by the call server while the model works."""
    model = dt.RemoteModel(Probe, name="probe", replicas=1)
    (home,) = model.start()
    pid, _ = model.call("where", 2.0)  # probed every 0.5 s (probe-after) while it sleeps
    assert pid == default_client.run(os.getpid)[home]
    assert model.build_counts() == {home: 1}
    model.close()


@pytest.mark.slow
@pytest.mark.timeout(120)  # a caller waiting for ever fails here
def test_a_frozen_worker_loses_its_call_to_another_replica():
    """A stopped (SIGSTOP) worker without a nanny keeps its connections open (its kernel
    still speaks TCP) and never answers; nobody kills it, and the scheduler would see it
    go only after ``worker-ttl`` (here 300 s, past the test's timeout).  The waiting
    call probes the worker's call server after ``probe-after``, gets no answer within
    ``probe-timeout`` and runs on another replica; the next calls avoid the worker."""
    with cluster_with_a_bare_worker() as (client, frozen):
        pids = client.run(os.getpid)
        (lone,) = [a for a, pid in pids.items() if pid == frozen.pid]
        model = dt.RemoteModel(Probe, name="probe", replicas=1, workers=[lone], scheduler=client)
        assert model.start() == [lone]
        assert model.call("where", 0.0)[0] == frozen.pid
        freeze(frozen.pid)
        t0 = time.monotonic()
        pid, _ = model.call("where", 0.0)
        waited = time.monotonic() - t0
        (other,) = set(scheduler_workers(client)) - {lone}
        assert pid == pids[other], f"answered by {pid}, the frozen worker is {frozen.pid}"
        assert waited < 30, waited  # a probe's 1.5 s, not Dask's 30 s nor worker-ttl
        t0 = time.monotonic()
        assert {model.call("where", 0.0)[0] for _ in range(3)} == {pids[other]}
        assert time.monotonic() - t0 < 10  # no call waits on the frozen worker again
        # nor do the questions asked of every worker (client.run to it never returns)
        assert model.workers() == [other]
        assert set(model.build_counts()) == {other}
        assert [w.address for w in dt.cluster_summary(client).workers if w.models] == [other]
        t0 = time.monotonic()
        model.close()  # nor does closing the model
        assert time.monotonic() - t0 < 10
        assert client.run(tasks.holds, model.key, workers=[other]) == {other: False}
        os.kill(frozen.pid, signal.SIGCONT)  # woken, the worker finds the lease gone
        assert eventually(
            lambda: client.run(tasks.holds, model.key, workers=[lone]) == {lone: False}
        )


def test_an_idle_connection_is_never_handed_to_another_worker_at_the_same_endpoint():
    """A call server that closed frees its port, and another worker's may bind it: a
    connection kept for the first must not carry the second's calls (it would read the
    closed server's EOF and take a live worker for a lost one)."""
    import socket

    from dasktensor.remote._channel import Channel

    with socket.create_server(("127.0.0.1", 0)) as listener:
        endpoint = ("127.0.0.1", listener.getsockname()[1], False)
        channel = Channel()
        first = channel.send("tcp://10.0.0.1:1", endpoint, None, ("ping",), 5)
        channel.give_back(first)
        other = channel.send("tcp://10.0.0.2:1", endpoint, None, ("ping",), 5)
        assert other is not first
        channel.give_back(other)
        assert channel.send("tcp://10.0.0.1:1", endpoint, None, ("ping",), 5) is first
        channel.forget("tcp://10.0.0.2:1")  # the other's idle connection closed, not first's
        assert not any(channel.idle.values())
        first.close()
