"""``dt.sample``: ``pm.sample``'s chains spread over a Dask cluster, checkpointed, resumable.

``pm.sample(cores=N)`` runs its chains in processes of the machine that calls it; a lost
process loses the run, and nothing can be continued.  ``dt.sample`` takes ``pm.sample``'s
arguments and returns its result, but its chains are Dask work that advances in segments
(:mod:`dasktensor.sampling._chains`): the caller keeps every chain's latest state, a segment lost
with its worker runs again elsewhere from that state, and with ``store=`` each finished
segment is written to disk (:mod:`dasktensor.sampling._store`) so that a run whose caller was
killed continues with ``resume=True``.

**It is pm.sample.**  ``pm.sample`` itself is called, with ``cores=1``; for the calling
thread only, its loop that runs the chains one after another (``_sample_many``) is
replaced by a :class:`~dasktensor.sampling._chains.ChainRunner`.  Seeds, initialisation, step
methods, traces, the result's type and groups and the convergence checks are therefore
PyMC's own on either line, and the draws are those of ``pm.sample`` with the same
arguments, whatever the number of workers, the segment sizes or the faults.  (What
differs: sampler statistics that time the sampler, ``process_time_diff`` and
``perf_counter_*``; and the log says where the chains run.)
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading

import numpy as np

from dasktensor._runtime import runtime
from dasktensor.cluster import (
    SchedulerLostError,
    default_client,
    is_client,
    lost_scheduler,
    scheduler_workers,
)

#: pm.sample arguments that say how to run chains in processes of this machine
_REFUSED = {
    "cores": "the chains run on the cluster's workers (one segment per worker thread at "
    "a time); start more workers or threads instead",
    "mp_ctx": "no process is started here; the chains run on the cluster's workers",
    "blas_cores": "workers set their own BLAS threads (dask worker --nthreads, or the "
    "OMP_NUM_THREADS of their environment)",
    "trace": "draws are kept by PyMC's default traces; store='run.zarr' keeps checkpoints",
}


def sample(draws: int = 1000, *, tune: int = 1000, chains: int = 4, random_seed=None,
           target_accept: float | None = None, init: str = "auto", initvals=None,
           discard_tuned_samples: bool = True, compute_convergence_checks: bool = True,
           idata_kwargs: dict | None = None, compile_kwargs: dict | None = None,
           progressbar=True, model=None, client=None, checkpoint_every: int | None = None,
           store=None, resume: bool = False, **kwargs):  # fmt: skip
    """Sample a PyMC model with NUTS (or its other step methods), chains on a Dask cluster.

    Takes ``pm.sample``'s arguments and returns its result (``InferenceData`` on PyMC 5,
    ``DataTree`` on PyMC 6, with ``sample_stats``, the warm-up groups when asked and
    PyMC's convergence warnings).  The chains run as Dask tasks of a few seconds each
    (*segments*, named ``chain_<c>`` on the dashboard), more chains than worker threads
    queue, and a worker that joins takes work.  A segment lost with its worker runs again
    on another one from the chain's last state: the draws are those of ``pm.sample``
    with the same arguments, on any number of workers and whatever fails.

    Parameters
    ----------
    draws, tune, chains, random_seed, target_accept, init, initvals, \
