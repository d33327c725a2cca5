"""The model behind ``dasktensor demo``: a PyMC model whose likelihood is remote model calls.

Each *site* stands for an expensive model owned by someone else (a simulator, a solver, a
neural surrogate): it holds its own data, and its ``logp_grad`` takes ``delay`` seconds
before returning the log-likelihood of a normal model with mean ``mu`` and log standard
deviation ``log_sigma``, and its gradient.  The PyMC model puts priors on ``mu`` and
``log_sigma`` and adds one likelihood term per site; the terms do not depend on each
other, so one evaluation of the model's log-density can call all sites at once.
"""

from __future__ import annotations

import functools
import string
import time

import numpy as np


class Site:
    """A slow model with its own data: ``logp_grad([mu, log_sigma]) -> (logp, grad)``."""

    def __init__(self, seed: int, delay: float, n: int = 250):
        rng = np.random.default_rng(seed)
        self.data = rng.normal(loc=1.5, scale=0.8, size=n)
        self.delay = float(delay)
        self.calls = 0

    def logp_grad(self, params):
        self.calls += 1
        time.sleep(self.delay)  # the expensive part of a real model
        mu, log_sigma = float(params[0]), float(params[1])
        r = (self.data - mu) * np.exp(-log_sigma)
        logp = float(np.sum(-0.5 * r * r) - r.size * (log_sigma + 0.5 * np.log(2 * np.pi)))
        grad = np.array([np.sum(r) * np.exp(-log_sigma), np.sum(r * r) - r.size])
        return logp, grad


def ideal_speedup(models: int, chains: int, cores: int, workers: int, concurrency: int = 1):
    """The demo's best possible speed-up over the serial run, and why.

    Each evaluation of the log-density calls every site once.  The serial run makes these
    calls one after another: ``models`` calls per evaluation.  Remotely, the
    ``min(chains, cores)`` sampler processes each call every site at once; a site has a
    replica on each worker that runs ``concurrency`` calls at a time (on the worker's call
    server, not its task threads), so each site serves ``workers * concurrency`` calls at
    once and the processes' calls to it take ``ceil(processes / that)`` rounds.

    Returns
    -------
    (float, str)
        The ideal ratio of serial to remote sampling time, and the reason in words.

    Examples
    --------
    >>> ideal_speedup(models=4, chains=2, cores=2, workers=4)
    (4.0, '4 calls of an evaluation at once')
    >>> ideal_speedup(models=4, chains=4, cores=4, workers=2)
    (2.0, '4 calls of an evaluation at once, 2 rounds: 4 processes share 2 replicas a site')
    """
    processes = max(1, min(chains, cores))
    slots = max(1, workers * concurrency)
    rounds = -(-processes // slots)
    why = f"{models} calls of an evaluation at once"
    if rounds > 1:
        why += f", {rounds} rounds: {processes} processes share {slots} replicas a site"
    return models / rounds, why


def site_names(n: int) -> list[str]:
    return [f"site-{string.ascii_lowercase[i]}" for i in range(n)]


def remote_sites(n: int, delay: float, seed: int = 0, scheduler=None):
    """``n`` RemoteModels, one per site, each built on the workers by ``Site(seed+i)``."""
    import dasktensor as dt

    return [
        dt.RemoteModel(functools.partial(Site, seed + i, delay), name=name, scheduler=scheduler)
        for i, name in enumerate(site_names(n))
    ]


def site_ops(models):
    """One ``LogpGradOp`` per remote site."""
    import pytensor.tensor as pt

    return [m.logp_grad_op("logp_grad", [pt.dvector], name=m.name) for m in models]


def local_site_ops(n: int, delay: float, seed: int = 0):
    """The same sites computed in this process: the serial baseline."""
    import pytensor.tensor as pt

    import dasktensor as dt

    return [
        dt.LogpGradOp(Site(seed + i, delay).logp_grad, [pt.dvector], name=name)
        for i, name in enumerate(site_names(n))
    ]


def build_model(ops):
    """Priors on ``mu`` and ``log_sigma``, one likelihood term per op."""
    import pymc as pm
    import pytensor.tensor as pt

    with pm.Model() as model:
        mu = pm.Normal("mu", 0.0, 5.0)
        log_sigma = pm.Normal("log_sigma", 0.0, 1.0)
        params = pt.stack([mu, log_sigma])
        for op in ops:
            pm.Potential(op.dasktensor_name, op(params)[0])
    return model


def serial_mode():
    """PyTensor's default mode without the rewrites that run independent calls at once."""
    from pytensor.compile.mode import get_default_mode

    return get_default_mode().excluding("dasktensor_parallel_calls", "dasktensor_remote_calls")
