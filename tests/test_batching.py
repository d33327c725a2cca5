"""Concurrent calls of a ``@dt.batched`` method coalesced into one evaluation at the replica.

The batcher itself (threads, no cluster), then remote models on a process cluster: each
caller's result bit for bit what it would be alone, errors and timeouts per caller, a
worker killed mid-batch, ``max_size=1``, and ``dt.sample`` of many chains.
"""

from __future__ import annotations

import functools
import os
import re
import signal
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from _clusters import eventually, local_cluster

import dasktensor as dt
from dasktensor_worker.batching import Batcher, batched

# ----------------------------------------------------------------------------- the batcher


class Slow:
    """A model whose batches take ``delay`` seconds whatever their size, and say how big
    they were."""

    def __init__(self, delay=0.05):
        self.delay = delay
        self.sizes: list[int] = []

    @batched
    def logp_grad(self, theta):
        time.sleep(self.delay)
        self.sizes.append(len(theta))
        return -0.5 * (theta**2).sum(axis=1), -theta

    @batched(max_size=1)
    def alone(self, theta):
        time.sleep(self.delay)
        self.sizes.append(len(theta))
        return theta.sum(axis=1)

    @batched
    def fails(self, theta):
        time.sleep(self.delay)
        raise FloatingPointError(f"no batch of {len(theta)}")

    @batched
    def wrong_rows(self, theta):
        return theta[1:].sum(axis=1)  # a row short

    @batched(stack=False)
    def names(self, who, times):
        return [f"{w} x{t}" for w, t in zip(who, times)]


def batcher(model, method):
    target = getattr(model, method)
    return Batcher(target, target.dasktensor_batched, threading.BoundedSemaphore(1), 1)


def together(fn, args_list, threads=8):
    """``fn(args)`` for each of ``args_list`` from ``threads`` threads at once; the
    outcomes (results, or the exceptions raised) in order."""

    def one(args):
        try:
            return fn(args)
        except Exception as e:
            return e

    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(one, args_list))


def test_concurrent_calls_run_in_batches_and_each_gets_its_own_row():
    model = Slow()
    b = batcher(model, "logp_grad")
    thetas = [np.arange(3.0) + i for i in range(16)]
    out = together(b.call, [(t,) for t in thetas])
    for t, (logp, grad) in zip(thetas, out):
        assert logp == -0.5 * (t**2).sum()  # the row's own value, bit for bit
        np.testing.assert_array_equal(grad, -t)
    assert sum(model.sizes) == 16 and b.calls == 16
    assert max(model.sizes) > 1, model.sizes  # calls that waited ran together
    assert len(model.sizes) < 16 and b.batches == len(model.sizes)


def test_a_lone_call_runs_at_once():
    model = Slow(delay=0.0)
    b = batcher(model, "logp_grad")
    t0 = time.perf_counter()
    logp, grad = b.call((np.ones(2),))
    assert logp == -1.0 and model.sizes == [1]
    assert time.perf_counter() - t0 < 1.0  # (no wait: nothing else queued)


def test_max_size_1_runs_every_call_alone():
    model = Slow(delay=0.01)
    b = batcher(model, "alone")
    out = together(b.call, [(np.full(2, float(i)),) for i in range(8)])
    assert [float(o) for o in out] == [2.0 * i for i in range(8)]
    assert model.sizes == [1] * 8


def test_wait_collects_calls_that_arrive_after_the_first():
    calls = []

    @batched(wait=0.3)
    def total(x):
        calls.append(len(x))
        return x.sum(axis=1)

    b = Batcher(total, total.dasktensor_batched, threading.BoundedSemaphore(1), 1)

    def late(i):
        time.sleep(0.02 * i)  # each arrives after the first started its batch
        return b.call((np.full(2, float(i)),))

    with ThreadPoolExecutor(4) as pool:
        out = list(pool.map(late, range(4)))
    assert [float(o) for o in out] == [0.0, 2.0, 4.0, 6.0]
    assert calls == [4]


