"""P20 and P21: UM-Bridge models through ``dt.umbridge_op``, against UM-Bridge's own client.

* **P20**: 4 UM-Bridge servers (``umbridge.serve_models``, UM-Bridge's own), a 50 ms
  model each; one PyTensor function evaluates the 4 independent models at once.  Wall
  time of an evaluation over one call's: target <= 1.5.  Beside it, UM-Bridge's PyMC Op
  (``umbridge.pymc.UmbridgeOp``) in the same kind of function, which calls them one after
  another (about 4).
* **P21**: the round trip of one call of a model that does not sleep, ``dt.umbridge_op``
  in a compiled function against ``umbridge.HTTPModel`` called directly, on the same
  server: target <= 1.1.

Each timed as a sampler calls: blocks of back-to-back evaluations, the variants'
blocks alternating (``_common.blocks``); medians over blocks.

Run: ``python benchmarks/bench_p20_umbridge.py``
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Row, blocks, fmt_time, load_row, print_rows, quiet, versions_line

NAME = "p20-umbridge"
HERE = os.path.dirname(os.path.abspath(__file__))
DELAY = 0.05


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def servers(n: int, max_workers: int = 4):
    """``n`` UM-Bridge servers of ``_umbridge_server.py``: their urls."""
    ports = [free_port() for _ in range(n)]
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.join(HERE, "_umbridge_server.py"), str(p), str(max_workers)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for p in ports
    ]
    try:
        for port in ports:
            deadline = time.monotonic() + 60
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), 1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise RuntimeError("a UM-Bridge server did not start") from None
                    time.sleep(0.1)
        yield [f"http://127.0.0.1:{p}" for p in ports]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(30)


def main() -> list[Row]:
    quiet()
    import numpy as np
    import pytensor
    import pytensor.tensor as pt
    import umbridge
    from umbridge.pymc import UmbridgeOp

    import dasktensor as dt

    print(f"[{NAME}] {versions_line()}")
    rows = [load_row(NAME)]
    theta = pt.dvector("theta")
    point = np.array([0.3, -0.2])
    with servers(4) as urls:
        slow = {"delay": DELAY}
        ours = [dt.umbridge_op(u, "forward", config=slow) for u in urls]
        theirs = [UmbridgeOp(u, "forward", slow) for u in urls]
        one = pytensor.function([theta], ours[0](theta).sum())
        four = pytensor.function(
            [theta], sum(op(theta * (k + 1)).sum() for k, op in enumerate(ours))
        )
        their_four = pytensor.function(
            [theta], sum(op(theta * (k + 1)).sum() for k, op in enumerate(theirs))
        )
        times = blocks(
            {"one call": lambda: one(point), "four, dasktensor": lambda: four(point),
             "four, umbridge's Op": lambda: their_four(point)},
            calls=5, rounds=5, warmup=1,
        )  # fmt: skip
        print(
            f"[{NAME}] P20 medians: " + ", ".join(f"{k} {fmt_time(v)}" for k, v in times.items())
        )
        rows.append(Row(NAME, "P20 4 models, one evaluation: wall / one call, dasktensor",
                        times["four, dasktensor"] / times["one call"], 1.5))  # fmt: skip
        rows.append(Row(NAME, "P20 same, umbridge's PyMC Op",
                        times["four, umbridge's Op"] / times["one call"]))  # fmt: skip

        fast = dt.umbridge_op(urls[0], "forward")
        f = pytensor.function([theta], fast(theta))
        model = umbridge.HTTPModel(urls[0], "forward")
        listed = [point.tolist()]
        times = blocks(
            {"dt.umbridge_op": lambda: f(point), "umbridge.HTTPModel": lambda: model(listed)},
            calls=200, rounds=7, warmup=20,
        )  # fmt: skip
        print(
            f"[{NAME}] P21 medians: " + ", ".join(f"{k} {fmt_time(v)}" for k, v in times.items())
        )
        rows.append(Row(NAME, "P21 round trip, dt.umbridge_op / umbridge.HTTPModel",
                        times["dt.umbridge_op"] / times["umbridge.HTTPModel"], 1.1))  # fmt: skip
        rows.append(Row(NAME, "P21 dt.umbridge_op round trip", times["dt.umbridge_op"], unit="s"))
    print_rows(rows, title=NAME)
    return rows


if __name__ == "__main__":
    from _common import save_results

    save_results(NAME, main())  # not saved with DASKTENSOR_BENCH_NO_SAVE=1
