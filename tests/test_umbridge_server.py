"""``dt.serve_umbridge``: a Dask cluster serving UM-Bridge models, checked with UM-Bridge's
own client (``umbridge.HTTPModel``), its protocol conformance tests, and raw HTTP."""

from __future__ import annotations

import functools
import http.client
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from _clusters import channel_calls, local_cluster
from _umbridge_models import BatchedDecay, Decay, hessian, jacobian, trajectory

import dasktensor as dt

umbridge = pytest.importorskip("umbridge")  # the test extra installs it

HERE = pathlib.Path(__file__).parent
CONFORMANCE = HERE / "umbridge_conformance"
POINT = [[2.0, 0.5]]


@pytest.fixture(scope="module")
def client():
    from distributed import Client

    with local_cluster(n_workers=2) as cluster, Client(cluster, set_as_default=False) as c:
        yield c


@pytest.fixture(scope="module")
def served(client):
    """``decay`` (every feature) and ``plain`` (Evaluate only), served on the cluster."""
    models = [dt.RemoteModel(Decay, name="decay", scheduler=client),
              dt.RemoteModel(functools.partial(Decay, "plain", False), name="plain",
                             scheduler=client)]  # fmt: skip
    with dt.serve_umbridge(models, port=0) as server:
        yield server
    for m in models:
        m.close()


