"""The worker side of remote models (``dasktensor_worker``): light, and a proper plugin.

A bare ``dask worker`` (no preload) must build and serve a model without importing
dasktensor or PyTensor, and the ``ModelHost`` plugin must come and go cleanly.
"""

from __future__ import annotations

import os
import pkgutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from _clusters import local_cluster

import dasktensor as dt
import dasktensor_worker
from dasktensor_worker import wire
from dasktensor_worker.plugin import PLUGIN_NAME, ModelHost, host_of

WORKER_MODULES = ["dasktensor_worker"] + [
    f"dasktensor_worker.{m.name}" for m in pkgutil.iter_modules(dasktensor_worker.__path__)
]


def run_fresh(code: str) -> str:
    """Run ``code`` in a fresh interpreter with this one's import path; its output."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_worker_package_imports_neither_dasktensor_nor_pytensor():
    assert len(WORKER_MODULES) >= 5  # the package, wire, replica, plugin, tasks
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in WORKER_MODULES)
        + "print(sorted(m for m in ('pytensor', 'pymc', 'dasktensor') if m in sys.modules))"
    )
    assert run_fresh(code) == "[]"


def test_what_the_caller_imports_of_it_does_not_import_distributed():
    """``import dasktensor`` stays free of distributed's import (dasktensor.remote uses these)."""
    code = (
        "import sys, dasktensor_worker, dasktensor_worker.wire, dasktensor_worker.tasks\n"
        "print('distributed' in sys.modules)"
    )
    assert run_fresh(code) == "False"


# ----------------------------------------------------------------------------- wire


@pytest.mark.parametrize(
    "value",
    [
        np.arange(6.0).reshape(2, 3)[:, ::2],  # strided
        np.asfortranarray(np.arange(6).reshape(2, 3)),
        np.array([1 + 2j, 3 - 1j], dtype=np.complex64),
        np.array([True, False]),
        np.array(3.5),  # 0-d array stays an array
        np.float32(2.5),  # a NumPy scalar stays a scalar
        np.zeros((0, 3), dtype=np.uint16),
        np.arange(100_000.0).reshape(1000, 100).T,  # large (out of band) and strided
        np.asfortranarray(np.ones((300, 300))),  # large, Fortran order
    ],
    ids=[
        "strided",
        "fortran",
        "complex64",
        "bool",
        "0-d",
        "scalar",
        "empty",
        "large-T",
        "large-F",
    ],
)
def test_numeric_arrays_cross_the_wire_as_writeable_equal_arrays(value):
    back = wire_round_trip(value)
    assert type(back) is type(value) and back.dtype == value.dtype
    np.testing.assert_array_equal(back, value)
    if isinstance(back, np.ndarray):
        assert back.flags.writeable


def test_large_arrays_travel_out_of_band_and_small_ones_inside_the_message():
    big, other, small = np.ones(10_000), np.zeros(1000), np.ones(10)
    frames = wire.dumps(("key", "method", (big, small, [other, big])))
    assert [f.nbytes for f in frames[1:]] == [big.nbytes, other.nbytes]  # once each, as views
    assert len(frames[0]) < 600  # the small array is in the pickle, the big ones are not


def test_large_arrays_at_any_depth_cross_together():
    """Arrays in tuples and lists are packed by the wire, arrays inside other objects by
    NumPy's pickling: both kinds of out-of-band frames in one message keep their order."""
    top, inner, deep = np.arange(1000.0), np.ones(600), np.full((30, 30), 3.0)
    value = (top, [inner, top], {"deep": deep}, np.float64(2.0), np.arange(3))
    a, (b, c), d, scalar, small = wire_round_trip(value)
    for got, want in [(a, top), (b, inner), (c, top), (d["deep"], deep), (small, [0, 1, 2])]:
        np.testing.assert_array_equal(got, want)
    assert type(scalar) is np.float64 and a.flags.writeable and d["deep"].flags.writeable
    assert len(wire.dumps(value)) == 1 + 3  # top (once), inner, deep


def test_other_values_and_sequences_cross_as_they_are():
    value = [1.5, "text", np.array([{"a": 1}], dtype=object), (np.int64(3), None)]
    back = wire_round_trip(value)
    assert back[:2] == [1.5, "text"] and back[2][0] == {"a": 1} and back[3] == (3, None)


