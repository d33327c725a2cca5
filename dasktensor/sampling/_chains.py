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
  (:mod:`dasktensor.sampling._store`).  Restoring the state and going on gives the draws of an
  uninterrupted chain bit for bit (checked against ``pm.sample`` on both lines, for
  segments of 7 and 50 draws), so the draws never depend on the number of workers, the
  segment sizes or faults.
* **Compiled once per worker.**  The step method, compiled by PyMC on the caller, is
  pickled once per run and installed on every worker by a plugin
  (:mod:`dasktensor.sampling._segments`); a worker unpickles it -- compiling its functions -- once
  per run and thread, and every segment of every chain it runs sets the chain's state
  into that step method.
* **Segment sizes** follow ``checkpoint_every`` (draws), or by default
  ``dasktensor.sample.segment-seconds`` of sampling each, from the draw rate of the
  chain's last segment (a first segment of a few draws measures it).
* **More chains than worker threads queue**, as any Dask tasks do; a worker that joins
  takes queued segments.
* **A silent worker's segments run twice.**  A worker cut off the network (or frozen)
  holds its segment until the scheduler gives up on it (``worker-ttl``, 5 min); once the
  scheduler has not heard from it for ``dasktensor.sample.silent-worker`` (5 s, while
  other workers were heard), its segments are submitted again to the other workers and
  the first copy to finish is taken: the same draws either way.

This module replaces, for one ``dt.sample`` call, PyMC's loop that runs the chains one
after another (``_sample_many``): everything before it (seeds, initialisation, step
methods, traces) and after it (``InferenceData``/``DataTree``, convergence checks) is
``pm.sample``'s own.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass

import numpy as np

from dasktensor import _config
from dasktensor.cluster import carrying, run_on_workers, scheduler_workers
from dasktensor.sampling._segments import (
    Start,
    StepMethod,
    aligned,
    forget,
    has_run,
    prepare_worker,
    run_segment,
)

#: draws of a chain's first segment when its size follows time (it measures the rate)
FIRST_SEGMENT = 10
#: seconds below which a chain's last segments are not split further (see _size)
TAIL_SECONDS = 0.25

