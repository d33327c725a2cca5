"""P6: posterior predictive sampling of a linear regression, side by side with PyMC and NumPyro.

The model: ``y ~ Normal(a + b * x, sigma)`` with ``a, b ~ Normal(0, 5)``, ``sigma ~
HalfNormal(1)``; the posterior has 4 chains x 1,000 draws, the predictive 1,000
observations per draw (4 million normal draws, 32 MB of float64).  The posterior is not
sampled: only its values matter for the predictive timing, so it is built from random
draws around a = 1, b = 2, sigma = 1 as the trace type of this PyMC line
(``InferenceData`` on PyMC 5, ``DataTree`` on PyMC 6), as in ``tests/test_predictive.py``.

Timed warm (every variant called before timing), in interleaved rounds (``compare``):

* ``dt.sample_posterior_predictive(..., compute=True, progressbar=False)``: the threaded
  scheduler in this process, default chunks (each call also runs PyMC on one draw and
  finds the vectorised graph an earlier call compiled: what a user pays per call once
  warm; the fixed part is printed as the cost of a call on a one-draw trace);
* ``pm.sample_posterior_predictive(..., progressbar=False)``: PyMC's loop over draws;
* NumPyro's ``Predictive(model, posterior_samples, parallel=True)``: the same model
  written in NumPyro, the same a, b, sigma draws flattened to 4,000 samples, vmapped on
  JAX (CPU, float64 via ``jax_enable_x64``, result blocked until ready); beside it, as
  information, the same ``Predictive`` inside ``jax.jit``;
* the floor: NumPy drawing the same normals in one call on one core,
  ``rng.normal(loc=a[:, None] + b[:, None] * x, scale=sigma[:, None])``.

Targets: dt / NumPyro <= 1.0 and dt / NumPy floor <= 1.5; the latter also for a small job (4
chains x 250 draws x 1,000 observations), where a call's fixed cost counts most.  The same
ratios are reported for a job 100x larger (100,000 observations: 400 million draws, 3.2
GB per result), where each variant is sampled fewer times (PyMC fewest); there every call
is timed on its own,
with the previous result freed and garbage collected outside the timed region.  There the
results' memory counts: each variant allocates and first touches GBs (dt: the chunks, then
the assembled result; the floor: two temporaries of the result's size), which on a VM
whose memory is backed lazily can cost more than drawing the numbers.

NumPyro and JAX come with the ``benchmarks`` extra; without them the NumPyro columns are
reported as unavailable (with the import error).

Run: ``python benchmarks/bench_p6_predictive.py [--small-only]``
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Row, compare, fmt_time, load_row, print_rows, print_table, quiet, versions_line

NAME = "p6-predictive"
CHAINS = 4
DRAWS = 1000
SMALL_DRAWS = 250
N_OBS = 1000
N_OBS_LARGE = 100_000

DT = "dt.sample_posterior_predictive"
PM = "pm.sample_posterior_predictive"
NP = "numpyro Predictive(parallel)"
NPJ = "numpyro jit(Predictive) (info)"
FLOOR = "numpy floor (1 core)"


# ----------------------------------------------------------------------------- posterior


def posterior_draws(seed: int = 1, draws: int = DRAWS):
    """Draws of a, b, sigma, each of shape (chains, draws), near a=1, b=2, sigma=1."""
    import numpy as np

    rng = np.random.default_rng(seed)
    shape = (CHAINS, draws)
    return {
        "a": rng.normal(1.0, 0.05, shape),
        "b": rng.normal(2.0, 0.05, shape),
        "sigma": np.exp(rng.normal(0.0, 0.03, shape)),
    }


def trace_of(draws):
    """The trace type of this PyMC line (InferenceData or DataTree) holding the draws."""
    import numpy as np
    import pymc as pm
    import xarray as xr

    chains, n_draws = draws["a"].shape
    posterior = xr.Dataset(
        {k: (("chain", "draw"), v) for k, v in draws.items()},
        coords={"chain": np.arange(chains), "draw": np.arange(n_draws)},
    )
    if pm.__version__.startswith("5"):
        import arviz as az

        return az.InferenceData(posterior=posterior)
    return xr.DataTree.from_dict({"posterior": posterior})


def group_of(result, name: str = "posterior_predictive"):
    """A group of an InferenceData or a DataTree, as a Dataset."""
    return result[name].to_dataset() if hasattr(result, "children") else result[name]


def pymc_model(x):
    import numpy as np
    import pymc as pm

    with pm.Model() as model:
        a = pm.Normal("a", 0.0, 5.0)
        b = pm.Normal("b", 0.0, 5.0)
        sigma = pm.HalfNormal("sigma", 1.0)
        pm.Normal("y", a + b * x, sigma, observed=np.zeros(len(x)))
    return model


# ----------------------------------------------------------------------------- NumPyro


def numpyro_variants(draws, x) -> tuple[dict, str]:
    """The NumPyro variants (name -> callable), or {} and why they are unavailable."""
    try:
        import jax
        import numpyro
        import numpyro.distributions as dist
        from numpyro.infer import Predictive
    except ImportError as err:  # not installed on this line
        return {}, f"{type(err).__name__}: {err}"
    jax.config.update("jax_enable_x64", True)  # float64 draws, as PyMC and NumPy make
    import jax.numpy as jnp

    def model(x):
        a = numpyro.sample("a", dist.Normal(0.0, 5.0))
        b = numpyro.sample("b", dist.Normal(0.0, 5.0))
        sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
        numpyro.sample("y", dist.Normal(a + b * x, sigma))

    samples = {k: jnp.asarray(v.reshape(-1)) for k, v in draws.items()}
    predictive = Predictive(model, samples, parallel=True, return_sites=["y"])
    xj = jnp.asarray(x)
    key = jax.random.PRNGKey(0)
    jitted = jax.jit(lambda key, x: predictive(key, x)["y"])
    fns = {
        NP: lambda: jax.block_until_ready(predictive(key, xj)["y"]),
        NPJ: lambda: jax.block_until_ready(jitted(key, xj)),
    }
    return fns, f"jax {jax.__version__}, numpyro {numpyro.__version__}"


# ----------------------------------------------------------------------------- timing


def timed_rounds(fns, repeats: dict[str, int], warmup: int = 1) -> dict[str, float]:
    """Median seconds per call, in interleaved rounds, freeing every result (and collecting
    garbage) outside the timed region: for results of several GB."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
            gc.collect()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(max(repeats.values())):
        names = list(fns) if r % 2 == 0 else list(reversed(fns))
        for name in names:
            if r >= repeats[name]:
                continue
            t0 = time.perf_counter()
            result = fns[name]()
            samples[name].append(time.perf_counter() - t0)
            del result
            gc.collect()
    return {k: statistics.median(v) for k, v in samples.items()}


