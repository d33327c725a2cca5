"""``dt.connect``: a distributed Client, to a running cluster or to an embedded one.

What the rest of dasktensor needs of a cluster once connected (finding the client, worker
resources, submitting) lives in the rest of :mod:`dasktensor.cluster`.
"""

from __future__ import annotations

import dask

from dasktensor import _config
from dasktensor.cluster._dashboard import list_the_page, show_calls_page
from dasktensor.cluster._gpus import (
    choose_devices,
    cpu_worker_env,
    find_devices,
    gpu_worker_options,
)
from dasktensor.cluster._nanny import Nanny, spawn_environ


def configured_address() -> str | None:
    """The scheduler address configured for ``dt.connect()`` (``dasktensor.scheduler-address``,
    then Dask's ``scheduler-address``), or None."""
    return _config.get("scheduler-address") or dask.config.get("scheduler-address", None)


class _NoHandshake(TimeoutError):
    """Something accepted the connection but did not answer as a Dask scheduler."""


def _handshake(address: str, security, timeout_s: float) -> None:
    """Connect to ``address`` and complete Dask's handshake within the timeout, or raise.

    ``distributed.Client`` waits for the scheduler's handshake without a timeout once a
    connection is made, so an endpoint that accepts connections but never answers (a
    ``tls://`` scheduler reached with ``tcp://``, the dashboard's port) would hang it; and
    a Client that fails to start stays half-started, its finaliser later blocking other
    Clients (distributed's LoopRunner lock).  One throw-away connection, in a thread of
    its own (this thread may run an event loop), checks first.

    Raises
    ------
    OSError
        Could not connect within ``timeout_s`` (refused, unknown host, certificates).
    _NoHandshake
        Connected, but no Dask handshake within about a second more.
    TypeError
        ``tls://`` without TLS settings (distributed's error).
    """
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from distributed.comm import connect as comm_connect
    from distributed.security import Security

    if security is None and dask.config.get("distributed.client.security-loader", None):
        return  # the Client asks the configured loader for its certificates
    if str(address).startswith("inproc://"):
        return  # a scheduler in this process: nothing to wait for
    args = (security or Security()).get_connection_args("client")

    async def handshake():
        # connect() bounds the connection attempts by timeout_s, not the handshake
        try:
            comm = await asyncio.wait_for(
                comm_connect(address, timeout=timeout_s, **args), timeout_s + 1
            )
        except TimeoutError as e:
            raise _NoHandshake(f"no Dask handshake from {address}") from e
        await comm.close()

    with ThreadPoolExecutor(1, thread_name_prefix="dasktensor-connect") as pool:
        pool.submit(asyncio.run, handshake()).result()


