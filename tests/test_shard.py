"""Sharding analysis (``dasktensor.sharding._analysis``): which graphs split into per-shard partial
values and a combine graph, and that the split computes what the function computes.

The PyMC models are compiled as ``pm.sample(compile_kwargs={"mode": "DASK"})`` compiles
them (``model.logp_dlogp_function(ravel_inputs=True, mode="DASK")``: ravelled inputs,
logp and dlogp), and ``find_shards`` reads that function's rewritten graph.  The partial
and combine graphs are compiled in the default mode and evaluated with 1, 2 and 3 shards;
values and gradients must agree with the default-mode function to round-off.
"""

from __future__ import annotations

import itertools

import numpy as np
import pymc as pm
import pytensor
import pytensor.tensor as pt
import pytest
from _shard_models import (
    ar1_data_model,
    data_model,
    design,
    gp_model,
    hierarchical,
    linear_regression,
    logistic_regression,
)
from pytensor.graph.basic import Constant
from pytensor.graph.fg import FunctionGraph
from pytensor.tensor import blas

import dasktensor  # noqa: F401  (registers the "DASK" mode)
from dasktensor._compat import PYTENSOR_3
from dasktensor.sharding._analysis import NotSharded, ShardPlan, find_shards

N = 20_000
RNG = np.random.default_rng(42)


def run_plan(plan: ShardPlan, values: dict, n_shards: int):
    """The outputs, as an execution side computes them; and the number of rounds."""
    part, comb = plan.partial_graph(), plan.combine_graph()
    shard_fn = pytensor.function(part.inputs, part.outputs, mode="FAST_RUN")
    combine_fn = pytensor.function(comb.inputs, comb.outputs, mode="FAST_RUN")
    data = plan.data_values()
    params = [values[v] for v in plan.param_inputs]
    rest = [values[v] for v in plan.rest_inputs]
    n_out = len(plan.fgraph.outputs)
    guesses = plan.guesses()
    for rounds in (1, 2):
        per_shard = [
            shard_fn(*[d.take(x, rows) for d, x in zip(plan.data, data)], *params, *guesses)
            for rows in plan.slices(n_shards)
        ]
        out = combine_fn(*rest, *plan.reduce(per_shard))
        truth = out[n_out:]
        if all(np.array_equal(t, g) for t, g in zip(truth, guesses)):
            return out[:n_out], rounds
        guesses = truth
    raise AssertionError("the assumptions did not settle in two rounds")


def assert_shards_exactly(plan, values, expected, n_shards=(1, 2, 3)):
    """Sharded outputs agree with ``expected`` to round-off for each number of shards."""
    for k in n_shards:
        out, _ = run_plan(plan, values, k)
        assert len(out) == len(expected)
        for got, want in zip(out, expected):
            np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------- PyMC models


def logp_dlogp(model):
    """(DASK-mode graph, default-mode function, a test point) of a model's logp+dlogp."""
    dask_fn = model.logp_dlogp_function(ravel_inputs=True, mode="DASK")._pytensor_function
    ref_fn = model.logp_dlogp_function(ravel_inputs=True)._pytensor_function
    fgraph = dask_fn.maker.fgraph
    point = np.random.default_rng(1).normal(scale=0.3, size=fgraph.inputs[0].type.shape)
    return fgraph, ref_fn, point


def check_model(model, **kwargs):
    fgraph, ref_fn, point = logp_dlogp(model)
    plan = find_shards(fgraph, **kwargs)
    assert isinstance(plan, ShardPlan), plan
    values = {v: point if i == 0 else v.get_value() for i, v in enumerate(fgraph.inputs)}
    assert_shards_exactly(plan, values, ref_fn(point))
    return plan


def reason_of(model, **kwargs):
    fgraph, _, _ = logp_dlogp(model)
    result = find_shards(fgraph, **kwargs)
    assert isinstance(result, NotSharded) and not result
    return result.reason


