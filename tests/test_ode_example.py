"""The worked example of ``docs/user-guide/umbridge.md`` (``docs/examples/lotka_volterra.py``):
an ODE returning a trajectory, with its vjp, sampled with NUTS through a remote model and
through ``dt.serve_umbridge`` + ``dt.umbridge_op``, against the same model in PyTensor."""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from pytensor.gradient import verify_grad

import dasktensor as dt

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "docs" / "examples"))
import lotka_volterra as lv

pytest.importorskip("umbridge")


def test_the_solver_matches_pytensor_and_its_vjp_matches_finite_differences():
    theta = lv.TRUE * np.array([1.1, 0.9, 1.05, 0.95])
    t = pt.dvector("t")
    in_pytensor = pytensor.function([t], lv.lotka_volterra_pt(t))
    np.testing.assert_allclose(lv.simulate(theta)[0], in_pytensor(theta), rtol=1e-12)
    model = lv.LotkaVolterra()
    op = dt.ArraysToArraysOp(model.solve, [pt.dvector], [pt.dvector], vjp=model.solve_vjp)
    verify_grad(lambda x: op(x)[0], [theta], rng=np.random.default_rng(0))
    # the vjp of a point solved before comes from the kept Jacobian, the same numbers
    g = np.linspace(-1.0, 1.0, 2 * len(lv.TIMES))
    kept = model.solve_vjp(theta, g)
    assert theta.tobytes() in model.jacobians
    np.testing.assert_array_equal(kept, lv.LotkaVolterra().solve_vjp(theta, g))


@pytest.mark.slow
def test_nuts_through_the_remote_model_and_umbridge_draws_what_pytensor_draws(default_client):
    """Through the remote model and through the served one, NUTS draws what the PyTensor
    model draws, to round-off: the log-density and its gradient agree to round-off, and
    so do the draws of a short run (NUTS's long trajectories amplify round-off as a run
    goes on: benchmark P23 measures how fast)."""
    import pymc as pm

    model = dt.RemoteModel(lv.LotkaVolterra, name="lotka-volterra", scheduler=default_client)
    solve = model.arrays_to_arrays_op("solve", [pt.dvector], [pt.dvector], vjp="solve_vjp")
    runs = {"draws": 8, "tune": 8, "chains": 1, "cores": 1, "random_seed": 3,
            "progressbar": False, "compute_convergence_checks": False,
            "discard_tuned_samples": False}  # fmt: skip
    with dt.serve_umbridge(model, port=0) as server:
        served_op = dt.umbridge_op(server.url, "lotka-volterra")
        models, draws = {}, {}
        for name, op in (("pytensor", None), ("remote", solve), ("served", served_op)):
            with lv.pymc_model(op) as models[name]:
                draws[name] = pm.sample(**runs)
        ref = draws["pytensor"]
        points = [
            {"theta_log__": np.log(t), "sigma_log__": np.log(s)}
            for t, s in zip(
                ref.posterior["theta"].values[0], ref.posterior["sigma"].values[0], strict=True
            )
        ]
        fns = {name: m.compile_fn([m.logp(), m.dlogp()]) for name, m in models.items()}
        values = {name: [fn(p) for p in points] for name, fn in fns.items()}
    model.close()
    for name in ("remote", "served"):
        for (want, want_grad), (got, got_grad) in zip(
            values["pytensor"], values[name], strict=True
        ):
            np.testing.assert_allclose(got, want, rtol=1e-10)
            np.testing.assert_allclose(got_grad, want_grad, rtol=1e-8, atol=1e-8)
        for group in ("warmup_posterior", "posterior"):
            np.testing.assert_allclose(draws[name][group]["theta"].values,
                                       ref[group]["theta"].values, rtol=1e-8)  # fmt: skip
    assert np.ptp(ref.posterior["theta"].values[0, :, 0]) > 0  # it moved
