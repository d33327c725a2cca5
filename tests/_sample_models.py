"""PyMC models for the dt.sample tests, importable by a subprocess that samples them too."""

from __future__ import annotations

import numpy as np

#: what a small run of the tests samples
RUN = dict(draws=30, tune=40, chains=3, random_seed=20261202, progressbar=False)
#: how pm.sample runs the chains it is compared with: as dt.sample does, from a pickled
#: step method.  On PyTensor 3, Numba compiles with fast-math flags, and a step method
#: compiled in a process can differ in its last bits from the same step method unpickled
#: in another (143 of 900 logp+dlogp evaluations of ``hierarchical()`` on a fresh
#: compile cache, none with ``numba__fastmath=False``): chains sampled in the process
#: that compiled (``cores=1``, or fork) then agree with dt.sample's to round-off only.
PICKLED = dict(cores=2, mp_ctx="spawn")
#: sampler statistics that time the sampler: they differ between any two runs
TIMING = {"process_time_diff", "perf_counter_diff", "perf_counter_start"}


def hierarchical(groups: int = 6, shift: float = 0.0):
    """Eight-schools-like: group means around a common mean, non-centred."""
    import pymc as pm

    rng = np.random.default_rng(7)
    effects = rng.normal(size=groups)
    y = effects[:, None] + rng.normal(scale=0.5, size=(groups, 12)) + shift
    with pm.Model() as model:
        mu = pm.Normal("mu", 0, 5)
        tau = pm.HalfNormal("tau", 2)
        z = pm.Normal("z", 0, 1, shape=(groups, 1))
        sigma = pm.HalfNormal("sigma", 2)
        pm.Deterministic("theta", mu + tau * z)
        pm.Normal("y", mu + tau * z, sigma, observed=y)
    return model


def groups_of(result) -> dict:
    """Group name -> Dataset of an InferenceData (PyMC 5) or a DataTree (PyMC 6)."""
    if hasattr(result, "children"):
        return {name: node.to_dataset() for name, node in result.children.items()}
    return {name: result[name] for name in result.groups()}


def assert_same_draws(got, expected) -> None:
    """Every group of draws equal bit for bit (timing statistics aside)."""
    got, expected = groups_of(got), groups_of(expected)
    sampled = [g for g in expected if "posterior" in g or "sample_stats" in g]
    assert sampled and sorted(g for g in got if g in sampled) == sorted(sampled)
    for group in sampled:
        for name, values in expected[group].data_vars.items():
            if name in TIMING:
                continue
            np.testing.assert_array_equal(
                got[group][name].values, values.values, err_msg=f"{group}/{name}"
            )


class Gaussian:
    """A remote model: the log-density of fixed data under N(mu, 1), and its gradient."""

    def __init__(self):
        self.data = np.random.default_rng(3).normal(1.0, 1.0, size=50)

    def logp_grad(self, mu):
        r = self.data - mu[0]
        return -0.5 * float(r @ r), np.array([r.sum()])


def with_remote_likelihood(client):
    """A model whose likelihood is a call of a ``dt.RemoteModel`` on the cluster."""
    import pymc as pm
    import pytensor.tensor as pt

    import dasktensor as dt

    remote = dt.RemoteModel(Gaussian, name="gaussian", scheduler=client)
    likelihood = remote.logp_grad_op("logp_grad", [pt.dvector])
    with pm.Model() as model:
        mu = pm.Normal("mu", 0.0, 5.0, shape=1)
        pm.Potential("likelihood", likelihood(mu)[0])
    return model, remote


def regression(rows: int = 4000):
    """A linear regression whose log-density is a sum over its observed rows."""
    import pymc as pm

    rng = np.random.default_rng(1)
    X = rng.normal(size=(rows, 2))
    y = X @ np.array([1.0, -1.0]) + rng.normal(size=rows)
    with pm.Model() as model:
        b = pm.Normal("b", 0, 1, shape=2)
        s = pm.HalfNormal("s", 1)
        pm.Normal("y", X @ b, s, observed=y)
    return model


def refusing_after(marker: str):
    """A model whose log-density raises FloatingPointError once the file ``marker`` exists
    (in whichever process evaluates it: the workers, for dt.sample)."""
    import os

    import pymc as pm
    import pytensor.tensor as pt

    import dasktensor as dt

    @dt.logp_op(itypes=[pt.dscalar], name="refusing")
    def refusing(mu):
        if os.path.exists(marker):
            raise FloatingPointError(f"the model refuses mu={float(mu):.3f}")
        return -0.5 * float(mu) ** 2

    with pm.Model() as model:
        mu = pm.Normal("mu", 0, 1)
        pm.Potential("refusing", refusing(mu))
    return model