@pytest.mark.parametrize("wait, most_common", [("auto", 8), (0, None)])
def test_callers_calling_back_to_back_stay_in_one_batch_with_wait_auto(wait, most_common):
    """8 chains, each calling again as soon as its call returns: by default a batch waits
    for the callers of the last one (at most a quarter of its time); with wait=0 the
    first one back runs alone, and lone batches alternate with the others."""
    import collections

    sizes = []

    @batched(wait=wait)
    def slow(x):
        sizes.append(len(x))
        time.sleep(0.04)
        return x

    b = Batcher(slow, slow.dasktensor_batched, threading.BoundedSemaphore(1), 1)

    def chain(i):
        return [float(b.call((np.array(float(i)),))) for _ in range(8)]

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(chain, range(8))) == [[float(i)] * 8 for i in range(8)]
    counts = collections.Counter(sizes[2:])  # (the first batches form as the threads start)
    if most_common is not None:
        assert counts.most_common(1)[0][0] == most_common and 1 not in counts, sizes
    else:
        assert counts[1] >= 3, sizes  # the first one back alone, again and again


def test_an_error_in_a_batch_reaches_every_caller_and_the_next_batch_runs():
    model = Slow()
    b = batcher(model, "fails")
    out = together(b.call, [(np.ones(2),) for _ in range(6)])
    assert all(isinstance(e, FloatingPointError) for e in out), out
    good = batcher(model, "logp_grad")
    assert together(good.call, [(np.ones(2),)] * 3)[0][0] == -1.0


def test_outputs_without_a_row_per_call_fail_with_a_message_saying_so():
    b = batcher(Slow(), "wrong_rows")
    out = together(b.call, [(np.ones(2),)] * 4, threads=4)
    assert all(isinstance(e, ValueError) for e in out), out
    assert "stacked along a first axis of one row per call" in str(out[0])
    assert re.search(r"(\d+) call\(s\), got an array of shape \((\d+),\)", str(out[0]))


def test_calls_of_other_shapes_go_in_other_batches():
    model = Slow()
    b = batcher(model, "logp_grad")
    thetas = [np.ones(2 + i % 2) * i for i in range(10)]
    out = together(b.call, [(t,) for t in thetas])
    for t, (logp, _) in zip(thetas, out):
        assert logp == -0.5 * (t**2).sum()


@pytest.mark.parametrize("concurrency", [1, 2, 3])
def test_many_threads_many_calls_each_get_their_own_result_and_the_lead_is_given_back(
    concurrency,
):
    """A stress test of the lead passing: threads calling at random moments, batches of
    random durations, several batches at once; every call answered with its own row, and
    no lead left held."""
    rng = np.random.default_rng(concurrency)
    pauses = rng.uniform(0, 0.002, size=(12, 40))

    @batched(max_size=5)
    def double(x):
        time.sleep(float(rng.uniform(0, 0.003)))
        return 2 * x

    b = Batcher(
        double, double.dasktensor_batched, threading.BoundedSemaphore(concurrency), concurrency
    )

    def caller(i):
        out = []
        for k in range(40):
            time.sleep(pauses[i, k])
            out.append(float(b.call((np.array(100.0 * i + k),))))
        return out

    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(caller, range(12)))
    assert results == [[2 * (100.0 * i + k) for k in range(40)] for i in range(12)]
    assert b.calls == 12 * 40 and b.leaders == 0 and not b.queue
    assert b.batches < b.calls  # some ran together