def connect(
    address: str | None = None,
    *,
    security=None,
    n_workers: int | None = None,
    threads_per_worker: int | None = None,
    processes: bool | None = None,
    resources: dict | None = None,
    gpus=None,
    host: str = "127.0.0.1",
    scheduler_port: int = 0,
    dashboard_address: str | None = None,
    timeout: float | str | None = None,
    set_as_default: bool = True,
    **cluster_kwargs,
):
    """Connect to a Dask cluster, or start an embedded one on this machine.

    With an address (argument, ``dask.config`` ``dasktensor.scheduler-address`` or Dask's own
    ``scheduler-address``, which ``DASK_SCHEDULER_ADDRESS`` sets), returns a Client of that
    scheduler; ``tls://`` addresses take a ``distributed.security.Security``.  Without one,
    starts a ``LocalCluster`` whose scheduler and dashboard listen on 127.0.0.1 only, and
    returns a Client that owns it (closing the client stops the cluster).

    dasktensor only needs the scheduler's address: a cluster started by
    ``dask scheduler`` / ``dask worker``, dask-jobqueue (HPC queues), dask-kubernetes or any
    other Dask deployment works the same way.

    Parameters
    ----------
    address : str, optional
        Scheduler address, e.g. ``"tcp://10.0.0.5:8786"``.
    security : distributed.security.Security, optional
        TLS settings for ``tls://`` clusters.
    n_workers, threads_per_worker, processes, resources
        Embedded cluster only: worker count, threads per worker, worker processes (the
        default) or threads, and the resources every worker offers (``{"GPU": 1}``).
        Defaults from ``dasktensor.cluster.*``.
    gpus : None, "all", int or list of int or str
        Embedded cluster only: GPU workers beside the ``n_workers`` CPU workers, one
        worker process per device, as dask-cuda starts them. ``"all"``: every GPU found
        (``CUDA_VISIBLE_DEVICES`` when set, else ``nvidia-smi -L``); a count: the first
        that many; a list: those device ids. Each GPU worker sees its device alone
        (``CUDA_VISIBLE_DEVICES``), offers ``{"GPU": 1}`` (beside ``resources``), and runs
        with ``dasktensor.gpu.*``: 1 thread, no host memory limit (the GPU stack's own
        host memory would otherwise get it restarted), JAX not preallocating the device.
        The CPU workers then see no device (``CUDA_VISIBLE_DEVICES=""``). None (the
        default): CPU workers only, their environment untouched.
    host, scheduler_port, dashboard_address
        Embedded cluster only: where the scheduler and the dashboard listen (default
        ``127.0.0.1``, a free port, and ``dasktensor.cluster.dashboard-address``);
        ``dashboard_address=False`` starts no dashboard.
    timeout : float or str, optional
        How long to wait for the scheduler (``dasktensor.connect-timeout``).
    set_as_default : bool
        Make the client Dask's default, so that ``dt.function`` and ``dask.compute`` use it.
    **cluster_kwargs
        Further ``LocalCluster`` arguments (embedded cluster only).

    Returns
    -------
    distributed.Client
        ``client.dashboard_link`` is the dashboard's address; ``dt.calls_link(client)``
        its page of remote-model calls and resident stages
        (``/individual-dasktensor-calls``), which the task stream does not show.

    Raises
    ------
    ConnectionError
        The scheduler at ``address`` did not answer within ``timeout``, refused the
        certificates, or a ``tls://`` address came without certificates to connect with.

    Examples
    --------
    >>> import dasktensor as dt
    >>> client = dt.connect(n_workers=1, dashboard_address=False)  # doctest: +SKIP
    >>> client.close()  # doctest: +SKIP

    Two CPU workers and one worker per GPU of this machine:

    >>> client = dt.connect(n_workers=2, gpus="all")  # doctest: +SKIP
    >>> print(dt.info(client))  # the devices each worker sees  # doctest: +SKIP
    """
    from distributed import Client
    from distributed.security import Security

    timeout_s = _seconds(timeout if timeout is not None else _config.get("connect-timeout"))
    if security is not None and not isinstance(security, Security):
        raise TypeError(
            f"dt.connect expected security= a distributed.security.Security, got {security!r}"
        )
    address = address or configured_address()
    if address is not None:
        if not isinstance(address, str):
            raise TypeError(
                "dt.connect expected a scheduler address such as 'tcp://10.0.0.5:8786', "
                f"got {address!r}"
            )
        embedded = {"n_workers": n_workers, "threads_per_worker": threads_per_worker,
                    "processes": processes, "resources": resources,
                    "gpus": gpus}  # fmt: skip
        given = [k for k, v in embedded.items() if v is not None] + list(cluster_kwargs)
        if given:
            raise TypeError(
                "connect() got an address and options for an embedded cluster "
                f"({', '.join(given)}): "
                "workers of an existing cluster are configured where they are started "
                "(`dask worker ADDRESS --resources 'GPU=1'`; one worker per GPU of a host: "
                "`dasktensor worker ADDRESS --gpus all`)"
            )
        tls = str(address).startswith("tls://")
        try:
            _handshake(address, security, timeout_s)
            client = Client(
                address, security=security, timeout=timeout_s, set_as_default=set_as_default
            )
            show_calls_page(client)
            return client
        except ValueError as e:  # distributed could not parse it
            raise ValueError(
                "dt.connect expected a scheduler address 'protocol://host:port' such as "
                f"'tcp://10.0.0.5:8786', got {address!r} ({e})"
            ) from e
        except TypeError as e:
            if not tls:
                raise
            # distributed fails with a TypeError, before connecting, when it has no TLS
            # context for a tls:// address (no security=, nor certificates in its config)
            raise ConnectionError(
                f"Could not connect to the TLS scheduler at {address!r}: no certificates "
                f"to connect with ({e}). Give the cluster's certificates as "
                "dt.connect(address, security=Security(tls_ca_file=..., "
                "tls_client_cert=..., tls_client_key=...)) or in Dask's config "
                "(distributed.comm.tls.ca-file, distributed.comm.tls.client.cert, "
                "distributed.comm.tls.client.key)."
            ) from e
        except (OSError, TimeoutError) as e:
            if isinstance(e, _NoHandshake):
                cause = (
                    "something accepted the connection but did not answer as a Dask "
                    "scheduler: a tls:// scheduler reached with tcp://, the dashboard's "
                    "port instead of the scheduler's (8786 by default)?"
                )
            else:
                cause = f"{type(e).__name__}: {e}"
            raise ConnectionError(
                f"Could not reach a Dask scheduler at {address!r} within {timeout_s:g} s "
                f"({cause}). Start one with `dask scheduler` and workers "
                f"with `dask worker {address}`, check the address and firewall"
                + (", and that security= holds certificates the cluster trusts" if tls else "")
                + ", or call dt.connect() without an address for an embedded cluster on this "
                "machine."
            ) from e

    _check_embedded(n_workers, threads_per_worker, resources, cluster_kwargs)
    devices = _gpu_devices(gpus, processes, resources, cluster_kwargs)
    kwargs = {
        "n_workers": n_workers if n_workers is not None else _config.get("cluster.n-workers"),
        "threads_per_worker": (
            threads_per_worker
            if threads_per_worker is not None
            else _config.get("cluster.threads-per-worker")
        ),
        "processes": processes if processes is not None else _config.get("cluster.processes"),
        "host": host,
        "scheduler_port": scheduler_port,
        # workers import dasktensor (and PyTensor, ~1 s) as they start, not on first use
        "preload": ["dasktensor"],
        **cluster_kwargs,
    }
    dashboard = (
        dashboard_address
        if dashboard_address is not None
        else _config.get("cluster.dashboard-address")
    )
    if dashboard:
        kwargs["dashboard_address"] = dashboard
    else:
        # no dashboard; the scheduler's HTTP server (health, metrics) still starts, and
        # would otherwise take port 8787 on every interface
        kwargs["dashboard_address"] = None
        kwargs["scheduler_kwargs"] = {
            **kwargs.get("scheduler_kwargs", {}),
            "dashboard": False,
            "dashboard_address": f"{host}:0",
        }
    if resources is not None:
        kwargs["resources"] = dict(resources)
    if kwargs["processes"]:
        # Dask's nanny, without Dask's MALLOC_TRIM_THRESHOLD_ (see cluster/_nanny.py)
        kwargs.setdefault("worker_class", Nanny)
        spawn_environ()  # a malformed setting fails here, before anything starts
    if devices:
        kwargs["env"] = {**kwargs.get("env", {}), **cpu_worker_env()}
    # a task asking for resources that no worker offers fails instead of waiting forever
    no_workers = {
        "distributed.scheduler.no-workers-timeout": _config.get("placement.resource-timeout")
    }
    list_the_page()  # on the dashboard of the scheduler started here, from the start
    with dask.config.set(no_workers):
        if security is None:
            # the client starts the cluster and stops it when it closes
            client = Client(
                timeout=timeout_s, set_as_default=set_as_default, protocol="tcp://", **kwargs
            )
        else:
            from distributed import LocalCluster

            cluster = LocalCluster(security=security, protocol="tls://", **kwargs)
            # client.shutdown() stops this cluster with the client
            client = Client(
                cluster, security=security, timeout=timeout_s, set_as_default=set_as_default
            )
        if devices:
            _start_gpu_workers(client, devices, resources)
    show_calls_page(client)
    return client


