"""``dt.sample``'s speed on one machine: what it reports of its wall time and what it does
to lose none (no timing is asserted: ``benchmarks/bench_p10_chains.py`` measures it).

* the breakdown of a run's wall time, printed with ``progressbar=True`` and kept for
  ``dasktensor.sampling.last_breakdown()``;
* segments that end where tuning ends and shrink near a chain's end;
* the workers import PyMC (and PyTensor's Numba backend) while the caller compiles;
* the step method's data sent once, views sharing memory as before;
* workers of one host unpickle a Numba step method at once, not one after another under
  the host's compile lock (which PyTensor's C backend still needs).
"""

from __future__ import annotations

import pickle
import re
import sys
import threading
import time

import pymc as pm
import pytest
from _clusters import local_cluster
from _sample_models import PICKLED, RUN, assert_same_draws, groups_of, hierarchical

import dasktensor as dt
from dasktensor import _compat
from dasktensor.sampling import last_breakdown

pytestmark = pytest.mark.slow


def test_progressbar_prints_where_the_wall_time_went(client, capsys):
    with hierarchical():
        dt.sample(**dict(RUN, progressbar=True), client=client, compute_convergence_checks=False)
    printed = capsys.readouterr().out
    breakdown = last_breakdown()
    assert re.search(r"dt\.sample: \d+\.\d\d s", printed), printed
    for label in ("PyMC's setup in the caller", "step method sent to the workers",
                  "tuning (until every chain is tuned)", "draws (until the last segment)",
                  "conversion to PyMC's result"):  # fmt: skip
        assert label in printed, printed
    assert {"prepare", "pickle", "send", "first", "tuning", "draws", "release",
            "conversion"} <= set(breakdown.phases)  # fmt: skip
    assert all(v >= 0 for v in breakdown.phases.values())
    assert breakdown.total == pytest.approx(sum(breakdown.phases.values()))
    assert breakdown.segments >= RUN["chains"] * 2  # tuning and draws are apart
    assert set(breakdown.compile) <= set(client.scheduler_info()["workers"])
    assert 1 <= breakdown.workers == len(breakdown.compile)
    assert 0 < breakdown.utilisation <= 1.0 + 1e-6


def test_without_a_progressbar_nothing_is_printed_and_the_breakdown_is_kept(client, capsys):
    with hierarchical():
        dt.sample(**RUN, client=client, compute_convergence_checks=False)
    assert "dt.sample:" not in capsys.readouterr().out
    assert last_breakdown().segments >= RUN["chains"]


def _chain(done, rate):
    from dasktensor.sampling._chains import Start, _Chain

    return _Chain(0, done, Start(None, {}), rate)


def test_segments_end_where_tuning_ends_and_halve_near_a_chains_end():
    import dask

    from dasktensor.sampling._chains import FIRST_SEGMENT, TAIL_SECONDS, ChainRunner

    runner = ChainRunner(client=None)
    with dask.config.set({"dasktensor.sample.segment-seconds": "5s"}):
        assert runner._size(_chain(0, None), tune=300, length=600) == FIRST_SEGMENT
        assert runner._size(_chain(0, None), tune=4, length=600) == 4  # tuning ends at 4
        # 10 ms a draw: 500 draws to a segment, cut where tuning ends
        assert runner._size(_chain(10, 0.01), tune=300, length=2000) == 290
        assert runner._size(_chain(300, 0.01), tune=300, length=2000) == 500
        # the last 10 s of a chain: half of what is left, down to TAIL_SECONDS
        assert runner._size(_chain(1100, 0.01), tune=300, length=2000) == 450
        assert runner._size(_chain(1900, 0.01), tune=300, length=2000) == 50
        assert runner._size(_chain(1990, 0.01), tune=300, length=2000) == int(TAIL_SECONDS / 0.01)
    assert ChainRunner(client=None, every=7)._size(_chain(290, 0.01), 300, 2000) == 7


