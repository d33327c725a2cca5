"""``dt.sample``: chains as Dask segments, on real worker processes, against ``pm.sample``.

The draws must be those of ``pm.sample`` with the same arguments, bit for bit (timing
statistics aside), whatever the segment size, the number of workers or the faults: a
worker killed mid-run, the calling process killed and the run resumed from its store.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pymc as pm
import pytest
from _clusters import cluster_with_a_bare_worker, freeze, local_cluster
from _sample_models import PICKLED, RUN, assert_same_draws, groups_of, hierarchical

import dasktensor as dt

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def process_cluster():
    """This module's own two worker processes (with nannies: a killed worker comes back),
    for conftest's ``client``."""
    with local_cluster() as cluster:
        yield cluster


@pytest.fixture(scope="module")
def reference():
    """pm.sample of the hierarchical model with the runs' arguments (chains in spawned
    processes, from the pickled step method: see ``_sample_models.PICKLED``)."""
    with hierarchical():
        return pm.sample(**RUN, **PICKLED, compute_convergence_checks=False)


def summary(caplog) -> str:
    lines = [r.getMessage() for r in caplog.records if r.name == "dasktensor.sample"]
    assert lines, "dt.sample logged no summary"
    return "\n".join(lines)


@pytest.mark.parametrize("every", [7, 50])
def test_draws_equal_pm_sample_whatever_the_segment_size(client, reference, every, caplog):
    caplog.set_level(logging.INFO, logger="dasktensor.sample")
    with hierarchical():
        idata = dt.sample(**RUN, client=client, checkpoint_every=every,
                          compute_convergence_checks=False)  # fmt: skip
    assert_same_draws(idata, reference)
    segments = int(re.search(r"in (\d+) segments", summary(caplog))[1])
    total = RUN["draws"] + RUN["tune"]
    assert segments == RUN["chains"] * -(-total // every)
    # the step method compiled once per worker that ran segments (one thread each)
    found = re.search(r"compiled (\d+) time\(s\) on (\d+) worker", summary(caplog))
    times, workers = found.groups()
    assert times == workers and int(workers) >= 1, summary(caplog)


def test_one_worker_gives_the_draws_of_two_and_warmup_groups(reference):
    from distributed import Client

    with local_cluster(n_workers=1) as one, Client(one, set_as_default=False) as client:
        with hierarchical():
            idata = dt.sample(**RUN, client=client, discard_tuned_samples=False,
                              compute_convergence_checks=False)  # fmt: skip
    assert_same_draws(idata, reference)
    groups = groups_of(idata)
    assert {"warmup_posterior", "warmup_sample_stats"} <= set(groups)
    assert groups["warmup_posterior"]["mu"].shape == (RUN["chains"], RUN["tune"])


def test_segments_are_named_after_their_chains_on_the_dashboard(client, reference):
    from dask.utils import key_split
    from distributed import get_task_stream

    with get_task_stream(client) as stream, hierarchical():
        dt.sample(**RUN, client=client, checkpoint_every=20, compute_convergence_checks=False)
    names = {key_split(t["key"]) for t in stream.data}
    assert {f"chain_{c}" for c in range(RUN["chains"])} <= names, names


def test_a_killed_worker_costs_a_segment_and_changes_no_draw(client, reference):
    """SIGKILL the worker running a segment, mid-run: Dask runs it again elsewhere."""
    killed = []

    def kill_a_busy_worker(trace, draw):
        if killed or draw.draw_idx < 25:
            return
        running = client.run(_executing_segment)  # a segment running now, not queued
        busy = [w for w, pid in running.items() if pid]
        if busy:
            os.kill(running[busy[0]], signal.SIGKILL)
            killed.append(running[busy[0]])

    with hierarchical():
        idata = dt.sample(**RUN, client=client, checkpoint_every=10, callback=kill_a_busy_worker,
                          compute_convergence_checks=False)  # fmt: skip
    assert killed
    assert killed[0] not in client.run(os.getpid).values()  # the nanny started a new one
    assert_same_draws(idata, reference)


def _executing_segment(dask_worker=None):
    """This worker's process id if it runs a chain's segment now, else None."""
    keys = [ts.key for ts in dask_worker.state.executing]
    return os.getpid() if any("chain_" in str(k) for k in keys) else None


CALLER = """
import sys
sys.path.insert(0, {tests!r})
from distributed import Client
import dasktensor as dt
from _sample_models import RUN, hierarchical
with Client({address!r}) as client, hierarchical():
    dt.sample(**RUN, client=client, store={store!r}, checkpoint_every=5,
              compute_convergence_checks=False)
"""


def test_a_killed_caller_resumes_from_its_store(
    process_cluster, client, reference, tmp_path, caplog
):
    """The calling process is SIGKILLed once segments are stored; dt.sample(resume=True)
    continues and gives the draws of an uninterrupted run."""
    store = tmp_path / "run.zarr"
    address = process_cluster.scheduler_address
    script = CALLER.format(tests=str(Path(__file__).parent), address=address,
                           store=str(store))  # fmt: skip
    caller = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        while _segments(store) < 4:
            assert caller.poll() is None, caller.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "no segment was stored"
            time.sleep(0.05)
        caller.send_signal(signal.SIGKILL)
    finally:
        caller.kill()
        caller.wait()
        caller.stderr.close()
    stored = _segments(store)
    assert 4 <= stored < RUN["chains"] * 14  # (70 draws in segments of 5 per chain)
    caplog.set_level(logging.INFO, logger="dasktensor.sample")
    with hierarchical():
        idata = dt.sample(**RUN, client=client, store=store, resume=True, checkpoint_every=9,
                          compute_convergence_checks=False)  # fmt: skip
    assert_same_draws(idata, reference)
    kept = re.search(r"\[([\d, ]+)\] draws of each chain were stored", summary(caplog))
    assert kept and sum(int(n) for n in kept[1].split(",")) >= 20, summary(caplog)


def _segments(store: Path) -> int:
    return len(list(store.glob("segments/chain-*/*.pkl"))) if store.exists() else 0


def test_a_store_of_another_run_is_refused_and_left_as_it_was(client, tmp_path):
    store = tmp_path / "run.zarr"
    small = dict(RUN, draws=5, tune=5, chains=1)
    with hierarchical():
        dt.sample(**small, client=client, store=store, compute_convergence_checks=False)
    before = sorted((p, p.stat().st_mtime_ns) for p in store.rglob("*"))
    with hierarchical(), pytest.raises(FileExistsError, match="resume=True"):
        dt.sample(**small, client=client, store=store)
    with hierarchical(shift=1.0), pytest.raises(dt.StoreMismatchError, match="model is"):
        dt.sample(**small, client=client, store=store, resume=True)
    with hierarchical(), pytest.raises(dt.StoreMismatchError, match="draws is 5 there, 6 here"):
        dt.sample(**dict(small, draws=6), client=client, store=store, resume=True)
    assert sorted((p, p.stat().st_mtime_ns) for p in store.rglob("*")) == before


def test_a_worker_that_joins_takes_segments(reference):
    """A worker added mid-run runs segments.  ``silent-worker`` is raised here: on a
    loaded machine the joining worker, busy compiling the step method, was heard from
    too seldom and its segments were twinned onto the other worker, which finished
    them first (the draws the same; what the test looks at, not)."""
    import dask
    from distributed import Client, get_task_stream

    with (
        dask.config.set({"dasktensor.sample.silent-worker": "60s"}),
        local_cluster(n_workers=1) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        (first,) = client.run(os.getpid)

        def has_the_step_method(dask_worker) -> bool:
            return any(n.startswith("dasktensor-step-method") for n in dask_worker.plugins)

        def add_a_worker(trace, draw):
            if len(cluster.workers) == 1 and draw.draw_idx == 15:
                cluster.scale(2)
                client.wait_for_workers(2, timeout=120)  # segments go on meanwhile
                # and until it has the run's step method (its import of dasktensor may
                # take seconds on a loaded machine), lest the run end before it can help
                deadline = time.monotonic() + 60
                while not all(client.run(has_the_step_method).values()):
                    assert time.monotonic() < deadline, "the new worker got no step method"
                    time.sleep(0.1)

        with get_task_stream(client) as stream, hierarchical():
            idata = dt.sample(**RUN, client=client, checkpoint_every=5, callback=add_a_worker,
                              compute_convergence_checks=False)  # fmt: skip
        (joined,) = set(client.run(os.getpid)) - {first}
        ran_on = {t["worker"] for t in stream.data if "chain_" in str(t["key"])}
        assert joined in ran_on, (joined, ran_on)
    assert_same_draws(idata, reference)


def test_concurrent_fits_in_threads_give_their_own_draws(client):
    """Two dt.sample calls at once (another model each), each equal to its pm.sample."""
    runs = dict(RUN, chains=2, draws=15, tune=15)
    results, errors = {}, []

    def fit(shift):
        try:
            with hierarchical(shift=shift):
                results[shift] = dt.sample(**runs, client=client, checkpoint_every=6,
                                           compute_convergence_checks=False)  # fmt: skip
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=fit, args=(s,)) for s in (0.0, 2.0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for shift, got in results.items():
        with hierarchical(shift=shift):
            expected = pm.sample(**runs, **PICKLED, compute_convergence_checks=False)
        assert_same_draws(got, expected)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"cores": 2}, TypeError, r"does not take cores= \(the chains run on the cluster"),
        ({"checkpoint_every": 0}, ValueError, "checkpoint_every= a positive integer"),
        ({"resume": True}, ValueError, "expected a store= to resume from"),
        ({"nuts_sampler": "numpyro"}, ValueError, "nuts_sampler='pymc'"),
        ({"store": "x.zarr", "random_seed": [1, 2]}, TypeError, "random_seed= an int"),
        ({"client": "tcp://nowhere:1"}, TypeError, "client= a distributed.Client"),
    ],
)
def test_bad_arguments_are_refused_before_any_work(kwargs, error, match, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with hierarchical(), pytest.raises(error, match=match):
        dt.sample(**{**RUN, **kwargs})
    assert not list(tmp_path.iterdir())  # no store was started


def test_without_a_cluster_it_says_what_to_do():
    import dask

    with (
        dask.config.set(scheduler="threads"),  # whatever default client another test left
        hierarchical(),
        pytest.raises(RuntimeError, match="expected a distributed Client"),
    ):
        dt.sample(**RUN)


def test_chains_whose_likelihood_calls_a_remote_model(client):
    """Segments on the workers call a RemoteModel (served by the workers too)."""
    from _clusters import channel_calls
    from _sample_models import with_remote_likelihood

    model, remote = with_remote_likelihood(client)
    runs = dict(RUN, chains=2, draws=20, tune=20)
    try:
        before = channel_calls(client).get("gaussian", 0)
        with model:
            got = dt.sample(**runs, client=client, checkpoint_every=8,
                            compute_convergence_checks=False)  # fmt: skip
            expected = pm.sample(**runs, **PICKLED, compute_convergence_checks=False)
        assert channel_calls(client)["gaussian"] - before >= 2 * 2 * 40  # both runs' calls
        assert_same_draws(got, expected)
    finally:
        remote.close()


def test_chains_whose_likelihood_is_sharded_over_the_workers(monkeypatch):
    """compile_kwargs={"mode": DASK with shards}: each segment's step method, unpickled on
    a worker, splits the log-density over data shards on the workers (built from within
    the segment's task, which leaves its thread slot meanwhile)."""
    import dask
    from _clusters import channel_calls
    from _sample_models import regression
    from distributed import Client

    # small data sharded: here, in the workers and in pm.sample's spawned processes
    monkeypatch.setenv("DASK_DASKTENSOR__SHARD__MIN_ROWS", "1000")
    runs = dict(RUN, chains=2, draws=15, tune=15)
    with (
        dask.config.set({"dasktensor.shard.min-rows": 1000}),
        local_cluster() as cluster,
        Client(cluster, set_as_default=False) as client,
        regression(),
    ):
        mode = dt.dask_mode(shards=2, scheduler=client)
        sharded = {"compile_kwargs": {"mode": mode}, "compute_convergence_checks": False}
        got = dt.sample(**runs, client=client, checkpoint_every=10, **sharded)
        calls = channel_calls(client).get("shard", 0)
        assert calls >= 2 * 2 * 30, calls  # 2 shards, each evaluation of 2 chains
        expected = pm.sample(**runs, **PICKLED, **sharded)
        assert channel_calls(client)["shard"] >= 2 * calls  # the reference is sharded too
    assert_same_draws(got, expected)


def test_a_models_error_on_a_worker_reaches_the_caller_with_its_type(client, tmp_path):
    """The log-density raises on the workers from the second segment on: dt.sample raises
    that exception (type, message, the worker's traceback), and nothing keeps running."""
    import traceback

    from _sample_models import refusing_after

    marker = tmp_path / "refuse"

    def refuse_from_now_on(trace, draw):
        marker.touch()

    with refusing_after(str(marker)), pytest.raises(FloatingPointError, match="refuses mu=") as e:
        dt.sample(**dict(RUN, chains=2), client=client, checkpoint_every=5,
                  callback=refuse_from_now_on, step=pm.Metropolis())  # fmt: skip
    assert "refusing" in "".join(traceback.format_tb(e.value.__traceback__))
    deadline = time.monotonic() + 30
    while any(client.processing().values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(client.processing().values())  # the other chain's segments were cancelled


def test_a_result_held_by_a_worker_that_froze_is_made_again(reference, caplog, tmp_path):
    """A segment finished on a worker that froze (SIGSTOP) before its result was
    fetched: fetching it would wait on a connection nobody answers; after
    ``silent-worker`` the segment runs again on the other worker, with the same draws."""
    settings = {"dasktensor.sample.silent-worker": "2s"}
    with cluster_with_a_bare_worker(settings) as (client, frozen):
        pids = client.run(os.getpid)
        (there,) = [a for a, p in pids.items() if p == frozen.pid]
        (other,) = [a for a in pids if a != there]
        let_go = tmp_path / "let-go"

        def hold_the_thread(marker: str) -> None:
            """Keep the other worker's one thread until ``marker`` exists (2 min at most)."""
            deadline = time.monotonic() + 120
            while not os.path.exists(marker) and time.monotonic() < deadline:
                time.sleep(0.05)

        def freeze_while_the_caller_is_busy(draw, **_):
            """From draw 20 on, the other worker's thread is held, so that the segments
            submitted from then on run on the worker to freeze (left to Dask, a run whose
            caller waits in this callback runs one segment at a time, on one worker that
            may be the other one).  While the caller records a draw (it fetches no result
            meanwhile), as soon as that worker holds the result of another chain's segment
            that the caller has not fetched: freeze it, and let the other worker go, to
            run that segment again.  (A result fetched stays on the worker until Dask
            releases it, later on a loaded machine: the keys on the worker while a chain's
            draws are recorded are that chain's fetched ones.)"""
            if stopped:
                return
            here = set(client.has_what([there])[there])
            fetched.update(k for k in here if str(k).startswith(f"chain_{draw.chain}-"))
            if draw.draw_idx < 20:
                return
            if not held:
                held.append(client.submit(hold_the_thread, str(let_go), workers=[other],
                                          pure=False))  # fmt: skip
                return
            others = tuple(f"chain_{c}-" for c in range(RUN["chains"]) if c != draw.chain)
            began = time.monotonic()
            while time.monotonic() - began < min(3, 60 - waited[0]):
                if any(str(k).startswith(others) and k not in fetched for k in here):
                    freeze(frozen.pid)
                    let_go.touch()
                    stopped.append(True)
                    break
                time.sleep(0.02)
                here = set(client.has_what([there])[there])
            waited[0] += time.monotonic() - began

        fetched: set = set()
        stopped: list[bool] = []
        held: list = []  # the future of hold_the_thread
        waited = [0.0]  # seconds the callback waited, 60 at most in all
        with caplog.at_level(logging.INFO, logger="dasktensor.sample"), hierarchical():
            idata = dt.sample(**RUN, client=client, checkpoint_every=5,
                              callback=freeze_while_the_caller_is_busy,
                              compute_convergence_checks=False)  # fmt: skip
        let_go.touch()
        assert stopped, f"{there} held no unfetched result of another chain in {waited[0]:.0f} s"
    assert "result is on a worker that does not answer" in summary(caplog), summary(caplog)
    assert_same_draws(idata, reference)
