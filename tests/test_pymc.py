"""PyMC integration: ``pm.sample`` and PyMC's compiled functions in the DASK mode.

How the mode reaches PyMC (both supported lines):

* ``pm.sample(compile_kwargs={"mode": "DASK"})`` hands ``compile_kwargs`` to ``init_nuts``,
  which builds ``model.logp_dlogp_function(ravel_inputs=True, **compile_kwargs)`` and the
  NUTS step (``GradientSharedStep.__init__`` -> ``model.logp_dlogp_function``); both are
  ``ValueGradFunction`` objects whose ``_pytensor_function`` is compiled by ``pm.compile``
  with ``mode="DASK"`` -- so its ``maker.linker`` is a :class:`dasktensor.DaskLinker`.
* ``cores=2``: PyMC forks (the default start method on Linux up to Python 3.13, for
  PyMC 5.28/Python 3.11 and PyMC 6/Python 3.12 alike) and the children use the parent's
  compiled step method; under ``spawn`` the step method is cloudpickled and every child
  compiles the function again from the pickle.

``nuts_sampler="pymc"`` is passed explicitly: PyMC 6 would pick nutpie (when installed)
for any mode whose linker is a ``NumbaLinker``, and ``DaskLinker`` subclasses it there.

Models:

* ``hierarchical``: eight schools, non-centred; its logp/dlogp plan is a single stage.
* ``heavy``: the same with the prior of ``z`` and part of the likelihood computed by the
  heavy Ops of ``_heavy_ops`` (each heavy node is a Dask task of its own), so that the
  plan has several tasks, Dask's threaded scheduler (or a distributed client) runs them,
  and -- with ``cores=2`` -- runs them inside PyMC's sampler processes.
"""

from __future__ import annotations

import contextlib
import os
import warnings

import numpy as np
import pymc as pm
import pytest
from _clusters import channel_calls
from _heavy_ops import LOG_ENV, HeavyNormalLogp, HeavyScale, read_log
from pymc.model.core import ValueGradFunction

import dasktensor  # noqa: F401  (registers the "DASK" mode)
from dasktensor import DaskLinker
from dasktensor._compat import PYMC_6, PYTENSOR_3

SEED = 20240611
DRAWS = 20
TUNE = 20

# Python >= 3.12 warns whenever a process with more than one thread forks.  In these tests
# the parent holds Dask's threaded-scheduler pool (the DASK mode ran the heavy model's
# logp there while PyMC chose initial points) or a distributed Client's event-loop
# thread.  That fork is exactly what dasktensor's at-fork handler makes safe, and the
# tests check that the forked children finish and give the right draws.
FORK_WARNING = (
    r"This process \(pid=\d+\) is multi-threaded, use of fork\(\) may lead to deadlocks "
    r"in the child"
)
FORK_WITH_THREADS = pytest.mark.filterwarnings(f"ignore:{FORK_WARNING}:DeprecationWarning")


# ----------------------------------------------------------------------------- models

Y = np.array([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0])
SIGMA = np.array([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0])


def hierarchical_model() -> pm.Model:
    with pm.Model() as model:
        mu = pm.Normal("mu", 0.0, 5.0)
        tau = pm.HalfNormal("tau", 5.0)
        z = pm.Normal("z", 0.0, 1.0, shape=8)
        pm.Normal("y", mu + tau * z, SIGMA, observed=Y)
    return model


def heavy_model() -> pm.Model:
    """The same model; ``z``'s prior and a rescaling of ``z`` are heavy Dask tasks."""
    with pm.Model() as model:
        mu = pm.Normal("mu", 0.0, 5.0)
        tau = pm.HalfNormal("tau", 5.0)
        z = pm.Flat("z", shape=8)
        pm.Potential("z_prior", HeavyNormalLogp(1.0)(z))
        pm.Normal("y", mu + tau * HeavyScale(2.0)(z) / 2.0, SIGMA, observed=Y)
    return model