def test_time_sized_segments_give_pm_samples_draws(client):
    """Segments sized by time (cut at tuning's end, halved at the end) on two workers."""
    import dask

    runs = dict(RUN, draws=60, tune=50)
    with dask.config.set({"dasktensor.sample.segment-seconds": "0.2s"}), hierarchical():
        got = dt.sample(**runs, client=client, compute_convergence_checks=False)
        expected = pm.sample(**runs, **PICKLED, compute_convergence_checks=False)
    assert_same_draws(got, expected)
    # a first segment, one that ends where tuning ends, and at least one after it
    assert last_breakdown().segments >= 3 * runs["chains"]


def test_the_workers_import_pymc_while_the_caller_compiles():
    """And, where the step method's functions will be linked with Numba (PyTensor 3's
    default), PyTensor's Numba backend: seconds of a cold worker's first unpickling."""
    from distributed import Client

    from dasktensor.sampling._chains import ChainRunner

    def imported() -> bool:
        from pytensor.compile.mode import get_default_mode

        numba = type(get_default_mode().linker).__name__ == "NumbaLinker"
        backend = "pytensor.link.numba.dispatch" in sys.modules
        return "pymc" in sys.modules and backend == numba

    with local_cluster(n_workers=1) as cluster, Client(cluster, set_as_default=False) as c:
        assert not any(c.run(imported).values())
        ChainRunner(c).prepare_workers()
        deadline = time.monotonic() + 120
        while not all(c.run(imported).values()):
            assert time.monotonic() < deadline, "the workers did not import PyMC"
            time.sleep(0.1)


def test_the_workers_import_pymc_ahead_only_for_plain_models(client):
    """Not while the caller's compilation builds data shards or remote models on them."""
    from _sample_models import with_remote_likelihood

    from dasktensor.sampling._sample import _plain

    with hierarchical() as model:
        assert _plain(model, None)
        assert not _plain(model, {"mode": dt.dask_mode()})
    remote_model, remote = with_remote_likelihood(client)
    try:
        assert not _plain(remote_model, None)
    finally:
        remote.close()


def test_which_step_methods_the_workers_of_a_host_unpickle_at_once():
    from dasktensor.sampling._chains import _cloudpickled

    with hierarchical():
        payload, concurrent = _cloudpickled(pm.NUTS())
        _, dasked = _cloudpickled(pm.NUTS(compile_kwargs={"mode": dt.dask_mode()}))
    assert concurrent is _compat.PYTENSOR_3  # Numba's linker; not PyTensor 2's C linker
    assert dasked is False
    assert isinstance(pickle.loads(payload), pm.NUTS)


# unpickled here, the step method's function holds the 3.2 MB matrix as a constant, which
# Numba says it cannot cache (PyTensor silences that warning where it compiles; pytest's
# filters, set again for each test, come first)
@pytest.mark.filterwarnings("ignore:Cannot cache compiled function:numba.core.errors.NumbaWarning")
def test_a_step_method_is_sent_with_its_data_once():
    """A regression's design matrix is in the step method's graphs as itself, as its
    transpose and, in the signatures PyTensor compares constants by, as masked copies
    with masks as large: pickled as before, 4 times over (15 MB for P10's 3.2 MB).  Sent
    now, its bytes go once, and the step method makes the same steps."""
    import cloudpickle
    import numpy as np

    from dasktensor.sampling._chains import _cloudpickled

    rng = np.random.default_rng(3)
    X = rng.normal(size=(20_000, 20))
    with pm.Model() as model:
        b = pm.Normal("b", 0, 1, shape=20)
        pm.Bernoulli("y", logit_p=pm.math.dot(X, b), observed=rng.binomial(1, 0.5, 20_000))
        step = pm.NUTS()
        start = model.initial_point()
    before = cloudpickle.dumps(step)
    payload, _ = _cloudpickled(step)
    assert len(before) > 3 * X.nbytes  # what this test is about: the data many times over
    assert len(payload) < 1.5 * X.nbytes, f"{len(payload):,} bytes for {X.nbytes:,} of data"
    steps = {}
    for name, pickled in (("as before", before), ("now", payload)):
        method, point, draws = pickle.loads(pickled), dict(start), []
        for _ in range(5):
            point, _stats = method.step(point)
            draws.append(point["b"].copy())
        steps[name] = np.array(draws)
    np.testing.assert_array_equal(steps["now"], steps["as before"])