def test_the_calls_of_one_message_join_the_batches_of_other_callers():
    model = Slow(delay=0.05)
    b = batcher(model, "logp_grad")
    first = threading.Thread(target=b.call, args=((np.zeros(2),),))
    first.start()  # leads a batch of one, for 50 ms
    time.sleep(0.01)
    groups = {}

    def many(i):
        rows = [(np.array([float(i), float(k)]),) for k in range(5)]
        groups[i] = [c.outcome() for c in b.call_many(rows)]

    threads = [threading.Thread(target=many, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in [first, *threads]:
        t.join()
    assert model.sizes == [1, 15]  # three messages of five calls: one batch
    for i, outs in groups.items():
        assert [float(logp) for logp, _ in outs] == [-0.5 * (i * i + k * k) for k in range(5)]
    assert b.leaders == 0 and not b.queue


def test_a_message_larger_than_max_size_runs_in_several_batches():
    class Small:
        @batched(max_size=4, wait=0)
        def double(self, x):
            return 2 * x

    b = batcher(Small(), "double")
    out = b.call_many([(np.array([float(k)]),) for k in range(10)])
    assert [float(c.outcome()[0]) for c in out] == [2.0 * k for k in range(10)]
    assert (b.batches, b.calls, b.leaders) == (3, 10, 0)


def test_unstacked_batches_get_lists_and_return_one_result_per_call():
    b = batcher(Slow(), "names")
    out = together(b.call, [(f"c{i}", i) for i in range(5)], threads=5)
    assert out == [f"c{i} x{i}" for i in range(5)]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_size": 0}, "max_size= an int >= 1, got 0"),
        ({"max_size": 2.5}, "max_size= an int >= 1, got 2.5"),
        ({"wait": -1}, "wait= seconds >= 0"),
        ({"wait": "1s"}, "wait= seconds >= 0"),
        ({"stack": "yes"}, "stack= True or False"),
    ],
)
def test_bad_options_are_refused_naming_what_was_expected(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        batched(**kwargs)
    assert batched(max_size=2)(lambda x: x).dasktensor_batched["max_size"] == 2


# ----------------------------------------------------------------------------- on a cluster


class Surrogate:
    """A normal likelihood over 1,000 rows, priced like a GPU surrogate: ``delay`` seconds
    a call whatever its batch.  ``logp_grad`` is batched; ``logp_grad_alone`` is the same
    arithmetic for one parameter vector, unbatched."""

    def __init__(self, delay: float = 0.02, pidfile: str | None = None):
        self.data = np.random.default_rng(0).normal(1.0, 0.5, size=1000)
        self.delay, self.pidfile = delay, pidfile

    @dt.batched
    def logp_grad(self, theta):  # (calls, 2): mu, log_sigma
        if self.pidfile:
            with open(self.pidfile, "a") as f:
                f.write(f"{os.getpid()} ")
        time.sleep(self.delay)
        mu, log_sigma = theta[:, 0:1], theta[:, 1:2]
        r = self.data[None, :] - mu
        s = np.exp(-2 * log_sigma)
        n = self.data.size
        logp = -0.5 * (r**2 * s).sum(axis=1) - n * log_sigma[:, 0]
        grad = np.stack([(r * s).sum(axis=1), (r**2 * s).sum(axis=1) - n], axis=1)
        return logp, grad

    def logp_grad_alone(self, theta):  # (2,)
        time.sleep(self.delay)
        mu, log_sigma = theta[0], theta[1]
        r = self.data - mu
        s = np.exp(-2 * log_sigma)
        n = self.data.size
        logp = -0.5 * (r**2 * s).sum() - n * log_sigma
        return logp, np.array([(r * s).sum(), (r**2 * s).sum() - n])


def batch_sizes(client, name: str) -> list[int]:
    """The batch sizes the workers' call logs recorded for model ``name`` (oldest first)."""

    def sizes(dask_worker):
        host = dask_worker.plugins.get("dasktensor-models")
        records = host.calls.since(0.0)["records"] if host is not None else []
        return [r[5] for r in records if r[0] == name]

    return [s for found in client.run(sizes).values() for s in found]


def test_remote_callers_get_their_own_rows_bit_for_bit(client):
    model = dt.RemoteModel(Surrogate, name="rows-alone", replicas=1, scheduler=client)
    thetas = [np.array([0.1 * i, -0.2 + 0.05 * i]) for i in range(32)]
    out = together(lambda t: model.call("logp_grad", t[0]), [(t,) for t in thetas])
    local = Surrogate(delay=0)
    for t, (logp, grad) in zip(thetas, out):
        want_logp, want_grad = local.logp_grad_alone(t)
        assert logp == want_logp  # bit for bit, whatever batch it ran in
        np.testing.assert_array_equal(grad, want_grad)
    sizes = batch_sizes(client, "rows-alone")
    assert sum(sizes) == 32 and max(sizes) > 1, sizes  # the calls log shows the batches
    model.close()


def test_an_error_in_a_remote_batch_reaches_each_caller_with_its_type(client):
    model = dt.RemoteModel(Slow, name="slow", replicas=1, scheduler=client)
    out = together(lambda _: model.call("fails", np.ones(2)), range(6))
    assert all(isinstance(e, FloatingPointError) for e in out), out
    assert "no batch of" in str(out[0])
    logp, _ = model.call("logp_grad", np.ones(2))  # the next calls work
    assert logp == -1.0
    model.close()


def test_a_timeout_during_a_batch_reaches_each_caller_and_the_model_serves_again(client):
    from dasktensor.remote._replicas import calls_in_flight

    model = dt.RemoteModel(
        functools.partial(Slow, 1.0),
        name="slow-timeout",
        replicas=1,
        timeout=0.3,
        scheduler=client,
    )
    model.start()
    out = together(lambda _: model.call("logp_grad", np.ones(2)), range(4), threads=4)
    assert all(isinstance(e, TimeoutError) for e in out), out
    assert eventually(lambda: not calls_in_flight(), seconds=20)  # the late replies read
    fast = dt.RemoteModel(
        functools.partial(Slow, 0.0), name="slow-after-timeout", replicas=1, scheduler=client
    )
    assert fast.call("logp_grad", np.ones(2))[0] == -1.0
    model.close()
    fast.close()


def test_max_size_1_serves_each_remote_call_alone(client):
    model = dt.RemoteModel(
        functools.partial(Slow, 0.01), name="alone", replicas=1, scheduler=client
    )
    out = together(lambda i: model.call("alone", np.full(2, float(i))), range(8))
    assert [float(o) for o in out] == [2.0 * i for i in range(8)]
    assert set(batch_sizes(client, "alone")) == {1}
    model.close()


def combined(model, method: str) -> bool:
    """Whether this process sends its threads' calls of ``method`` in one message (it
    does once a reply said the method is batched)."""
    from dasktensor._runtime import runtime
    from dasktensor.remote._calls import _Combiners

    return (model._spec.key, method) in runtime.state(_Combiners).by_method


def test_many_threads_calls_travel_in_one_message_and_each_gets_its_own_row(client):
    model = dt.RemoteModel(Surrogate, name="combined-rows", replicas=1, scheduler=client)
    local = Surrogate(delay=0)
    first = model.call("logp_grad", np.array([0.0, 0.0]))  # the reply says: batched
    assert first[0] == local.logp_grad_alone(np.array([0.0, 0.0]))[0]
    assert combined(model, "logp_grad") and not combined(model, "logp_grad_alone")
    thetas = [np.array([0.01 * i, 0.002 * k]) for i in range(32) for k in range(4)]
    out = together(lambda t: model.call("logp_grad", t), thetas, threads=32)
    for t, (logp, grad) in zip(thetas, out):
        want_logp, want_grad = local.logp_grad_alone(t)
        assert logp == want_logp  # bit for bit, whatever message and batch it was in
        np.testing.assert_array_equal(grad, want_grad)
    sizes = batch_sizes(client, "combined-rows")
    assert sum(sizes) == 1 + len(thetas) and max(sizes) > 8, sizes
    model.close()


class Doubler:
    @batched(wait=0)
    def double(self, x):
        return 2 * x


def test_threads_hammering_a_batched_model_on_every_worker_all_get_their_rows(client):
    """Messages to several replicas at once, the lead handed on thousands of times: no
    call lost, none answered twice, no thread left waiting."""
    model = dt.RemoteModel(Doubler, name="doubler", scheduler=client)
    assert len(model.start()) >= 2
    model.call("double", np.ones(1))

    def many(i):
        return [float(model.call("double", np.array([i * 1000.0 + k]))[0]) for k in range(60)]

    out = together(many, range(32), threads=32)
    for i, got in enumerate(out):
        assert got == [2 * (i * 1000.0 + k) for k in range(60)], got
    model.close()


class Picky:
    """A batched model whose batches fail when one of their rows is negative."""

    @batched
    def double(self, x):
        time.sleep(0.01)
        if (x < 0).any():
            raise FloatingPointError(f"a negative row among {len(x)}")
        return 2 * x


def test_a_failing_batch_of_a_combined_message_reaches_each_of_its_callers(client):
    model = dt.RemoteModel(Picky, name="picky", replicas=1, scheduler=client)
    np.testing.assert_array_equal(model.call("double", np.ones(2)), [2.0, 2.0])
    assert combined(model, "double")
    rows = [np.full(2, float(i if i % 7 else -i - 1)) for i in range(40)]
    out = together(lambda x: model.call("double", x), rows, threads=20)
    for x, got in zip(rows, out):
        if isinstance(got, Exception):  # its batch held a negative row
            assert isinstance(got, FloatingPointError) and "negative row" in str(got), got
            remote = "".join(traceback.format_tb(got.__traceback__))
            assert "in double" in remote and "dasktensor_worker" in remote, remote
        else:
            np.testing.assert_array_equal(got, 2 * x)
    assert all(isinstance(out[i], FloatingPointError) for i in range(0, 40, 7))
    np.testing.assert_array_equal(model.call("double", np.ones(2)), [2.0, 2.0])  # serves on
    model.close()


def kill_the_first_writer(pidfile) -> None:
    """SIGKILL the process that first writes its pid into ``pidfile`` (a model's batch)."""
    while not pidfile.exists():
        time.sleep(0.02)
    os.kill(int(pidfile.read_text().split()[0]), signal.SIGKILL)


@pytest.mark.parametrize("warm", [False, True], ids=["one-message-each", "combined"])
def test_a_worker_killed_mid_batch_has_each_caller_retried_elsewhere(tmp_path, warm):
    from distributed import Client

    pidfile = tmp_path / "pids"
    with local_cluster(n_workers=2) as cluster, Client(cluster, set_as_default=False) as c:
        model = dt.RemoteModel(
            functools.partial(Surrogate, 1.0, str(pidfile)), name="killed", scheduler=c
        )
        assert len(model.start()) == 2
        if warm:  # the threads' calls then travel in messages of several calls
            model.call("logp_grad", np.zeros(2))
            assert combined(model, "logp_grad")
            pidfile.unlink()

        killer = threading.Thread(target=kill_the_first_writer, args=(pidfile,))
        killer.start()
        thetas = [np.array([0.1 * i, 0.0]) for i in range(12 if warm else 6)]
        out = together(lambda t: model.call("logp_grad", t), thetas, threads=len(thetas))
        killer.join()
        local = Surrogate(delay=0)
        for t, result in zip(thetas, out):
            assert not isinstance(result, Exception), result
            assert result[0] == local.logp_grad_alone(t)[0]
        assert len(set(pidfile.read_text().split())) >= 2  # batches ran on another worker
        model.close()


# ----------------------------------------------------------------------------- graph stages


def regression(rows: int = 20_000):
    import pymc as pm

    rng = np.random.default_rng(3)
    X = rng.normal(size=(rows, 3))
    y = X @ np.array([1.0, -2.0, 0.5]) + rng.normal(size=rows)
    with pm.Model() as model:
        beta = pm.Normal("beta", 0, 1, shape=3)
        sigma = pm.HalfNormal("sigma", 1)
        pm.Normal("y", X @ beta, sigma, observed=y)
    return model


def sharded_copies(model, client, n: int):
    """``n`` copies of the model's logp+dlogp function in the DASK mode, sharded in 2, as
    ``n`` samplers hold them (each compiled on its own)."""
    import dask

    settings = {"dasktensor.shard.min-rows": 1000, "dasktensor.shard.min-work": 0}
    with dask.config.set(settings):
        mode = dt.dask_mode(scheduler=client, shards=2)
        return [
            model.logp_dlogp_function(ravel_inputs=True, mode=mode)._pytensor_function
            for _ in range(n)
        ]


def shard_replicas(dask_worker):
    """On a worker: ``{key: calls}`` of the shard stages it holds."""
    host = dask_worker.plugins.get("dasktensor-models")
    replicas = getattr(host, "replicas", {})
    return {
        k: r.model.calls for k, r in replicas.items() if type(r.model).__name__ == "ShardServer"
    }


def test_copies_of_a_sharded_function_share_one_set_of_shards(client):
    model = regression()
    fs = sharded_copies(model, client, 3)
    q = np.zeros(fs[0].maker.fgraph.inputs[0].type.shape)
    outs = [f(q) for f in fs]
    for out in outs[1:]:
        for a, b in zip(out, outs[0]):
            np.testing.assert_array_equal(a, b)
    stages = {id(f.maker.linker.sharded.stages()[0]) for f in fs}
    assert len(stages) == 1  # one set, held by the three copies
    keys = {m.key for f in fs for s in f.maker.linker.sharded.stages() for m in s.models}
    held = {k for found in client.run(shard_replicas).values() for k in found if k in keys}
    assert len(keys) == 2 and held == keys


def hold_shards(keys, seconds: float, dask_worker=None) -> int:
    """On a worker: take the slots of the shard stages among ``keys`` that it holds, as a
    busy evaluation would, and give each back from a thread of its own once a call waits
    for that shard and ``seconds`` more have passed (or after a minute: then
    ``held_shards`` says so).  The number of shards held."""
    import threading

    host = dask_worker.plugins["dasktensor-models"]
    held = [r for k, r in host.replicas.items() if k in keys]
    dask_worker.held_shards = waited = []

    def give_back(replica):
        deadline = time.monotonic() + 60
        batcher = replica.batcher("run_together")
        # a call waits for the shard: queued, or taken into a batch that waits for a slot
        while not (batcher.queue or batcher.leaders) and time.monotonic() < deadline:
            time.sleep(0.005)
        waited.append(bool(batcher.queue or batcher.leaders))
        time.sleep(seconds)
        for _ in range(replica.concurrency):
            replica.slots.release()

    for replica in held:
        for _ in range(replica.concurrency):
            replica.slots.acquire()
        threading.Thread(target=give_back, args=(replica,), daemon=True).start()
    return len(held)


def held_shards(dask_worker=None) -> list[bool]:
    """On a worker: for each shard ``hold_shards`` held, whether a call waited for it
    before it was given back (False: given back after the minute)."""
    return list(getattr(dask_worker, "held_shards", []))


def test_each_threads_sharded_result_under_coalescing_equals_the_call_alone(client):
    model = regression(40_000)  # data of its own: shards no other test built
    fs = sharded_copies(model, client, 4)
    size = fs[0].maker.fgraph.inputs[0].type.shape
    points = [np.random.default_rng(i).normal(scale=0.3, size=size) for i in range(4)]
    alone = [[np.array(o) for o in fs[0](q)] for q in points]  # one at a time
    keys = {m.key for s in fs[0].maker.linker.sharded.stages() for m in s.models}
    before = sum(n for w in client.run(shard_replicas).values() for k, n in w.items() if k in keys)

    def chain(i):  # a sampler's chain: its own copy, back-to-back evaluations
        return [[np.array(o) for o in fs[i](points[i])] for _ in range(25)]

    def batches(since, dask_worker=None):
        records = dask_worker.plugins["dasktensor-models"].calls.since(since)["records"]
        return [r[5] for r in records if r[0] == "shard"]

    # Whether the chains' calls meet is up to the machine's timing (on a CI machine,
    # eight rounds of four chains once never did): the first evaluation's calls are
    # held on the shards for half a second, while the other chains' calls queue behind
    # it in this process; they then travel together, one message per shard.
    held = sum(client.run(hold_shards, sorted(keys), 0.5).values())
    assert held == 2
    began = time.time()
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(chain, range(4)))
    for i, runs in enumerate(results):
        for got in runs:
            for g, w in zip(got, alone[i]):
                np.testing.assert_array_equal(g, w)  # bit for bit, whatever coalesced
    sizes = [s for found in client.run(batches, began).values() for s in found]
    print(f"batches of {sorted(set(sizes))} calls")
    # each shard was given back because the first evaluation's call waited for it
    assert sum(client.run(held_shards).values(), []) == [True, True]
    assert sum(sizes) == 2 * 4 * 25  # each chain's calls, to both shards
    assert max(sizes) >= 3, f"the queued chains' calls did not run together: {sorted(sizes)}"
    after = sum(n for w in client.run(shard_replicas).values() for k, n in w.items() if k in keys)
    assert after - before == 2 * 4 * 25  # every call reached both shards once