def test_linear_regression_shards():
    plan = check_model(linear_regression(N, RNG))
    assert plan.n_rows == N and not plan.assumptions
    # y, X and the X.T the rewrites fold into a constant of its own (row axis 1)
    assert sorted(d.axis for d in plan.data) == [0, 0, 1]
    assert {d.variable.type.ndim for d in plan.data} == {1, 2}
    assert all(p.kind == "add" for p in plan.partials)
    # three scalar sums (logp, and two for alpha's and sigma's gradients) and X.T @ g
    shapes = sorted(int(np.prod(p.variable.type.shape)) for p in plan.partials)
    assert shapes == [1, 1, 1, 3]


def test_logistic_regression_shards_with_the_parameter_check_as_an_assumption():
    plan = check_model(logistic_regression(N, RNG))
    # Bernoulli checks 0 <= p <= 1 over all rows, and uses that flag row by row
    assert len(plan.assumptions) == 1
    assert sorted(p.kind for p in plan.partials) == ["add", "add", "and", "and"]


def test_hierarchical_model_with_group_index_shards():
    n_groups = 7
    plan = check_model(hierarchical(N, RNG, groups=n_groups))
    # the gradient of a[group] is a scatter-add by group into a's prior gradient (-a):
    # shards add into zeros, and the combine graph adds -a once
    [scatter] = [p for p in plan.partials if p.offset]
    assert scatter.variable.type.shape == (n_groups,)


def test_data_model_follows_set_data():
    model = data_model(N, RNG)
    fgraph, ref_fn, point = logp_dlogp(model)
    plan = find_shards(fgraph)
    assert isinstance(plan, ShardPlan), plan
    assert sorted(d.name for d in plan.data) == ["X", "y_obs"]
    X2, y2 = design(N, rng=RNG)
    pm.set_data({"X": X2, "y_obs": y2}, model=model)
    values = {v: point if i == 0 else v.get_value() for i, v in enumerate(fgraph.inputs)}
    by_name = dict(zip([d.name for d in plan.data], plan.data_values()))
    np.testing.assert_array_equal(by_name["X"], X2)
    assert_shards_exactly(plan, values, ref_fn(point))
    # data of another length: this plan no longer applies, a new one does
    pm.set_data({"X": X2[:-10], "y_obs": y2[:-10]}, model=model)
    with pytest.raises(ValueError, match="find the shards again"):
        plan.data_values()
    assert find_shards(fgraph).n_rows == N - 10


def test_ar1_with_numpy_data_shards_because_the_shifts_are_constants():
    y = np.cumsum(RNG.normal(size=N + 1)) * 0.1
    with pm.Model() as model:
        rho = pm.Normal("rho")
        sigma = pm.HalfNormal("sigma")
        pm.Normal("y_t", rho * y[:-1], sigma, observed=y[1:])
    # PyMC hands y[:-1] and y[1:] to the graph as two constants of N rows: row i of
    # one is paired with row i of the other, which is exactly a sum over rows
    plan = check_model(model)
    assert len(plan.data) == 2 and plan.n_rows == N


def test_ar1_shifting_rows_in_the_graph_is_not_sharded():
    reason = reason_of(ar1_data_model(N, RNG))
    assert "Subtensor" in reason and "'y_series'" in reason and "shifts rows" in reason


def test_gaussian_process_over_rows_is_not_sharded():
    # distances of constant inputs are folded into an (N, N) constant; y reaches the
    # triangular solve of the MvNormal density
    reason = reason_of(gp_model(40, RNG), min_rows=10)
    assert "Solve" in reason and "MvNormal" in reason
    # with x as data, already the outer difference x[:, None] - x[None, :] mixes rows
    reason = reason_of(gp_model(40, RNG, data=True), min_rows=10)
    assert "mixes rows" in reason and "'x'" in reason


def test_shardable_likelihood_plus_a_cumsum_potential_is_not_sharded():
    X, y = design(N, rng=RNG)
    with pm.Model() as model:
        beta = pm.Normal("beta", 0, 1, shape=3)
        sigma = pm.HalfNormal("sigma")
        mu = X @ beta
        pm.Normal("y", mu, sigma, observed=y)
        pm.Potential("drift", -1e-3 * pt.sum(pt.cumsum(y - mu) ** 2))
    assert "accumulates along the rows" in reason_of(model)


