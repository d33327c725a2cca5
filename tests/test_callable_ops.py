"""Ops wrapping Python callables: checks, gradients, one call per logp+dlogp, clusters."""

from __future__ import annotations

import functools
import os

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from _ops import (
    CALLS,
    fails_first_time,
    normal_logp_and_grad,
    slow_unless_positive,
    strided_sum_and_first,
)
from pytensor.gradient import verify_grad

import dasktensor as dt

normal = dt.LogpGradOp(normal_logp_and_grad, [pt.dvector, pt.dscalar], name="normal-remote")


def test_gradient_matches_finite_differences():
    rng = np.random.default_rng(0)
    verify_grad(lambda x, mu: normal(x, mu)[0], [rng.normal(size=4), np.array(0.3)], rng=rng)


@pytest.mark.parametrize("mode", ["DASK", None])
def test_one_call_per_logp_and_dlogp_evaluation(mode):
    x, mu = pt.dvector("x"), pt.dscalar("mu")
    logp = normal(x, mu)[0]
    f = pytensor.function([x, mu], [logp, *pytensor.grad(logp, [x, mu])], mode=mode)
    CALLS["normal"] = 0
    lp, gx, gmu = f(np.array([1.0, 2.0]), 0.5)
    assert CALLS["normal"] == 1
    assert lp == pytest.approx(-0.5 * (0.25 + 2.25))
    np.testing.assert_allclose(gx, [-0.5, -1.5])
    assert float(gmu) == pytest.approx(2.0)


def test_inputs_go_through_as_tensor_variable():
    square = dt.ArraysToArraysOp(np.square, [pt.dscalar], [pt.dscalar])
    f = dt.function([], square(2))  # a Python int becomes a constant, cast to float64
    assert float(f()) == 4.0


def test_wrong_arity_dtype_and_shape_fail_at_graph_build():
    op = dt.ArraysToArraysOp(np.cumsum, [pt.TensorType("float64", shape=(3,))], [pt.dvector])
    with pytest.raises(TypeError, match=r"expected 1 inputs, got 2"):
        op(pt.dvector(), pt.dvector())
    with pytest.raises(TypeError, match=r"input 0 expected .*1 dimensions.*got .*2 dimensions"):
        op(pt.dmatrix())
    with pytest.raises(TypeError, match=r"input 0 expected dtype float64, got complex128"):
        op(pt.zvector())
    with pytest.raises(TypeError, match=r"input 0 expected shape \(3,\), got \(4,\)"):
        op(pt.TensorType("float64", shape=(4,))())


def test_wrong_result_shape_fails_at_call_time_naming_the_op():
    op = dt.ArraysToArraysOp(
        lambda x: np.zeros(5), [pt.dvector], [pt.TensorType("float64", shape=(3,))]
    )
    f = dt.function([x := pt.dvector("x")], op(x), scheduler="sync")
    with pytest.raises(ValueError, match=r"ArraysToArraysOp\{<lambda>\} output 0.*shape \(5,\)"):
        f(np.ones(3))


@pytest.mark.parametrize("wrap", [list, tuple])
def test_one_output_returned_in_a_list_is_told_what_to_return(wrap):
    op = dt.ArraysToArraysOp(lambda x: wrap([2 * x]), [pt.dvector], [pt.dvector])
    f = dt.function([x := pt.dvector("x")], op(x), scheduler="sync")
    kind = wrap.__name__
    with pytest.raises(ValueError, match=rf"shape \(1, 4\).*wrapped in a {kind} of one: "):
        f(np.ones(4))
    with pytest.raises(ValueError, match=r"return the array itself \(`return out`, not"):
        f(np.ones(4))
    # a one-element vector is an answer in its own right: no hint where it fits
    fine = dt.ArraysToArraysOp(lambda x: [x.sum()], [pt.dvector], [pt.dvector])
    assert dt.function([x], fine(x), scheduler="sync")(np.ones(4)).tolist() == [4.0]


def test_props_make_equal_ops_merge_and_options_distinguish_them():
    a = dt.LogpOp(np.sum, [pt.dvector])
    assert a == dt.LogpOp(np.sum, [pt.dvector]) and hash(a) == hash(
        dt.LogpOp(np.sum, [pt.dvector])
    )
    assert a != dt.LogpOp(np.sum, [pt.dvector], retries=1)
    assert a != dt.LogpOp(np.sum, [pt.dvector], name="other")


