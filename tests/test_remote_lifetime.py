"""How long a RemoteModel's replicas live: while the model does, in the process that made it.

A notebook cell that makes a model, re-run 20 times, must not leave 20 sets of replicas on
the workers; nor may a killed caller leave its models (shards of data, GPU memory) behind.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from _clusters import eventually, local_cluster
from _models import Probe

import dasktensor as dt
from dasktensor_worker import tasks


@pytest.fixture(scope="module")
def process_cluster():
    """This module's own 2 worker processes (it counts the replicas left on them), for
    conftest's ``default_client``."""
    with local_cluster() as cluster:
        yield cluster


def replicas_of(client, name: str) -> dict[str, int]:
    """``{model key: workers holding it}`` of the models called ``name`` on the cluster."""
    held: dict[str, int] = {}
    for found in client.run(tasks.summary).values():
        for key, model in found["models"].items():
            if model == name:
                held[key] = held.get(key, 0) + 1
    return held


def logp_function(model):
    """A compiled function of the model's ``logp_grad`` (it holds the Op, not ``model``)."""
    op = model.logp_grad_op("logp_grad", [pt.dvector, pt.dscalar])
    x, mu = pt.dvector("x"), pt.dscalar("mu")
    return pytensor.function([x, mu], op(x, mu)[0])


def test_a_model_nobody_holds_is_released(default_client):
    model = dt.RemoteModel(Probe, name="dropped")
    model.call("where")
    key = model.key
    assert replicas_of(default_client, "dropped") == {key: 2}
    del model
    gc.collect()
    gone = eventually(lambda: not replicas_of(default_client, "dropped"))
    assert gone, replicas_of(default_client, "dropped")


def test_re_running_a_cell_leaves_one_set_of_replicas(default_client):
    x, mu = pt.dvector("x"), pt.dscalar("mu")
    for _ in range(6):  # the cell, run again: its names now hold the new model
        model = dt.RemoteModel(Probe, name="cell")
        op = model.logp_grad_op("logp_grad", [pt.dvector, pt.dscalar])
        f = pytensor.function([x, mu], op(x, mu)[0])
        assert float(f(np.ones(3), 0.0)) == -1.5
    gc.collect()
    one_set = eventually(lambda: replicas_of(default_client, "cell") == {model.key: 2})
    assert one_set, replicas_of(default_client, "cell")


def test_replicas_live_while_their_model_does(default_client, tmp_path):
    """The lease checks keep a live model's replicas: a compiled function works however
    long it waits, without building the model again."""
    log = tmp_path / "builds"
    model = dt.RemoteModel(lambda: Probe(str(log)), name="kept")
    f = logp_function(model)
    assert float(f(np.ones(3), 0.0)) == -1.5
    time.sleep(3)  # three lease checks on every worker
    assert replicas_of(default_client, "kept") == {model.key: 2}
    assert float(f(np.ones(3), 1.0)) == 0.0
    assert len(log.read_text().split()) == 2  # built once on each worker, not again
    model.close()


def test_an_op_outliving_its_model_builds_it_again(default_client, tmp_path):
    """PyTensor keeps every Op it compiled (its rewriters cache them), so an Op cannot
    tell whether it is still in use: the model's own object decides.  An Op called after
    that was dropped builds the model again and keeps it for the rest of the process."""
    log = tmp_path / "builds"
    model = dt.RemoteModel(lambda: Probe(str(log)), name="outlived")
    f = logp_function(model)
    assert float(f(np.ones(3), 0.0)) == -1.5
    key = model.key
    del model
    gc.collect()
    assert eventually(lambda: not replicas_of(default_client, "outlived"))
    assert float(f(np.ones(3), 1.0)) == 0.0
    assert replicas_of(default_client, "outlived") == {key: 2}
    assert len(log.read_text().split()) == 4  # built on each worker, twice
    time.sleep(2)
    # held now by the process's lease
    assert replicas_of(default_client, "outlived") == {key: 2}


@pytest.mark.slow
def test_a_killed_caller_leaves_no_replicas(process_cluster):
    """The scheduler forgets a killed client's keys, the lease among them: the workers
    drop the replicas its models had (within their lease check, 1 s)."""
    from distributed import Client

    script = textwrap.dedent(
        f"""
        import time
        from distributed import Client
        from _models import Probe
        import dasktensor as dt

        client = Client({process_cluster.scheduler_address!r})
        model = dt.RemoteModel(Probe, name="orphan")
        model.call("where")
        print(model.key, flush=True)
        time.sleep(600)
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    caller = subprocess.Popen(
        [sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        key = caller.stdout.readline().strip()
        with Client(process_cluster, set_as_default=False) as client:
            assert replicas_of(client, "orphan") == {key: 2}
            caller.send_signal(signal.SIGKILL)
            caller.wait()
            t0 = time.monotonic()
            assert eventually(lambda: not replicas_of(client, "orphan"))
            assert time.monotonic() - t0 < 10
    finally:
        caller.kill()
        caller.wait()