def small_heavy_model() -> pm.Model:
    """A well-conditioned model with the same heavy Ops: short NUTS trajectories, so few
    logp/dlogp calls (each one a round trip to the cluster in the distributed tests)."""
    with pm.Model() as model:
        z = pm.Flat("z", shape=3)
        pm.Potential("z_prior", HeavyNormalLogp(1.0)(z))
        pm.Normal("y", HeavyScale(2.0)(z) / 2.0, 1.0, observed=[0.5, -0.3, 1.2])
    return model


MODELS = {
    "hierarchical": hierarchical_model,
    "heavy": heavy_model,
    "small-heavy": small_heavy_model,
}

HEAVY_PREFIXES = ("heavy-normal-logp", "heavy-scale")


# ----------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def reference_run():
    """Context of the runs in PyTensor's default mode, the reference of every comparison.

    On PyTensor 3 the default mode compiles with Numba, which has no implementation of the
    test's Python Ops and calls their ``perform`` in object mode, with a UserWarning.  That
    is expected of the reference runs only: the DASK mode runs heavy nodes through
    ``perform`` itself, so the filter is not active around DASK runs.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore",
            message=r"Numba will use object mode to run Heavy",
            category=UserWarning,
        )
        yield


def sample(model: pm.Model, mode: str | None = None, **kwargs) -> dict[str, np.ndarray]:
    """``pm.sample`` with small settings; the posterior draws of the free variables."""
    kwargs.setdefault("draws", DRAWS)
    kwargs.setdefault("tune", TUNE)
    kwargs.setdefault("chains", 1)
    kwargs.setdefault("cores", 1)
    compile_kwargs = {} if mode is None else {"mode": mode}
    with model:
        idata = pm.sample(
            random_seed=SEED,
            progressbar=False,
            compute_convergence_checks=False,
            nuts_sampler="pymc",
            compile_kwargs=compile_kwargs,
            **kwargs,
        )
    posterior = idata.posterior
    return {rv.name: np.asarray(posterior[rv.name].values) for rv in model.free_RVs}


_REFERENCES: dict[tuple, tuple[dict[str, np.ndarray], list]] = {}


def reference(model_name: str, chains: int, tmp_path_factory, **kwargs):
    """Draws of ``pm.sample`` without the mode (``cores=chains``, default start method),
    and the heavy Ops' log rows of that run; computed once per module and settings.

    PyMC's draws depend on the seed only: the same with ``fork``, ``spawn`` or one process
    (checked on both lines when this file was written), so the tests of every start
    method compare with this one run rather than sampling without the mode under ``spawn``
    again (which costs 15-25 s on the 2-core machines).
    """
    key = (model_name, chains, tuple(sorted(kwargs.items())))
    if key not in _REFERENCES:
        log = tmp_path_factory.mktemp("reference") / "heavy.log"
        old = os.environ.get(LOG_ENV)
        os.environ[LOG_ENV] = str(log)
        try:
            with reference_run(), warnings.catch_warnings():
                # see FORK_WITH_THREADS: this run forks, and may do so while earlier tests'
                # Dask thread pools or the session's cluster threads live in this process
                warnings.filterwarnings(
                    "ignore", message=FORK_WARNING, category=DeprecationWarning
                )
                draws = sample(MODELS[model_name](), chains=chains, cores=chains, **kwargs)
        finally:
            if old is None:
                del os.environ[LOG_ENV]
            else:
                os.environ[LOG_ENV] = old
        _REFERENCES[key] = (draws, read_log(log))
    return _REFERENCES[key]


# On PyTensor 3 the Numba backend compiles with fast-math.  A multi-task plan compiles its
# stages as separate functions, and LLVM may then order their sums differently than in the
# whole-graph function of the default mode (PyTensor alone does the same when a graph is
# split by hand; with numba__fastmath=False the results are bit-identical).  Values then
# agree to round-off (about 1 ulp per evaluation), which NUTS carries into the draws
# (about 1e-11 after 40 iterations); on PyTensor 2.38 (C) they are identical.
EXACT = not PYTENSOR_3
VALUE_RTOL = 1e-10
DRAW_RTOL = 1e-6


def assert_same_values(got, want) -> None:
    """Equal on PyTensor 2.38; equal to round-off on PyTensor 3 (see ``EXACT``)."""
    if EXACT:
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=VALUE_RTOL, atol=1e-12)


def assert_same_draws(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for name, want in expected.items():
        have = got[name]
        assert have.shape == want.shape, name
        same = (
            np.array_equal(have, want)
            if EXACT
            else np.allclose(have, want, rtol=DRAW_RTOL, atol=DRAW_RTOL)
        )
        if not same:
            diff = np.max(np.abs(have - want))
            n = int(np.sum(have != want))
            pytest.fail(
                f"draws of {name!r} differ from the default mode's: {n} of "
                f"{have.size} entries, max abs difference {diff:.3g}"
            )


def dask_thread_rows(rows, pid=None):
    """Log rows of heavy ``perform`` calls made in threads of Dask's threaded scheduler."""
    return [
        r for r in rows if r[1].startswith("ThreadPoolExecutor") and (pid is None or r[0] == pid)
    ]


