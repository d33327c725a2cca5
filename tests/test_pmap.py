"""dt.pmap: a graph mapped over a batch axis equals a Python loop of the one-element graph."""

from __future__ import annotations

import dask
import dask.array as da
import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

import dasktensor as dt

RNG = np.random.default_rng(0)


def loop(fn, args, batched):
    """The reference: the one-element graph, compiled, called element by element."""
    inputs = [
        pt.tensor(dtype=str(a.dtype), shape=(None,) * (a.ndim - b), name=f"x{i}")
        for i, (a, b) in enumerate(zip(args, batched))
    ]
    outputs = fn(*inputs)
    f = pytensor.function(inputs, outputs)
    n = next(len(a) for a, b in zip(args, batched) if b)
    rows = [f(*[a[i] if b else a for a, b in zip(args, batched)]) for i in range(n)]
    if isinstance(outputs, list | tuple):
        return [np.stack([r[k] for r in rows]) for k in range(len(outputs))]
    return np.stack(rows)


GRAPHS = {
    "matmul-tanh-sum": (
        lambda x, w: pt.tanh(x @ w).sum(),
        [RNG.normal(size=(7, 3)), RNG.normal(size=(3, 4))],
        (0, None),
    ),
    "broadcasting": (
        lambda x, c: x * c + x.sum() - pt.exp(c),
        [RNG.normal(size=(9, 5)), np.array(0.5)],
        (0, None),
    ),
    "two-batched-inputs": (
        lambda a, b: pt.outer(a, b).max(axis=0),
        [RNG.normal(size=(6, 3)), RNG.normal(size=(6, 4))],
        0,
    ),
    "two-outputs": (
        lambda x: [pt.cumsum(x), pt.sort(x)[-1]],
        [RNG.normal(size=(10, 6))],
        0,
    ),
    "linear-solve": (
        lambda a, b: pt.linalg.solve(a + 3 * pt.eye(3), b),
        [RNG.normal(size=(5, 3, 3)), RNG.normal(size=(3,))],
        (0, None),
    ),
}


@pytest.mark.parametrize("name", list(GRAPHS))
@pytest.mark.parametrize("chunks", [3, "auto"])
def test_pmap_equals_a_python_loop(name, chunks):
    fn, args, in_axes = GRAPHS[name]
    batched = [a == 0 for a in (in_axes if isinstance(in_axes, tuple) else [in_axes] * len(args))]
    got = dt.pmap(fn, in_axes=in_axes, chunks=chunks)(*args)
    want = loop(fn, args, batched)
    if isinstance(want, list):
        assert isinstance(got, tuple) and all(isinstance(g, da.Array) for g in got)
        got = dask.compute(*got)
    else:
        assert isinstance(got, da.Array)  # lazy
        n = len(args[0])
        if chunks == 3:
            assert got.chunks[0] == (3,) * (n // 3) + ((n % 3,) if n % 3 else ())  # ragged end
        got = [got.compute()]
        want = [want]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)


def test_in_axes_maps_over_any_axis_with_the_batch_axis_first_in_the_result():
    x = RNG.normal(size=(3, 6, 4))  # batch along axis 1 (and -2)
    w = RNG.normal(size=(4, 6))  # batch along axis 1 (the last)
    want = np.stack([np.tanh(x[:, i, :] @ w[:, i]) for i in range(6)])
    for axes in [(1, 1), (-2, -1)]:
        got = dt.pmap(lambda a, b: pt.tanh(a @ b), in_axes=axes, chunks=4)(x, w)
        assert got.shape == (6, 3)
        np.testing.assert_allclose(got.compute(), want)
    lazy = dt.pmap(lambda a, b: pt.tanh(a @ b), in_axes=(1, 1))(
        da.from_array(x, chunks=(3, 2, 4)), w
    )
    assert lazy.chunks[0] == (2, 2, 2)  # the Dask input's chunks along its batch axis
    np.testing.assert_allclose(lazy.compute(), want)


def test_dask_array_input_keeps_its_chunks_and_reductions_stay_lazy():
    x = da.from_array(RNG.normal(size=(11, 4)), chunks=(4, 4))
    y = dt.pmap(lambda v: pt.exp(v) / pt.exp(v).sum())(x)
    assert y.chunks == ((4, 4, 3), (4,))
    total = y.sum(axis=1)  # a Dask reduction of the mapped output
    assert isinstance(total, da.Array)
    np.testing.assert_allclose(total.compute(), np.ones(11))


