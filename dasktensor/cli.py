"""The ``dasktensor`` command line (``dasktensor --help``)."""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def _demo(args) -> int:
    import numpy as np
    import pytensor

    import dasktensor as dt
    from dasktensor._demo import demo_graph

    if args.scheduler:
        print(f"Connecting to the scheduler at {args.scheduler} ...")
        client = dt.connect(args.scheduler)
    else:
        print(f"Starting an embedded cluster: {args.workers} worker process(es) on {args.host}")
        client = dt.connect(
            n_workers=args.workers,
            threads_per_worker=1,
            host=args.host,
            scheduler_port=args.port,
            dashboard_address=args.dashboard_address,
        )
    try:
        print(f"Dashboard: {client.dashboard_link}")
        x, outputs = demo_graph(args.delay, n_models=args.models)
        f = dt.function([x], outputs, scheduler=client)
        reference = pytensor.function([x], outputs)
        print()
        print(f.plan)
        print()
        xv = np.linspace(-1.0, 1.0, 1000)
        got, want = f(xv), reference(xv)  # first calls compile
        # to round-off: on PyTensor 3 Numba's fast-math may sum separately compiled stages
        # in another order than the whole-graph function
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-12)
        print(f"Result check against PyTensor's default mode: OK (total = {float(got[0]):.6f})")

        def median(fn):
            times = []
            for _ in range(args.calls):
                t0 = time.perf_counter()
                fn(xv)
                times.append(time.perf_counter() - t0)
            return statistics.median(times)

        t_default = median(reference)
        t_dask = median(f)
        print(
            f"{args.models} model calls of {args.delay * 1e3:.0f} ms each, median of "
            f"{args.calls} calls:\n"
            f"  default mode (serial): {t_default * 1e3:8.1f} ms\n"
            f"  dasktensor:            {t_dask * 1e3:8.1f} ms\n"
            f"  speed-up:              {t_default / t_dask:8.2f}x "
            f"(ideal {min(args.models, len(client.scheduler_info()['workers']))}x)"
        )
        if args.keep_open:
            print("Cluster kept open; press Ctrl+C to stop.")
            try:
                while True:
                    time.sleep(1)
            except KeyboardInterrupt:
                pass
    finally:
        if args.scheduler:
            client.close()
        else:
            client.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``dasktensor`` command."""
    parser = argparse.ArgumentParser(prog="dasktensor", description="Run PyTensor graphs on Dask.")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "demo",
        help="run a branchy graph with slow model calls on a Dask cluster",
        description=(
            "Compile a graph with several slow model calls, run it on an embedded "
            "LocalCluster (or --scheduler ADDR), print the plan, check the result against "
            "PyTensor's default mode, and compare timings."
        ),
    )
    demo.add_argument("--scheduler", metavar="ADDR", help="address of a running scheduler")
    demo.add_argument("--host", default="127.0.0.1", help="embedded scheduler host (127.0.0.1)")
    demo.add_argument("--port", type=int, default=0, help="embedded scheduler port (0: any)")
    demo.add_argument(
        "--dashboard-address", default="127.0.0.1:0", help="embedded dashboard (127.0.0.1:0)"
    )
    demo.add_argument("--workers", type=int, default=4, help="embedded worker processes (4)")
    demo.add_argument("--models", type=int, default=4, help="number of slow model calls (4)")
    demo.add_argument("--delay", type=float, default=0.2, help="seconds per model call (0.2)")
    demo.add_argument("--calls", type=int, default=5, help="timed calls per mode (5)")
    demo.add_argument(
        "--keep-open", action="store_true", help="keep the cluster up to browse the dashboard"
    )
    demo.set_defaults(run=_demo)

    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
