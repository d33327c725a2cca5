"""A corpus of PyTensor graphs, each checked against PyTensor's default mode.

Every graph runs through :func:`oracle.assert_matches_default` under seven execution
settings (the ``run`` fixture):

* ``threads`` / ``sync`` / ``client``: the default planner threshold, with Dask's threaded
  scheduler, the synchronous one, and a distributed Client of worker processes (cluster
  tasks submitted as Dask tasks, ``dasktensor.execute.path: tasks``);
* ``channel``: the same Client, cluster tasks called as resident stages through the
  remote-call channel (``dasktensor.execute.path: channel``);
* ``heavy0-threads`` / ``heavy0-client`` / ``heavy0-channel``: ``heavy_flops=0``, so that
  every node whose static shapes are known is "costly" and the planner cuts the graph into
  many tasks (partitioning, in-place Ops across task boundaries, multi-output tasks).

Graphs use static shapes (the cost rule needs them) and tiny arrays (the Numba line
compiles every stage).  ``IdentHeavy`` is a copying identity marked heavy: inserted in the
middle of a graph it forces a multi-task plan under every setting.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import dask
import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from oracle import assert_matches_default
from pytensor import ifelse  # pytensor.ifelse.ifelse is deprecated on PyTensor 3
from pytensor.compile.builders import OpFromGraph
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op
from pytensor.tensor.random.op import RandomVariable

PYTENSOR_3 = int(pytensor.__version__.split(".")[0]) >= 3

# ----------------------------------------------------------------------------- heavy Ops


class IdentHeavy(Op):
    """Identity that copies its input, planned as a task of its own."""

    __props__ = ()
    dasktensor_heavy = True
    dasktensor_name = "ident-heavy"

    def make_node(self, x):
        x = pt.as_tensor_variable(x)
        return Apply(self, [x], [x.type()])

    def perform(self, node, inputs, output_storage):
        output_storage[0][0] = np.array(inputs[0], copy=True)

    if PYTENSOR_3:  # PyTensor 3 dropped the fgraph parameter

        def infer_shape(self, node, shapes):
            return [shapes[0]]

    else:

        def infer_shape(self, fgraph, node, shapes):
            return [shapes[0]]

    # the backward pass goes through a heavy node too
    if PYTENSOR_3:

        def pullback(self, inputs, outputs, cotangents):
            return [type(self)()(cotangents[0])]

    else:

        def L_op(self, inputs, outputs, output_grads):
            return [type(self)()(output_grads[0])]


class IdentHeavyTwo(IdentHeavy):
    """A second heavy identity (another type, so that merging never fuses it with the first)."""

    dasktensor_name = "ident-heavy-two"


ident_heavy = IdentHeavy()
ident_heavy_two = IdentHeavyTwo()

if PYTENSOR_3:
    # The reference (PyTensor's default mode, Numba on this line) would otherwise run the
    # Python ``perform`` in Numba's object mode, which compiles slowly and is not cached.
    # dasktensor runs heavy nodes through ``perform`` whatever the backend.
    from pytensor.link.numba.dispatch import basic as _numba_basic

    @_numba_basic.register_funcify_default_op_cache_key(IdentHeavy)
    def _numba_funcify_ident_heavy(op, node=None, **kwargs):
        @_numba_basic.numba_njit
        def ident_heavy_numba(x):
            return x.copy()

        return ident_heavy_numba

# ----------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class Setting:
    name: str
    scheduler: object
    heavy_flops: float | None

    @property
    def partitioned(self) -> bool:
        return self.heavy_flops == 0

    def __call__(self, inputs, outputs, input_values=(), **kwargs):
        return assert_matches_default(
            inputs,
            outputs,
            input_values,
            scheduler=self.scheduler,
            heavy_flops=self.heavy_flops,
            **kwargs,
        )


SETTINGS = {  # name: (scheduler, heavy_flops, dasktensor.execute.path)
    "threads": (None, None, "tasks"),
    "sync": ("sync", None, "tasks"),
    "client": ("client", None, "tasks"),
    "channel": ("client", None, "channel"),
    "heavy0-threads": (None, 0, "tasks"),
    "heavy0-client": ("client", 0, "tasks"),
    "heavy0-channel": ("client", 0, "channel"),
}


@pytest.fixture(params=list(SETTINGS))
def run(request) -> Setting:
    scheduler, heavy_flops, path = SETTINGS[request.param]
    if scheduler == "client":
        scheduler = request.getfixturevalue("client")
    with dask.config.set({"dasktensor.execute.path": path}):
        yield Setting(request.param, scheduler, heavy_flops)


def check_plan(f, run: Setting, *, heavy: int = 0, splits: bool | None = True) -> None:
    """Plan properties every setting must show.

    heavy: how many heavy tasks the graph must give (0: the graph has no heavy Op).
    splits: whether ``heavy_flops=0`` must give more than one task (None: no claim).
    """
    plan = f.plan
    tasks = plan.tasks
    assert sum(t.kind == "heavy" for t in tasks) == heavy, plan
    if heavy:
        assert len(tasks) > 1, plan
        assert all(t.name.startswith("ident-heavy") for t in tasks if t.kind == "heavy"), plan
    elif run.partitioned:
        if splits:
            assert len(tasks) > 1, plan
    else:
        assert plan.single_stage, plan


# ----------------------------------------------------------------------------- helpers


def vec(name, n, dtype="float64"):
    return pt.tensor(name, dtype=dtype, shape=(n,))


def mat(name, m, n, dtype="float64"):
    return pt.tensor(name, dtype=dtype, shape=(m, n))


def normal(k: int, *shape, seed: int = 0):
    """Input values that differ from call to call (``k`` is the call index)."""
    return np.random.default_rng([seed, k]).normal(size=shape)


_NEXT_RNG_KWARG = "return_next_rng" in inspect.signature(RandomVariable.__call__).parameters


def draw(dist, *args, rng, **kwargs):
    """``(next_rng, draws)`` of a random variable, on both PyTensor lines."""
    if _NEXT_RNG_KWARG:
        return dist(*args, rng=rng, return_next_rng=True, **kwargs)
    out = dist(*args, rng=rng, **kwargs)
    return out.owner.outputs[0], out


# ----------------------------------------------------------------------------- elementwise


def test_elemwise_chain(run):
    x, y = vec("x", 4), vec("y", 4)
    i = vec("i", 4, "int64")
    outs = [
        pt.exp(x) * y + pt.sin(x) / (1 + y**2),
        pt.maximum(x, y) - pt.sqr(x),
        i // 2 + (i % 3) * i,
        pt.switch(x > y, i, -i),
        pt.cast(x, "float32") * np.float32(2),
        pt.cumsum(pt.tanh(x - y)),  # not fusable: a second costly block
    ]

    def values(k):
        return [normal(k, 4), normal(k, 4, seed=1), np.arange(4) * (k + 1) - 3]

    f = run([x, y, i], outs, values)
    check_plan(f, run, splits=None)  # fusion may leave a single chain


def test_elemwise_heavy_in_the_middle(run):
    x, y = vec("x", 4), vec("y", 4)
    h = ident_heavy(pt.exp(x) * y)
    outs = [pt.sin(h) + y, (h**2).sum(), h, pt.log1p(pt.abs(x))]
    f = run([x, y], outs, lambda k: [normal(k, 4), normal(k, 4, seed=1)])
    check_plan(f, run, heavy=1)


# ----------------------------------------------------------------------------- reductions


def test_reductions(run):
    X = mat("X", 3, 4)
    outs = [
        X.sum(axis=0),
        X.max(axis=1),
        pt.argmax(X, axis=1),  # int64
        pt.all(X > -3),  # bool
    ]
    f = run([X], outs, lambda k: [normal(k, 3, 4)])
    check_plan(f, run)


# ----------------------------------------------------------------------------- dot / BLAS


def test_dot_blas_shared_weights(run):
    rng = np.random.default_rng(7)
    W = pytensor.shared(rng.normal(size=(4, 3)), name="W", shape=(4, 3))
    b = pytensor.shared(rng.normal(size=3), name="b", shape=(3,))
    X, v, u = mat("X", 5, 4), vec("v", 4), vec("u", 3)
    outs = [
        X @ W + b,  # matrix-matrix (Gemm / Dot22)
        W.T @ v,  # matrix-vector (Gemv)
        X @ (W @ u),  # matrix-vector on a product
        pt.outer(v, v) + 1.0,  # Ger
        pt.dot(v, v),
    ]
    updates = {W: W - 0.01 * pt.outer(v, u)}  # in-place Ger on an updated shared variable

    def values(k):
        return [normal(k, 5, 4), normal(k, 4, seed=1), normal(k, 3, seed=2)]

    f = run([X, v, u], outs, values, updates=updates)
    check_plan(f, run)


def test_dot_heavy_in_the_middle(run):
    W = pytensor.shared(np.random.default_rng(8).normal(size=(4, 3)), name="W", shape=(4, 3))
    X = mat("X", 5, 4)
    h = ident_heavy(X @ W)
    outs = [pt.tanh(h) @ W.T, h.sum(axis=0), (X @ W) * 2]
    f = run([X], outs, lambda k: [normal(k, 5, 4)])
    check_plan(f, run, heavy=1)


# ----------------------------------------------------------------------------- Blockwise


def _spd(A):
    return A @ A.mT + 3.0 * pt.eye(A.shape[-1])


def test_blockwise_linalg_and_vectorize(run):
    A = pt.tensor("A", shape=(2, 3, 3))
    b = pt.tensor("b", shape=(2, 3))
    S = _spd(A)
    row_norm = pt.vectorize(lambda a: pt.sqrt((a**2).sum()), signature="(n)->()")
    outs = [
        pt.linalg.cholesky(S),
        pt.linalg.solve(S, b, b_ndim=1),
        row_norm(b),
    ]
    f = run([A, b], outs, lambda k: [normal(k, 2, 3, 3), normal(k, 2, 3, seed=1)], rtol=1e-6)
    check_plan(f, run)


def test_blockwise_heavy_in_the_middle(run):
    A = pt.tensor("A", shape=(2, 3, 3))
    b = pt.tensor("b", shape=(2, 3))
    S = ident_heavy(_spd(A))
    outs = [pt.linalg.solve(S, b, b_ndim=1), S.sum()]
    f = run([A, b], outs, lambda k: [normal(k, 2, 3, 3), normal(k, 2, 3, seed=1)], rtol=1e-6)
    check_plan(f, run, heavy=1)


# ----------------------------------------------------------------------------- Scan


def test_scan_with_shared_variables(run):
    rng = np.random.default_rng(9)
    W = pytensor.shared(0.5 * rng.normal(size=(3, 3)), name="W", shape=(3, 3))
    h0 = pytensor.shared(np.zeros(3), name="h0", shape=(3,))
    xs = mat("xs", 5, 3)

    def step(x_t, h_prev):
        return pt.tanh(x_t + h_prev @ W)  # W: an implicit shared non-sequence

    hs = pytensor.scan(step, sequences=[xs], outputs_info=[h0], return_updates=False)
    outs = [hs, hs.sum(), pt.cumsum(xs, axis=0)]
    f = run([xs], outs, lambda k: [normal(k, 5, 3)], updates={h0: hs[-1]}, n_calls=3)
    check_plan(f, run)


def test_scan_heavy_in_the_middle(run):
    xs = mat("xs", 4, 3)
    a = pt.tensor("a", shape=(3,))
    hs = pytensor.scan(
        lambda x_t, acc: acc * 0.5 + x_t,
        sequences=[ident_heavy(xs)],
        outputs_info=[a],
        return_updates=False,
    )
    outs = [hs[-1], ident_heavy_two(hs).sum(axis=0)]
    f = run([xs, a], outs, lambda k: [normal(k, 4, 3), normal(k, 3, seed=1)])
    check_plan(f, run, heavy=2)


# ----------------------------------------------------------------------------- IfElse


def test_ifelse(run):
    a = pt.scalar("a")
    x, y = vec("x", 4), vec("y", 4)
    single = ifelse(a > 0, x * 2, pt.exp(y))
    first, second = ifelse(a > 0, [x, y.sum()], [y, x.sum()])
    outs = [single, first + 1, second, pt.cumsum(x)]

    def values(k):  # alternate branches from call to call
        return [np.float64(1.0 if k % 2 == 0 else -1.0), normal(k, 4), normal(k, 4, seed=1)]

    f = run([a, x, y], outs, values, n_calls=3)
    check_plan(f, run)


def test_ifelse_heavy_branch(run):
    a = pt.scalar("a")
    x, y = vec("x", 4), vec("y", 4)
    out = ifelse(a > 0, ident_heavy(x), pt.cumsum(y))
    outs = [out + 1, out.sum() * y]

    def values(k):
        return [np.float64(1.0 if k % 2 == 0 else -1.0), normal(k, 4), normal(k, 4, seed=1)]

    f = run([a, x, y], outs, values, n_calls=3)
    check_plan(f, run, heavy=1)


# ----------------------------------------------------------------------------- indexing


def test_subtensor_and_advanced_indexing(run):
    X = mat("X", 4, 5)
    idx = vec("idx", 3, "int64")
    v = vec("v", 5)
    outs = [
        X[1:3, ::2],
        X[idx],  # AdvancedSubtensor1
        X[idx, idx[::-1]],  # AdvancedSubtensor
        X[X > 0],  # boolean mask: unknown output shape
        pt.set_subtensor(X[1:3], 0.0),
        pt.inc_subtensor(X[idx], v),  # duplicate indices accumulate
        pt.set_subtensor(X[idx, 1], -1.0),
    ]

    def values(k):
        return [normal(k, 4, 5), np.array([0, 2, 0]) + k % 2, normal(k, 5, seed=1)]

    f = run([X, idx, v], outs, values)
    check_plan(f, run)


def test_set_subtensor_inplace_on_intermediates(run):
    """set/inc_subtensor on intermediates that other nodes also read: in-place prone."""
    X = mat("X", 4, 5)
    idx = vec("idx", 2, "int64")
    Y = X * 2.0
    Z = pt.exp(X)
    outs = [
        pt.set_subtensor(Y[0], 0.0),  # may overwrite Y in place...
        Y.sum(axis=0),  # ...which this reads
        pt.inc_subtensor(Z[idx], 1.0),
        Z.max(axis=1),
        pt.set_subtensor(pt.cumsum(X, axis=0)[:, 1], 5.0),
    ]
    f = run([X, idx], outs, lambda k: [normal(k, 4, 5), np.array([1, 3]) - k % 2])
    check_plan(f, run)


# ---------------------------------------------------------------------- in place across tasks


def test_inplace_through_a_view_across_tasks(run):
    """An in-place Op destroys an intermediate through a view (a Subtensor) while another
    node reads the intermediate.  PyTensor orders the reader first; the tasks must too."""
    x = vec("x", 6)
    t = pt.cumsum(x)
    outs = [pt.exp(t[1:]), pt.cumsum(t).sum()]
    f = run([x], outs, lambda k: [normal(k, 6)])
    check_plan(f, run)


def test_update_in_place_through_a_view_across_tasks(run):
    """The update of a shared variable overwrites it in place through views, while other
    nodes still read the old value."""
    s = pytensor.shared(np.arange(6.0), name="s", shape=(6,))
    outs = [pt.cumsum(s).sum(), pt.cumsum(s[::2])]
    f = run([], outs, updates={s: pt.exp(s[1:4] * 0.1).repeat(2)}, n_calls=3)
    check_plan(f, run)


def test_update_in_place_through_a_view_with_heavy(run):
    s = pytensor.shared(np.linspace(-1.0, 1.0, 6), name="s", shape=(6,))
    outs = [ident_heavy(s), pt.cumsum(s)[1:]]
    f = run([], outs, updates={s: pt.exp(s[::-1])}, n_calls=3)
    check_plan(f, run, heavy=1)


def test_intermediate_feeds_two_heavy_nodes_one_consumed_in_place(run):
    """``t`` feeds two heavy nodes, and a cheap stage overwrites ``t`` in place (through a
    view) while the second heavy node still has to read it (it waits for the first one);
    the output of the first heavy node is overwritten in place too (``set_subtensor``)."""
    x = vec("x", 5)
    t = ident_heavy(pt.cumsum(x))  # the shared intermediate
    h1 = ident_heavy(pt.cumsum(t))
    h2 = ident_heavy_two(t + h1)
    h3 = ident_heavy(pt.exp(t[1:]))  # exp may overwrite t[1:] in place
    outs = [h3, h2 * 2.0, pt.set_subtensor(h1[0], -1.0), h1 + h2]
    f = run([x], outs, lambda k: [normal(k, 5)])
    check_plan(f, run, heavy=4)


def test_intermediate_feeds_two_heavy_nodes_direct_inplace(run):
    """As above, but the in-place consumer overwrites the intermediate directly."""
    x = vec("x", 5)
    t = pt.cumsum(x)
    h1 = ident_heavy(t)
    h2 = ident_heavy_two(t)
    outs = [h1 + h2, pt.inc_subtensor(t[1:], 1.0), t * 3.0]
    f = run([x], outs, lambda k: [normal(k, 5)])
    check_plan(f, run, heavy=2)


# ----------------------------------------------------------------------------- random variables


def test_random_variables_with_generator_updates(run):
    rng1 = pytensor.shared(np.random.default_rng(42), name="rng1")
    rng2 = pytensor.shared(np.random.default_rng(43), name="rng2")
    mu = vec("mu", 4)
    next1, z = draw(pt.random.normal, mu, 1.0, size=(4,), rng=rng1)
    next1b, u = draw(pt.random.uniform, -1.0, 1.0, size=(4,), rng=next1)
    next2, n = draw(pt.random.integers, 0, 10, size=(5,), rng=rng2)
    outs = [z, u, n, z * u + mu, n.sum()]
    updates = {rng1: next1b, rng2: next2}
    f = run([mu], outs, lambda k: [normal(k, 4)], updates=updates, n_calls=3)
    check_plan(f, run)


def test_random_heavy_in_the_middle(run):
    rng = pytensor.shared(np.random.default_rng(5), name="rng")
    next1, z = draw(pt.random.normal, 0.0, 1.0, size=(3,), rng=rng)
    h = ident_heavy(z)
    next2, w = draw(pt.random.normal, h, 0.5, rng=next1)
    outs = [h, w, w - z]
    f = run([], outs, updates={rng: next2}, n_calls=3)
    check_plan(f, run, heavy=1)


# ----------------------------------------------------------------------------- OpFromGraph


class HeavySubgraph(OpFromGraph):
    """An OpFromGraph marked heavy: its runner compiles the inner graph ("inner" backend)."""

    dasktensor_heavy = True
    dasktensor_name = "heavy-subgraph"


def test_heavy_op_from_graph(run):
    a, b = vec("a", 4), vec("b", 4)
    sub = HeavySubgraph([a, b], [pt.exp(a) * b, pt.cumsum(a + b)])
    x, y = vec("x", 4), vec("y", 4)
    p, q = sub(x * 2.0, y)
    outs = [p + q, q.sum(), sub(p, q)[0]]
    f = run([x, y], outs, lambda k: [normal(k, 4), normal(k, 4, seed=1)])
    plan = f.plan
    assert sum(t.kind == "heavy" for t in plan.tasks) == 2, plan
    assert {t.name for t in plan.tasks if t.kind == "heavy"} == {"heavy-subgraph"}, plan


# ----------------------------------------------------------------------------- gradients


def test_grad_with_shared_updates(run):
    w = pytensor.shared(np.array([0.5, -0.2, 0.1]), name="w", shape=(3,))
    X, y = mat("X", 5, 3), vec("y", 5)
    loss = ((X @ w - y) ** 2).mean() + 0.1 * (w**2).sum()
    gw = pt.grad(loss, w)
    gX = pt.grad(loss, X)
    f = run(
        [X, y],
        [loss, gw, gX],
        lambda k: [normal(k, 5, 3), normal(k, 5, seed=1)],
        updates={w: w - 0.1 * gw},
        n_calls=3,
    )
    check_plan(f, run)


def test_grad_through_heavy(run):
    w = pytensor.shared(np.array([0.5, -0.2, 0.1]), name="w", shape=(3,))
    X = mat("X", 5, 3)
    loss = pt.tanh(ident_heavy(X @ w)).sum()
    gw = pt.grad(loss, w)
    f = run([X], [loss, gw], lambda k: [normal(k, 5, 3)], updates={w: w - 0.1 * gw})
    check_plan(f, run, heavy=2)  # forward and backward IdentHeavy


# ----------------------------------------------------------------------------- function API


def test_multiple_outputs_repeated_and_input_outputs(run):
    x, y = vec("x", 3), vec("y", 3)
    e = pt.exp(x)
    outs = [e, e, e * y, x, y, pt.cumsum(y)]  # a variable twice; inputs returned as is
    f = run([x, y], outs, lambda k: [normal(k, 3), normal(k, 3, seed=1)])
    check_plan(f, run, splits=None)


def test_input_returned_directly_with_heavy(run):
    x = vec("x", 3)
    outs = [x, ident_heavy(x), x * 2]
    f = run([x], outs, lambda k: [normal(k, 3)])
    check_plan(f, run, heavy=1)


def test_single_output_is_not_a_list(run):
    x = vec("x", 3)
    f = run([x], ident_heavy(pt.exp(x)).sum(), lambda k: [normal(k, 3)])
    check_plan(f, run, heavy=1)


def test_shared_variable_updates(run):
    acc = pytensor.shared(np.zeros(3), name="acc", shape=(3,))
    count = pytensor.shared(np.int64(0), name="count")
    a = pytensor.shared(np.arange(3.0), name="a", shape=(3,))
    b = pytensor.shared(-np.arange(3.0), name="b", shape=(3,))
    x = vec("x", 3)
    updates = {acc: acc + x, count: count + 1, a: b, b: a}  # a and b swap every call
    outs = [acc * 2, count, a - b, acc + x]  # the last one is also an update
    f = run([x], outs, lambda k: [normal(k, 3)], updates=updates, n_calls=3)
    check_plan(f, run)


def test_shared_variable_updates_with_heavy(run):
    acc = pytensor.shared(np.zeros(3), name="acc", shape=(3,))
    a = pytensor.shared(np.arange(3.0), name="a", shape=(3,))
    b = pytensor.shared(-np.arange(3.0), name="b", shape=(3,))
    x = vec("x", 3)
    new_acc = ident_heavy(acc + x)
    updates = {acc: new_acc, a: b, b: a}
    # old values of updated shared variables, and an output that is also an update
    outs = [new_acc.sum(), acc, a, new_acc]
    f = run([x], outs, lambda k: [normal(k, 3)], updates=updates, n_calls=3)
    check_plan(f, run, heavy=1)


def test_givens(run):
    s = pytensor.shared(np.array([1.0, 2.0, 3.0]), name="s", shape=(3,))
    x = vec("x", 3)
    z = vec("z", 3)
    outs = [z * s, pt.cumsum(z) + x, (s**2).sum()]
    givens = {z: pt.exp(x), s: x + 1.0}
    f = run([x], outs, lambda k: [normal(k, 3)], givens=givens)
    check_plan(f, run, splits=None)  # fusion may leave a single chain


def test_givens_with_heavy(run):
    s = pytensor.shared(np.array([1.0, 2.0, 3.0]), name="s", shape=(3,))
    x, z = vec("x", 3), vec("z", 3)
    outs = [ident_heavy(z) * s, z.sum()]
    f = run([x], outs, lambda k: [normal(k, 3)], givens={z: x * 2.0})
    check_plan(f, run, heavy=1)


def test_no_inputs(run):
    s = pytensor.shared(np.array([0.5, 1.5, -1.0]), name="s", shape=(3,))
    outs = [pt.exp(s).sum(), s * 2, pt.cumsum(s)]
    f = run([], outs)
    check_plan(f, run)


def test_no_inputs_with_heavy(run):
    s = pytensor.shared(np.array([0.5, 1.5, -1.0]), name="s", shape=(3,))
    h = ident_heavy(s)
    f = run([], [h + 1, h * s], updates={s: h * 0.5}, n_calls=3)
    check_plan(f, run, heavy=1)


def test_constants_as_outputs(run):
    x = vec("x", 3)
    outs = [pt.constant(3.0), pt.as_tensor(np.arange(3)), x + 1, pt.constant(np.ones((2, 2)))]
    f = run([x], outs, lambda k: [normal(k, 3)])
    check_plan(f, run, splits=None)


def test_constants_as_outputs_with_heavy(run):
    x = vec("x", 3)
    outs = [pt.constant(np.int32(7)), ident_heavy(x), pt.as_tensor(np.arange(3.0))]
    f = run([x], outs, lambda k: [normal(k, 3)])
    check_plan(f, run, heavy=1)


def test_constant_graph_without_inputs(run):
    f = run([], [pt.constant(np.arange(4.0)) * 2, pt.constant(2) + 3])
    check_plan(f, run, splits=None)


# ----------------------------------------------------------------------------- wide graphs


def test_wide_graph_with_shared_branches(run):
    """Independent branches that share intermediates: many tasks, multi-output tasks."""
    A = mat("A", 4, 4)
    x = vec("x", 4)
    b1 = A @ x
    b2 = A.T @ x
    b3 = pt.cumsum(x)
    c = b1 * b3 + b2
    d = pt.cumsum(c[::-1])
    e = c[::-1] @ A
    g = pt.set_subtensor(b3[0], d[0])
    outs = [d, e, g, (b1 - b2).max(), pt.outer(b2, b3).sum(axis=1)]
    f = run([A, x], outs, lambda k: [normal(k, 4, 4), normal(k, 4, seed=1)])
    check_plan(f, run)


def test_unknown_shapes(run):
    """Without static shapes the cost rule knows nothing: heavy_flops=0 splits nothing."""
    X = pt.matrix("X")
    v = pt.vector("v")
    outs = [X @ v, X.sum(axis=0) + v, pt.cumsum(v)]
    f = run([X, v], outs, lambda k: [normal(k, 3, 3), normal(k, 3, seed=1)])
    if run.partitioned:
        assert f.plan.single_stage, f.plan
    check_plan(f, run, splits=None)
