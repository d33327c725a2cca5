"""PyMC models and traces shared by the tests of the vectorised fronts over a posterior
(posterior predictive, log-likelihood), and how their results are read on either line."""

from __future__ import annotations

import warnings

import numpy as np
import pymc as pm

SEED = 20261130
RNG = np.random.default_rng(SEED)
DRAWS = {"draws": 400, "tune": 300, "chains": 2}


def sample(model):
    with model, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pm.sample(
            **DRAWS, random_seed=SEED, progressbar=False, compute_convergence_checks=False
        )


def pymc_predictive(idata, model, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pm.sample_posterior_predictive(
            idata, model=model, random_seed=SEED, progressbar=False, **kwargs
        )


# ----------------------------------------------------------------------------- models

X = np.linspace(-2.0, 2.0, 30)


def linear_regression(noise_scale: float = 1.0):
    with pm.Model(coords={"obs": np.arange(len(X))}) as model:
        a = pm.Normal("a", 0.0, 5.0)
        b = pm.Normal("b", 0.0, 5.0)
        sigma = pm.HalfNormal("sigma", 1.0)
        mu = pm.Deterministic("mu", a + b * X, dims="obs")
        pm.Normal("y", mu, sigma * noise_scale, observed=1.0 + 2.0 * X + RNG.normal(size=30))
    return model


def hierarchical():
    groups = np.repeat(np.arange(4), 6)
    coords = {"group": ["a", "b", "c", "d"], "obs": np.arange(24)}
    with pm.Model(coords=coords) as model:
        mu = pm.Normal("mu", 0.0, 5.0)
        tau = pm.HalfNormal("tau", 2.0)
        offset = pm.Normal("offset", 0.0, 1.0, dims="group")
        theta = pm.Deterministic("theta", mu + tau * offset, dims="group")
        y = np.array([1.0, 2.0, -1.0, 3.0])[groups] + RNG.normal(size=24)
        pm.Normal("y", theta[groups], 1.0, observed=y, dims="obs")
    return model


def with_data():
    with pm.Model(coords={"obs": np.arange(20)}) as model:
        x = pm.Data("x", np.linspace(0.0, 1.0, 20), dims="obs")
        y_data = pm.Data("y_data", 3.0 * np.linspace(0.0, 1.0, 20) + RNG.normal(size=20) * 0.3)
        slope = pm.Normal("slope", 0.0, 5.0)
        sigma = pm.HalfNormal("sigma", 1.0)
        pm.Normal("y", slope * x, sigma, observed=y_data, shape=x.shape, dims="obs")
    return model


def multivariate():
    cov = np.array([[1.0, 0.5, 0.0], [0.5, 2.0, 0.3], [0.0, 0.3, 0.5]])
    with pm.Model(coords={"obs": np.arange(15), "dim": ["u", "v", "w"]}) as model:
        mu = pm.Normal("mu", 0.0, 3.0, dims="dim")
        obs = RNG.multivariate_normal([1.0, -1.0, 0.5], cov, size=15)
        pm.MvNormal("y", mu, cov=cov, observed=obs, dims=("obs", "dim"))
        pm.Deterministic("y_total", model["y"].sum(axis=-1), dims="obs")
    return model


MODELS = {
    "linear-regression": linear_regression,
    "hierarchical": hierarchical,
    "with-data": with_data,
    "multivariate": multivariate,
}
_TRACES: dict = {}


def trace(name):
    if name not in _TRACES:
        model = MODELS[name]()
        _TRACES[name] = (model, sample(model))
    return _TRACES[name]


# ----------------------------------------------------------------------------- comparison


def group_names(result) -> set[str]:
    return set(result.children) if hasattr(result, "children") else set(result.groups())


def group_of(result, name="posterior_predictive"):
    return result[name] if not hasattr(result, "children") else result[name].to_dataset()
