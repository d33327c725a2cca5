"""Chains as Dask work: segments of draws that any worker can run from a chain's last state.

``pm.sample`` runs each chain in one process from its first draw to its last.  Here a
chain advances in *segments*, each an ordinary Dask task (``chain_<c>-<token>`` on the
dashboard) that takes the chain's state, makes some draws and returns them with the state
after them:

* **The caller keeps every chain's latest state**: the step method's ``sampling_state``
  (PyMC's own description of a step method's mutable state: step size and mass matrix
  adaptation, counters, random generators) and the chain's last point.  A segment lost
  with its worker is run again by Dask from the same state, elsewhere, and gives the
  same draws; so does a run continued from a checkpoint store
  (:mod:`dasktensor._store`).  Restoring the state and going on gives the draws of an
  uninterrupted chain bit for bit (checked against ``pm.sample`` on both lines, for
  segments of 7 and 50 draws), so the draws never depend on the number of workers, the
  segment sizes or faults.
* **Compiled once per worker.**  The step method, compiled by PyMC on the caller, is
  pickled once per run and reaches the workers as the result of one task (Dask moves it
  to each worker once, and computes it again if the worker holding it is lost).  A worker
  unpickles it -- compiling its functions -- once per run and thread, under the
  process's and host's compile lock, and then every segment of every chain it runs
  sets the chain's state into that step method.
* **Segment sizes** follow ``checkpoint_every`` (draws), or by default
  ``dasktensor.sample.segment-seconds`` of sampling each, from the draw rate of the
  chain's last segment (a first segment of a few draws measures it).
* **More chains than worker threads queue**, as any Dask tasks do; a worker that joins
  takes queued segments.

This module replaces, for one ``dt.sample`` call, PyMC's loop that runs the chains one
after another (``_sample_many``): everything before it (seeds, initialisation, step
methods, traces) and after it (``InferenceData``/``DataTree``, convergence checks) is
``pm.sample``'s own.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from dasktensor import _compat, _config
from dasktensor._cluster import carrying

#: draws of a chain's first segment when its size follows time (it measures the rate)
FIRST_SEGMENT = 10

_log = logging.getLogger("dasktensor.sample")

# ----------------------------------------------------------------------------- workers

# compiled step methods on this worker, by run token: the idle ones (one per thread that
# ran a segment at once), most recently used last
_steps: OrderedDict[str, list] = OrderedDict()
_steps_lock = threading.Lock()
#: how many times each run's step method was unpickled (compiled) in this process
_compiles: dict[str, int] = {}
_RUNS_KEPT = 8


def _reset_after_fork() -> None:  # pragma: no cover - runs in forked children
    global _steps_lock
    _steps_lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)


def _checkout(token: str, template: bytes):
    """An idle compiled step method of run ``token``, or a new one from ``template``."""
    from dasktensor._runners import compiling

    with _steps_lock:
        idle = _steps.get(token)
        if idle:
            return idle.pop()
    with compiling():
        step = pickle.loads(template)
    with _steps_lock:
        _compiles[token] = _compiles.get(token, 0) + 1
        _steps.setdefault(token, [])
        _steps.move_to_end(token)
        while len(_steps) > _RUNS_KEPT:  # runs whose caller never said it ended
            gone, _ = _steps.popitem(last=False)
            _compiles.pop(gone, None)
    return step


def _checkin(token: str, step) -> None:
    with _steps_lock:
        if token in _steps:  # a run that ended meanwhile: the step method goes
            _steps[token].append(step)


def forget(token: str) -> int:
    """Drop run ``token``'s compiled step methods from this process; how many it had
    compiled (run on every worker when the run ends)."""
    with _steps_lock:
        _steps.pop(token, None)
        return _compiles.pop(token, 0)


def compiles(token: str) -> int:
    """How many times this process compiled run ``token``'s step method so far."""
    with _steps_lock:
        return _compiles.get(token, 0)


@dataclass
class Start:
    """Where a segment starts: a chain's state, or its beginning (``rng`` set)."""

    state: object
    point: dict
    #: the chain's random generator, for a chain's first segment (else None)
    rng: object = None