discard_tuned_samples, compute_convergence_checks, idata_kwargs, compile_kwargs, \
progressbar, model
        As for ``pm.sample`` (``target_accept``: NUTS's, None for its default).  Other
        ``pm.sample`` keywords (``step``, ``var_names``, ``callback``,
        ``return_inferencedata``, ``n_init``, ``nuts``...) pass through, except those
        about local processes (``cores``, ``mp_ctx``, ``blas_cores``) and ``trace``.
    client : distributed.Client, optional
        The cluster; by default Dask's default client (``dt.connect()``).
    checkpoint_every : int, optional
        Draws per segment: what a lost worker or a killed caller costs at most, and how
        often the store is written.  By default segments take about
        ``dasktensor.sample.segment-seconds`` (5 s) each.
    store : str or path, optional
        A zarr store (``"run.zarr"``) to which every finished segment's draws and each
        chain's state are written.  It must not exist, unless ``resume=True``.
    resume : bool
        Continue the run ``store`` holds (from its last whole segment of each chain), or
        start it if the store does not exist.  A store written with another model, data
        or arguments is refused (``StoreMismatchError``).  With ``random_seed=None`` the
        seed the store was started with is used.

    Returns
    -------
    InferenceData or DataTree
        As ``pm.sample`` returns it.

    Examples
    --------
    >>> import numpy as np, pymc as pm, dasktensor as dt
    >>> from distributed import Client, LocalCluster
    >>> with LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as cluster:
    ...     with Client(cluster) as client, pm.Model() as model:
    ...         mu = pm.Normal("mu", 0, 1)
    ...         _ = pm.Normal("y", mu, 1, observed=np.array([0.5, 1.5]))
    ...         idata = dt.sample(50, tune=50, chains=2, random_seed=1, progressbar=False,
    ...                           compute_convergence_checks=False)
    ...         reference = pm.sample(50, tune=50, chains=2, random_seed=1, cores=1,
    ...                               progressbar=False, compute_convergence_checks=False)
    >>> bool((idata.posterior["mu"] == reference.posterior["mu"]).all())
    True
    """
    import pymc as pm

    from dasktensor.sampling._breakdown import Breakdown, _set_last

    timing = Breakdown()
    timing.start()
    refused = sorted(k for k in kwargs if k in _REFUSED)
    if refused:
        raise TypeError(
            "dt.sample does not take " + "; nor ".join(f"{k}= ({_REFUSED[k]})" for k in refused)
        )
    if kwargs.get("nuts_sampler", "pymc") != "pymc":
        raise ValueError(
            "dt.sample runs PyMC's own samplers (nuts_sampler='pymc'); got nuts_sampler="
            f"{kwargs['nuts_sampler']!r}: external samplers do not run as Dask segments"
        )
    for name, value, low in (("draws", draws, 1), ("tune", tune, 0), ("chains", chains, 1)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
            # pm.sample's own errors for these say nothing of them (tune=-1: one draw)
            raise ValueError(f"dt.sample expected {name}= an int >= {low}, got {value!r}")
    _check_step(kwargs.get("step"))
    every = _positive("checkpoint_every", checkpoint_every)
    if resume and store is None:
        raise ValueError("dt.sample(resume=True) expected a store= to resume from, got none")
    if store is not None and not isinstance(store, str | os.PathLike):
        raise TypeError(f"dt.sample expected store= a path (str or os.PathLike), got {store!r}")
    if store is not None:
        random_seed = _store_seed(store, random_seed, resume)
    client = _client(client)
    timing.lap("connect")
    model = pm.modelcontext(model)
    if not isinstance(model, pm.Model):
        raise TypeError(f"dt.sample expected model= a pymc.Model, got {model!r}")
    if target_accept is not None:
        kwargs["target_accept"] = target_accept
    open_store = None
    if store is not None:
        identity = _identity(model, random_seed, draws, tune, init, initvals, kwargs)
        open_store = _store_opener(store, identity, resume)
    from dasktensor.sampling._chains import ChainRunner  # (imports distributed)

    runner = ChainRunner(client, every, open_store, breakdown=timing)
    if _plain(model, compile_kwargs):
        runner.prepare_workers()  # while PyMC compiles here
    # PyTensor's compilation is not thread-safe (two dt.sample calls in threads, on a
    # cold compile cache: a failed Apply node, or draws off in the 12th digit): one
    # pm.sample prepares (compiles) at a time, the chains of all run at once (_dispatch).
    # Not _runners.compiling()'s lock: preparing may wait for builds on in-process workers
    # that take that one.
    with _chains_run_by(runner, client, chains), _preparing, _scheduler_lost(client, store):
        result = pm.sample(
            draws,
            tune=tune,
            chains=chains,
            cores=1,
            random_seed=random_seed,
            init=init,
            initvals=initvals,
            discard_tuned_samples=discard_tuned_samples,
            compute_convergence_checks=compute_convergence_checks,
            idata_kwargs=idata_kwargs,
            compile_kwargs=compile_kwargs,
            progressbar=progressbar,
            model=model,
            blas_cores=None,
            **kwargs,
        )
    timing.lap("conversion")
    _set_last(timing)
    if progressbar:
        print(timing.table(), flush=True)
    return result


@contextlib.contextmanager
def _scheduler_lost(client, store):
    """Raise :class:`~dasktensor.SchedulerLostError` for Dask's errors of a lost
    scheduler (a cancelled segment, a registration on a client that gave up
    reconnecting), saying where the draws so far are and how to continue."""
    address = client.scheduler.address
    try:
        yield
    except Exception as e:
        if not lost_scheduler(client, e):
            raise
        if store is None:
            then = (
                "the draws so far are lost with it: pass store='run.zarr' to keep them "
                "through such a failure and continue with resume=True"
            )
        else:
            then = (
                f"the finished segments are in {str(store)!r}: once the cluster runs "
                f"again, dt.sample(..., store={str(store)!r}, resume=True) continues"
            )
        raise SchedulerLostError(
            f"dt.sample lost the scheduler at {address} (the client is {client.status}; "
            f"Dask's workers close with their scheduler): {then}.  Dask said: "
            f"{type(e).__name__}: {e}"
        ) from e


# ----------------------------------------------------------------------------- checks


def _client(client):
    if client is None:
        client = default_client()
        if client is None:
            raise RuntimeError(
                "dt.sample runs chains on a Dask cluster: expected a distributed Client "
                "(client = dt.connect(), or dt.sample(..., client=client)), found none; "
                "in one process, use pm.sample"
            )
    elif not is_client(client):
        raise TypeError(f"dt.sample expected client= a distributed.Client, got {client!r}")
    if client.status in ("closing", "closed"):
        raise RuntimeError(
            f"dt.sample expected a running distributed Client, got {client!r} ({client.status})"
        )
    return client


def _check_step(step) -> None:
    """A step method, or several: pm.sample's error for anything else is an internal one."""
    from pymc.step_methods.compound import BlockedStep, CompoundStep

    steps = step if isinstance(step, list | tuple) else [step]
    if step is not None and not all(isinstance(s, BlockedStep | CompoundStep) for s in steps):
        raise TypeError(
            "dt.sample expected step= a PyMC step method (pm.NUTS(), pm.Metropolis()...) "
            f"or a list of them, got {step!r}"
        )


def _positive(name: str, value):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"dt.sample expected {name}= a positive integer or None, got {value!r}")
    return int(value)