class Halves:
    """Two models of one sum, as two data shards are: ``part`` sums its half of the rows
    for each parameter row, and fails for a negative parameter."""

    def __init__(self, half: int, delay: float = 0.0, pidfile: str | None = None):
        self.rows = np.arange(1000.0)[half * 500 : (half + 1) * 500]
        self.delay, self.pidfile = delay, pidfile

    @dt.batched(stack=False, wait=0)
    def part(self, thetas):
        if self.pidfile:
            with open(self.pidfile, "a") as f:
                f.write(f"{os.getpid()} ")
        time.sleep(self.delay)
        for t in thetas:
            if t < 0:
                raise FloatingPointError(f"a negative parameter among {len(thetas)}")
        return [float((self.rows * t).sum()) for t in thetas]


def halves(client, **kwargs):
    """Two ``Halves`` models (one replica each) and their ``part`` methods combined."""
    from dasktensor.remote import RemoteMethod

    models = [
        dt.RemoteModel(
            functools.partial(Halves, h, **kwargs),
            name=f"half-{'ab'[h]}",
            replicas=1,
            scheduler=client,
        )
        for h in (0, 1)
    ]
    return models, RemoteMethod.combined([m.method("part") for m in models])


def test_threads_calling_the_same_targets_travel_together_each_with_its_own_results(client):
    models, both = halves(client, delay=0.05)
    want = [float(np.arange(500.0).sum()), float(np.arange(500.0, 1000.0).sum())]
    assert both((1.0,)) == want  # a lone thread: the plain calls
    began = time.time()
    out = together(lambda t: both((t,)), [float(i) for i in range(1, 17)], threads=16)
    for t, got in zip(range(1, 17), out):
        assert got == [w * t for w in want]  # its own results, in the targets' order
    sizes = {h: [] for h in ("half-a", "half-b")}

    def batches(since, dask_worker=None):
        records = dask_worker.plugins["dasktensor-models"].calls.since(since)["records"]
        return [(r[0], r[5]) for r in records if r[0].startswith("half-")]

    for found in client.run(batches, began).values():
        for name, size in found:
            sizes[name].append(size)
    # the threads that queued behind the first call travel in one message to each target
    assert sorted(sizes["half-a"]) == sorted(sizes["half-b"]), sizes
    assert sum(sizes["half-a"]) == 16 and max(sizes["half-a"]) >= 8, sizes
    for m in models:
        m.close()


