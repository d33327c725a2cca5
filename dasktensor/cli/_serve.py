"""``dasktensor serve-umbridge MODULE:FACTORY --name NAME``: a UM-Bridge server whose
requests run on the replicas of a remote model on a Dask cluster (``dt.serve_umbridge``).

``MODULE`` is a module name (importable from the current directory or the environment)
or a path to a ``.py`` file; ``FACTORY`` a callable in it that builds an
``umbridge.Model`` (the model class itself, usually).  A module that is not part of an
installed package travels to the workers by value (cloudpickle), so a script beside the
command needs not be on the workers.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import pathlib
import signal
import sys
import sysconfig

from dasktensor.cluster import calls_link, connect


def _installed(path: pathlib.Path) -> bool:
    roots = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    return any(path.is_relative_to(pathlib.Path(r).resolve()) for r in roots)


def load_factory(spec: str):
    """The callable ``FACTORY`` of ``MODULE:FACTORY`` (a module name or a ``.py`` path)."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            "expected MODULE:FACTORY (e.g. 'mymodels:Forward' or 'models.py:Forward'), "
            f"got {spec!r}"
        )
    if module_name.endswith(".py") or os.sep in module_name:
        path = pathlib.Path(module_name).resolve()
        if not path.is_file():
            raise FileNotFoundError(f"{spec!r}: expected a Python file at {path}, found none")
        name = path.stem
        loaded = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(loaded)
        sys.modules[name] = module  # cloudpickle finds it by name
        loaded.loader.exec_module(module)
    else:
        if "" not in sys.path and os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())  # as `python -m` would
        module = importlib.import_module(module_name)
    factory = getattr(module, attr, None)
    if not callable(factory):
        found = "nothing" if factory is None else repr(factory)
        raise ValueError(
            f"{spec!r}: expected a callable {attr!r} in {module.__name__} that builds an "
            f"umbridge.Model, found {found}"
        )
    where = getattr(module, "__file__", None)
    if where and not _installed(pathlib.Path(where).resolve()):
        import cloudpickle

        cloudpickle.register_pickle_by_value(module)
    return factory


def _resources(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        try:
            out[key] = float(value)
        except ValueError:
            sep = ""
        if not sep or not key:
            raise ValueError(f"expected --resources NAME=AMOUNT (e.g. GPU=1), got {item!r}")
    return out


def run(args) -> int:
    """The ``serve-umbridge`` command: serve until Ctrl-C or SIGTERM; the exit code."""
    import dasktensor as dt

    try:
        factory = load_factory(args.factory)
        resources = _resources(args.resources)
    except (ValueError, FileNotFoundError, ImportError) as e:
        print(f"dasktensor serve-umbridge: {e}", file=sys.stderr)
        return 2
    if args.scheduler:
        print(f"Connecting to the scheduler at {args.scheduler} ...", flush=True)
        client = connect(args.scheduler)
    else:
        print(f"Starting an embedded cluster: {args.workers} worker process(es)", flush=True)
        client = connect(n_workers=args.workers, threads_per_worker=1,
                         dashboard_address=args.dashboard_address)  # fmt: skip
    model = server = None
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop as Ctrl-C does
    try:
        model = dt.RemoteModel(factory, name=args.name, resources=resources or None,
                               replicas=args.replicas, concurrency=args.concurrency)  # fmt: skip
        server = dt.serve_umbridge(model, port=args.port, host=args.host)
        print(f"Dashboard: {client.dashboard_link}")
        print(f"Remote calls: {calls_link(client)}")
        print(f"Model {args.name!r}: a replica on each of {len(model.workers())} worker(s)")
        print(f"UM-Bridge server: {server.url} (Ctrl-C stops it)", flush=True)
        server.wait()
    except KeyboardInterrupt:
        pass
    finally:
        if server is not None:
            server.close()
        if model is not None:
            model.close()
        if args.scheduler:
            client.close()
        else:  # (the scheduler would warn of each replica's build task lost with its worker)
            logging.getLogger("distributed.scheduler").setLevel(logging.ERROR)
            client.shutdown()
    print("UM-Bridge server stopped.", flush=True)
    return 0


def add_parser(sub) -> None:
    """The ``serve-umbridge`` verb of the ``dasktensor`` command."""
    serve = sub.add_parser(
        "serve-umbridge",
        help="serve an umbridge.Model to UM-Bridge clients from replicas on a Dask cluster",
        description=(
            "Build the umbridge.Model that FACTORY makes on the workers of a Dask cluster "
            "(--scheduler ADDR, else an embedded LocalCluster) and serve it over UM-Bridge "
            "(protocol 1.0) at http://HOST:PORT under NAME: each request runs on a replica, "
            "the replicas share the requests, a lost worker's requests move to another "
            "one, and the calls show on the dashboard's calls page. Blocks until Ctrl-C."
        ),
    )
    serve.add_argument("factory", metavar="MODULE:FACTORY",
                       help="a module name or .py file, and the callable in it building the "
                       "umbridge.Model (e.g. models.py:Forward)")  # fmt: skip
    serve.add_argument("--name", required=True, help="the model's name for UM-Bridge clients")
    serve.add_argument("--port", type=int, default=4242, help="port to listen on (4242; 0: any)")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on "
                       "(127.0.0.1; 0.0.0.0: every interface)")  # fmt: skip
    serve.add_argument("--scheduler", metavar="ADDR", help="address of a running scheduler")
    serve.add_argument("--workers", type=int, default=2, help="embedded worker processes (2)")
    serve.add_argument("--dashboard-address", default="127.0.0.1:0",
                       help="embedded dashboard (127.0.0.1:0)")  # fmt: skip
    serve.add_argument("--replicas", type=int, default=None,
                       help="workers holding the model "
                       "(default: every one offering --resources)")  # fmt: skip
    serve.add_argument("--resources", nargs="*", default=[], metavar="NAME=AMOUNT",
                       help="worker resources a replica needs, e.g. GPU=1")  # fmt: skip
    serve.add_argument("--concurrency", type=int, default=1,
                       help="requests one replica runs at once (1: the model needs not be "
                       "thread-safe)")  # fmt: skip
    serve.set_defaults(run=run)