# what a run did, shown as PyMC shows its own messages: at INFO, on stderr, unless the
# application configured logging itself
_log = logging.getLogger("dasktensor.sample")
if not logging.root.handlers:
    _log.setLevel(logging.INFO)
    if not _log.handlers:
        _log.addHandler(logging.StreamHandler())


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
        (:class:`dasktensor.sampling._store.SampleStore`), or None to keep none.
    """

    def __init__(self, client, every: int | None = None, store=None, breakdown=None):
        from dasktensor.sampling._breakdown import Breakdown

        self.client, self.every, self.open_store = client, every, store
        self.breakdown = Breakdown() if breakdown is None else breakdown
        self.token = uuid.uuid4().hex
        self.segments = 0  # segments run
        self.compiled: dict[str, int] = {}  # worker -> times it compiled the step method
        self._heard: list[str] = []  # while some worker is silent: the others
        self._pinned: list[str] = []  # while the step method is not on every worker: those

    def __call__(self, *, draws, chains, traces, start, rngs, step, callback=None, **kwargs):
        from pymc.progress_bar import MCMCProgressBarManager

        timing = self.breakdown
        timing.lap("prepare")
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
        payload, concurrent = _cloudpickled(step)  # functions travel as graphs
        plugin = StepMethod(self.token, payload, concurrent)
        timing.lap("pickle")
        self._install(plugin)
        timing.lap("send")
        recorder = _Recorder(traces, tune, draws, progress, callback, store)
        try:
            with progress:
                if store is not None:
                    for run in runs:
                        recorder.restore(run)
                    _log.info(
                        "Continuing %s: %s draws of each chain were stored",
                        store.path.name, [r.done for r in runs],
                    )  # fmt: skip
                self._run(runs, tune, draws, recorder)
        finally:
            timing.lap("draws")
            self._release(plugin.name)
            timing.lap("release")
        if self.compiled:
            _log.info(
                "Sampled %d chains in %d segments; the step method was compiled %d time(s) "
                "on %d worker(s)", chains, self.segments, sum(self.compiled.values()),
                len(self.compiled),
            )  # fmt: skip
        else:  # the workers did not answer in time
            _log.info("Sampled %d chains in %d segments", chains, self.segments)

    def prepare_workers(self) -> None:
        """Have the workers import PyMC while the caller compiles (in a thread not
        waited for: a silent worker would hold up ``client.run`` for Dask's connect
        timeout)."""

        def prepare():
            try:
                self.client.run(prepare_worker, on_error="ignore")
            except Exception:  # the run's own calls say what is wrong with the cluster
                pass

        threading.Thread(target=prepare, name="dasktensor-prepare", daemon=True).start()

    def _release(self, name: str) -> None:
        """Drop the run's step methods from the workers, in a thread waited for at most
        ``sample.silent-worker``: a worker gone silent (known, or too recently to be
        known) would hold up the caller for Dask's connect timeout (30 s)."""
        counted: dict = {}
        if self.client.status != "running":  # the scheduler is lost: its workers too
            self.compiled = {}
            return

        def release():
            try:
                if self._heard:  # not to a worker known to be silent (nor one gone since)
                    found = run_on_workers(self.client, forget, self.token, workers=self._heard)
                else:
                    found = self.client.run(forget, self.token, on_error="return")
                counted.update((a, n) for a, n in found.items() if isinstance(n, int) and n)
                self.client.unregister_worker_plugin(name)
            except Exception:  # the cluster is gone: nothing to release
                pass

        thread = threading.Thread(target=release, name="dasktensor-release", daemon=True)
        thread.start()
        thread.join(_config.seconds("sample.silent-worker"))
        self.compiled = dict(counted)

    def _run(self, runs, tune: int, length: int, recorder) -> None:
        finished: queue.Queue = queue.Queue()  # futures, as they end (done callbacks)
        pending: dict = {}  # future -> (run, last draw); a twin shares its original's

        def submit(run: _Chain, last: int | None = None, workers=None):
            last = min(length, run.done + self._size(run, tune, length)) if last is None else last
            workers = workers or self._heard or None  # not to a silent worker
            future = self.client.submit(
                run_segment, self.token, run.start, run.done, last, tune, length,
                key=f"chain_{run.index}-{uuid.uuid4().hex}", pure=False, workers=workers,
            )  # fmt: skip
            pending[future] = (run, last)
            future.add_done_callback(finished.put)
            return future

        timing, began = self.breakdown, time.perf_counter()
        workers: set = set()
        tuned = all(run.done >= tune for run in runs)
        timing.slots = self._slots()
        for run in runs:
            if run.done < length:
                submit(run)
        silent = _config.seconds("sample.silent-worker")
        looked = time.monotonic()
        try:
            while pending:
                try:
                    future = finished.get(timeout=1.0)
                except queue.Empty:
                    future = None
                if self.client.status != "running":  # asking the scheduler would wait
                    raise ConnectionError(  # for the client to reconnect (its timeout)
                        f"the client lost its scheduler (it is {self.client.status})"
                    )
                if time.monotonic() - looked >= 1.0:
                    looked = time.monotonic()
                    self._twin_silent(pending, silent, submit)
                if future is None:
                    continue
                if future not in pending:  # its twin finished first, with the same draws
                    continue
                run, last = pending.pop(future)
                twins = [f for f, (r, _) in pending.items() if r is run]
                try:  # a model's error is raised here, with its remote traceback
                    result = future.result(timeout=silent)
                except TimeoutError:
                    if future.status == "error":  # the model's own TimeoutError
                        raise
                    # finished, but on a worker gone silent since: fetching its result
                    # would wait for Dask's connect timeout (30 s); run it again instead
                    self._refetch(future, run, last, twins, submit)
                    continue
                for twin in twins:
                    del pending[twin]
                self.client.cancel(twins)
                self.segments += 1
                if self.segments == 1:
                    timing.lap("first")
                fetched = time.perf_counter()
                recorder.segment(run, last, result)
                if run.done < length:
                    submit(run)
                timing.gathering += time.perf_counter() - fetched
                timing.busy += result["seconds"] + result.get("compile", 0.0)
                where = result.get("worker")
                workers.add(where)
                if where not in timing.compile:  # its first segment of the run
                    timing.compile[where] = result.get("compile", 0.0)
                if not tuned and all(r.done >= tune for r in runs):
                    tuned = True
                    timing.lap("tuning")
        except KeyboardInterrupt:  # as pm.sample: stop, keep what was drawn
            self.client.cancel(list(pending))
        except BaseException:
            self.client.cancel(list(pending))
            raise
        finally:
            timing.segments, timing.workers = self.segments, len(workers)
            timing.sampling_wall = time.perf_counter() - began
        recorder.finish(runs)

    def _slots(self) -> int:
        """Worker threads that can run segments now (for the breakdown's utilisation;
        0 if the scheduler does not answer: the run itself then says what is wrong)."""
        if self.client.status != "running":
            return 0
        try:
            return sum(w.get("nthreads", 1) for w in scheduler_workers(self.client).values())
        except Exception:
            return 0

    def _refetch(self, future, run: _Chain, last: int, twins: list, submit) -> None:
        """A segment finished on a worker whose result does not come: run it again on
        the other workers (unless a twin already runs), and forget this copy."""
        holders = {a for held in self.client.who_has(future).values() for a in held}
        _log.info("chain %d: its segment's result is on a worker that does not answer; "
                  "running it again elsewhere", run.index)  # fmt: skip
        self.client.cancel([future])
        if not twins:
            others = [a for a in scheduler_workers(self.client) if a not in holders]
            submit(run, last, workers=others or None)

    def _twin_silent(self, pending: dict, silent: float, submit) -> None:
        """Run again elsewhere the segments of workers the scheduler has not heard from
        for ``silent`` seconds (cut off the network, or frozen): Dask would wait for
        ``worker-ttl`` (5 min) before it gives up on them.  A segment's draws follow
        from its start, so whichever copy ends first gives the same draws."""
        workers = scheduler_workers(self.client)
        freshest = max((w["last_seen"] for w in workers.values()), default=0.0)
        quiet = [a for a, w in workers.items() if freshest - w["last_seen"] > silent]
        others = [a for a in workers if a not in quiet]
        if self._pinned:
            others = [a for a in others if a in self._pinned] or self._pinned
        self._heard = others if quiet else self._pinned  # where new segments go meanwhile
        if not quiet or not others:
            return
        running = {k for keys in self.client.processing(workers=quiet).values() for k in keys}
        twinned = {id(r) for f, (r, _) in pending.items() if f.key not in running}
        for future, (run, last) in list(pending.items()):
            if future.key in running and id(run) not in twinned:
                _log.info("chain %d: its worker is silent; running its segment elsewhere too",
                          run.index)  # fmt: skip
                submit(run, last, workers=others)
                twinned.add(id(run))

    def _install(self, plugin: StepMethod) -> None:
        """Install the run's step method on every worker (``register_plugin``; workers
        that join later get it too), waiting at most ``sample.silent-worker`` seconds:
        Dask's registration goes through every worker, and one already silent would
        hold up the start for Dask's connect timeout (30 s) and then fail it.  If the
        registration has not ended by then, the chains start on the workers heard from
        that have the step method, and the registration ends in the background."""
        ended: dict = {}

        def register():
            try:
                with carrying(len(plugin.payload)):
                    self.client.register_plugin(plugin)
            except BaseException as e:  # raised below, unless the start went on without
                ended["error"] = e
            ended["done"] = True

        thread = threading.Thread(target=register, name="dasktensor-install", daemon=True)
        thread.start()
        thread.join(_config.seconds("sample.silent-worker"))
        if ended.get("done"):
            if "error" in ended:
                raise ended["error"]
            return
        workers = scheduler_workers(self.client)
        freshest = max((w["last_seen"] for w in workers.values()), default=0.0)
        silent = _config.seconds("sample.silent-worker")
        heard = [a for a, w in workers.items() if freshest - w["last_seen"] <= silent]
        found = self.client.run(has_run, self.token, workers=heard, on_error="return")
        pinned = [a for a, yes in found.items() if yes is True]
        if not pinned:
            thread.join()  # no worker has it yet: wait for Dask's own outcome
            if "error" in ended:
                raise ended["error"]
            return
        self._heard = self._pinned = pinned

        def unpin():  # once every worker has it (a silent one may never: then never)
            thread.join()
            if "error" not in ended:
                self._pinned = []

        threading.Thread(target=unpin, name="dasktensor-install-wait", daemon=True).start()
        _log.info(
            "the step method is not installed on every worker yet (a silent one?): the "
            "chains start on %d worker(s) that have it", len(self._heard),
        )  # fmt: skip

    def _size(self, run: _Chain, tune: int = 0, length: int | None = None) -> int:
        """Draws of ``run``'s next segment.

        ``checkpoint_every`` if set.  Otherwise about ``sample.segment-seconds`` from the
        chain's last draw rate (a first segment of ``FIRST_SEGMENT`` draws measures it),
        with two cuts that cost a round trip each (a few milliseconds, hidden when a
        worker has another chain's segment queued) and save whole seconds: a segment
        ends where tuning ends, so the breakdown can tell tuning from draws; and near a
        chain's end, segments take half of what is left (down to ``TAIL_SECONDS``), so
        that the chains end together rather than one worker running a last long segment
        while the others wait.
        """
        if self.every:
            return self.every
        if run.rate is None:
            size = FIRST_SEGMENT
        else:
            target = _config.seconds("sample.segment-seconds")
            rate = max(run.rate, 1e-9)
            size = max(1, int(target / rate))
            if length is not None:
                left = length - run.done
                if left * rate < 2 * target:  # the chain's last segments: halve what is left
                    size = max(-(-left // 2), int(TAIL_SECONDS / rate), 1)
        if run.done < tune < run.done + size:
            size = tune - run.done
        return size


class _Recorder:
    """Draws into PyMC's traces, the progress bar, the store and the user's callback."""

    def __init__(self, traces, tune, length, progress, callback, store):
        from pymc.stats.convergence import log_warning_stats

        self.traces, self.tune, self.length = traces, tune, length
        self.progress, self.callback, self.store = progress, callback, store
        self.log_warning_stats = log_warning_stats
        self.finished: set[int] = set()

    def restore(self, run: _Chain) -> None:
        """Record the draws the store holds of ``run`` (the callback sees them too), and
        move the chain to the state after them."""
        checkpoint = self.store.checkpoint(run.index)
        if not checkpoint.done:
            return
        points = self.store.points(run.index, checkpoint.done)
        self._record(run, 0, points, checkpoint.stats)
        run.done, run.start = checkpoint.done, Start(checkpoint.state, checkpoint.point)

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
        points = aligned(points)
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


def _cloudpickled(step) -> tuple[bytes, bool]:
    """The step method pickled, and whether the workers of a host may unpickle it at
    once: every compiled function in it is linked by Numba (whose cache of compiled code
    is safe to fill from several processes), none by PyTensor's C linker (whose module
    cache is not, pymc-devs/pymc#7819)."""
    import io

    import cloudpickle
    from pytensor.tensor.variable import TensorConstantSignature

    linkers: set[str] = set()

    class Pickler(cloudpickle.Pickler):
        def persistent_id(self, obj):
            if type(obj).__name__ == "Function":
                linker = getattr(getattr(obj, "maker", None), "linker", None)
                if linker is not None:
                    linkers.add(type(linker).__name__)
            return None

        def reducer_override(self, obj):
            if type(obj) is np.ndarray and obj.nbytes >= SHARED_BYTES:
                whole = _whole_view(obj)
                if whole is not None:
                    return _view, whole
            elif type(obj) is TensorConstantSignature:  # without its masked copy
                state = {k: v for k, v in vars(obj).items() if k != "_no_nan"}
                return _signature, (type(obj), tuple(obj), state)
            return super().reducer_override(obj)

    buffer = io.BytesIO()
    Pickler(buffer, protocol=cloudpickle.DEFAULT_PROTOCOL).dump(step)
    return buffer.getvalue(), bool(linkers) and linkers <= {"NumbaLinker"}


#: arrays from this size on travel as views of the array that holds their memory
SHARED_BYTES = 1 << 16


def _whole_view(a: np.ndarray) -> tuple | None:
    """``(base, shape, dtype, offset, strides, writeable)`` if ``a`` is a view of an
    ndarray ``base`` that spans all of ``base``'s memory (a transpose, a reshape, a
    constant PyTensor keeps beside the data it came from), else None.

    A step method's graphs hold the model's data in such views (P10's design matrix as
    itself and as its transpose).  Pickled as views of ``base``, which the pickle's memo
    writes once, the data travels once, and the views share memory after unpickling as
    before.  A view of part of its base is pickled as usual: the whole base would be more
    to send.
    """
    base = a.base  # NumPy points a view of a view at the array that holds the memory
    if type(base) is not np.ndarray or base.nbytes != a.nbytes or a.dtype.hasobject:
        return None
    if not base.flags.c_contiguous or min(a.strides, default=0) < 0:
        return None
    offset = a.__array_interface__["data"][0] - base.__array_interface__["data"][0]
    return base, a.shape, a.dtype, offset, a.strides, a.flags.writeable


def _signature(cls, items: tuple, state: dict):
    """A PyTensor constant's signature (how equal constants are found), unpickled.

    Each signature caches a masked copy of its constant (``_no_nan``, made when the
    constant is first compared or hashed): pickled, that copy writes the data, and a
    mask as large, once more.  It is left out, and made again when needed.
    """
    signature = cls(items)
    vars(signature).update(state)
    return signature


def _view(base: np.ndarray, shape, dtype, offset: int, strides, writeable: bool) -> np.ndarray:
    """The view ``_whole_view`` described, of the unpickled ``base``."""
    view = np.ndarray(shape, dtype, buffer=base, offset=offset, strides=strides)
    if not writeable:
        view.flags.writeable = False
    return view