def test_small_model_is_not_sharded():
    X, y = design(500, rng=RNG)
    with pm.Model() as model:
        beta = pm.Normal("beta", 0, 1, shape=3)
        pm.Normal("y", X @ beta, 1.0, observed=y)
    assert reason_of(model) == "no data input with >= 10000 rows"
    assert reason_of(model, min_rows=1000) == "no data input with >= 1000 rows"
    assert check_model(model, min_rows=100).n_rows == 500


def test_the_work_estimate_grows_with_rows_and_columns():
    def work(n, k):
        X, y = design(n, k, RNG)
        with pm.Model() as model:
            beta = pm.Normal("beta", 0, 1, shape=k)
            sigma = pm.HalfNormal("sigma")
            pm.Normal("y", X @ beta, sigma, observed=y)
        return check_model(model, min_rows=100).work

    base = work(1000, 3)
    assert work(2000, 3) == 2 * base
    # X @ beta and X.T @ g: 2 operations per element of X each, and 2 more columns of X
    assert work(1000, 5) - base == 2 * 2 * 2 * 1000
    assert base > 2 * 2 * 3 * 1000  # the elementwise terms count too


# ---------------------------------------------------------------- rules, one by one

n = 12
Y = pt.constant(np.linspace(-1.0, 2.0, n), name="y")
X = pt.constant(np.arange(3.0 * n).reshape(n, 3) / n, name="X")
IDX = pt.constant(np.arange(n) % 4, name="idx")
mu = pt.dscalar("mu")
b = pt.dvector("b")
a = pt.dvector("a")


def plan_of(inputs, outputs, rewrite=False):
    """find_shards of a small graph: as built, or as the default mode rewrites it."""
    if rewrite:
        fgraph = pytensor.function(inputs, outputs, mode="FAST_RUN").maker.fgraph
    else:
        fgraph = FunctionGraph(inputs, outputs, clone=True)
    return find_shards(fgraph, min_rows=10), fgraph


def check(inputs, outputs, values, rewrite=False):
    """The graph shards, and the shards compute what the graph computes."""
    plan, fgraph = plan_of(inputs, outputs, rewrite)
    assert isinstance(plan, ShardPlan), plan
    expected = pytensor.function(inputs, outputs, mode="FAST_RUN")(*values)
    assert_shards_exactly(plan, dict(zip(fgraph.inputs, values)), expected)
    return plan


def rejected(inputs, outputs, rewrite=False):
    plan, _ = plan_of(inputs, outputs, rewrite)
    assert isinstance(plan, NotSharded), plan
    return plan.reason


B = np.array([0.5, -1.0, 2.0])


@pytest.mark.parametrize("rewrite", [False, True])
def test_elemwise_with_broadcast_parameters(rewrite):
    plan = check([mu, b], [((Y - mu) ** 2 * b[0]).sum()], [0.3, B], rewrite)
    assert [d.name for d in plan.data] == ["y"]


def test_elemwise_with_a_full_length_parameter_is_rejected():
    v = pt.dvector("v")
    assert "does not broadcast along the row axis" in rejected([v], [(Y * v).sum()])


def test_elemwise_combining_two_row_axes_is_rejected():
    assert "mixes rows" in rejected([mu], [(Y[:, None] - Y[None, :] * mu).sum()])


def test_dimshuffle_moves_the_row_axis():
    # X.T has its rows on axis 1; summing its first axis leaves a row-aligned vector
    check([b], [((X.T * b[:, None]).sum(axis=0) ** 2).sum()], [B])
    check([mu], [(Y[:, None] * mu).sum()], [0.7])


def test_reduction_over_another_axis_keeps_the_rows():
    check([mu], [((X.sum(axis=1) - mu) ** 2).sum(axis=0)], [0.2])
    assert "reaches output 0 without a sum" in rejected([mu], [X.sum(axis=1) * mu])


def test_max_and_all_over_rows_combine_exactly():
    plan = check([mu], [pt.max(Y * mu), pt.all(Y * mu > -3.0), pt.prod(Y + mu)], [1.5])
    assert sorted(p.kind for p in plan.partials) == ["and", "max", "mul"]


def test_argmax_over_rows_is_rejected():
    assert "may mix rows" in rejected([mu], [pt.argmax(Y * mu)])