def test_an_error_in_a_combined_round_reaches_the_threads_of_its_batch(client):
    models, both = halves(client, delay=0.02)
    thetas = [float(i if i % 5 else -i - 1) for i in range(20)]
    out = together(lambda t: both((t,)), thetas, threads=20)
    for t, got in zip(thetas, out):
        if isinstance(got, Exception):  # its batch held a negative parameter
            assert isinstance(got, FloatingPointError), got
            assert "negative parameter among" in str(got), got
            remote = "".join(traceback.format_tb(got.__traceback__))
            assert "in part" in remote and "dasktensor_worker" in remote, remote
        else:
            assert got == [float((np.arange(1000.0)[h * 500 : (h + 1) * 500] * t).sum())
                           for h in (0, 1)], (t, got)  # fmt: skip
    assert all(isinstance(out[i], FloatingPointError) for i in range(0, 20, 5))
    assert both((2.0,))[0] == 2 * float(np.arange(500.0).sum())  # serves on
    for m in models:
        m.close()


def test_a_worker_killed_during_a_combined_round_has_each_thread_served_elsewhere(tmp_path):
    from distributed import Client

    from dasktensor.remote import RemoteMethod

    pidfile = tmp_path / "pids"
    with local_cluster(n_workers=2) as cluster, Client(cluster, set_as_default=False) as c:
        models = [
            dt.RemoteModel(
                functools.partial(Halves, h, 1.0, str(pidfile) if h == 0 else None),
                name=f"killed-half-{'ab'[h]}",
                replicas=1,
                scheduler=c,
            )
            for h in (0, 1)
        ]
        for m in models:
            m.start()
        both = RemoteMethod.combined([m.method("part") for m in models])

        killer = threading.Thread(target=kill_the_first_writer, args=(pidfile,))
        killer.start()
        thetas = [float(i) for i in range(1, 9)]
        out = together(lambda t: both((t,)), thetas, threads=len(thetas))
        killer.join()
        for t, got in zip(thetas, out):
            assert not isinstance(got, Exception), got
            assert got == [float((np.arange(1000.0)[h * 500 : (h + 1) * 500] * t).sum())
                           for h in (0, 1)]  # fmt: skip
        assert len(set(pidfile.read_text().split())) >= 2  # rebuilt on the other worker
        for m in models:
            m.close()