def wire_round_trip(value):
    """``value`` sent to a call server that returns its argument, and back."""
    server = wire.WireServer("127.0.0.1", lambda key, method, args: ("OK", args[0]))
    try:
        with socket.create_connection(server.address) as sock:
            wire.send(sock, ("key", None, (value,)))
            status, back = wire.recv(sock.makefile("rb"))
        assert status == "OK"
        return back
    finally:
        server.close()


def test_the_server_answers_a_broken_request_with_an_error_and_keeps_the_connection():
    class Unpicklable:
        def __reduce__(self):
            return (_refuse, ())

    replies = []
    server = wire.WireServer("127.0.0.1", lambda key, method, args: ("OK", args))
    try:
        with socket.create_connection(server.address) as sock:
            reader = sock.makefile("rb")
            wire.send(sock, ("key", None, (Unpicklable(),)))  # fails to unpickle there
            replies.append(wire.recv(reader))
            wire.send(sock, ("key", None, (1, 2)))
            replies.append(wire.recv(reader))
    finally:
        server.close()
    assert replies[0][0] == "error" and "refused on the worker" in replies[0][1]["exception_text"]
    assert replies[1] == ("OK", (1, 2))


def _refuse():
    raise ValueError("refused on the worker")


def test_a_request_of_several_calls_gets_one_reply_per_call_and_bad_ones_an_error():
    def answer(key, method, args):
        return ("OK", 2 * args[0]) if args[0] else ("error", {"exception_text": "zero"})

    server = wire.WireServer("127.0.0.1", answer)
    try:
        with socket.create_connection(server.address) as sock:
            reader = sock.makefile("rb")
            wire.send(sock, ("key", "m", [(1,), (0,), (np.float64(2.5),)], wire.MANY))
            many = wire.recv(reader)
            wire.send(sock, ("key", "m", 7, wire.MANY))  # calls that are not a list
            broken = wire.recv(reader)
            wire.send(sock, ("key", "m", (3,)))  # the connection is still usable
            after = wire.recv(reader)
    finally:
        server.close()
    assert many == ("many", [("OK", 2), ("error", {"exception_text": "zero"}), ("OK", 5.0)])
    assert broken[0] == "error" and "int" in broken[1]["exception_text"]
    assert after == ("OK", 6)


def test_busy_poll_says_whether_a_message_came_and_stops_polling_after_a_miss():
    import threading

    a, b = socket.socketpair()
    try:
        waiter = wire.BusyPoll(a, 0.05, threading.Lock())
        t0 = time.perf_counter()
        assert not waiter.wait(0.2)  # nothing came: polled, then slept, 0.2 s in all
        assert 0.15 < time.perf_counter() - t0 < 2
        assert waiter._skip == 1  # the next wait sleeps at once
        threading.Timer(0.01, b.send, (b"x",)).start()
        assert waiter.wait(1.0)
        assert a.recv(1) == b"x"
        b.send(b"y")  # came before the wait: no polling needed
        assert waiter.wait(0) and a.recv(1) == b"y"
        taken = threading.Lock()
        taken.acquire()  # another thread polls: this one sleeps
        busy = wire.BusyPoll(a, 10.0, taken)
        t0 = time.perf_counter()
        assert not busy.wait(0.05) and time.perf_counter() - t0 < 1
    finally:
        a.close()
        b.close()


# ----------------------------------------------------------------------------- the plugin


class FakeWorker:
    """What ``ModelHost`` touches of a worker."""

    def __init__(self):
        self.address = "tcp://127.0.0.1:0"
        self.handlers = {"other": print}
        self.plugins = {}


def test_teardown_stops_the_call_server_and_releases_the_replicas():
    worker, host = FakeWorker(), ModelHost()
    host.setup(worker)
    assert worker.handlers["dasktensor_call_log"] == host.call_log
    host.build("m-1", "m", dict, 1)
    host.build("m-1", "m", dict, 1)  # built once
    assert host.builds == {"m-1": 1}
    address, port, tls = host.endpoint
    sock = socket.create_connection((address, port))
    wire.send(sock, ("m-1", "__len__", ()))
    assert wire.recv(sock.makefile("rb")) == ("OK", 0)
    host.teardown(worker)
    assert worker.handlers == {"other": print}
    assert host.replicas == {} and host.endpoint is None and not tls
    assert sock.recv(1) == b""  # the server closed the connection
    with pytest.raises(ConnectionRefusedError):  # and stopped listening
        socket.create_connection((address, port), timeout=5)
    with pytest.raises(RuntimeError, match="plugin was removed from this worker"):
        host.build("m-2", "m", dict, 1)


