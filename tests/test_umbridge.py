"""``dt.umbridge_op``: UM-Bridge models as differentiable Ops.

Real servers: ``umbridge.serve_models`` in subprocesses (``tests/_umbridge_models.py``),
on loopback ports.  Checked: the values and sizes the server gives, gradients against
the analytic ones and ``verify_grad``, ``pushforward``/``Rop`` through ``ApplyJacobian``,
independent calls of one evaluation running at once (the servers' own start and stop
times), several servers balanced and one going away, the errors (an unknown model, a
model without gradients, the server's ``InvalidInput``, a server gone), pickling, and
``pm.sample`` through it drawing what the same model in PyTensor draws.
"""

from __future__ import annotations

import contextlib
import pathlib
import socket
import subprocess
import sys
import time

import cloudpickle
import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from _clusters import free_port
from pytensor.gradient import verify_grad

import dasktensor as dt

HERE = pathlib.Path(__file__).parent
T = np.array([0.0, 0.5, 1.0, 2.0, 4.0])


@contextlib.contextmanager
def umbridge_server(log: pathlib.Path | None = None):
    """A ``umbridge.serve_models`` server of ``_umbridge_models`` on a free port: its url."""
    port = free_port()
    args = [sys.executable, str(HERE / "_umbridge_models.py"), str(port)]
    proc = subprocess.Popen(
        [*args, *([str(log)] if log else [])],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the UM-Bridge server did not start")
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}", proc
    finally:
        proc.kill()
        proc.wait(30)


@pytest.fixture(scope="module")
def server():
    with umbridge_server() as (url, _):
        yield url


def test_the_ops_shape_and_values_come_from_the_server(server):
    op = dt.umbridge_op(server, "decay")
    assert [t.shape for t in op.itypes] == [(2,)] and [t.shape for t in op.otypes] == [(5,), (1,)]
    theta = pt.dvector("theta")
    f = dt.function([theta], op(theta))
    y, yk = f(np.array([2.0, 0.5]))
    np.testing.assert_allclose(y, 2.0 * np.exp(-0.5 * T))
    np.testing.assert_allclose(yk, [1.0])


def test_gradients_through_the_servers_gradient(server):
    op = dt.umbridge_op(server, "decay")
    rng = np.random.default_rng(0)
    verify_grad(lambda th: op(th)[0], [np.array([1.5, 0.3])], rng=rng)
    verify_grad(lambda th: op(th)[0].sum() * op(th)[1].sum(), [np.array([1.5, 0.3])], rng=rng)
    theta = pt.dvector("theta")
    g = dt.function([theta], pytensor.grad((op(theta)[0] ** 2).sum(), theta))
    point = np.array([2.0, 0.5])
    y = point[0] * np.exp(-point[1] * T)
    np.testing.assert_allclose(g(point), [2 * y @ (y / point[0]), 2 * y @ (-T * y)])


def test_pushforward_through_apply_jacobian(server):
    from dasktensor._compat import PYTENSOR_3

    op = dt.umbridge_op(server, "decay")
    theta, v = pt.dvector("theta"), pt.dvector("v")
    if PYTENSOR_3:
        from pytensor.gradient import pushforward

        jv = pushforward(op(theta)[0], theta, v, use_op_pushforward=True)
    else:
        from pytensor.gradient import Rop

        jv = Rop(op(theta)[0], theta, v, use_op_rop_implementation=True)
    f = pytensor.function([theta, v], jv)
    point, vec = np.array([2.0, 0.5]), np.array([0.3, -1.0])
    y = point[0] * np.exp(-point[1] * T)
    np.testing.assert_allclose(f(point, vec), 0.3 * y / 2.0 + 1.0 * T * y)


def test_independent_calls_of_one_evaluation_run_at_once(tmp_path):
    log = tmp_path / "calls.log"
    with umbridge_server(log) as (url, _):
        ops = [dt.umbridge_op(url, "decay", config={"delay": 0.3}) for _ in range(4)]
        theta = pt.dvector("theta")
        total = sum(op(theta * (k + 1))[0].sum() for k, op in enumerate(ops))
        f = dt.function([theta], total)
        f(np.array([1.0, 0.1]))
    spans = sorted(tuple(map(float, line.split()[:2])) for line in log.read_text().splitlines())
    assert len(spans) == 4
    # every call started before the first one ended: they ran at once on the server
    assert max(start for start, _ in spans) < min(stop for _, stop in spans)