def test_arrays_that_share_memory_share_it_after_the_trip():
    """Views that span their base's memory travel as views of it; anything else (part of
    a base, negative strides, objects, small arrays) as before; flags are kept."""
    import numpy as np

    from dasktensor.sampling._chains import _cloudpickled

    base = np.arange(200_000.0).reshape(200, 1000)
    frozen = base.T.view()
    frozen.flags.writeable = False
    objects = np.empty((100, 100), dtype=object)
    objects[:] = 1.5
    sent = (base, base.T, base.reshape(-1), frozen, base[:10], base[::-1], objects.T,
            base[:2, :2].T)  # fmt: skip
    payload, concurrent = _cloudpickled(sent)
    got = pickle.loads(payload)
    assert concurrent is False  # no compiled function in it
    # base once, and base[::-1] as a copy; as before, base four times more
    assert len(payload) < 2.2 * base.nbytes + objects.size * 20, f"{len(payload):,} bytes"
    for original, copy in zip(sent, got):
        np.testing.assert_array_equal(copy, original)
        assert copy.dtype == original.dtype
        assert copy.flags.writeable == original.flags.writeable
    whole, transposed, flat, ro = got[:4]
    assert [v.strides for v in got[:4]] == [v.strides for v in sent[:4]]
    assert all(np.shares_memory(whole, v) for v in (transposed, flat, ro))
    assert not np.shares_memory(whole, got[4]) and not np.shares_memory(whole, got[5])
    transposed[0, 0] = -1.0  # as the original views: writing one writes the others
    assert whole[0, 0] == flat[0] == ro[0, 0] == -1.0


@pytest.mark.skipif(not _compat.PYTENSOR_3, reason="PyTensor 2's C backend takes the host lock")
def test_workers_unpickle_a_numba_step_method_without_the_host_lock(client):
    """The host's compile lock held by this process all along: the run still ends."""
    from dasktensor.engine._runners import _host_compile_lock

    done: dict = {}

    def fit():
        try:
            with hierarchical(shift=0.5):
                done["result"] = dt.sample(**RUN, client=client, compute_convergence_checks=False)
        except BaseException as e:  # reported below
            done["error"] = e

    with _host_compile_lock():
        thread = threading.Thread(target=fit)
        thread.start()
        thread.join(240)
        assert not thread.is_alive(), "the workers waited for the host's compile lock"
    assert "error" not in done, done
    assert groups_of(done["result"])["posterior"]["mu"].shape[0] == RUN["chains"]


def _profiling(dask_worker=None):
    """(whether this worker runs a chain's segment now, whether its profiler runs and its
    event loop probe at Dask's interval, whether both are as paused for segments)."""
    import dask
    from dask.utils import parse_timedelta

    from dasktensor.sampling._segments import SLOW_TICK_MS

    executing = any("chain_" in str(ts.key) for ts in dask_worker.state.executing)
    profile, tick = (dask_worker.periodic_callbacks[k] for k in ("profile", "tick"))
    own = parse_timedelta(dask.config.get("distributed.admin.tick.interval"), "ms") * 1000
    as_set = profile.is_running() and tick.callback_time == own
    paused = not profile.is_running() and tick.callback_time == SLOW_TICK_MS
    return executing, as_set, paused