def test_unbatched_input_is_one_key_read_by_every_chunk():
    w = RNG.normal(size=(50, 50))
    y = dt.pmap(lambda x, w: (x @ w).sum(), in_axes=(0, None), chunks=2)(np.ones((8, 50)), w)
    graph = dict(y.__dask_graph__())
    holding_w = [k for k, v in graph.items() if isinstance(v, np.ndarray) and v.shape == w.shape]
    assert len(holding_w) == 1  # the matrix is in the graph once, not once per chunk
    chunk_tasks = [v for k, v in graph.items() if k[0].startswith("pmap-") and "-out" not in k[0]]
    assert len(chunk_tasks) == 4
    assert all(holding_w[0] in task.dependencies for task in chunk_tasks)
    np.testing.assert_allclose(y.compute(), np.full(8, w.sum()))


def random_graph(mu, rng=None):
    return pt.random.normal(mu, 1.0, size=(3,), rng=rng)


# PyTensor 3 announces that random variables will return their next generator
@pytest.mark.filterwarnings("ignore:RandomVariable Ops will stop hiding:DeprecationWarning")
def test_random_variables_draw_from_per_chunk_generators():
    """A chunk's draws are those of the one-element graph called in turn on the chunk's
    generator (spawned from the seed), and do not depend on the scheduler."""
    mu = np.arange(7.0)
    shared_rng = pytensor.shared(np.random.default_rng(123))
    g = dt.pmap(lambda m: random_graph(m, shared_rng), chunks=3, random_seed=42)
    got = g(mu).compute(scheduler="sync")
    np.testing.assert_array_equal(got, g(mu).compute(scheduler="threads"))

    m, rng_in = pt.dscalar("m"), pt.random.type.random_generator_type("rng")
    draw = random_graph(m, rng_in)
    step = pytensor.function([m, rng_in], [draw.owner.outputs[0], draw])
    seeds = np.random.SeedSequence(42).spawn(3)
    want = []
    for chunk, seed in zip([mu[0:3], mu[3:6], mu[6:]], seeds):
        (child,) = seed.spawn(1)
        rng = np.random.default_rng(child)
        for value in chunk:
            rng, row = step(value, rng)
            want.append(row)
    np.testing.assert_allclose(got, np.array(want), rtol=1e-12)
    other = dt.pmap(lambda m: random_graph(m, shared_rng), chunks=3, random_seed=43)(mu)
    assert not np.allclose(other.compute(), got)  # another seed, other draws


def test_compute_true_returns_numpy_and_results_match_a_cluster(client):
    fn, args, in_axes = GRAPHS["matmul-tanh-sum"]
    g = dt.pmap(fn, in_axes=in_axes, chunks=2)
    local = g(*args, compute=True)
    assert isinstance(local, np.ndarray)
    np.testing.assert_allclose(g(*args).compute(scheduler=client), local)


def test_each_worker_compiles_the_chunk_function_once(client):
    x = RNG.normal(size=(40, 8))
    y = dt.pmap(lambda v: pt.tanh(v).sum(), chunks=4, name="tanh-sum")(x)
    np.testing.assert_allclose(y.compute(scheduler=client), np.tanh(x).sum(axis=1))

    def compiled(name):
        from dasktensor.engine._runners import restored

        return [len(r._pool) for r in restored() if r.name == name]

    per_worker = client.run(compiled, "tanh-sum")
    assert all(n == [1] for n in per_worker.values() if n), per_worker  # one runner, compiled once
    assert any(per_worker.values())