def _plain(model, compile_kwargs) -> bool:
    """Whether nothing of the run works on the workers while PyMC compiles here: the
    default backend, and no dasktensor Op in the log-density (a data shard or a remote
    model is built on the workers then).  Only then do the workers import PyMC meanwhile,
    in their event loop: an import there, while a build in a worker thread holds an
    import lock and waits for that loop, hung a worker."""
    if (compile_kwargs or {}).get("mode") is not None:
        return False
    from pytensor.graph.traversal import ancestors

    return not any(
        v.owner is not None and type(v.owner.op).__module__.startswith("dasktensor")
        for v in ancestors([model.logp()])
    )


# ----------------------------------------------------------------------------- the store


def _store_seed(store, random_seed, resume: bool):
    """The seed a stored run needs: an int (None: the store's own, or a fresh one)."""
    if random_seed is not None:
        if isinstance(random_seed, bool) or not isinstance(random_seed, int | np.integer):
            raise TypeError(
                "dt.sample(store=...) expected random_seed= an int or None (the store "
                f"records it, to continue the same chains), got {random_seed!r}"
            )
        return int(random_seed)
    if resume and os.path.exists(store):
        from dasktensor.sampling._store import _zarr

        try:
            found = dict(_zarr().open_group(str(store), mode="r").attrs).get("dasktensor")
        except Exception:
            found = None  # not a store: SampleStore says so when the run opens it
        if found and "seed" in found:
            return found["seed"]
    return int(np.random.SeedSequence().entropy)


def fingerprint(model) -> str:
    """A digest of ``model``'s log-density graph and of every value it reads (observed
    data, ``pm.Data``, constants): equal for the same model and data."""
    from pytensor.compile.sharedvalue import SharedVariable
    from pytensor.graph.basic import Constant
    from pytensor.graph.traversal import graph_inputs
    from pytensor.printing import debugprint

    logp = model.logp()
    digest = hashlib.blake2b(digest_size=16)
    digest.update(debugprint(logp, file="str").encode())
    for var in graph_inputs([logp]):
        if isinstance(var, Constant):
            value = var.data
        elif isinstance(var, SharedVariable):
            value = var.get_value(borrow=True)
        else:
            continue
        if isinstance(value, np.ndarray | np.generic | int | float):
            array = np.ascontiguousarray(value)
            digest.update(f"{array.dtype.str}{array.shape}".encode())
            digest.update(array.view(np.uint8).reshape(-1).tobytes())
    return digest.hexdigest()


