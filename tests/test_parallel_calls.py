"""Outside the DASK mode, independent model calls run concurrently in one node."""

from __future__ import annotations

import numpy as np
import pymc as pm
import pytensor
import pytensor.tensor as pt
import pytest
from _ops import failing_logp, make_rendezvous

import dasktensor as dt
from dasktensor.ops import _callable as dt_callable_ops


def parallel_nodes(f):
    return [n for n in f.maker.fgraph.apply_nodes if isinstance(n.op, dt.ParallelCallsOp)]


def test_independent_calls_run_concurrently_in_the_default_mode():
    fn = make_rendezvous(2)  # sequential calls would break the barrier
    a = dt.LogpGradOp(fn, [pt.dvector], name="model-a")
    b = dt.LogpGradOp(fn, [pt.dvector], name="model-b")
    x = pt.dvector("x")
    logp = a(x)[0] + b(2 * x)[0]
    f = pytensor.function([x], [logp, pytensor.grad(logp, x)])
    assert len(parallel_nodes(f)) == 1
    lp, g = f(np.ones(2))
    assert float(lp) == pytest.approx(-0.5 * 2 - 0.5 * 8)
    np.testing.assert_allclose(g, -np.ones(2) - 2 * 2 * np.ones(2))


def test_dependent_calls_stay_apart():
    square = dt.ArraysToArraysOp(np.square, [pt.dvector], [pt.dvector])
    x = pt.dvector("x")
    f = pytensor.function([x], square(square(x) + 1))
    assert parallel_nodes(f) == []
    np.testing.assert_allclose(f(np.array([1.0, 2.0])), [4.0, 25.0])


def test_an_exception_in_one_call_is_raised_with_its_type_and_the_next_call_works():
    op = dt.LogpOp(failing_logp, [pt.dvector])
    x = pt.dvector("x")
    f = pytensor.function([x], op(x) + op(x + 1))
    assert len(parallel_nodes(f)) == 1
    with pytest.raises(FloatingPointError, match="negative input refused"):
        f(np.array([-5.0]))
    assert float(f(np.array([1.0]))) == 3.0


def test_the_dask_mode_keeps_one_task_per_call():
    a = dt.LogpOp(failing_logp, [pt.dvector], name="model-a")
    x = pt.dvector("x")
    f = dt.function([x], a(x) + a(2 * x), scheduler="sync")
    assert parallel_nodes(f) == []
    assert [t.name for t in f.plan.tasks if t.kind == "heavy"] == ["model-a", "model-a"]


@pytest.mark.slow
def test_pm_sample_in_the_default_mode_runs_independent_terms_concurrently():
    def draws(fn, mode):
        terms = [dt.LogpGradOp(fn, [pt.dvector], name=f"term-{k}") for k in "ab"]
        with pm.Model():
            mu = pm.Normal("mu", shape=2)
            pm.Potential("a", terms[0](mu)[0])
            pm.Potential("b", terms[1](mu + 1)[0])
            idata = pm.sample(
                draws=20,
                tune=20,
                chains=1,
                random_seed=3,
                progressbar=False,
                compute_convergence_checks=False,
                nuts_sampler="pymc",
                compile_kwargs={} if mode is None else {"mode": mode},
            )
        return idata.posterior["mu"].values

    # the merged node: a barrier of 2 breaks unless both terms run at once
    merged = draws(make_rendezvous(2), None)
    # the same model without the rewrite, one call at a time
    sequential = pytensor.compile.mode.get_mode("FAST_RUN").excluding("dasktensor_parallel_calls")
    np.testing.assert_array_equal(merged, draws(make_rendezvous(1), sequential))


def test_the_default_mode_runs_callable_ops_without_warnings():
    import warnings

    op = dt.LogpOp(failing_logp, [pt.dvector])
    x = pt.dvector("x")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # on PyTensor 3: no "Numba will use object mode"
        # a socket of an earlier test's cluster, collected meanwhile, is not this test's
        warnings.simplefilter("ignore", ResourceWarning)
        f = pytensor.function([x], op(x) + op(2 * x))
        assert float(f(np.ones(2))) == 6.0


class Recorded(dt_callable_ops.RemoteCallTarget):
    """A remote-like target that records how its calls were made."""

    batches: list = []

    def __init__(self, scale: float, batchable: bool = True):
        self.scale = scale
        self._batchable = batchable

    @property
    def batchable(self) -> bool:
        return self._batchable

    def __call__(self, x):
        Recorded.batches.append(1)
        return -0.5 * self.scale * float(x @ x), -self.scale * x

    @classmethod
    def call_together(cls, calls):
        cls.batches.append(len(calls))
        return [(-0.5 * t.scale * float(x @ x), -t.scale * x) for t, (x,) in calls]


@pytest.mark.parametrize("batchable, batches", [(True, [2]), (False, [1, 1])])
def test_merged_calls_use_the_remote_call_target_protocol(batchable, batches):
    """Batchable targets go to their class's call_together, results to store_result."""
    Recorded.batches = []
    a, b = (dt.LogpGradOp(Recorded(k, batchable), [pt.dvector]) for k in (1.0, 2.0))
    assert a.dasktensor_remote and (a.batch_target is not None) == batchable
    x = pt.dvector("x")
    logp = a(x)[0] + b(x)[0]
    f = pytensor.function([x], [logp, pytensor.grad(logp, x)])
    assert len(parallel_nodes(f)) == 1
    lp, g = f(np.ones(2))
    assert float(lp) == pytest.approx(-0.5 * 2 - 0.5 * 2 * 2)
    np.testing.assert_allclose(g, -3 * np.ones(2))
    assert Recorded.batches == batches
