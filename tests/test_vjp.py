"""Gradients through vector-valued models: ``ArraysToArraysOp(..., vjp=, jvp=)``.

A simulator returns a vector (a trajectory, observables) and the likelihood is written
in PyMC on top of it; its vector-Jacobian product makes ``pytensor.grad`` (and NUTS) work
through it.  Checked here: against finite differences (``verify_grad``) and analytic
values, ``Rop`` both ways (through the jvp directly, and PyTensor's default road of two
pullbacks), the errors a wrong vjp gets, a remote model's vjp on a process cluster in
the default and the DASK mode, and ``pm.sample`` (NUTS) through it drawing what the same
model written in PyTensor draws.
"""

from __future__ import annotations

import functools

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from _models import Decay
from pytensor.gradient import verify_grad

import dasktensor as dt
from dasktensor._compat import PYTENSOR_3


def rop(f, wrt, points, through_the_jvp: bool):
    """The Jacobian-vector product: ``pushforward`` on PyTensor 3, ``Rop`` before."""
    if PYTENSOR_3:
        from pytensor.gradient import pushforward

        return pushforward(f, wrt, points, use_op_pushforward=through_the_jvp)
    from pytensor.gradient import Rop

    return Rop(f, wrt, points, use_op_rop_implementation=through_the_jvp)


def f(x, y):
    return np.sin(x) * y, x * y.sum()


def f_vjp(x, y, g1, g2):
    return np.cos(x) * y * g1 + g2 * y.sum(), np.sin(x) * g1 + (g2 @ x) * np.ones_like(y)


def f_jvp(x, y, tx, ty):
    return np.cos(x) * y * tx + np.sin(x) * ty, tx * y.sum() + x * ty.sum()


def two_outputs(**kwargs):
    return dt.ArraysToArraysOp(
        f, [pt.dvector, pt.dvector], [pt.dvector, pt.dvector], vjp=f_vjp, **kwargs
    )


def test_the_vjp_gives_gradients_that_match_finite_differences():
    op = two_outputs()
    rng = np.random.default_rng(0)
    points = [rng.normal(size=4), rng.normal(size=4)]
    verify_grad(lambda x, y: op(x, y)[0], points, rng=rng)
    verify_grad(lambda x, y: op(x, y)[1], points, rng=rng)
    verify_grad(lambda x, y: op(x, y)[0] * op(x, y)[1], points, rng=rng)


def test_an_output_the_cost_ignores_gets_a_zero_cotangent():
    seen = []

    def vjp(x, y, g1, g2):
        seen.append((g1.copy(), g2.copy()))
        return f_vjp(x, y, g1, g2)

    op = dt.ArraysToArraysOp(f, [pt.dvector, pt.dvector], [pt.dvector, pt.dvector], vjp=vjp)
    x, y = pt.dvector("x"), pt.dvector("y")
    g = dt.function([x, y], pytensor.grad(op(x, y)[0].sum(), x))
    xv, yv = np.array([0.1, 0.2]), np.array([1.0, 2.0])
    np.testing.assert_allclose(g(xv, yv), np.cos(xv) * yv)
    g1, g2 = seen[-1]
    np.testing.assert_array_equal(g1, [1.0, 1.0])
    np.testing.assert_array_equal(g2, [0.0, 0.0])


@pytest.mark.parametrize("through_the_jvp", [True, False], ids=["op-jvp", "two-pullbacks"])
def test_rop_through_the_jvp_both_roads(through_the_jvp):
    op = two_outputs(jvp=f_jvp)
    x, y, v, w = (pt.dvector(n) for n in "xyvw")
    r = rop(op(x, y)[0], [x, y], [v, w], through_the_jvp)
    jvp = pytensor.function([x, y, v, w], r)
    xv, yv, vv, wv = np.random.default_rng(1).normal(size=(4, 3))
    np.testing.assert_allclose(jvp(xv, yv, vv, wv), np.cos(xv) * yv * vv + np.sin(xv) * wv)


def test_rop_without_a_jvp_says_what_to_give():
    op = two_outputs()
    x, y, v, w = (pt.dvector(n) for n in "xyvw")
    with pytest.raises(NotImplementedError, match="has no jvp: give jvp="):
        rop(op(x, y)[0], [x, y], [v, w], True)