def test_a_pickled_copy_in_another_process_finds_the_same_shards(client, tmp_path):
    import pickle
    import subprocess
    import sys
    import textwrap

    model = regression(30_000)  # data of its own: shards no other test built
    (f,) = sharded_copies(model, client, 1)
    q = np.full(f.maker.fgraph.inputs[0].type.shape, 0.1)
    want = f(q)
    (tmp_path / "f.pkl").write_bytes(pickle.dumps(f))
    keys = {m.key for s in f.maker.linker.sharded.stages() for m in s.models}
    script = textwrap.dedent(
        f"""
        import pickle, numpy as np, dask, dasktensor
        from distributed import Client
        client = Client({client.scheduler.address!r})
        with dask.config.set({{"dasktensor.shard.min-rows": 1000,
                               "dasktensor.shard.min-work": 0}}):
            f = pickle.loads(open({str(tmp_path / "f.pkl")!r}, "rb").read())
        out = f(np.full({f.maker.fgraph.inputs[0].type.shape!r}, 0.1))
        print(repr(float(out[0])))
        print(sorted(m.key for s in f.maker.linker.sharded.stages() for m in s.models))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    logp, other_keys = done.stdout.strip().splitlines()[-2:]
    assert float(logp) == float(want[0])
    assert eval(other_keys) == sorted(keys)  # the same stages, found, not built again

    def builds(dask_worker):
        return dict(dask_worker.plugins["dasktensor-models"].builds)

    counts = [n for found in client.run(builds).values() for k, n in found.items() if k in keys]
    assert counts == [1, 1]


# ----------------------------------------------------------------------------- dt.sample


@pytest.mark.slow
def test_dt_sample_of_8_chains_on_a_batched_model_gives_the_same_draws_every_time():
    """Two runs of 8 chains calling one batched replica draw the same, and so does the
    unbatched method: the draws do not depend on what happened to run together."""
    import pymc as pm
    import pytensor.tensor as pt
    from distributed import Client

    def draws(client, model, method):
        op = model.logp_grad_op(method, [pt.dvector])
        with pm.Model():
            mu = pm.Normal("mu", 1.0, 5.0)
            log_sigma = pm.Normal("log_sigma", 0.0, 1.0)
            pm.Potential("likelihood", op(pt.stack([mu, log_sigma]))[0])
            idata = dt.sample(
                20,
                tune=20,
                chains=8,
                random_seed=7,
                progressbar=False,
                compute_convergence_checks=False,
                client=client,
            )
        return {v: np.asarray(idata.posterior[v].values) for v in ("mu", "log_sigma")}

    with (
        local_cluster(n_workers=2, threads_per_worker=4) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        model = dt.RemoteModel(
            functools.partial(Surrogate, 0.005), name="chains-model", replicas=1, scheduler=client
        )
        first = draws(client, model, "logp_grad")
        again = draws(client, model, "logp_grad")
        alone = draws(client, model, "logp_grad_alone")
        for v in first:
            np.testing.assert_array_equal(first[v], again[v])
            np.testing.assert_array_equal(first[v], alone[v])
        assert max(batch_sizes(client, "chains-model")) > 1  # chains' calls ran together
        model.close()


# ----------------------------------------------------------------------------- shared models


def held_keys(client) -> set[str]:
    def keys(dask_worker):
        host = dask_worker.plugins.get("dasktensor-models")
        return list(getattr(host, "replicas", {}))

    return {k for found in client.run(keys).values() for k in found}


def test_models_made_with_one_key_share_replicas_until_the_last_lets_go(client, tmp_path):
    import subprocess
    import sys
    import textwrap

    key = "5a7ed0123456789a"
    one = dt.RemoteModel(Surrogate, name="shared", key=key, replicas=1, scheduler=client)
    two = dt.RemoteModel(Surrogate, name="shared", key=key, replicas=1, scheduler=client)
    assert one.key == two.key == "shared-5a7ed0123456789a"
    assert one.start() == two.start()
    assert set(one.build_counts().values()) == {1}  # built once, found by the other
    # another process makes the same model, calls it, and exits: the replica stays
    script = textwrap.dedent(
        f"""
        import numpy as np, dasktensor as dt, test_batching
        from distributed import Client
        client = Client({client.scheduler.address!r})
        m = dt.RemoteModel(test_batching.Surrogate, name="shared", key={key!r}, replicas=1)
        print(float(m.call("logp_grad_alone", np.zeros(2))[0]))
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert set(one.build_counts().values()) == {1}
    one.close()  # the other object of this process still holds it
    time.sleep(1.5)  # more than a lease check: the other process's lease is gone too
    assert one.key in held_keys(client)
    np.testing.assert_array_equal(
        two.call("logp_grad_alone", np.zeros(2))[0], Surrogate(0).logp_grad_alone(np.zeros(2))[0]
    )
    two.close()  # the last holder
    assert eventually(lambda: one.key not in held_keys(client))


def test_a_key_that_is_not_hex_digits_is_refused():
    with pytest.raises(ValueError, match=r"key=\.\.\.\) expected at least 8 lowercase hex"):
        dt.RemoteModel(Surrogate, name="shared", key="not-a-token")
