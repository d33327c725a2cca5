"""A replica holds its model's worker resources while it lives.

A GPU worker holding a surrogate model must not also run other tasks that ask for the
same GPU: Dask counts a task's resources only while the task runs, and a replica is not
a task.  Each replica therefore keeps a seceded ``hold-<name>`` task running on its worker,
which asks for the model's ``resources`` and ends when the replica is dropped.

On a real cluster of worker processes: ``gpu`` offers ``{"GPU": 1}``, ``cpu`` nothing.
"""

from __future__ import annotations

import gc
import os
import time

import pytest
from _clusters import eventually, gpu_worker_address
from _models import Probe

import dasktensor as dt


@pytest.fixture
def client(mixed_cluster):
    from distributed import Client

    with Client(mixed_cluster) as c:  # the default client: the models use it
        yield c


def pid() -> int:
    return os.getpid()


def gpu_in_use(client) -> tuple[float, float]:
    """The GPU the scheduler counts as taken on the GPU worker, and what the worker
    itself counts as free."""
    address = gpu_worker_address(client)

    def used(dask_scheduler):
        return dask_scheduler.workers[address].used_resources.get("GPU", 0)

    def free(dask_worker):
        return dask_worker.state.available_resources.get("GPU")

    return client.run_on_scheduler(used), client.run(free, workers=[address])[address]


def gpu_task(client):
    """A task asking for the GPU: the id of the worker process that ran it."""
    return client.submit(pid, resources={"GPU": 1}, pure=False)


def worker_pid(client, address: str) -> int:
    return client.run(pid, workers=[address])[address]


def test_a_replica_holds_its_resources_until_it_is_closed(client):
    gpu = gpu_worker_address(client)
    model = dt.RemoteModel(Probe, name="held", resources={"GPU": 1})
    assert model.call("where")[0] == worker_pid(client, gpu)
    assert eventually(lambda: gpu_in_use(client) == (1, 0)), gpu_in_use(client)

    waiting = gpu_task(client)
    time.sleep(1.0)  # it runs in milliseconds once the GPU is free
    assert not waiting.done(), "a task asking for the GPU ran beside the replica"
    assert model.call("where")[0] == worker_pid(client, gpu)  # the model still answers

    model.close()
    assert waiting.result(timeout=30) == worker_pid(client, gpu)
    assert eventually(lambda: gpu_in_use(client) == (0, 1)), gpu_in_use(client)


def test_a_collected_model_gives_its_resources_back(client):
    model = dt.RemoteModel(Probe, name="dropped", resources={"GPU": 1})
    model.call("where")
    assert eventually(lambda: gpu_in_use(client) == (1, 0)), gpu_in_use(client)
    waiting = gpu_task(client)
    del model
    gc.collect()
    assert waiting.result(timeout=30) == worker_pid(client, gpu_worker_address(client))


def test_models_sharing_a_gpu_ask_for_a_part_of_it(client):
    halves = [dt.RemoteModel(Probe, name=f"half-{i}", resources={"GPU": 0.5}) for i in "ab"]
    gpu = worker_pid(client, gpu_worker_address(client))
    assert [m.call("where")[0] for m in halves] == [gpu, gpu]
    assert eventually(lambda: gpu_in_use(client) == (1, 0)), gpu_in_use(client)
    for m in halves:
        m.close()
    assert eventually(lambda: gpu_in_use(client) == (0, 1)), gpu_in_use(client)


def test_without_hold_resources_only_the_build_asks_for_them(client):
    model = dt.RemoteModel(Probe, name="light", resources={"GPU": 1}, hold_resources=False)
    gpu = worker_pid(client, gpu_worker_address(client))
    assert model.call("where")[0] == gpu
    assert gpu_task(client).result(timeout=30) == gpu  # runs beside the replica
    assert gpu_in_use(client) == (0, 1)
    model.close()


def test_hold_resources_must_be_a_bool():
    with pytest.raises(TypeError, match=r"hold_resources=...\) expected True or False, got 1"):
        dt.RemoteModel(Probe, resources={"GPU": 1}, hold_resources=1)
