"""Silent workers: probes of the workers' call servers, and the suspects they find.

A worker cut off the network, or frozen, closes nothing: a call to it would wait for
Dask's TCP timeout (~30 s), and asking it anything through Dask (``client.run``) for
Dask's connect timeout.  So a worker is *probed*: its call server is sent a request for
no model, which a live server answers at once (``missing``) on its connection's thread,
whatever its models are doing.  A worker that does not answer within
``dasktensor.remote.probe-timeout`` becomes a *suspect*: no call picks it while other
replicas are there, and no replica is looked for or built there, until it answers a
probe again (every look at the cluster probes the suspects) or the scheduler drops it.

Who probes when is decided elsewhere: a call waiting for its reply
(``dasktensor.remote._calls``), a look at the cluster (``dasktensor.remote._replicas``),
a question asked of every worker (``dasktensor.remote._summary``).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import dask

from dasktensor import _config
from dasktensor._runtime import ProcessState, runtime
from dasktensor.cluster import scheduler_workers
from dasktensor.remote._channel import get_channel


class _Suspects(ProcessState):
    """Workers that did not answer a probe: address -> (endpoint, security) to probe again."""

    def __init__(self):
        self.suspects: dict[str, tuple] = {}
        self.lock = threading.Lock()


def suspects() -> dict[str, tuple]:
    """This process's suspects (read it, do not change it)."""
    return runtime.state(_Suspects).suspects


def answers(address: str, endpoint: tuple, security, timeout: float) -> bool:
    """Whether the call server of the worker at ``address`` answers a probe within
    ``timeout`` seconds; one that does not becomes a suspect."""
    if get_channel().probe(address, endpoint, security, timeout):
        return True
    state = runtime.state(_Suspects)
    with state.lock:
        state.suspects[address] = (endpoint, security)
    return False


def answering_workers(workers: dict[str, dict], known: dict[str, tuple], security) -> dict:
    """``workers`` without those whose call server does not answer a probe: asking a
    silent worker through Dask (``client.run``) would wait for Dask's connect timeout
    (30 s), holding up every call that waits for this look.  Probed: the suspects, and
    the workers whose call servers the caller knows (``known``, address -> endpoint: a
    few sub-millisecond round trips when all is well); a worker never seen cannot be
    probed.  A suspect that answers is one no more; one the scheduler dropped is
    forgotten."""
    state = runtime.state(_Suspects)
    with state.lock:
        for gone in set(state.suspects) - set(workers):
            del state.suspects[gone]
        probes = {a: (e, security) for a, e in known.items() if a in workers}
        probes.update((a, s) for a, s in state.suspects.items())
    if not probes:
        return workers
    timeout = _config.seconds("remote.probe-timeout")

    def probe(item):
        address, (endpoint, creds) = item
        return address, get_channel().probe(address, endpoint, creds, timeout)

    with ThreadPoolExecutor(min(8, len(probes)), thread_name_prefix="dasktensor-probe") as pool:
        answered = dict(pool.map(probe, probes.items()))
    with state.lock:
        for address, yes in answered.items():
            if yes:
                state.suspects.pop(address, None)
            else:
                state.suspects[address] = probes[address]
        return {a: w for a, w in workers.items() if a not in state.suspects}


def some_answering(workers: dict[str, dict], known: dict[str, tuple], security) -> dict:
    """``answering_workers``, patient when none answers: a probe of every worker timing
    out at once is more often a loaded machine (a 1-s probe on two busy cores) than a
    frozen cluster, and with no worker left there is nothing faster to turn to.  So
    the silent ones are probed again until Dask's connect timeout
    (``distributed.comm.timeouts.connect``) has passed; what is returned then may be
    empty (the caller says so)."""
    found = answering_workers(workers, known, security)
    if found or not workers:
        return found
    patience = dask.utils.parse_timedelta(dask.config.get("distributed.comm.timeouts.connect"))
    deadline = time.monotonic() + patience
    while not found and time.monotonic() < deadline:
        time.sleep(0.2)
        found = answering_workers(workers, known, security)
    return found


def answering(client) -> list[str]:
    """The scheduler's workers but those that did not answer a probe (suspects, probed
    again now): ``client.run`` on a silent worker waits for Dask's connect timeout."""
    workers = answering_workers(scheduler_workers(client), {}, getattr(client, "security", None))
    return list(workers)