def run_segment(template: bytes, token: str, start: Start, first: int, last: int,
                tune: int, length: int) -> dict:  # fmt: skip
    """On a worker: draws ``[first, last)`` of a chain from ``start``, as PyMC's
    ``_iter_sample`` makes them; the points, sampler statistics and state after them."""
    step = _checkout(token, template)
    try:
        step.sampling_state = start.state
        if start.rng is not None:  # the chain's beginning, as pm.sample sets it up
            _compat.setup_chain(step, start.rng, tune, length - tune)
            step.tune = bool(tune)
            if hasattr(step, "reset_tuning"):
                step.reset_tuning()
        point, points, stats = _aligned(start.point), [], []
        began = time.perf_counter()
        for i in range(first, last):
            if i == 0 and hasattr(step, "iter_count"):
                step.iter_count = 0
            if i == tune:
                step.stop_tuning()
            point, draw_stats = step.step(point)
            points.append(point)
            stats.append(draw_stats)
        seconds = time.perf_counter() - began
        stacked = {name: np.stack([p[name] for p in points]) for name in point}
        return {"points": stacked, "stats": stats, "state": step.sampling_state,
                "point": point, "seconds": seconds}  # fmt: skip
    finally:
        _checkin(token, step)


def _identity(value):
    return value


def _aligned(arrays: dict) -> dict:
    """Arrays as compiled functions take them: arrays that arrive in a network frame may
    be unaligned."""
    return {name: np.require(a, requirements=["A"]) for name, a in arrays.items()}


# ----------------------------------------------------------------------------- caller


@dataclass
class _Chain:
    index: int
    done: int  # draws recorded
    start: Start  # what its next segment starts from
    rate: float | None = None  # seconds per draw in its last segment


class ChainRunner:
    """The chains of one ``dt.sample`` call, run as segments on ``client``.

    Called by ``pm.sample`` in place of its sequential loop over chains, with the same
    arguments (``draws`` includes tuning).

    Parameters
    ----------
    client : distributed.Client
        The cluster.
    every : int or None
        Draws per segment (``checkpoint_every``); None sizes segments by time.
    store : callable or None
        ``store(layout, chains, length)`` opens the run's checkpoint store
        (:class:`dasktensor._store.SampleStore`), or None to keep none.
    """

    def __init__(self, client, every: int | None = None, store=None):
        self.client, self.every, self.open_store = client, every, store
        self.token = uuid.uuid4().hex
        self.segments = 0  # segments run
        self.resumed = 0  # draws read back from the store
        self.compiled: dict[str, int] = {}  # worker -> times it compiled the step method

    def __call__(self, *, draws, chains, traces, start, rngs, step, callback=None, **kwargs):
        from pymc.progress_bar import MCMCProgressBarManager

        tune = kwargs.get("tune", 0)
        progress = MCMCProgressBarManager(
            step_method=step,
            chains=chains,
            draws=draws - tune,
            tune=tune,
            progressbar=kwargs.get("progressbar", True),
            **({"progressbar_theme": t} if (t := kwargs.get("progressbar_theme")) else {}),
        )
        store = None
        if self.open_store is not None:
            layout = {k: (np.shape(v), np.asarray(v).dtype.str) for k, v in start[0].items()}
            store = self.open_store(layout, chains, draws)
        initial = step.sampling_state
        runs = [_Chain(c, 0, Start(initial, start[c], rngs[c])) for c in range(chains)]
        payload = _cloudpickled(step)  # compiled functions travel as graphs
        with carrying(len(payload)):
            template = self.client.submit(
                _identity, payload, key=f"step-method-{self.token}", pure=False
            )
        recorder = _Recorder(traces, tune, draws, progress, callback, store)
        try:
            with progress:
                if store is not None:
                    for run in runs:
                        self.resumed += recorder.restore(run)
                    _log.info(
                        "Continuing %s: %s draws of each chain were stored",
                        store.path, [r.done for r in runs],
                    )  # fmt: skip
                self._run(runs, template, tune, draws, recorder)
        finally:
            template.release()
            try:
                compiled = self.client.run(forget, self.token, on_error="return")
                self.compiled = {a: n for a, n in compiled.items() if isinstance(n, int) and n}
            except Exception:  # the cluster is gone: nothing to release
                pass
        _log.info(
            "Sampled %d chains in %d segments; the step method was compiled %s",
            chains, self.segments,
            ", ".join(f"{n}x on {a}" for a, n in sorted(self.compiled.items())) or "nowhere",
        )  # fmt: skip

    def _run(self, runs, template, tune: int, length: int, recorder) -> None:
        from distributed import as_completed

        pending = {}

        def submit(run: _Chain):
            last = min(length, run.done + self._size(run))
            future = self.client.submit(
                run_segment, template, self.token, run.start, run.done, last, tune, length,
                key=f"chain_{run.index}-{uuid.uuid4().hex}", pure=False,
            )  # fmt: skip
            pending[future] = (run, last)
            return future

        queue = as_completed(
            [submit(run) for run in runs if run.done < length], loop=self.client.loop
        )
        try:
            for future in queue:
                run, last = pending.pop(future)
                result = future.result()  # a model's error is raised here, remote traceback
                self.segments += 1
                recorder.segment(run, last, result)
                if run.done < length:
                    queue.add(submit(run))
        except KeyboardInterrupt:  # as pm.sample: stop, keep what was drawn
            self.client.cancel(list(pending))
        except BaseException:
            self.client.cancel(list(pending))
            raise
        recorder.finish(runs)

    def _size(self, run: _Chain) -> int:
        if self.every:
            return self.every
        if run.rate is None:
            return FIRST_SEGMENT
        target = _config.seconds("sample.segment-seconds")
        return max(1, int(target / max(run.rate, 1e-9)))


