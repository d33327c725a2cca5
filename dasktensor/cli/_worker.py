"""``dasktensor worker SCHEDULER --gpus all``: a GPU host's workers for a running cluster.

One worker process (with its nanny) per device, as ``dask cuda worker`` starts them and
as ``dt.connect(gpus=...)`` starts them on an embedded cluster: each sees its device
alone (``CUDA_VISIBLE_DEVICES``), offers ``GPU=1``, and runs with ``dasktensor.gpu.*``
(1 thread, no host memory limit, JAX not preallocating the device).  The nannies run in
this process's event loop until Ctrl-C or SIGTERM, or until the scheduler closes them.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
import sys

from dasktensor.cluster import choose_devices, find_devices, gpu_worker_options, parse_gpus


def _gpus_argument(text: str):
    try:
        return parse_gpus(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _threads_argument(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a number of threads >= 1, got {text!r}")
    return int(text)


def _resources_argument(text: str) -> dict:
    out = {}
    for item in text.replace(",", " ").split():
        key, sep, value = item.partition("=")
        try:
            amount = float(value)
        except ValueError:
            sep = ""
        if not sep or not key:
            raise argparse.ArgumentTypeError(
                f"expected NAME=AMOUNT pairs such as 'MEM=1 DISK=2', got {text!r}"
            )
        out[key] = amount
    if "GPU" in out:
        raise argparse.ArgumentTypeError(
            f"expected resources without GPU, got {text!r}: each worker of --gpus offers "
            "GPU=1 of its own"
        )
    return out


async def _serve(args, devices) -> None:
    from dasktensor.cluster import Nanny  # Dask's, with glibc's own malloc

    host_name = args.name_prefix or socket.gethostname()
    security = _security(args)
    scheme, sep, _ = args.scheduler.partition("://")
    nannies = []
    for device in devices:
        options = gpu_worker_options(device, args.resources)
        if args.nthreads is not None:
            options["nthreads"] = args.nthreads
        if args.memory_limit is not None:
            options["memory_limit"] = args.memory_limit
        nannies.append(
            Nanny(
                args.scheduler,
                name=f"{host_name}-gpu-{device.id}",
                host=args.host,
                protocol=scheme if sep else None,  # tls:// listens with TLS too
                security=security,
                preload=["dasktensor"],
                **options,
            )
        )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await asyncio.gather(*nannies)  # starts them: each waits for its worker
        for nanny, device in zip(nannies, devices, strict=True):
            print(f"GPU worker {nanny.worker_address} ({device.describe()})", flush=True)
        print(f"{len(nannies)} GPU worker(s) of {args.scheduler} (Ctrl-C stops them)", flush=True)
        finished = [asyncio.ensure_future(n.finished()) for n in nannies]
        waiting = asyncio.ensure_future(stop.wait())
        await asyncio.wait([waiting, *finished], return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
    finally:
        await asyncio.gather(*(n.close(timeout=10) for n in nannies), return_exceptions=True)


def _security(args):
    """The TLS settings of ``--tls-*`` (all three, or none: Dask's config then)."""
    files = (args.tls_ca_file, args.tls_cert, args.tls_key)
    if not any(files):
        return None
    from distributed.security import Security

    return Security(
        tls_ca_file=args.tls_ca_file,
        tls_worker_cert=args.tls_cert,
        tls_worker_key=args.tls_key,
        tls_client_cert=args.tls_cert,
        tls_client_key=args.tls_key,
        require_encryption=True,
    )


def run(args) -> int:
    """The ``worker`` command: start the GPU workers, serve until stopped; the exit code."""
    tls_files = (args.tls_ca_file, args.tls_cert, args.tls_key)
    if any(tls_files) and not all(tls_files):
        print(
            "dasktensor worker: --tls-ca-file, --tls-cert and --tls-key go together (the "
            "cluster's CA certificate, the workers' certificate and its private key)",
            file=sys.stderr,
        )
        return 2
    found, how = find_devices()
    try:
        devices = choose_devices(args.gpus, found, how, owner="dasktensor worker --gpus")
    except ValueError as e:
        print(f"dasktensor worker: {e}", file=sys.stderr)
        return 2
    print(
        f"Starting {len(devices)} GPU worker(s) for {args.scheduler}: "
        + "; ".join(d.describe() for d in devices),
        flush=True,
    )
    asyncio.run(_serve(args, devices))
    print("GPU workers stopped.", flush=True)
    return 0


def add_parser(sub) -> None:
    """The ``worker`` verb of the ``dasktensor`` command."""
    worker = sub.add_parser(
        "worker",
        help="start one worker per GPU of this host for a running cluster",
        description=(
            "Start one Dask worker process (with its nanny) per GPU of this host for the "
            "scheduler at SCHEDULER, as `dask cuda worker` does: each sees its device alone "
            "(CUDA_VISIBLE_DEVICES), offers the resource GPU=1 (what dt.annotate(resources="
            "{'GPU': 1}) and RemoteModel(resources={'GPU': 1}) ask for), and runs with the "
            "dasktensor.gpu.* settings: 1 thread, no host memory limit (the CUDA and XLA "
            "libraries alone hold several GiB of host memory, which Dask's default limit "
            "restarts a worker for), JAX not preallocating the device. Devices are found "
            "with CUDA_VISIBLE_DEVICES when set, else nvidia-smi. Runs until Ctrl-C or "
            "SIGTERM. A tls:// scheduler takes --tls-ca-file/--tls-cert/--tls-key, or the "
            "certificates in Dask's config (distributed.comm.tls.*). Exit code 2 for bad "
            "input or no GPU."
        ),
    )
    worker.add_argument("scheduler", metavar="SCHEDULER",
                        help="the scheduler's address, e.g. tcp://10.0.0.5:8786")  # fmt: skip
    worker.add_argument("--gpus", type=_gpus_argument, required=True, metavar="all|N|IDS",
                        help="'all', a number of GPUs (the first N), or device ids such as "
                        "0,1 (indices as nvidia-smi lists them, or UUIDs)")  # fmt: skip
    worker.add_argument("--nthreads", type=_threads_argument, default=None,
                        help="threads per GPU worker "
                        "(dasktensor.gpu.threads-per-worker: 1)")  # fmt: skip
    worker.add_argument("--memory-limit", default=None, metavar="BYTES",
                        help="host memory limit per GPU worker, e.g. 32GiB "
                        "(dasktensor.gpu.memory-limit: 0, none)")  # fmt: skip
    worker.add_argument("--resources", type=_resources_argument, default=None,
                        metavar="'NAME=AMOUNT ...'",
                        help="further resources each GPU worker offers "
                        "(GPU=1 is given)")  # fmt: skip
    worker.add_argument("--host", default=None,
                        help="the address the workers listen on "
                        "(Dask's default: this host's)")  # fmt: skip
    worker.add_argument("--name-prefix", default=None,
                        help="worker names are PREFIX-gpu-ID "
                        "(default: this host's name)")  # fmt: skip
    worker.add_argument(
        "--tls-ca-file", metavar="PEM", help="tls://: the cluster's CA certificate"
    )
    worker.add_argument("--tls-cert", metavar="PEM", help="tls://: the workers' certificate")
    worker.add_argument("--tls-key", metavar="PEM", help="tls://: its private key")
    worker.set_defaults(run=run)