def variants(draws, n_obs: int, numpyro: bool):
    """The variants of one job size, and a check of dt's draws against the posterior."""
    import numpy as np
    import pymc as pm

    import dasktensor as dt

    x = np.linspace(-2.0, 2.0, n_obs)
    model = pymc_model(x)
    idata = trace_of(draws)
    a, b, sigma = (draws[k].reshape(-1) for k in ("a", "b", "sigma"))
    rng = np.random.default_rng(5)

    def check():
        y = np.asarray(
            group_of(
                dt.sample_posterior_predictive(
                    idata, model=model, compute=True, progressbar=False, random_seed=3
                )
            )["y"]
        )
        n_draws = draws["a"].shape[1]
        assert y.shape == (CHAINS, n_draws, n_obs), y.shape
        flat = y.reshape(-1, n_obs)
        for i in (0, 123, CHAINS * n_draws - 1):  # draws around the posterior's a + b x
            z = (flat[i] - (a[i] + b[i] * x)) / sigma[i]
            assert abs(z.mean()) < 5 / np.sqrt(n_obs) and abs(z.std() - 1) < 0.2, (i, z)

    fns = {
        DT: lambda: dt.sample_posterior_predictive(
            idata, model=model, compute=True, progressbar=False
        ),
        PM: lambda: pm.sample_posterior_predictive(idata, model=model, progressbar=False),
        FLOOR: lambda: rng.normal(loc=a[:, None] + b[:, None] * x, scale=sigma[:, None]),
    }
    info = ""
    if numpyro:
        extra, info = numpyro_variants(draws, x)
        fns.update(extra)
    return fns, check, info


def report(times: dict[str, float], title: str):
    base = times[FLOOR]
    rows = [(k, fmt_time(v), f"{v / base:.3f}", f"{times[DT] / v:.3f}") for k, v in times.items()]
    print_table(["variant", "median", "/ numpy floor", "dt / variant"], rows, title=title)