def test_a_bad_vjp_is_told_clearly():
    with pytest.raises(TypeError, match=r"vjp=\.\.\.\) expected a callable, got 3"):
        dt.ArraysToArraysOp(f, [pt.dvector], [pt.dvector], vjp=3)
    with pytest.raises(
        TypeError, match="must be floating point to have a derivative, got input .*int64"
    ):
        dt.ArraysToArraysOp(f, [pt.lvector], [pt.dvector], vjp=f_vjp)
    op = dt.ArraysToArraysOp(np.sin, [pt.dvector], [pt.dvector], vjp=lambda x, g: g[:1])
    x = pt.dvector("x")
    g = dt.function([x], pytensor.grad(op(x).sum(), x))
    with pytest.raises(
        ValueError,
        match=r"arrays-remote-vjp.*shape \(1,\) for input 0, expected the input.s shape \(3,\)",
    ):
        g(np.ones(3))
    assert g.maker.fgraph  # the function is intact: a right-sized call works
    ok = dt.ArraysToArraysOp(np.sin, [pt.dvector], [pt.dvector], vjp=lambda x, g: np.cos(x) * g)
    h = dt.function([x], pytensor.grad(ok(x).sum(), x))
    np.testing.assert_allclose(h(np.ones(3)), np.cos(np.ones(3)))


def decay_data():
    times = np.array([0.0, 0.5, 1.0, 2.0, 4.0])
    observed = 2.0 * np.exp(-0.7 * times) + np.random.default_rng(3).normal(0, 0.05, 5)
    return times, observed


@pytest.mark.parametrize("mode", [None, "DASK"])
def test_a_remote_models_vjp_on_a_cluster_matches_the_analytic_gradient(default_client, mode):
    model = dt.RemoteModel(Decay, name="decay-grad", scheduler=default_client)
    op = model.arrays_to_arrays_op("solve", [pt.dvector], [pt.dvector], vjp="solve_vjp")
    theta = pt.dvector("theta")
    times, observed = decay_data()
    cost = -0.5 * ((op(theta) - observed) ** 2).sum()
    g = pytensor.function([theta], [cost, pytensor.grad(cost, theta)], mode=mode)
    point = np.array([1.5, 0.4])
    value, grad = g(point)
    y = point[0] * np.exp(-point[1] * times)
    r = observed - y
    np.testing.assert_allclose(value, -0.5 * r @ r)
    np.testing.assert_allclose(grad, [r @ (y / point[0]), r @ (-times * y)])
    # the vjp's call reached the replica that solved the same point: it reused it
    assert model.call("reuses") >= 1
    model.close()


def decay_pymc(op=None):
    import pymc as pm

    times, observed = decay_data()
    with pm.Model() as m:
        y0 = pm.LogNormal("y0", 0.0, 1.0)
        k = pm.LogNormal("k", -0.5, 1.0)
        theta = pt.stack([y0, k])
        mean = op(theta) if op is not None else y0 * pt.exp(-k * times)
        pm.Normal("y", mean, 0.05, observed=observed)
    return m


@pytest.mark.slow
def test_nuts_through_a_remote_vjp_draws_what_the_pytensor_model_draws(default_client):
    import pymc as pm

    model = dt.RemoteModel(Decay, name="decay-nuts", scheduler=default_client)
    op = model.arrays_to_arrays_op(
        "solve", [pt.dvector], [pt.dvector], vjp="solve_vjp", jvp="solve_jvp"
    )
    runs = dict(draws=60, tune=60, chains=1, cores=1, random_seed=7, progressbar=False)
    with decay_pymc(op):
        remote = pm.sample(**runs, compute_convergence_checks=False)
    with decay_pymc():
        local = pm.sample(**runs, compute_convergence_checks=False)
    for name in ("y0", "k"):
        a = remote.posterior[name].values
        b = local.posterior[name].values
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert sum(default_client.run(lambda: 0).values()) == 0  # the cluster is intact
    model.close()


def _decay_counts(dask_worker) -> tuple[int, int]:
    """On a worker: (forward solutions kept, vjp calls that reused one) of its Decay."""
    host = dask_worker.plugins.get("dasktensor-models")
    models = [r.model for r in getattr(host, "replicas", {}).values()]
    decays = [m for m in models if type(m).__name__ == "Decay"]
    return sum(len(m.solved) for m in decays), sum(m.reused for m in decays)


def test_the_vjp_goes_to_the_replica_that_solved_its_point(default_client):
    from concurrent.futures import ThreadPoolExecutor

    slow = functools.partial(Decay, delay=0.02)  # concurrent calls spread over the replicas
    model = dt.RemoteModel(slow, name="decay-affinity", scheduler=default_client)
    assert len(model.start()) == 2
    op = model.arrays_to_arrays_op("solve", [pt.dvector], [pt.dvector], vjp="solve_vjp")
    points = [np.array([1.0 + 0.1 * i, 0.5]) for i in range(12)]

    with ThreadPoolExecutor(6) as pool:
        list(pool.map(op.fn, points))
    solved = {a: n for a, (n, _) in default_client.run(_decay_counts).items()}
    assert min(solved.values()) > 0, f"the forward calls did not spread: {solved}"
    for point in points:  # one after another: without affinity, all to one replica
        op.vjp(point, np.ones(5))
    reused = sum(r for _, r in default_client.run(_decay_counts).values())
    assert reused == len(points)
    model.close()