def _identity(model, seed, draws, tune, init, initvals, options) -> dict:
    from dask.base import tokenize

    return {
        "model": fingerprint(model),
        "seed": seed,
        "draws": int(draws),
        "tune": int(tune),
        "init": str(init),
        "initvals": tokenize(initvals),
        "options": tokenize(
            sorted((k, _describe(v)) for k, v in options.items() if k not in _NOT_IDENTITY)
        ),
    }


#: pm.sample options that change what the caller sees, not the draws: a run resumed
#: without its progress callback is the same run
_NOT_IDENTITY = {"callback", "return_inferencedata", "keep_warning_stat", "progressbar_theme"}


def _describe(value):
    """What of an option identifies a run: plain values as they are, others by type."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, dict):
        return sorted((str(k), _describe(v)) for k, v in value.items())
    if isinstance(value, list | tuple):
        return [_describe(v) for v in value]
    return type(value).__qualname__


def _store_opener(path, identity: dict, resume: bool):
    def open_store(layout, chains, length):
        from dasktensor.sampling._store import SampleStore

        return SampleStore(path, identity, layout, chains, length, resume=resume)

    return open_store


# ----------------------------------------------------------------------------- pm.sample


_active = threading.local()
_patch_lock = runtime.lock()
_preparing = runtime.rlock()  # held while a pm.sample of dt.sample prepares its chains
# PyMC's patched functions, and how many runs use them: not per-process state, since a
# forked child inherits the patched module as it was
_patched = {"count": 0, "originals": None}


@contextlib.contextmanager
def _chains_run_by(runner, client, chains: int):
    """While ``pm.sample`` runs in this thread: its chains run by ``runner``.

    Other threads' ``pm.sample`` calls are left alone: the replaced functions dispatch
    on the calling thread.
    """
    import pymc.sampling.mcmc as mcmc

    with _patch_lock:
        if _patched["count"] == 0:
            originals = {"_sample_many": mcmc._sample_many,
                         "_sample_population": mcmc._sample_population}  # fmt: skip
            _patched["originals"] = originals
            mcmc._sample_many = _dispatch("_sample_many", originals["_sample_many"])
            mcmc._sample_population = _dispatch(
                "_sample_population", originals["_sample_population"]
            )
        _patched["count"] += 1
    log = logging.getLogger("pymc.sampling.mcmc")
    where = _Where(client, chains)
    log.addFilter(where)
    _active.runner = runner
    try:
        yield
    finally:
        _active.runner = None
        log.removeFilter(where)
        with _patch_lock:
            _patched["count"] -= 1
            if _patched["count"] == 0:
                for name, original in _patched["originals"].items():
                    setattr(mcmc, name, original)


def _dispatch(name: str, original):
    def run(**kwargs):
        runner = getattr(_active, "runner", None)
        if runner is None:
            return original(**kwargs)
        if name == "_sample_population":
            raise NotImplementedError(
                "dt.sample runs chains independently, as Dask tasks; population samplers "
                "(DEMetropolis, DEMetropolisZ) move all chains together: use pm.sample"
            )
        _preparing.release()  # taken by sample(): the chains run on the cluster meanwhile
        try:
            return runner(**kwargs)
        finally:
            _preparing.acquire()

    return run


class _Where(logging.Filter):
    """Says where the chains run in pm.sample's log line about it (this thread's only)."""

    def __init__(self, client, chains: int):
        super().__init__()
        self.thread = threading.get_ident()
        self.client, self.chains = client, chains

    def filter(self, record: logging.LogRecord) -> bool:
        if threading.get_ident() == self.thread and str(record.msg).startswith(
            "Sequential sampling"
        ):
            workers = len(scheduler_workers(self.client))
            record.msg = f"Sampling {self.chains} chains in segments on {workers} Dask worker(s)"
            record.args = ()
        return True