def test_a_host_pickles_as_a_new_empty_host():
    import pickle

    host = ModelHost()
    host.build("m-1", "m", dict, 1)
    copy = pickle.loads(pickle.dumps(host))
    assert isinstance(copy, ModelHost) and copy.replicas == {} and not copy.closed
    host.teardown(FakeWorker())


# ----------------------------------------------------------------------------- a bare worker


@pytest.fixture(scope="module")
def bare():
    """A Client of a one-worker process cluster started without any preload (two threads:
    builds may race)."""
    from distributed import Client

    with (
        local_cluster(n_workers=1, threads_per_worker=2) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        client.wait_for_workers(1, timeout=60)
        yield client


def numpy_model():
    """A factory needing NumPy only, pickled by value (a class defined in a function)."""

    class Shift:
        def __init__(self):
            self.offset = np.arange(3.0)

        def logp_grad(self, x):
            r = x - self.offset
            return -0.5 * float(r @ r), -r

        def pid(self):
            return os.getpid()

    return Shift


def worker_state(client) -> dict:
    def state(dask_worker=None):
        return {
            "modules": sorted(m for m in ("pytensor", "pymc", "dasktensor") if m in sys.modules),
            "handler": "dasktensor_call_log" in dask_worker.handlers,
            "plugin": "dasktensor-models" in dask_worker.plugins,
        }

    (found,) = client.run(state).values()
    return found


def remove_host(client) -> None:
    """Remove the worker's ModelHost (if it has one) with the worker's own API."""

    async def remove(dask_worker=None):
        if "dasktensor-models" in dask_worker.plugins:
            return (await dask_worker.plugin_remove("dasktensor-models"))["status"]
        return "none"

    assert set(client.run(remove).values()) <= {"OK", "none"}
    assert worker_state(client)["handler"] is False


def held(client) -> list[tuple[str, list[str]]]:
    """The worker's host: its type and the keys of its replicas."""

    def replicas(dask_worker=None):
        host = host_of(dask_worker)
        return type(host).__name__, sorted(host.replicas)

    return list(client.run(replicas).values())


def test_a_bare_worker_builds_and_serves_a_model_without_importing_pytensor(bare):
    assert worker_state(bare) == {"modules": [], "handler": False, "plugin": False}
    model = dt.RemoteModel(numpy_model(), name="shift", scheduler=bare)
    logp, grad = model.call("logp_grad", np.ones(3))
    assert logp == -0.5 * 2.0
    np.testing.assert_array_equal(grad, [-1.0, 0.0, 1.0])
    assert worker_state(bare) == {"modules": [], "handler": True, "plugin": True}
    model.close()


def test_removing_the_plugin_releases_the_replicas_and_the_next_call_rebuilds(bare):
    model = dt.RemoteModel(numpy_model(), name="shift", scheduler=bare)
    (address,) = model.start()
    pid = model.call("pid")
    remove_host(bare)
    assert model.workers() == [] and model.build_counts() == {}
    assert model.call("pid") == pid  # rebuilt on the same worker
    assert model.build_counts() == {address: 1}  # by a new host
    assert worker_state(bare) == {"modules": [], "handler": True, "plugin": True}
    model.close()


def test_the_plugin_registered_by_the_client_serves_models_and_unregisters(bare):
    remove_host(bare)
    bare.register_plugin(ModelHost())
    assert worker_state(bare)["handler"] is True
    model = dt.RemoteModel(numpy_model(), name="shift", scheduler=bare)
    model.call("pid")
    assert held(bare) == [("ModelHost", [model.key])]  # the registered host serves it
    bare.unregister_worker_plugin(PLUGIN_NAME)
    assert worker_state(bare)["plugin"] is False
    assert model.workers() == []
    model.call("pid")  # the build task adds a host again
    assert len(model.workers()) == 1
    model.close()


def test_builds_racing_on_one_worker_install_one_host_and_build_once(bare):
    remove_host(bare)
    models = [dt.RemoteModel(numpy_model(), name="shift", scheduler=bare) for _ in range(2)]
    with ThreadPoolExecutor(6) as pool:
        pids = list(pool.map(lambda m: m.call("pid"), models * 3))
    assert len(set(pids)) == 1
    assert held(bare) == [("ModelHost", sorted(m.key for m in models))]
    assert [m.build_counts() for m in models] == [{a: 1} for a in bare.run(os.getpid)] * 2
    for m in models:
        m.close()