def test_sort_and_cumsum_over_rows_are_rejected():
    assert "reorders the rows" in rejected([mu], [pt.sort(Y * mu)[-3:].sum()])
    assert "accumulates along the rows" in rejected([mu], [pt.cumsum(Y * mu).sum()])


@pytest.mark.parametrize("rewrite", [False, True])
def test_products_keep_or_contract_the_rows(rewrite):
    r = X @ b - Y
    plan = check([b], [(r**2).sum(), pytensor.grad((r**2).sum(), b)], [B], rewrite)
    assert max(int(np.prod(p.variable.type.shape or (1,))) for p in plan.partials) == 3


def test_products_mixing_rows_are_rejected():
    assert "mixes rows" in rejected([mu], [(pt.dot(X, X.T) * mu).sum()])
    v = pt.dvector("v")  # a parameter of the length of the rows
    assert "mixes rows" in rejected([v], [X.T @ v])


def test_gemv_and_gemm_add_their_z_term_once():
    one, two = (pt.constant(np.float64(c)) for c in (1.0, 2.0))
    g = Y * b[0]  # row-aligned
    contraction = blas.Gemv(inplace=False)(b, one, X.T, g, two)  # 2 b + X.T @ g
    keep_rows = blas.Gemv(inplace=False)(Y, two, X, b, one)  # y + 2 X @ b
    M = pt.dmatrix("M")
    gemm = blas.Gemm(inplace=False)(M, two, X.T, X * b, one)  # M + 2 X.T @ (X * b)
    plan = check([b, M], [contraction, keep_rows.sum(), gemm], [B, np.ones((3, 3))])
    assert sorted(p.offset for p in plan.partials) == [False, True, True]
    # with beta == 0, z is not read: a row-aligned product may write into any buffer
    zero = pt.constant(np.float64(0.0))
    empty = pt.empty((n,), dtype="float64")
    check([b], [(blas.Gemv(inplace=False)(empty, one, X, b, zero) ** 2).sum()], [B])


def test_gather_and_scatter_by_row_index():
    terms = (a[IDX] - Y) ** 2
    plan = check([a], [terms.sum(), pytensor.grad(terms.sum(), a)], [np.arange(4.0)])
    assert not any(p.offset for p in plan.partials)  # the gradient scatters into zeros
    # a scatter into a target that is not zero adds the target once
    plan = check([a], [pt.inc_subtensor(a[IDX], Y)], [np.arange(4.0)])
    assert [p.offset for p in plan.partials] == [True]
    # a 2-d gather by a row index and a slice
    A = pt.dmatrix("A")
    check([A], [(A[IDX, :2] * X[:, :2]).sum()], [np.arange(12.0).reshape(4, 3)])


def test_indexing_rows_and_setting_by_row_index_are_rejected():
    assert "shifts rows" in rejected([mu], [(Y[1:] - Y[:-1] * mu).sum()])
    i = pt.lvector("i")
    assert "indexes a row-aligned value" in rejected([i], [Y[i].sum()])
    assert "sets values by row index" in rejected([a], [pt.set_subtensor(a[IDX], Y)])


def test_rows_only_in_the_increment_of_a_scatter_are_rejected():
    i = pt.lvector("i")
    assert "uses a row-aligned value (input 1" in rejected([a, i], [pt.inc_subtensor(a[i], Y)])


def test_the_row_count_falls_back_to_another_length():
    Z = pt.constant(np.linspace(0.0, 1.0, 15), name="z")
    # 15 rows are tried first (the longer axis) and rejected; with 12 rows, z is not data
    # and its cumsum is computed once, after the sums
    plan = check([mu], [(Y * mu).sum() + pt.cumsum(Z * mu).sum()], [0.5])
    assert plan.n_rows == n and [d.name for d in plan.data] == ["y"]
    # when no length works, the reason is the first length's
    reason = rejected([mu], [pt.cumsum(Y * mu).sum() + pt.cumsum(Z * mu).sum()])
    assert "from 'z'" in reason