def rows_of(times: dict[str, float], label: str, why_no_numpyro: str) -> list[Row]:
    rows = []
    if NP in times:
        rows.append(Row(NAME, f"dt/numpyro {label}", times[DT] / times[NP], 1.0))
        rows.append(Row(NAME, f"dt/numpyro-jit {label}", times[DT] / times[NPJ]))
    else:
        rows.append(Row(NAME, f"dt/numpyro {label}: unavailable ({why_no_numpyro})", float("nan")))
    rows += [
        Row(NAME, f"dt/numpy-floor {label}", times[DT] / times[FLOOR], 1.5),
        Row(NAME, f"dt/pymc {label}", times[DT] / times[PM]),
        Row(NAME, f"dt {label}", times[DT], unit="s"),
    ]
    return rows


def main(repeat: int = 11, large: bool = True, large_repeat: int = 5) -> list[Row]:
    quiet()
    import logging
    import warnings

    import numpy as np

    warnings.filterwarnings("ignore", module="pymc")
    import pymc  # noqa: F401  (it sets its logger's level when imported)

    logging.getLogger("pymc").setLevel(logging.WARNING)  # "Sampling: [y]" at every call
    print(f"[{NAME}] {versions_line()}")
    draws = posterior_draws()

    # --- the job of the brief: 4 x 1,000 draws x 1,000 observations
    fns, check, info = variants(draws, N_OBS, numpyro=True)
    has_numpyro = NP in fns
    why = "" if has_numpyro else info
    print(f"[{NAME}] NumPyro: {info if has_numpyro else 'unavailable: ' + info}")
    check()
    # the per-call cost of dt that does not grow with the draws: PyMC's one-draw run and
    # the vectorised graph's compilation, on a one-draw trace
    import dasktensor as dt

    one = {k: v[:1, :1] for k, v in draws.items()}
    one_trace = trace_of(one)
    one_model = pymc_model(np.linspace(-2.0, 2.0, N_OBS))
    fixed = compare(
        {
            "dt, one draw": lambda: dt.sample_posterior_predictive(
                one_trace, model=one_model, compute=True, progressbar=False
            )
        },
        repeat=repeat,
    )["dt, one draw"]
    times = compare(fns, repeat=repeat, warmup=2)
    title = f"[{NAME}] {CHAINS} x {DRAWS} draws x {N_OBS} obs, median of {repeat} rounds"
    report(times, title)
    print(f"[{NAME}] dt's fixed cost per call (one-draw trace): {fmt_time(fixed)}")
    rows = rows_of(times, f"{N_OBS // 1000}k obs", why)
    rows.append(Row(NAME, "dt fixed cost per call (1 draw)", fixed, unit="s"))

    # --- a small job, where the fixed cost of a call counts most: 4 x 250 draws
    small, check, _ = variants(posterior_draws(draws=SMALL_DRAWS), N_OBS, numpyro=False)
    check()
    times = compare({k: small[k] for k in (DT, FLOOR)}, repeat=repeat, warmup=2)
    report_small = f"[{NAME}] {CHAINS} x {SMALL_DRAWS} draws x {N_OBS} obs, median of {repeat}"
    print(f"{report_small}: dt {fmt_time(times[DT])}, numpy floor {fmt_time(times[FLOOR])}")
    rows.append(Row(NAME, f"dt/numpy-floor small job ({CHAINS} x {SMALL_DRAWS} draws)",
                    times[DT] / times[FLOOR], 1.5))  # fmt: skip

    # --- 100x larger: 100,000 observations, 3.2 GB per result
    if large:
        del fns
        gc.collect()
        fns, check, _ = variants(draws, N_OBS_LARGE, numpyro=has_numpyro)
        check()
        gc.collect()
        repeats = {k: large_repeat for k in fns}
        repeats[PM] = max(1, large_repeat // 2)
        times = timed_rounds(fns, repeats)
        title = (
            f"[{NAME}] {CHAINS} x {DRAWS} draws x {N_OBS_LARGE} obs, median of "
            f"{large_repeat} rounds ({repeats[PM]} for PyMC)"
        )
        report(times, title)
        rows += rows_of(times, f"{N_OBS_LARGE // 1000}k obs", why)

    rows.append(load_row(NAME))
    print_rows(rows, title=f"[{NAME}] summary")
    return rows


if __name__ == "__main__":
    from _common import save_results

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small-only", action="store_true", help="skip the 100x larger job")
    parser.add_argument("--repeat", type=int, default=11)
    parser.add_argument("--large-repeat", type=int, default=5)
    parser.add_argument("--no-save", action="store_true", help="do not write the results file")
    args = parser.parse_args()
    rows = main(repeat=args.repeat, large=not args.small_only, large_repeat=args.large_repeat)
    if not args.no_save:
        save_results(NAME, rows)