@pytest.fixture
def heavy_log(tmp_path, monkeypatch):
    """A fresh log file for the heavy Ops (children inherit the environment variable)."""

    def new(name: str):
        path = tmp_path / f"{name}.log"
        monkeypatch.setenv(LOG_ENV, str(path))
        return path

    return new


@pytest.fixture
def value_grad_functions(monkeypatch):
    """Every ``ValueGradFunction`` PyMC builds during the test (init_nuts, the NUTS step)."""
    made: list[ValueGradFunction] = []
    original = ValueGradFunction.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(ValueGradFunction, "__init__", spy)
    return made


@pytest.fixture
def dask_linked(monkeypatch):
    """Every DaskLinker that linked a function during the test."""
    linked: list[DaskLinker] = []
    original = DaskLinker.make_thunk

    def spy(self, *args, **kwargs):
        linked.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(DaskLinker, "make_thunk", spy)
    return linked


def assert_compiled_by_dask(functions, multi_task: bool | None = None) -> None:
    assert functions, "PyMC built no logp/dlogp function"
    for vgf in functions:
        linker = vgf._pytensor_function.maker.linker
        assert isinstance(linker, DaskLinker), type(linker)
        assert linker.plan is not None, "DaskLinker.make_thunk never ran"
        if multi_task is not None:
            assert (not linker.plan.single_stage) == multi_task, linker.plan


def default_start_method() -> str:
    from pymc.sampling.parallel import _initialize_multiprocessing_context

    return _initialize_multiprocessing_context(None).get_start_method()


# ----------------------------------------------------------------------------- 1. one chain


@pytest.mark.parametrize("model_name", ["hierarchical", "heavy"])
def test_sample_one_chain_identical_to_default_mode(model_name, value_grad_functions, heavy_log):
    model = MODELS[model_name]()
    with reference_run():
        expected = sample(model)
    assert value_grad_functions
    assert not any(
        isinstance(f._pytensor_function.maker.linker, DaskLinker) for f in value_grad_functions
    )

    value_grad_functions.clear()
    log = heavy_log("dask")
    got = sample(model, "DASK")

    # the mode reached the logp/dlogp functions of init_nuts and of the NUTS step
    assert_compiled_by_dask(value_grad_functions, multi_task=model_name == "heavy")
    if model_name == "heavy":
        # the heavy tasks ran on Dask's threaded scheduler, in this process
        assert dask_thread_rows(read_log(log), pid=os.getpid())
    assert_same_draws(got, expected)


def test_sample_would_notice_an_ignored_mode(value_grad_functions):
    """The check of the test above fails when the mode does not reach PyMC's functions."""
    model = hierarchical_model()
    sample(model, None)
    with pytest.raises(AssertionError):
        assert_compiled_by_dask(value_grad_functions)


# ----------------------------------------------------------------------------- 2. two processes


def test_default_start_method_is_fork():
    """What ``mp_ctx=None`` means on these lines (Linux, Python 3.11 and 3.12)."""
    assert default_start_method() == "fork"