def _gpu_devices(gpus, processes, resources, cluster_kwargs) -> list:
    """The devices ``gpus=`` asks for, checked with the options they could contradict,
    before anything starts."""
    if gpus is None:
        return []
    given = f"gpus={gpus!r}"
    if processes is False or (processes is None and not _config.get("cluster.processes")):
        raise ValueError(
            f"dt.connect got {given} with worker threads (processes=False): a GPU worker is "
            "a process of its own, started with its device alone visible; expected "
            "processes=True (the default)"
        )
    if resources and "GPU" in resources:
        raise ValueError(
            f"dt.connect got {given} and resources={resources!r}: resources= is what "
            "every worker offers, CPU workers included, while each GPU worker offers "
            "{'GPU': 1} of its own; expected resources without 'GPU' beside gpus= (or "
            "resources={'GPU': ...} without gpus=, for workers that offer it on their own)"
        )
    env = cluster_kwargs.get("env") or {}
    if "CUDA_VISIBLE_DEVICES" in env:
        raise ValueError(
            f"dt.connect got {given} and env={{'CUDA_VISIBLE_DEVICES': "
            f"{env['CUDA_VISIBLE_DEVICES']!r}}}: gpus= sets each worker's "
            "CUDA_VISIBLE_DEVICES; expected one of the two"
        )
    found, how = find_devices()
    return choose_devices(gpus, found, how)