def test_the_workers_profiler_pauses_while_segments_run(client):
    """Dask's statistical profiler (a stack sample every 10 ms, under the GIL) is stopped
    and its event loop probe slowed while a worker runs segments, and both are as Dask
    set them once it is over."""
    seen: list = []

    def look(trace, draw):
        if draw.draw_idx % 5 == 0:
            seen.extend(client.run(_profiling).values())

    assert all(as_set for _, as_set, _ in client.run(_profiling).values())
    with hierarchical():
        dt.sample(**dict(RUN, chains=4), client=client, checkpoint_every=5, callback=look,
                  compute_convergence_checks=False)  # fmt: skip
    during = [paused for executing, _, paused in seen if executing]
    assert any(during), seen  # seen paused while segments ran (the race: the test below)
    deadline = time.monotonic() + 10
    while not all(as_set for _, as_set, _ in client.run(_profiling).values()):
        assert time.monotonic() < deadline, "the profiler did not start again"
        time.sleep(0.05)


def _back_to_back(segments: int) -> list[bool]:
    """In a worker's task: pairs of segments, the second started as soon as the first
    ended (a queued segment) while the worker's event loop was busy; whether the
    profiler ran during each second one."""
    from distributed import get_worker

    from dasktensor.sampling._segments import profiler_paused

    worker = get_worker()
    profile = worker.periodic_callbacks["profile"]
    seen = []
    for _ in range(segments):
        with profiler_paused():
            time.sleep(0.05)  # (the event loop pauses the profiler meanwhile)
            worker.loop.add_callback(time.sleep, 0.1)  # and is busy as the segment ends
        with profiler_paused():
            time.sleep(0.2)
            seen.append(profile.is_running())
    return seen


def test_a_segment_right_after_another_runs_without_the_profiler(client):
    """The pause follows the count of running segments when the event loop applies it:
    a segment that starts before the loop restored the profiler for the one that ended
    must not find it restarted (it did, every time, when each segment's start decided
    what to pause from what ran at that moment)."""
    seen = client.submit(_back_to_back, 5, pure=False).result()
    assert not any(seen), seen


def _paused_for(seconds: float) -> bool:
    """In a worker's task: what a segment of ``seconds`` does to the worker's callbacks."""
    from dasktensor.sampling._segments import profiler_paused

    with profiler_paused():
        time.sleep(seconds)
    time.sleep(0.3)  # the event loop probe runs again meanwhile
    return True


def _record_ticks(on: bool, dask_worker=None) -> list[str]:
    """In a worker: start (``on``) or stop recording Dask's "Event loop was
    unresponsive" messages of this worker; the messages recorded when stopping.  The
    ``distributed.core`` logger is set to INFO meanwhile (its level restored after)."""
    import logging

    logger = logging.getLogger("distributed.core")
    if on:

        class Keep(logging.Handler):
            def __init__(self):
                super().__init__(logging.INFO)
                self.messages: list[str] = []
                self.level_before = logger.level

            def emit(self, record):
                if "unresponsive" in record.getMessage():
                    self.messages.append(record.getMessage())

        dask_worker._dasktensor_ticks = keep = Keep()
        logger.addHandler(keep)
        logger.setLevel(logging.INFO)
        return []
    keep = dask_worker.__dict__.pop("_dasktensor_ticks")
    logger.removeHandler(keep)
    logger.setLevel(keep.level_before)
    return keep.messages


def test_a_long_segment_is_not_reported_as_a_stalled_event_loop(client):
    """A segment longer than Dask's ``tick.limit`` (3 s) leaves the worker's event loop
    free all along: its probe, slowed meanwhile, must not report it as a stall (stopped,
    its first tick after the segment did, at INFO, on every worker)."""
    worker = sorted(client.scheduler_info()["workers"])[0]
    client.run(_record_ticks, True, workers=[worker])
    try:
        client.submit(_paused_for, 3.6, workers=[worker], pure=False).result()
    finally:
        reported = client.run(_record_ticks, False, workers=[worker])[worker]
    assert reported == []