@FORK_WITH_THREADS
@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("mp_ctx", [None, "fork", "spawn"], ids=["default", "fork", "spawn"])
@pytest.mark.parametrize("model_name", ["hierarchical", "heavy"])
def test_sample_two_processes_identical_to_default_mode(
    model_name, mp_ctx, value_grad_functions, heavy_log, tmp_path_factory
):
    expected, ref_rows = reference(model_name, 2, tmp_path_factory)
    model = MODELS[model_name]()

    value_grad_functions.clear()
    log = heavy_log("dask")
    got = sample(model, "DASK", chains=2, cores=2, mp_ctx=mp_ctx)

    assert_compiled_by_dask(value_grad_functions, multi_task=model_name == "heavy")
    if model_name == "heavy":
        parent = os.getpid()
        # without the mode, both sampler processes ran the heavy Ops in their main thread
        ref_children = {r[0] for r in ref_rows if r[0] != parent}
        assert len(ref_children) == 2, ref_rows
        # in the DASK mode, both ran them in Dask's threaded scheduler, and only there
        rows = read_log(log)
        children = {r[0] for r in dask_thread_rows(rows) if r[0] != parent}
        assert len(children) == 2, rows
        assert not [r for r in rows if r[0] != parent and r[1] == "MainThread"], rows
    assert_same_draws(got, expected)


# ----------------------------------------------------------------------------- 3. distributed


# each logp/dlogp call is a round trip to the cluster (50-150 ms on the 2-core machines):
# a small model and fewer iterations than elsewhere
CLUSTER_DRAWS = {"draws": 10, "tune": 10}


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "cores, mp_ctx",
    [
        (1, None),
        pytest.param(2, "fork", marks=FORK_WITH_THREADS),
        (2, "spawn"),
    ],
    ids=["one-process", "fork", "spawn"],
)
def test_sample_on_default_distributed_client(
    process_cluster, cores, mp_ctx, value_grad_functions, heavy_log, tmp_path_factory
):
    from distributed import Client

    expected, _ = reference("small-heavy", cores, tmp_path_factory, **CLUSTER_DRAWS)
    model = small_heavy_model()
    kwargs = {"chains": cores, "cores": cores, **CLUSTER_DRAWS}
    if mp_ctx is not None:
        kwargs["mp_ctx"] = mp_ctx

    value_grad_functions.clear()
    log = heavy_log("dask")  # set here, after the cluster's workers started: they don't log
    with Client(process_cluster) as c:  # the default client while sampling
        before = channel_calls(c)
        got = sample(model, "DASK", **kwargs)
        after = channel_calls(c)

    assert_compiled_by_dask(value_grad_functions, multi_task=True)
    for prefix in HEAVY_PREFIXES:
        ran = after.get(prefix, 0) - before.get(prefix, 0)
        assert ran > 0, f"no {prefix!r} stage was called on the cluster: {sorted(after)}"
    # ... and none ran here or in PyMC's sampler processes
    assert read_log(log) == []
    assert_same_draws(got, expected)


# ----------------------------------------------------------------------------- 4. functions


def points(model: pm.Model, n: int = 3) -> list[dict[str, np.ndarray]]:
    """The initial point and ``n`` random points of the model's value variables."""
    rng = np.random.default_rng(SEED)
    start = model.initial_point()
    out = [start]
    for _ in range(n):
        out.append({k: v + rng.normal(size=np.shape(v)) for k, v in start.items()})
    return out


@pytest.mark.parametrize("model_name", ["hierarchical", "heavy"])
def test_compile_logp_and_dlogp(model_name):
    model = MODELS[model_name]()
    with reference_run():
        ref_logp, ref_dlogp = model.compile_logp(), model.compile_dlogp()
    logp = model.compile_logp(mode="DASK")
    dlogp = model.compile_dlogp(mode="DASK")
    for f in (logp, dlogp):
        assert isinstance(f.f.maker.linker, DaskLinker)
    assert (not logp.f.maker.linker.plan.single_stage) == (model_name == "heavy")
    for point in points(model):
        assert_same_values(logp(point), ref_logp(point))
        assert_same_values(dlogp(point), ref_dlogp(point))


