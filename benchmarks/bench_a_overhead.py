"""(a) Overhead of the DASK mode on a graph with nothing to parallelise.

A PyMC hierarchical normal model (20 groups, 500 observations) compiles its
``logp_dlogp_function`` in the default mode and in the ``"DASK"`` mode; both are
evaluated at the initial point many times.  The planner should make the DASK version a
single in-process stage compiled by the line's own backend, so the ratio DASK/default
should be ~1 (target <= 1.05).

PyMC API note (checked in ``pymc/model/core.py`` of both lines): neither PyMC 5.28 nor
PyMC 6.4 takes ``compile_kwargs=`` in ``Model.logp_dlogp_function``; its ``**kwargs`` go
to ``ValueGradFunction`` and from there to ``pymc.pytensorf.compile``, so the mode is
given as ``mode="DASK"`` (``compile_kwargs={"mode": "DASK"}`` fails on both lines with
``TypeError: function() got an unexpected keyword argument 'compile_kwargs'``).

Run: ``python benchmarks/bench_a_overhead.py``
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (
    Row,
    compare,
    load_row,
    print_ratio_table,
    print_rows,
    quiet,
    versions_line,
)

NAME = "a-overhead"
N_GROUPS = 20
N_OBS = 500


def build_model():
    import numpy as np
    import pymc as pm

    rng = np.random.default_rng(42)
    group = rng.integers(0, N_GROUPS, N_OBS)
    true_theta = rng.normal(1.0, 2.0, N_GROUPS)
    y = rng.normal(true_theta[group], 1.5)
    with pm.Model() as model:
        mu = pm.Normal("mu", 0.0, 5.0)
        tau = pm.HalfNormal("tau", 5.0)
        z = pm.Normal("z", 0.0, 1.0, shape=N_GROUPS)  # non-centred
        theta = pm.Deterministic("theta", mu + tau * z)
        sigma = pm.HalfNormal("sigma", 2.0)
        pm.Normal("y", theta[group], sigma, observed=y)
    return model


def compile_logp_dlogp(model, mode=None):
    """``model.logp_dlogp_function(ravel_inputs=True)``, optionally in ``mode``.

    The mode travels through ``**kwargs`` to ``pymc.pytensorf.compile`` on both lines
    (see the module docstring: there is no ``compile_kwargs=`` parameter).
    """
    import dasktensor  # noqa: F401  (importing dasktensor registers the "DASK" mode)

    kwargs = {} if mode is None else {"mode": mode}
    fn = model.logp_dlogp_function(ravel_inputs=True, **kwargs)
    fn.set_extra_values({})  # no extra (non-gradient) variables in this model
    return fn


def main(repeat: int = 601, number: int = 20) -> list[Row]:
    quiet()
    import numpy as np
    from pymc.blocking import DictToArrayBijection

    import dasktensor as dt
    from dasktensor._linker import DaskLinker

    print(f"[{NAME}] {versions_line()}")
    model = build_model()
    f_default = compile_logp_dlogp(model)
    f_dask = compile_logp_dlogp(model, "DASK")
    f_default2 = compile_logp_dlogp(model)  # A/A control: the noise floor of the ratio

    linker = f_dask._pytensor_function.maker.linker
    assert isinstance(linker, DaskLinker), type(linker)
    plan = linker.plan
    print(
        f"default linker: {type(f_default._pytensor_function.maker.linker).__name__}; "
        f"DASK linker: {type(linker).__name__}"
    )
    print(plan)

    x0 = DictToArrayBijection.map(model.initial_point(0)).data
    lp0, g0 = f_default(x0)
    lp1, g1 = f_dask(x0)
    np.testing.assert_allclose(lp0, lp1, rtol=1e-10)
    np.testing.assert_allclose(g0, g1, rtol=1e-10)
    print(f"logp at the initial point: {float(lp0):.6f} (both modes); {x0.size} free parameters")

    raw_default = f_default._pytensor_function
    raw_dask = f_dask._pytensor_function
    wrapped = dt.DaskFunction(raw_dask)  # what dt.function adds around a Function
    times = compare(
        {
            "default (ValueGradFunction)": lambda: f_default(x0),
            "DASK (ValueGradFunction)": lambda: f_dask(x0),
            "default again (A/A control)": lambda: f_default2(x0),
            "default (raw Function)": lambda: raw_default(x0),
            "DASK (raw Function)": lambda: raw_dask(x0),
            "DASK (raw, DaskFunction wrapper)": lambda: wrapped(x0),
        },
        repeat=repeat,
        number=number,
        warmup=50,
    )
    print_ratio_table(
        {
            k: times[k]
            for k in (
                "default (ValueGradFunction)",
                "DASK (ValueGradFunction)",
                "default again (A/A control)",
            )
        },
        "default (ValueGradFunction)",
        title=f"per-call median, {repeat} interleaved samples x {number} calls",
    )
    print_ratio_table(
        {
            k: times[k]
            for k in (
                "default (raw Function)",
                "DASK (raw Function)",
                "DASK (raw, DaskFunction wrapper)",
            )
        },
        "default (raw Function)",
    )
    ratio = times["DASK (ValueGradFunction)"] / times["default (ValueGradFunction)"]
    raw_ratio = times["DASK (raw Function)"] / times["default (raw Function)"]
    rows = [
        Row(NAME, "plan tasks", len(plan.tasks), 1),
        Row(NAME, "default per call", times["default (ValueGradFunction)"], unit="s"),
        Row(NAME, "DASK per call", times["DASK (ValueGradFunction)"], unit="s"),
        Row(NAME, "DASK/default (logp_dlogp_function)", ratio, 1.05),
        Row(NAME, "DASK/default (raw Function)", raw_ratio, 1.05),
        Row(
            NAME,
            "default#2/default (A/A noise control)",
            times["default again (A/A control)"] / times["default (ValueGradFunction)"],
        ),
        Row(
            NAME,
            "DaskFunction wrapper/default (raw)",
            times["DASK (raw, DaskFunction wrapper)"] / times["default (raw Function)"],
        ),
        load_row(NAME),
    ]
    print_rows(rows, title=f"[{NAME}] summary")
    return rows


if __name__ == "__main__":
    from _common import save_results

    save_results(NAME, main())  # not saved with DASKTENSOR_BENCH_NO_SAVE=1