class _Recorder:
    """Draws into PyMC's traces, the progress bar, the store and the user's callback."""

    def __init__(self, traces, tune, length, progress, callback, store):
        from pymc.stats.convergence import log_warning_stats

        self.traces, self.tune, self.length = traces, tune, length
        self.progress, self.callback, self.store = progress, callback, store
        self.log_warning_stats = log_warning_stats
        self.finished: set[int] = set()

    def restore(self, run: _Chain) -> int:
        """Record the draws the store holds of ``run``; how many."""
        checkpoint = self.store.checkpoint(run.index)
        if not checkpoint.done:
            return 0
        points = self.store.points(run.index, checkpoint.done)
        self._record(run, 0, points, checkpoint.stats)
        run.done, run.start = checkpoint.done, Start(checkpoint.state, checkpoint.point)
        return checkpoint.done

    def segment(self, run: _Chain, last: int, result: dict) -> None:
        """Record a finished segment, commit it to the store, move the chain on."""
        first = run.done
        self._record(run, first, result["points"], result["stats"])
        if self.store is not None:
            self.store.commit(run.index, first, last, result["points"], result["stats"],
                              result["state"], result["point"])  # fmt: skip
        run.done, run.start = last, Start(result["state"], result["point"])
        run.rate = result["seconds"] / max(last - first, 1)

    def _record(self, run: _Chain, first: int, points: dict, stats: list) -> None:
        from pymc.sampling.parallel import Draw

        trace, chain = self.traces[run.index], run.index
        points = _aligned(points)
        for k, draw_stats in enumerate(stats):
            i = first + k
            point = {name: values[k, ...] for name, values in points.items()}
            trace.record(point, draw_stats, in_warmup=i < self.tune)
            self.log_warning_stats(draw_stats)
            if self.callback is not None:  # as pm.sample calls it (is_last as PyMC has it)
                self.callback(
                    trace=trace,
                    draw=Draw(chain, i == self.length, i, i < self.tune, draw_stats, point),
                )
            self.progress.update(
                chain_idx=chain, is_last=False, draw=i, stats=draw_stats, tuning=i < self.tune
            )
        if first + len(stats) >= self.length and stats:
            self._close(run, stats[-1])

    def _close(self, run: _Chain, stats) -> None:
        self.traces[run.index].close()
        self.finished.add(run.index)
        if not self.progress.combined_progress or len(self.finished) == len(self.traces):
            self.progress.update(
                chain_idx=run.index, is_last=True, draw=self.length - 1, stats=stats,
                tuning=False,
            )  # fmt: skip

    def finish(self, runs) -> None:
        """Close the traces of chains that stopped early (interrupted)."""
        for run in runs:
            if run.index not in self.finished:
                self.traces[run.index].close()


def _cloudpickled(step) -> bytes:
    import cloudpickle

    return cloudpickle.dumps(step)
