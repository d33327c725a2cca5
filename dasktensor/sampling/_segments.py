"""The worker side of ``dt.sample``: a run's step method, and the segments that use it.

* **One step method per run and worker.**  The caller pickles the step method PyMC
  compiled, once per run, and installs it on every worker -- present, joining or
  restarted -- with a worker plugin (:class:`StepMethod`): segments name their run by its
  token only.  (Were the step method a Dask value that segments depend on, the scheduler
  would keep sending them to the worker holding it while others idle: measured, one of
  two workers idle for the first 6 s of a 15 s run.)  A worker unpickles it, compiling
  its functions, on the first segment it runs, under the process's and the host's compile
  lock (``dasktensor.engine._runners.compiling``), and keeps it, one per thread running segments
  at once, until the run ends.
* **Compiled once per host, where it can be.**  Unpickling a step method compiles its
  functions again; with Numba (PyTensor 3's backend) that reads the compile cache the
  caller filled when PyMC compiled the step method (workers of the caller's host share
  it), and the workers of a host unpickle at once.  Other backends unpickle one worker
  of a host at a time (PyTensor's C module cache breaks under concurrent compiles,
  pymc-devs/pymc#7819).
* **Imports ahead.**  While PyMC compiles the step method in the caller, each worker
  imports PyMC and the linker's backend (:func:`prepare_worker`): a worker's first
  import of them takes seconds.
* **No profiler beside a segment.**  A Dask worker samples the stack of its running
  task every 10 ms for the dashboard's profile, under the GIL, in its event loop, and
  times its event loop every 20 ms (``tick``, 1.2 % of a core on an idle worker): beside a
  NUTS segment that cost the worker process several percent of CPU that PyMC's own
  processes do not spend.  While the process runs segments the profiler stops (the task
  stream still shows them) and the probe runs once a second, often enough to report a
  stalled event loop at Dask's ``tick.limit`` (3 s) and never to report one that was
  not; both return to Dask's settings when no segment runs (:func:`profiler_paused`).
* **A segment** (:func:`run_segment`) restores a chain's state into that step method and
  makes draws as PyMC's ``_iter_sample`` does (see :mod:`dasktensor.sampling._chains`).
"""

from __future__ import annotations

import contextlib
import pickle
import threading
import time
from dataclasses import dataclass

import numpy as np
from distributed.diagnostics.plugin import WorkerPlugin

from dasktensor import _compat
from dasktensor._runtime import ProcessState, runtime


class _StepMethods(ProcessState):
    """On a worker: each run's pickled step method (installed by its StepMethod plugin),
    the idle compiled step methods unpickled from it (one per thread that ran a segment
    of the run at once), and how many times each was unpickled (compiled)."""

    def __init__(self):
        self.payloads: dict[str, bytes] = {}
        self.steps: dict[str, list] = {}
        self.compiles: dict[str, int] = {}
        self.shared: dict[str, bool] = {}  # run -> unpickled by the host's workers at once
        self.lock = threading.Lock()


#: a worker's periodic callback that stops while it runs segments: the statistical profiler
STOPPED = "profile"
#: ...and the one that runs less often meanwhile, every SLOW_TICK_MS: the event loop's
#: latency probe.  Stopped, its first tick after the segments measured the whole pause
#: and logged "Event loop was unresponsive" (an INFO line of every worker, for nothing);
#: once a second it still reports a real stall at Dask's ``tick.limit`` (3 s).
SLOWED = "tick"
SLOW_TICK_MS = 1000


class _Profiler(ProcessState):
    """On a worker: segments running now, and what the event loop changed for them."""

    def __init__(self):
        self.running = 0
        #: the callbacks' settings while paused, None when not: (profile was running,
        #: the tick's own interval)
        self.saved: tuple | None = None
        self.lock = threading.Lock()


@contextlib.contextmanager
def profiler_paused():
    """While any segment runs in this worker process, its statistical profiler (Dask's
    ``profile`` callback) is stopped and its event loop probe (``tick``) runs every
    ``SLOW_TICK_MS``; both return to Dask's settings when the last one ends.  Outside a
    worker nothing changes.

    Examples
    --------
    >>> with profiler_paused():  # not in a worker's task here
    ...     pass
    """
    try:
        from distributed import get_worker

        worker = get_worker()
    except ValueError:
        yield
        return
    state = runtime.state(_Profiler)
    with state.lock:
        state.running += 1
        if state.running == 1:  # (the event loop's own thread changes its callbacks)
            worker.loop.add_callback(_follow, worker, state)
    try:
        yield
    finally:
        with state.lock:
            state.running -= 1
            if state.running == 0:
                worker.loop.add_callback(_follow, worker, state)


def _follow(worker, state: _Profiler) -> None:
    """On the worker's event loop: pause the callbacks if segments run now, restore them
    if none does.  It reads the count when it runs, not when it was scheduled: a segment
    that starts right after another ended (a queued one) finds them paused still, or
    paused again, never left running."""
    callbacks = worker.periodic_callbacks
    profile, tick = callbacks.get(STOPPED), callbacks.get(SLOWED)
    with state.lock:
        busy, saved = state.running > 0, state.saved
        if busy and saved is None:
            state.saved = (
                profile is not None and profile.is_running(),
                tick.callback_time if tick is not None else None,
            )
            if state.saved[0]:
                profile.stop()
            if tick is not None:
                tick.callback_time = max(tick.callback_time, SLOW_TICK_MS)
        elif not busy and saved is not None:
            state.saved = None
            was_running, interval = saved
            if was_running and not profile.is_running():
                profile.start()
            if interval is not None:
                tick.callback_time = interval