def _start_gpu_workers(client, devices, resources) -> None:
    """Add a GPU worker per device to the embedded cluster of ``client``, and wait for
    them; the cluster is stopped if they do not come."""
    import copy

    cluster = client.cluster
    before = len(cluster.worker_spec)
    for device in devices:
        spec = copy.deepcopy(cluster.new_spec)
        options = gpu_worker_options(device, resources)
        # the user's env= (in the CPU workers' spec) under the GPU worker's own
        cpu_env = {
            k: v for k, v in spec["options"].get("env", {}).items() if k not in cpu_worker_env()
        }
        options["env"] = {**cpu_env, **options["env"]}
        spec["options"].update(options)
        cluster.worker_spec[f"gpu-{device.id}"] = spec
    cluster.scale(len(cluster.worker_spec))  # starts what the spec lists and is not running
    wait_s = max(60.0, _config.seconds("connect-timeout"))
    try:
        client.wait_for_workers(before + len(devices), timeout=wait_s)
    except TimeoutError as e:
        client.shutdown()
        raise RuntimeError(
            f"dt.connect expected {len(devices)} GPU worker(s) "
            f"({', '.join(d.describe() for d in devices)}) to join the embedded cluster "
            f"within {wait_s:g} s; they did not (see the log above)"
        ) from e


def _seconds(timeout) -> float:
    """``timeout`` (seconds, or a duration such as ``"30s"``) in seconds, > 0."""
    from dask.utils import parse_timedelta

    try:
        seconds = parse_timedelta(timeout, default="s")
    except (ValueError, TypeError, KeyError):
        seconds = None
    if not (isinstance(seconds, int | float) and seconds > 0):
        raise ValueError(
            "dt.connect expected timeout= a number of seconds > 0 or a duration such as "
            f"'30s', got {timeout!r}"
        )
    return seconds


def _check_embedded(n_workers, threads_per_worker, resources, cluster_kwargs) -> None:
    """The embedded cluster's options, checked before anything starts: LocalCluster takes
    them as they come, and fails late (a typo in a worker option: 'Nanny failed to start',
    seconds later, a half-started client left behind) or not at all (n_workers=-1 starts
    no worker)."""
    import difflib
    import inspect
    import numbers

    from distributed import LocalCluster, Nanny, Worker

    counts = (("n_workers", n_workers, 0), ("threads_per_worker", threads_per_worker, 1))
    for name, value, low in counts:
        if value is not None and not (
            isinstance(value, int) and not isinstance(value, bool) and value >= low
        ):
            raise ValueError(f"dt.connect expected {name}= an int >= {low}, got {value!r}")
    if resources is not None and not (
        isinstance(resources, dict)
        and all(isinstance(k, str) and isinstance(v, numbers.Real) for k, v in resources.items())
    ):
        raise TypeError(
            "dt.connect expected resources= a dict of resource names to amounts, such as "
            f"{{'GPU': 1}}, got {resources!r}"
        )
    if "worker_class" in cluster_kwargs:
        return  # its own options: not known here
    known: set[str] = set()
    for cls in (LocalCluster, *inspect.getmro(Nanny), *inspect.getmro(Worker)):
        if "__init__" in vars(cls):
            params = inspect.signature(vars(cls)["__init__"]).parameters.values()
            named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
            known.update(p.name for p in params if p.kind in named)
    unknown = sorted(set(cluster_kwargs) - known)
    if unknown:
        close = [m for u in unknown for m in difflib.get_close_matches(u, known, 1)]
        raise TypeError(
            f"dt.connect got {unknown}, which neither LocalCluster nor its workers take; "
            "expected options of distributed.LocalCluster or distributed.Worker"
            + (f" (closest: {close})" if close else "")
        )