def test_several_servers_share_the_calls_and_one_going_away_loses_nothing():
    with umbridge_server() as (a, proc_a), umbridge_server() as (b, _):
        op = dt.umbridge_op(urls=[a, b], name="decay")
        theta = pt.dvector("theta")
        f = dt.function([theta], op(theta)[0])
        point = np.array([2.0, 0.5])
        for _ in range(3):
            np.testing.assert_allclose(f(point), 2.0 * np.exp(-0.5 * T))
        proc_a.kill()
        proc_a.wait(30)
        for _ in range(5):  # each call may find the dead one first: it goes on to b
            np.testing.assert_allclose(f(point), 2.0 * np.exp(-0.5 * T))


def test_errors_name_the_model_and_the_next_call_works(server):
    with pytest.raises(dt.UMBridgeError, match=r"serves \['decay', 'plain'\], not 'nope'"):
        dt.umbridge_op(server, "nope")
    with pytest.raises(TypeError, match="expected a url or urls"):
        dt.umbridge_op()
    with pytest.raises(ValueError, match="expected a UM-Bridge server's url"):
        dt.umbridge_op("localhost:4242")
    plain = dt.umbridge_op(server, "plain")
    theta = pt.dvector("theta")
    with pytest.raises(Exception, match=r"plain\.Evaluate"):  # no gradient: named
        pytensor.grad(plain(theta).sum(), theta)
    op = dt.umbridge_op(server, "decay")
    with pytest.raises(TypeError, match=r"expected shape \(2,\)"):
        op(pt.as_tensor(np.ones(3)))
    # the server's own check of the sizes, reached with a target called directly
    with pytest.raises(dt.UMBridgeError, match="InvalidInput: Input parameter 0 has invalid"):
        op.fn(np.ones(3))
    f = dt.function([theta], op(theta)[0])
    np.testing.assert_allclose(f(np.array([2.0, 0.5])), 2.0 * np.exp(-0.5 * T))


def test_a_server_gone_mid_call_is_a_clear_error_and_a_new_one_serves_the_next():
    with umbridge_server() as (url, proc):
        op = dt.umbridge_op(url, "decay", config={"delay": 2.0})
        theta = pt.dvector("theta")
        f = dt.function([theta], op(theta)[0])
        import threading

        threading.Timer(0.5, proc.kill).start()
        with pytest.raises(ConnectionError, match=r"'decay': no server answered /Evaluate"):
            f(np.array([2.0, 0.5]))
    with umbridge_server() as (other, _):
        op = dt.umbridge_op(other, "decay")
        f = dt.function([theta], op(theta)[0])
        np.testing.assert_allclose(f(np.array([2.0, 0.5])), 2.0 * np.exp(-0.5 * T))


def test_the_op_pickles_for_sampler_processes(server):
    op = dt.umbridge_op(server, "decay")
    theta = pt.dvector("theta")
    f = dt.function([theta], pytensor.grad(op(theta)[0].sum(), theta))
    g = cloudpickle.loads(cloudpickle.dumps(f))
    np.testing.assert_allclose(g(np.array([2.0, 0.5])), f(np.array([2.0, 0.5])))


@pytest.mark.slow
def test_nuts_through_an_umbridge_model_draws_what_the_pytensor_model_draws(server):
    import pymc as pm

    op = dt.umbridge_op(server, "decay")
    observed = 2.0 * np.exp(-0.7 * T) + np.random.default_rng(3).normal(0, 0.05, 5)

    def model(through_umbridge: bool):
        with pm.Model() as m:
            y0 = pm.LogNormal("y0", 0.0, 1.0)
            k = pm.LogNormal("k", -0.5, 1.0)
            theta = pt.stack([y0, k])
            mean = op(theta)[0] if through_umbridge else y0 * pt.exp(-k * T)
            pm.Normal("y", mean, 0.05, observed=observed)
        return m

    runs = dict(draws=40, tune=40, chains=1, cores=1, random_seed=5, progressbar=False,
                compute_convergence_checks=False)  # fmt: skip
    with model(True):
        remote = pm.sample(**runs)
    with model(False):
        local = pm.sample(**runs)
    for name in ("y0", "k"):
        np.testing.assert_allclose(
            remote.posterior[name].values, local.posterior[name].values, rtol=1e-6
        )
