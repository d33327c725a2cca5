"""PyMC models whose log-density is, or is not, a sum over rows of data: the models of the
sharding analysis (``test_shard.py``) and of sharded execution on a cluster
(``test_sharded.py``).

``rows`` is the number of data rows; ``rng`` a seed, or a module's numpy Generator (the data
then depend on what its tests drew before)."""

from __future__ import annotations

import numpy as np
import pymc as pm
import pytensor.tensor as pt


def design(rows: int, k: int = 3, rng=0):
    """``X`` of ``rows`` x ``k`` normal values, and ``y = X @ (1, ..., k) + 0.5 + noise``."""
    rng = np.random.default_rng(rng)
    X = rng.normal(size=(rows, k))
    return X, X @ np.arange(1.0, k + 1) + 0.5 + rng.normal(size=rows)


def linear_regression(rows: int, rng=0):
    """y ~ N(X @ beta + alpha, sigma), of ``design(rows)``."""
    X, y = design(rows, rng=rng)
    with pm.Model() as model:
        beta = pm.Normal("beta", 0, 1, shape=3)
        alpha = pm.Normal("alpha")
        sigma = pm.HalfNormal("sigma")
        pm.Normal("y", X @ beta + alpha, sigma, observed=y)
    return model


def logistic_regression(rows: int, rng=0):
    """y > 0 ~ Bernoulli(logit_p=X @ beta), of ``design(rows)``: Bernoulli checks that
    0 <= p <= 1 over all the rows."""
    X, y = design(rows, rng=rng)
    with pm.Model() as model:
        beta = pm.Normal("beta", 0, 1, shape=3)
        pm.Bernoulli("y", logit_p=X @ beta, observed=(y > 0).astype("int64"))
    return model


def hierarchical(rows: int, rng=0, groups: int = 6):
    """y ~ N(a[group] + b * x, sigma): a parameter vector indexed by each row's group."""
    rng = np.random.default_rng(rng)
    group = rng.integers(0, groups, size=rows)
    x = rng.normal(size=rows)
    y = np.arange(groups)[group] + 0.5 * x + rng.normal(size=rows)
    with pm.Model() as model:
        a = pm.Normal("a", 0, 1, shape=groups)
        b = pm.Normal("b")
        sigma = pm.HalfNormal("sigma")
        pm.Normal("y", a[group] + b * x, sigma, observed=y)
    return model


def data_model(rows: int, rng=0):
    """A linear regression of ``pm.Data`` "X" and "y_obs" (``design(rows)``), whose
    observed variable takes its length from X: ``pm.set_data`` may change their values
    and their number of rows."""
    X, y = design(rows, rng=rng)
    with pm.Model() as model:
        Xd = pm.Data("X", X)
        yd = pm.Data("y_obs", y)
        beta = pm.Normal("beta", 0, 1, shape=3)
        sigma = pm.HalfNormal("sigma")
        pm.Normal("y", Xd @ beta, sigma, observed=yd, shape=Xd.shape[0])
    return model


def gp_model(rows: int, rng=0, data: bool = False):
    """A Gaussian process over ``rows`` points x of [0, 1] (as ``pm.Data`` "x" with
    ``data``): an MvNormal whose covariance pairs every row with every other."""
    rng = np.random.default_rng(rng)
    x = np.linspace(0, 1, rows)
    y = np.sin(6 * x) + 0.1 * rng.normal(size=rows)
    with pm.Model() as model:
        ls = pm.HalfNormal("ls")
        eta = pm.HalfNormal("eta")
        xs = pm.Data("x", x) if data else x
        d = xs[:, None] - xs[None, :]
        cov = eta**2 * pt.exp(-0.5 * d**2 / ls**2) + 1e-6 * np.eye(rows)
        pm.MvNormal("y", mu=np.zeros(rows), cov=cov, observed=y)
    return model


def ar1_data_model(rows: int, rng=0):
    """An AR(1) of ``pm.Data`` "y_series": the graph pairs y_series[1:] with
    y_series[:-1], shifting the rows."""
    rng = np.random.default_rng(rng)
    with pm.Model() as model:
        yd = pm.Data("y_series", np.cumsum(rng.normal(size=rows)) * 0.1)
        rho = pm.Normal("rho")
        sigma = pm.HalfNormal("sigma")
        pm.Normal("y_t", rho * yd[:-1], sigma, observed=yd[1:])
    return model