def _state() -> _StepMethods:
    return runtime.state(_StepMethods)


class StepMethod(WorkerPlugin):
    """A run's pickled step method, on every worker of the cluster, present and future
    (``client.register_plugin``); its teardown drops the run's compiled step methods.

    Examples
    --------
    >>> plugin = StepMethod("t0", pickle.dumps("a step method"))
    >>> plugin.setup(worker=None); (_checkout("t0"), compiles("t0"))
    (('a step method', True), 1)
    >>> plugin.teardown(worker=None); forget("t0")
    0
    """

    def __init__(self, token: str, payload: bytes, concurrent: bool = False):
        self.token, self.payload, self.concurrent = token, payload, concurrent
        self.name = f"dasktensor-step-method-{token}"

    def setup(self, worker) -> None:
        state = _state()
        with state.lock:
            state.payloads[self.token] = self.payload
            state.shared[self.token] = self.concurrent

    def teardown(self, worker) -> None:
        forget(self.token)


def _checkout(token: str):
    """An idle compiled step method of run ``token``, or a new one from its payload; and
    whether it is new."""
    from dasktensor.engine import compiling

    state = _state()
    with state.lock:
        idle = state.steps.get(token)
        if idle:
            return idle.pop(), False
        payload = state.payloads.get(token)
        concurrent = state.shared.get(token, False)
    if payload is None:  # pragma: no cover - the plugin is set up before any task runs
        raise RuntimeError(f"this worker has no step method of run {token} (its plugin is gone)")
    with compiling(host=not concurrent):
        step = pickle.loads(payload)
    with state.lock:
        state.compiles[token] = state.compiles.get(token, 0) + 1
    return step, True


def _checkin(token: str, step) -> None:
    state = _state()
    with state.lock:
        if token in state.payloads:  # a run that ended meanwhile: the step method goes
            state.steps.setdefault(token, []).append(step)


def forget(token: str) -> int:
    """Drop run ``token``'s step methods from this process; how many it had compiled."""
    state = _state()
    with state.lock:
        state.payloads.pop(token, None)
        state.shared.pop(token, None)
        state.steps.pop(token, None)
        return state.compiles.pop(token, 0)


def prepare_worker() -> bool:
    """Import PyMC, and the backend the step method's functions will be linked with, in
    this process now: a worker's first segment would otherwise spend seconds on them,
    after the caller's compilation rather than during it (on PyTensor 3, importing the
    Numba backend, PyTensor's conversions of every Op, takes 0.5-0.6 s in a process that
    has PyMC and dasktensor already).

    It runs where ``client.run`` runs it, in the worker's event loop, as Dask's own
    unpickling of a segment's arguments (PyMC's objects) would import PyMC there anyway.
    (Not in a thread of its own: two threads importing PyMC at once can fail with a
    "partially initialized module" ``ImportError``.)

    Examples
    --------
    >>> prepare_worker()
    True
    """
    import pymc  # noqa: F401
    from pytensor.compile.mode import get_default_mode

    if type(get_default_mode().linker).__name__ == "NumbaLinker":
        import pytensor.link.numba.dispatch  # noqa: F401

    return True


def has_run(token: str) -> bool:
    """Whether this process has run ``token``'s step method (its plugin was set up)."""
    state = _state()
    with state.lock:
        return token in state.payloads


def compiles(token: str) -> int:
    """How many times this process compiled run ``token``'s step method so far."""
    state = _state()
    with state.lock:
        return state.compiles.get(token, 0)


@dataclass
class Start:
    """Where a segment starts: a chain's state, or its beginning (``rng`` set)."""

    state: object
    point: dict
    #: the chain's random generator, for a chain's first segment (else None)
    rng: object = None


def run_segment(token: str, start: Start, first: int, last: int, tune: int, length: int) -> dict:
    """On a worker: draws ``[first, last)`` of a chain from ``start``, as PyMC's
    ``_iter_sample`` makes them; the points, sampler statistics and state after them."""
    began = time.perf_counter()
    step, compiled = _checkout(token)
    compile_seconds = time.perf_counter() - began if compiled else 0.0
    try:
        step.sampling_state = start.state
        if start.rng is not None:  # the chain's beginning, as pm.sample sets it up
            _compat.setup_chain(step, start.rng, tune, length - tune)
            step.tune = bool(tune)
            if hasattr(step, "reset_tuning"):
                step.reset_tuning()
        point, points, stats = aligned(start.point), [], []
        began = time.perf_counter()
        with profiler_paused():
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
                "point": point, "seconds": seconds, "compile": compile_seconds,
                "worker": _worker_address()}  # fmt: skip
    finally:
        _checkin(token, step)


def _worker_address() -> str | None:
    try:
        from distributed import get_worker

        return get_worker().address
    except ValueError:  # not in a worker's task (called directly)
        return None


def aligned(arrays: dict) -> dict:
    """Arrays as compiled functions take them: arrays that arrive in a network frame may
    be unaligned."""
    return {name: np.require(a, requirements=["A"]) for name, a in arrays.items()}