def post(url: str, route: str, body) -> tuple[int, dict]:
    """A raw request (``body``: a dict, or bytes sent as they are); the status and JSON."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", route, data, {"Content-Type": "application/json"})
    reply = conn.getresponse()
    out = reply.status, json.loads(reply.read())
    conn.close()
    return out


@pytest.mark.parametrize("first", ["decay", "plain"])
def test_the_protocols_conformance_tests_pass(client, first, tmp_path):
    """UM-Bridge's conformance tests check the first model a server lists: served first,
    ``decay`` takes the supported branch of each feature, ``plain`` the unsupported."""
    models = [dt.RemoteModel(Decay, name="decay", scheduler=client),
              dt.RemoteModel(functools.partial(Decay, "plain", False), name="plain",
                             scheduler=client)]  # fmt: skip
    if first == "plain":
        models.reverse()
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    with dt.serve_umbridge(models, port=0) as server:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "options", "-p", "no:cacheprovider",
             "-c", str(tmp_path / "pytest.ini"), "--rootdir", str(tmp_path), "-v",
             str(CONFORMANCE / "protocol_1_0.py"), f"--model_url={server.url}",
             "--input_value=1.0"],
            capture_output=True, text=True, timeout=240, check=False,
            env={**os.environ, "PYTHONPATH": str(CONFORMANCE)},
        )  # fmt: skip
    for m in models:
        m.close()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert re.search(r"\b22 passed\b", done.stdout), done.stdout[-1000:]


def test_umbridges_client_gets_what_the_model_computes(served):
    model = umbridge.HTTPModel(served.url, "decay")
    theta = np.array(POINT[0])
    assert umbridge.supported_models(served.url) == ["decay", "plain"]
    assert model.get_input_sizes() == [2] and model.get_output_sizes() == [5, 1]
    assert (model.supports_gradient(), model.supports_apply_hessian()) == (True, True)
    y, prod = model(POINT)
    np.testing.assert_allclose(y, trajectory(theta))
    assert prod == [1.0]
    sens = np.linspace(-1.0, 1.0, 5)
    np.testing.assert_allclose(
        model.gradient(0, 0, POINT, sens.tolist()), sens @ jacobian(theta, 0)
    )
    vec = np.array([0.3, -1.0])
    np.testing.assert_allclose(
        model.apply_jacobian(0, 0, POINT, vec.tolist()), jacobian(theta, 0) @ vec
    )
    np.testing.assert_allclose(model.apply_jacobian(1, 0, POINT, vec.tolist()), [0.5 * 0.3 - 2.0])
    # the Hessian against central differences of the gradient
    hv = model.apply_hessian(0, 0, 0, POINT, sens.tolist(), vec.tolist())
    eps = 1e-6
    fd = [
        (sens @ jacobian(theta + eps * vec, 0) - sens @ jacobian(theta - eps * vec, 0)) / (2 * eps)
    ]
    np.testing.assert_allclose(hv, fd[0], rtol=1e-6)
    np.testing.assert_allclose(hv, hessian(theta, 0, sens) @ vec)
    plain = umbridge.HTTPModel(served.url, "plain")
    assert (plain.supports_evaluate(), plain.supports_gradient()) == (True, False)
    np.testing.assert_allclose(plain(POINT)[0], trajectory(theta))


def test_dt_umbridge_op_differentiates_through_the_served_model(served):
    op = dt.umbridge_op(served.url, "decay")
    theta = pt.dvector("theta")
    y, prod = op(theta)
    cost = (y * np.arange(1.0, 6.0)).sum() + prod.sum()
    f = pytensor.function([theta], [cost, pytensor.grad(cost, theta)])
    point = np.array([1.5, 0.3])
    value, grad = f(point)
    np.testing.assert_allclose(value, trajectory(point) @ np.arange(1.0, 6.0) + 0.45)
    np.testing.assert_allclose(
        grad, np.arange(1.0, 6.0) @ jacobian(point, 0) + jacobian(point, 1)[0]
    )
    pytensor.gradient.verify_grad(lambda t: op(t)[0].sum(), [point], rng=np.random.default_rng(0))


def test_concurrent_requests_run_at_once_on_both_replicas(client, tmp_path):
    log = tmp_path / "calls.log"
    model = dt.RemoteModel(functools.partial(Decay, log=str(log)), name="logged", scheduler=client)
    with dt.serve_umbridge(model, port=0) as server:
        clients = [umbridge.HTTPModel(server.url, "logged") for _ in range(2)]
        with ThreadPoolExecutor(2) as pool:
            outs = list(pool.map(lambda m: m(POINT, {"delay": 0.5}), clients))
        served_calls = channel_calls(client).get("logged", 0)
    model.close()
    for out in outs:
        np.testing.assert_allclose(out[0], trajectory(np.array(POINT[0])))
    spans = [line.split() for line in log.read_text().splitlines()]
    assert len(spans) == 2
    assert len({pid for _, _, pid in spans}) == 2  # one call on each replica
    starts, stops = [float(s[0]) for s in spans], [float(s[1]) for s in spans]
    assert max(starts) < min(stops)  # and at the same time
    # the calls went through the channel, where the dashboard's calls page counts them
    assert served_calls >= 2


def test_concurrent_requests_of_a_batched_method_run_in_batches(client):
    model = dt.RemoteModel(BatchedDecay, name="batched", replicas=1, scheduler=client)
    with dt.serve_umbridge(model, port=0) as server:
        clients = [umbridge.HTTPModel(server.url, "batched") for _ in range(4)]
        points = [[[1.0 + k, 0.1 * k]] for k in range(4)]
        with ThreadPoolExecutor(4) as pool:
            # whether requests queue is up to the machine; rounds is counted after the loop
            for rounds in range(1, 4):  # noqa: B007  used after the loop
                outs = list(pool.map(lambda mp: mp[0](mp[1], {"delay": 0.2}),
                                     zip(clients, points, strict=True)))  # fmt: skip
                for out, p in zip(outs, points, strict=True):  # each its own row
                    np.testing.assert_allclose(out[0], trajectory(np.array(p[0])))
                if max(model.call("batch_sizes")) > 1:
                    break
        sizes = model.call("batch_sizes")
    model.close()
    assert sum(sizes) == 4 * rounds  # every request in one batch or another
    assert max(sizes) > 1, sizes


def test_a_worker_killed_mid_request_loses_nothing(tmp_path):
    from distributed import Client

    started = tmp_path / "started"
    with local_cluster(n_workers=2) as cluster, Client(cluster, set_as_default=False) as c:
        model = dt.RemoteModel(Decay, name="decay", scheduler=c)
        assert len(model.start()) == 2
        with dt.serve_umbridge(model, port=0) as server:
            remote = umbridge.HTTPModel(server.url, "decay")

            def kill_the_first():
                while not started.exists():
                    time.sleep(0.02)
                os.kill(int(started.read_text().split()[0]), signal.SIGKILL)

            killer = threading.Thread(target=kill_the_first)
            killer.start()
            out = remote(POINT, {"delay": 1.0, "started": str(started)})
            killer.join()
            np.testing.assert_allclose(out[0], trajectory(np.array(POINT[0])))
            assert len(set(started.read_text().split())) == 2  # it ran again elsewhere
            np.testing.assert_allclose(remote(POINT)[0], trajectory(np.array(POINT[0])))
        model.close()


@pytest.mark.parametrize(
    ("route", "body", "status", "kind", "message"),
    [
        ("/Evaluate", {"name": "nope", "input": POINT}, 400, "ModelNotFound", "available: ['decay', 'plain']"),  # noqa: E501  a table row
        ("/Evaluate", {"name": "decay", "input": [[1.0]]}, 400, "InvalidInput", "Expected 2 but got 1"),  # noqa: E501  a table row
        ("/Evaluate", {"name": "decay", "input": [[1.0, "a"]]}, 400, "InvalidInput", "array of numbers"),  # noqa: E501  a table row
        ("/Evaluate", {"name": "decay"}, 400, "InvalidInput", "Expected 1 arrays of numbers, got null"),  # noqa: E501  a table row
        ("/Evaluate", b"{not json", 400, "InvalidInput", "not JSON"),
        ("/Evaluate", {"name": "decay", "input": POINT, "config": {"fail": "no convergence"}},
         500, "ModelError", "__call__ raised ValueError: no convergence"),
        ("/Evaluate", {"name": "decay", "input": POINT, "config": {"short": True}},
         500, "InvalidOutput", "Output vector 0 has invalid length! Model declared 5 but returned 4"),  # noqa: E501  a table row
        ("/Gradient", {"name": "plain", "input": POINT, "outWrt": 0, "inWrt": 0, "sens": [1] * 5},
         400, "UnsupportedFeature", "Gradient not supported by model 'plain'"),
        ("/Gradient", {"name": "decay", "input": POINT, "outWrt": 2, "inWrt": 0, "sens": [1] * 5},
         400, "InvalidInput", "Invalid outWrt index"),
        ("/Gradient", {"name": "decay", "input": POINT, "outWrt": 1, "inWrt": 0, "sens": [1] * 5},
         400, "InvalidInput", "sens has invalid length! Expected 1 but got 5"),
        ("/ApplyJacobian", {"name": "decay", "input": POINT, "outWrt": 0, "inWrt": 0, "vec": [1]},
         400, "InvalidInput", "vec has invalid length! Expected 2 but got 1"),
        ("/Evaluat", {"name": "decay"}, 404, "NotFound", "no route /Evaluat"),
    ],
    ids=["unknown-model", "wrong-size", "not-numbers", "no-input", "not-json", "model-raises",
         "wrong-output", "unsupported", "out-wrt", "sens-size", "vec-size", "no-route"],
)  # fmt: skip
def test_bad_requests_get_the_protocols_errors_and_the_next_request_works(
    served, route, body, status, kind, message
):
    got_status, got = post(served.url, route, body)
    assert (got_status, got["error"]["type"]) == (status, kind), got
    assert message in got["error"]["message"], got
    ok_status, ok = post(served.url, "/Evaluate", {"name": "decay", "input": POINT})
    assert ok_status == 200
    np.testing.assert_allclose(ok["output"][0], trajectory(np.array(POINT[0])))


def test_umbridges_client_raises_the_servers_errors_with_their_message(served):
    with pytest.raises(Exception, match="not supported by server.*decay"):
        umbridge.HTTPModel(served.url, "nope")
    model = umbridge.HTTPModel(served.url, "decay")
    with pytest.raises(Exception, match="InvalidInput: Input parameter 0 has invalid length"):
        model([[1.0, 2.0, 3.0]])
    with pytest.raises(Exception, match="ModelError: .*ValueError: diverged"):
        model(POINT, {"fail": "diverged"})


def test_info_for_a_browser_or_curl(served):
    host, port = served.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("GET", "/Info")
    reply = conn.getresponse()
    assert reply.status == 200 and reply.getheader("Content-Type") == "application/json"
    assert json.loads(reply.read()) == {"protocolVersion": 1.0, "models": ["decay", "plain"]}
    conn.request("GET", "/")  # the same connection: kept alive
    page = conn.getresponse().read().decode()
    assert "UM-Bridge server" in page and "decay, plain" in page and "/Evaluate" in page
    conn.close()


def test_serving_what_is_not_served_fails_clearly(client, served):
    with pytest.raises(TypeError, match="expected a dt.RemoteModel.*got 'decay'"):
        dt.serve_umbridge("decay")
    with pytest.raises(TypeError, match="expected dt.RemoteModel objects.*Decay"):
        dt.serve_umbridge([Decay()])
    a = dt.RemoteModel(Decay, name="twice", scheduler=client)
    b = dt.RemoteModel(Decay, name="twice", scheduler=client)
    with pytest.raises(ValueError, match=r"different names, got \['twice'\]"):
        dt.serve_umbridge([a, b], port=0)
    with pytest.raises(ValueError, match="port in 0..65535, got 70000"):
        dt.serve_umbridge(a, port=70000)
    port = int(served.url.rsplit(":", 1)[1])
    with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}.*another port"):
        dt.serve_umbridge(a, port=port)
    not_umbridge = dt.RemoteModel(dict, name="dict", scheduler=client)
    with pytest.raises(TypeError, match="build an umbridge.Model.*no 'supports_evaluate'"):
        dt.serve_umbridge(not_umbridge, port=0)
    for m in (a, b, not_umbridge):
        m.close()


def test_the_command_line_serves_until_stopped(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "dasktensor", "serve-umbridge",
         str(HERE / "_umbridge_models.py") + ":Decay", "--name", "decay", "--port", "0",
         "--workers", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path,
    )  # fmt: skip
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("UM-Bridge server:"):
                break
        url = lines[-1].split()[2]
        assert url.startswith("http://127.0.0.1:"), lines
        np.testing.assert_allclose(umbridge.HTTPModel(url, "decay")(POINT)[0],
                                   trajectory(np.array(POINT[0])))  # fmt: skip
    finally:
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, "".join(lines) + rest
    assert "UM-Bridge server stopped." in rest
    assert any("Dashboard: http://" in line for line in lines), lines


@pytest.mark.parametrize(
    ("spec", "message"),
    [("nocolon", "expected MODULE:FACTORY"), ("missing.py:F", "expected a Python file"),
     (str(HERE / "_umbridge_models.py") + ":Nope", "expected a callable 'Nope'")],
    ids=["no-colon", "no-file", "no-factory"],
)  # fmt: skip
def test_the_command_line_refuses_a_factory_it_cannot_find(spec, message):
    done = subprocess.run(
        [sys.executable, "-m", "dasktensor", "serve-umbridge", spec, "--name", "m"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2 and message in done.stderr, done.stderr