@pytest.mark.parametrize("model_name", ["hierarchical", "heavy"])
def test_logp_dlogp_function(model_name):
    model = MODELS[model_name]()
    with reference_run():
        ref = model.logp_dlogp_function(ravel_inputs=True)
    f = model.logp_dlogp_function(ravel_inputs=True, mode="DASK")
    assert_compiled_by_dask([f], multi_task=model_name == "heavy")
    for point in points(model):
        q = np.concatenate([np.ravel(point[v.name]) for v in model.value_vars])
        got, expected = f(q, extra_vars={}), ref(q, extra_vars={})
        assert len(got) == len(expected) == 2
        for g, e in zip(got, expected):
            assert_same_values(g, e)


@pytest.mark.skipif(not PYMC_6, reason="freeze_model and its cached functions are PyMC 6")
def test_logp_dlogp_function_of_frozen_model():
    """A frozen model hands out ``Function.copy``s of one cached compiled function."""
    from pymc.model.transform.optimization import freeze_model

    model = freeze_model(heavy_model())
    with reference_run():
        ref = model.logp_dlogp_function(ravel_inputs=True)
    first = model.logp_dlogp_function(ravel_inputs=True, mode="DASK")
    second = model.logp_dlogp_function(ravel_inputs=True, mode="DASK")
    assert_compiled_by_dask([first, second], multi_task=True)
    for point in points(model):
        q = np.concatenate([np.ravel(point[v.name]) for v in model.value_vars])
        expected = ref(q, extra_vars={})
        for f in (first, second):
            for g, e in zip(f(q, extra_vars={}), expected):
                assert_same_values(g, e)


@pytest.mark.parametrize("model_name", ["hierarchical", "heavy"])
def test_pm_compile_logp_graph(model_name):
    model = MODELS[model_name]()
    inputs = model.value_vars
    outputs = [model.logp(), model.logp(sum=False)[0], model.dlogp(vars=[model["mu"]])]
    with reference_run():
        ref = pm.compile(inputs, outputs)
    f = pm.compile(inputs, outputs, mode="DASK")
    assert isinstance(f.maker.linker, DaskLinker)
    for point in points(model):
        args = [point[v.name] for v in inputs]
        for g, e in zip(f(*args), ref(*args)):
            assert_same_values(g, e)


@pytest.mark.parametrize("heavy", [False, True], ids=["cheap", "heavy"])
def test_pm_compile_random_draws(heavy):
    """``pm.compile`` seeds the graph's generators and updates them on every call."""

    def build():
        x = pm.Normal.dist(0.0, 1.0, size=5)
        s = pm.HalfNormal.dist(2.0)
        if heavy:
            return [x, s, HeavyScale(3.0)(x) * s, HeavyNormalLogp(2.0)(x)]
        return [x, s, 3.0 * x * s]

    with reference_run():
        ref = pm.compile([], build(), random_seed=SEED)
        expected = [ref() for _ in range(3)]
    f = pm.compile([], build(), random_seed=SEED, mode="DASK")
    assert isinstance(f.maker.linker, DaskLinker)
    assert (not f.maker.linker.plan.single_stage) == heavy
    got = [f() for _ in range(3)]
    assert not np.array_equal(got[0][0], got[1][0]), "the generator was not updated"
    for g_call, e_call in zip(got, expected):
        for g, e in zip(g_call, e_call):
            assert_same_values(g, e)


def test_sample_prior_predictive(dask_linked):
    model = hierarchical_model()
    with model:
        expected = pm.sample_prior_predictive(draws=10, random_seed=SEED)
        assert not dask_linked
        got = pm.sample_prior_predictive(
            draws=10, random_seed=SEED, compile_kwargs={"mode": "DASK"}
        )
    assert dask_linked, "the forward-sampling function was not linked by DaskLinker"
    for group in ("prior", "prior_predictive"):
        for name in expected[group].data_vars:
            assert_same_values(got[group][name].values, expected[group][name].values)