def test_annotations_and_names_reach_the_plan():
    @dt.logp_op(itypes=[pt.dvector], resources={"GPU": 1}, retries=2, name="surrogate")
    def surrogate(x):
        return float(np.sum(x**2))

    f = dt.function([x := pt.dvector("x")], surrogate(x) + 1)
    (task,) = [t for t in f.plan.tasks if t.kind == "heavy"]
    assert task.name == "surrogate"
    assert task.placement == dt.Placement(resources={"GPU": 1}, retries=2)


def test_logp_grad_op_refuses_integer_inputs_and_second_derivatives():
    with pytest.raises(TypeError, match="must be floating point"):
        dt.LogpGradOp(normal_logp_and_grad, [pt.lvector, pt.dscalar])
    x, mu = pt.dvector("x"), pt.dscalar("mu")
    g = pytensor.grad(normal(x, mu)[0], mu)
    with pytest.raises(NotImplementedError, match="first derivatives only"):
        pytensor.grad(g, mu)


def test_strided_and_non_contiguous_inputs_on_a_cluster(client):
    op = dt.ArraysToArraysOp(strided_sum_and_first, [pt.dmatrix], [pt.dvector])
    m = pt.dmatrix("m")
    f = dt.function([m], op(m), scheduler=client)
    base = np.arange(24.0).reshape(4, 6)
    for value in (base[:, ::2], base.T, np.asfortranarray(base)):
        np.testing.assert_allclose(f(value), [value.sum(), value[0, -1]])


def test_independent_calls_run_concurrently_on_the_cluster(client):
    x, mu = pt.dvector("x"), pt.dscalar("mu")
    terms = [normal(x + k, mu)[0] for k in range(2)]
    total = sum(terms)
    f = dt.function([x, mu], [total, *pytensor.grad(total, [x, mu])], scheduler=client)
    heavy = [t for t in f.plan.tasks if t.kind == "heavy"]
    assert len(heavy) == 2 and not any(set(t.deps) & {h.index for h in heavy} for t in heavy)
    lp, gx, gmu = f(np.zeros(3), 0.0)
    assert lp == pytest.approx(-0.5 * 3 * (0 + 1))
    np.testing.assert_allclose(gx, -(np.zeros(3) + np.ones(3)))


def test_a_call_that_does_not_return_in_time_fails_and_the_next_one_works():
    op = dt.LogpOp(slow_unless_positive, [pt.dvector], timeout=0.5)
    f = dt.function([x := pt.dvector("x")], op(x) + 1, scheduler="sync")
    with pytest.raises(TimeoutError, match=r"did not return within 0.5 s"):
        f(np.array([-1.0]))
    assert float(f(np.array([2.0]))) == 3.0
    with pytest.raises(TypeError, match="number of seconds > 0"):
        dt.LogpOp(slow_unless_positive, [pt.dvector], timeout=0)


def test_a_transient_failure_succeeds_with_retries_on_the_cluster(client, tmp_path):
    marker = str(tmp_path / "failed-once")
    op = dt.LogpOp(functools.partial(fails_first_time, marker=marker), [pt.dvector], retries=1)
    f = dt.function([x := pt.dvector("x")], op(x) * 2, scheduler=client)
    assert float(f(np.array([1.0, 2.0]))) == 6.0
    assert os.path.exists(marker)  # the first attempt did fail
    no_retry = dt.LogpOp(
        functools.partial(fails_first_time, marker=str(tmp_path / "again")), [pt.dvector]
    )
    g = dt.function([x], no_retry(x), scheduler=client)
    with pytest.raises(ConnectionError, match="transient failure"):
        g(np.array([1.0]))


def test_an_unpickled_function_runs_its_callable_ops_without_numbas_warning(tmp_path):
    """A sampler's or a worker's copy of a function is unpickled, not built: its callable
    Ops are registered with Numba's object mode there too (PyTensor 3 would warn once per
    process that it runs them in object mode, e.g. on every worker of ``dt.sample``)."""
    import pickle
    import subprocess
    import sys

    x, mu = pt.dvector("x"), pt.dscalar("mu")
    logp = dt.LogpGradOp(normal_logp_and_grad, [pt.dvector, pt.dscalar], name="normal")(x, mu)[0]
    f = pytensor.function([x, mu], logp)
    (tmp_path / "f.pkl").write_bytes(pickle.dumps(f))
    code = (
        "import pickle, warnings, numpy as np\n"
        "warnings.simplefilter('error')\n"
        f"with open({str(tmp_path / 'f.pkl')!r}, 'rb') as fh:\n"
        "    f = pickle.load(fh)\n"
        "print(float(f(np.ones(2), 0.0)))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout) == -1.0