def test_length_of_the_rows_is_the_total_length():
    y = pytensor.shared(np.linspace(0.0, 1.0, n), name="y_shared")
    # the mean over rows divides by y.shape[0]: Shape_i{0}(y) after rewriting, which a
    # shard must read as n, not as its own length
    mean = (y - mu).sum() / y.shape[0]
    fgraph = pytensor.function([mu], mean, mode="FAST_RUN").maker.fgraph
    assert any("Shape_i" in str(node.op) for node in fgraph.apply_nodes)
    plan = find_shards(fgraph, min_rows=10)
    assert isinstance(plan, ShardPlan), plan
    out, _ = run_plan(plan, {fgraph.inputs[0]: 0.25}, 3)
    np.testing.assert_allclose(out[0], np.linspace(0, 1, n).mean() - 0.25, rtol=1e-12)


def test_blockwise_over_rows_and_over_core_dimensions():
    mats = pt.constant(np.eye(2) * (1 + np.arange(n))[:, None, None], name="mats")
    rhs = pt.constant(np.ones((n, 2)), name="rhs")
    # one small system per row: the rows are a batch axis
    check([mu], [pt.linalg.solve(mats * mu, rhs, b_ndim=1).sum()], [2.0])
    # one system over all rows
    S = pt.dmatrix("S")
    assert "MvNormal" in rejected([S], [pt.linalg.solve(S, Y, b_ndim=1).sum()])


def test_a_flag_over_all_rows_is_an_assumption_checked_after_the_sum():
    ok = pt.all(Y * mu > -2.0)  # a total, used row by row below
    out = pt.switch(ok, (Y * mu) ** 2, 0.0).sum()
    plan, fgraph = plan_of([mu], [out])
    assert isinstance(plan, ShardPlan) and len(plan.assumptions) == 1
    f = pytensor.function([mu], out)
    for value, rounds in ((1.0, 1), (5.0, 2)):  # the guess (true) holds, then it fails
        got, used = run_plan(plan, {fgraph.inputs[0]: value}, 3)
        assert used == rounds
        np.testing.assert_allclose(got[0], f(value), rtol=1e-12)


def test_a_float_total_used_row_by_row_is_rejected():
    centred = Y * mu - (Y * mu).mean()
    assert "a total over rows together" in rejected([mu], [(centred**2).sum()])


def test_data_as_an_output_or_unused_is_handled():
    assert "reaches output 1" in rejected([mu], [(Y * mu).sum(), Y])
    small = pt.constant(np.ones(3))
    assert rejected([mu], [(small * mu).sum()]) == "no data input with >= 10 rows"


def test_slices_cover_the_rows_in_nearly_equal_contiguous_parts():
    plan, _ = plan_of([mu], [(Y * mu).sum()])
    for k in range(1, n + 1):
        parts = plan.slices(k)
        sizes = [s.stop - s.start for s in parts]
        assert parts[0].start == 0 and parts[-1].stop == n and max(sizes) - min(sizes) <= 1
        assert all(p.stop == q.start for p, q in itertools.pairwise(parts))
    with pytest.raises(ValueError):
        plan.slices(n + 1)


def test_partial_and_combine_graphs_have_documented_inputs():
    plan, fgraph = plan_of([mu, b], [((X @ b - Y) ** 2).sum() + mu**2])
    part, comb = plan.partial_graph(), plan.combine_graph()
    assert [v.type.shape for v in part.inputs[: len(plan.data)]] in (
        [(None,), (None, 3)],
        [(None, 3), (None,)],
    )
    assert list(plan.param_inputs) == [fgraph.inputs[1]]  # mu is only used after the sum
    assert list(plan.rest_inputs) == [fgraph.inputs[0]]
    assert len(comb.inputs) == 1 + len(plan.partials)
    assert len(comb.outputs) == 1 and len(part.outputs) == len(plan.partials)
    # the graphs are fresh copies (sharing constants only): the plan's graph is left alone
    for graph in (part, comb):
        shared = set(graph.variables) & set(fgraph.variables)
        assert all(isinstance(v, Constant) for v in shared)


def test_backend_fused_ops_are_inlined_on_pytensor_3():
    plan, fgraph = plan_of([b], [((X @ b - Y) ** 2).sum()], rewrite=True)
    fused = [n for n in fgraph.apply_nodes if "Fused" in type(n.op).__name__]
    assert bool(fused) == PYTENSOR_3
    assert isinstance(plan, ShardPlan)