def test_bad_arguments_fail_clearly():
    with pytest.raises(ValueError, match=r"in_axes entries must be an int .* or None .*, got 'x'"):
        dt.pmap(pt.exp, in_axes="x")(np.ones((2, 2)))
    with pytest.raises(ValueError, match=r"in_axes\[0\]=2 is out of range for input 0 of shape"):
        dt.pmap(pt.exp, in_axes=2)(np.ones((2, 2)))
    with pytest.raises(ValueError, match=r"in_axes\[0\]=0 is out of range .* shape \(\)"):
        dt.pmap(pt.exp)(np.float64(1.0))
    with pytest.raises(ValueError, match="needs at least one batched input"):
        dt.pmap(pt.exp, in_axes=None)(np.ones(2))
    with pytest.raises(ValueError, match=r"same length along their batch axes, got \[2, 3\]"):
        dt.pmap(lambda a, b: a + b)(np.ones(2), np.ones(3))
    with pytest.raises(ValueError, match=r"chunks=...\) expected 'auto' or an int > 0, got 0"):
        dt.pmap(pt.exp, chunks=0)
    with pytest.raises(TypeError, match="expected a function building a PyTensor graph"):
        dt.pmap(3)


def test_compute_shows_the_distributed_progress_bar_and_it_can_be_turned_off(
    process_cluster, capsys
):
    from distributed import Client

    g = dt.pmap(lambda v: pt.tanh(v).sum(), chunks=5)
    x = RNG.normal(size=(20, 3))
    with Client(process_cluster):  # the default client: pmap computes there
        np.testing.assert_allclose(g(x, compute=True), np.tanh(x).sum(axis=1))
        shown = capsys.readouterr().out
        g(x, compute=True, progressbar=False)
        hidden = capsys.readouterr().out
    assert "100% Completed" in shown
    assert "Completed" not in hidden


@pytest.mark.filterwarnings("ignore:RandomVariable Ops will stop hiding:DeprecationWarning")
def test_shared_data_is_read_when_called_and_new_sizes_rebuild_the_graph():
    data = pytensor.shared(np.ones(3), name="data")
    rng = pytensor.shared(np.random.default_rng(0))
    g = dt.pmap(lambda x: x * data.sum() + pt.random.normal(size=data.shape, rng=rng) * 0.0)
    x = np.arange(4.0)
    before = g(x)  # lazy: holds the data of this call
    np.testing.assert_array_equal(before.compute(), np.repeat(3.0 * x[:, None], 3, axis=1))
    data.set_value(np.full(3, 2.0))
    np.testing.assert_array_equal(g(x).compute(), np.repeat(6.0 * x[:, None], 3, axis=1))
    np.testing.assert_array_equal(before.compute(), np.repeat(3.0 * x[:, None], 3, axis=1))
    data.set_value(np.ones(5))  # the random variable's size follows the data's shape
    np.testing.assert_array_equal(g(x).compute(), np.repeat(5.0 * x[:, None], 5, axis=1))


def test_compute_true_assembles_in_place_without_holding_every_chunk():
    """compute=True copies each chunk into the result as it completes: the peak of NumPy
    memory is about the result, not the chunks plus their concatenation (twice)."""
    import tracemalloc

    g = dt.pmap(lambda v: v * pt.ones(2000), chunks=50)  # 100 chunks of 0.8 MB
    x = np.arange(5000.0)
    result_bytes = 5000 * 2000 * 8
    tracemalloc.start()
    try:
        out = g(x, compute=True, progressbar=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    np.testing.assert_array_equal(out[:, 0], x)
    np.testing.assert_array_equal(out[:, -1], x)
    assert peak < 1.3 * result_bytes, f"peak {peak / 1e6:.0f} MB for an 80 MB result"


def test_compute_true_on_a_client_fills_every_output_of_shared_chunks(client):
    g = dt.pmap(lambda v: [pt.cumsum(v), pt.sort(v)[-1]], chunks=3)
    x = RNG.normal(size=(10, 6))
    with dask.config.set(scheduler=client):
        got = g(x, compute=True, progressbar=False)
    np.testing.assert_allclose(got[0], np.cumsum(x, axis=1))
    np.testing.assert_allclose(got[1], x.max(axis=1))


def test_compute_true_under_the_processes_scheduler():
    """Chunks computed in other processes cannot be stored into this process's result:
    they come back and are copied in."""
    g = dt.pmap(lambda v: v * 2.0 + 1.0, chunks=3)
    x = np.arange(7.0)
    with dask.config.set(scheduler="processes", num_workers=2):
        got = g(x, compute=True, progressbar=False)
    np.testing.assert_array_equal(got, 2.0 * x + 1.0)
