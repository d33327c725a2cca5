"""The ``dasktensor`` command line, run the way the README runs it."""

from __future__ import annotations

import dask
import pytest

from dasktensor.cli import main

SMALL = ["--draws", "15", "--tune", "15", "--delay", "0.002", "--seed", "3"]


@pytest.mark.parametrize("chains", [1, 2])
def test_demo_samples_on_an_embedded_cluster(capfd, chains):
    args = ["demo", "--workers", "2", "--chains", str(chains), "--cores", str(chains)]
    assert main(args + SMALL) == 0
    out, err = capfd.readouterr()
    assert "Warning" not in out + err, out + err  # nothing a new user cannot act on
    assert "Dashboard: http://127.0.0.1:" in out
    assert "Remote calls (not in the task stream): http://127.0.0.1:" in out
    assert "/individual-dasktensor-calls\n" in out
    assert "4 remote models (site-a, site-b, site-c, site-d)" in out
    assert "identical draws: True" in out  # remote and serial runs agree draw for draw
    # 2 workers hold a replica of each site: an evaluation's 4 calls run at once
    assert "x (ideal 4x: 4 calls of an evaluation at once); identical draws" in out
    header, mu, log_sigma = out.split("Posterior (remote run):\n")[1].splitlines()[:3]
    assert header.split() == ["mean", "sd", "hdi_3%", "hdi_97%"]
    assert mu.split()[0] == "mu" and log_sigma.split()[0] == "log_sigma"
    mu_mean = float(mu.split()[1])
    assert 1.3 < mu_mean < 1.7  # the sites' data have mean 1.5


@pytest.mark.slow
def test_the_demo_run_as_a_new_user_runs_it_prints_no_warning(tmp_path):
    """``dasktensor demo`` in a fresh process, as a fresh machine runs it: with an empty
    cache, ArviZ 0.23 (PyMC 5.28's) warns of its refactor on its first import of the day,
    which the demo must not show (and nothing else may warn either)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}  # ArviZ's daily stamp
    done = subprocess.run(
        [sys.executable, "-m", "dasktensor", "demo", "--workers", "2", *SMALL],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "identical draws: True" in done.stdout
    assert "Warning" not in done.stdout + done.stderr, done.stderr[-3000:]


def test_demo_reports_an_unreachable_scheduler():
    with dask.config.set({"dasktensor.connect-timeout": "1s"}):
        with pytest.raises(ConnectionError, match="dask scheduler"):
            main(["demo", "--scheduler", "tcp://127.0.0.1:9"])


# ------------------------------------------------------------------------- dasktensor info

FAKE_DASKTENSOR = "9.9.9"  # what the second worker's package metadata says


@pytest.fixture(scope="module")
def info_cluster(tmp_path_factory):
    """A scheduler with a dashboard, a worker process of its own and a `dask worker`.

    The `dask worker` process offers {"GPU": 1}, 2 threads and 512 MiB, and finds package
    metadata of dasktensor 9.9.9 first on its path: a worker with another dasktensor
    installed, as `dasktensor info` should flag it.
    """
    import os
    import subprocess
    import sys

    from _clusters import local_cluster
    from distributed import Client

    site = tmp_path_factory.mktemp("other-dasktensor")
    meta = site / f"dasktensor-{FAKE_DASKTENSOR}.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: dasktensor\nVersion: {FAKE_DASKTENSOR}\n"
    )
    cluster = local_cluster(n_workers=1, dashboard_address="127.0.0.1:0", memory_limit="1GiB")
    worker = subprocess.Popen(
        [sys.executable, "-m", "distributed.cli.dask_worker", cluster.scheduler_address]
        + ["--no-nanny", "--host", "127.0.0.1", "--no-dashboard", "--name", "gpu-worker"]
        + ["--nthreads", "2", "--memory-limit", "512MiB", "--resources", "GPU=1"],
        env={**os.environ, "PYTHONPATH": str(site)},
        cwd=site,  # `python -m` puts the working directory first on sys.path
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        with Client(cluster, set_as_default=False) as c:
            c.wait_for_workers(2, timeout=60)
        yield cluster
    finally:
        worker.terminate()
        try:
            worker.wait(timeout=20)
        except subprocess.TimeoutExpired:  # pragma: no cover - a worker that hangs
            worker.kill()
            worker.wait()
        cluster.close()


def report_lines(out: str, heading: str) -> list[str]:
    """The indented lines of a section of ``dasktensor info``'s output, split in columns."""
    lines = out.split(heading, 1)[1].splitlines()[1:]
    rows = []
    for line in lines:
        if not line.startswith("  "):
            break
        rows.append(line.split())
    return rows


def test_info_shows_workers_resources_and_flags_other_versions(info_cluster, capsys):
    import sys
    from importlib.metadata import version

    address = info_cluster.scheduler_address
    assert main(["info", "--scheduler", address]) == 0
    out = capsys.readouterr().out
    assert f"Scheduler:  {address}\n" in out
    assert f"Dashboard:  {info_cluster.dashboard_link}\n" in out
    calls = info_cluster.dashboard_link.replace("/status", "/individual-dasktensor-calls")
    assert f"Calls page: {calls}\n" in out
    assert info_cluster.dashboard_link.startswith("http://127.0.0.1:")
    assert "Workers:    2 (3 thread(s), memory limit 1.50 GiB)" in out

    header, *workers = report_lines(out, "Workers:")
    assert header == ["address", "name", "threads", "memory", "limit", "resources"]
    by_name = {w[1]: w for w in workers}
    assert set(by_name) == {"0", "gpu-worker"}
    gpu, plain = by_name["gpu-worker"], by_name["0"]
    assert gpu[0].startswith("tcp://127.0.0.1:") and gpu[2:] == ["2", "512.00", "MiB", "GPU=1"]
    assert plain[2:] == ["1", "1.00", "GiB", "-"]

    header, *rows = report_lines(out, "Versions:")
    assert header == ["package", "client", "scheduler", "workers"]
    table = {r[0]: r[1:] for r in rows}
    assert list(table) == [
        "dasktensor",
        "dask",
        "distributed",
        "pytensor",
        "pymc",
        "numpy",
        "python",
    ]
    for package in ("dask", "distributed", "pytensor", "pymc", "numpy"):
        mine = version(package)
        assert table[package] == [mine, mine, mine], package  # the same everywhere
    python = ".".join(map(str, sys.version_info[:3]))
    assert table["python"] == [python, python, python]
    ours = version("dasktensor")
    assert table["dasktensor"][:2] == [ours, ours]
    assert table["dasktensor"][2:] == ["mixed:", ours, "(1),", FAKE_DASKTENSOR, "(1)", "<-"]
    mismatches = out.split("VERSION MISMATCH", 1)[1].splitlines()[1:]
    assert mismatches == [f"  dasktensor: client {ours}, worker(s) {gpu[0]} {FAKE_DASKTENSOR}"]


def test_info_finds_the_scheduler_in_dask_scheduler_address(info_cluster):
    """The console entry point in a fresh process, the address from the environment."""
    import os
    import subprocess
    import sys

    address = info_cluster.scheduler_address
    env = {**os.environ, "DASK_SCHEDULER_ADDRESS": address}
    done = subprocess.run(
        [sys.executable, "-m", "dasktensor", "info"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert f"Scheduler:  {address}\n" in done.stdout
    assert "GPU=1" in done.stdout
    assert "VersionMismatchWarning" not in done.stderr  # reported in the table instead


def child_processes() -> set[int]:
    import psutil

    alive = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    return set(alive)


def test_info_without_an_address_says_how_to_give_one_and_starts_nothing(capsys):
    children = child_processes()
    with dask.config.set({"scheduler-address": None, "dasktensor.scheduler-address": None}):
        assert main(["info"]) == 2
    err = capsys.readouterr().err
    for advice in ("--scheduler", "DASK_SCHEDULER_ADDRESS", "dask scheduler", "--embedded"):
        assert advice in err
    assert child_processes() == children  # no cluster was started


def test_info_reports_an_unreachable_scheduler_without_a_traceback():
    import os
    import subprocess
    import sys

    env = {**os.environ, "DASK_DASKTENSOR__CONNECT_TIMEOUT": "1s"}
    env.pop("DASK_SCHEDULER_ADDRESS", None)
    done = subprocess.run(
        [sys.executable, "-m", "dasktensor", "info", "--scheduler", "tcp://127.0.0.1:9"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert done.stdout == ""
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith("dasktensor info: Could not reach a Dask scheduler at")
    for words in ("'tcp://127.0.0.1:9' within 1 s", "dask scheduler", "dask worker"):
        assert words in done.stderr


@pytest.mark.timeout(60)  # distributed alone would wait forever here
def test_info_fails_within_the_timeout_on_a_port_that_is_not_a_scheduler(info_cluster, capsys):
    import socket
    import time

    silent = socket.socket()  # accepts connections (the kernel does) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    dashboard_port = info_cluster.scheduler.http_server.port  # an HTTP server: no reply
    try:
        for port in (silent.getsockname()[1], dashboard_port):
            address = f"tcp://127.0.0.1:{port}"
            t0 = time.perf_counter()
            with dask.config.set({"dasktensor.connect-timeout": "1s"}):
                assert main(["info", "--scheduler", address]) == 1
            assert time.perf_counter() - t0 < 5
            err = capsys.readouterr().err
            assert f"Could not reach a Dask scheduler at '{address}' within 1 s" in err
            assert "did not answer as a Dask scheduler" in err and "dask scheduler" in err
    finally:
        silent.close()


def test_info_on_an_embedded_cluster_stops_it(capsys):
    children = child_processes()
    settings = {"dasktensor.cluster.n-workers": 1, "dasktensor.scheduler-address": "tcp://x:1"}
    with dask.config.set(settings):  # --embedded ignores a configured address
        assert main(["info", "--embedded"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Embedded cluster started by dt.connect() (stopped on exit):\n")
    assert "Scheduler:  tcp://127.0.0.1:" in out
    assert "Workers:    1 (1 thread(s)" in out
    assert "Versions match" in out
    assert child_processes() == children  # its worker processes are gone


# ------------------------------------------------------------------------ dasktensor bench


def test_bench_lists_the_benchmarks_of_the_source_tree(capsys):
    from pathlib import Path

    import dasktensor

    assert main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    where = Path(dasktensor.__file__).resolve().parent.parent / "benchmarks"
    assert out.splitlines()[0].startswith(f"Benchmarks in {where} ")
    rows = {line.split()[0]: line.split(None, 2)[1:] for line in out.splitlines()[1:]}
    assert {"a", "b", "c", "p1", "p2", "p5"} <= set(rows)
    assert rows["a"] == [
        "bench_a_overhead.py",
        "Overhead of the DASK mode on a graph with nothing to parallelise.",
    ]
    assert rows["p1"][1].startswith("one remote logp+gradient round trip")


def test_bench_refuses_unknown_names_before_running_anything(capsys):
    assert main(["bench", "a", "zz"]) == 2
    captured = capsys.readouterr()
    assert "unknown benchmark(s) zz" in captured.err and "p1" in captured.err
    assert captured.out == ""


def installed_copy(tmp_path):
    """The dasktensor package copied alone into a directory, as a wheel installs it."""
    import shutil
    from pathlib import Path

    import dasktensor

    site = tmp_path / "site-packages"
    shutil.copytree(
        Path(dasktensor.__file__).parent,
        site / "dasktensor",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    return site


def run_cli(site, *args):
    import os
    import subprocess
    import sys

    # the copy comes before the editable install (and `python -m` puts the working
    # directory first on sys.path: not the source tree's)
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run(
        [sys.executable, "-m", "dasktensor", *args],
        env=env,
        cwd=site,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_bench_without_benchmarks_beside_the_package_says_where_they_are(tmp_path):
    site = installed_copy(tmp_path)
    for args in (["bench", "--list"], ["bench", "a"]):
        done = run_cli(site, *args)
        assert done.returncode == 1
        assert "Traceback" not in done.stderr
        assert done.stderr.startswith("dasktensor bench: The benchmarks are not installed")
        assert str(site / "benchmarks") in done.stderr  # the copy ran, not the source tree
        assert "installed from a wheel" in done.stderr and "pip install -e" in done.stderr


def test_bench_runs_run_all_in_a_subprocess_with_this_interpreter(tmp_path):
    """A source tree whose run_all.py only reports how it was run."""
    import sys

    site = installed_copy(tmp_path)
    benchmarks = site / "benchmarks"
    benchmarks.mkdir()
    (benchmarks / "bench_x_probe.py").write_text('"""(x) Reports how it was started."""\n')
    (benchmarks / "run_all.py").write_text(
        "import sys\n"
        'BENCHMARKS = {"x": "bench_x_probe", "y": "bench_y_missing"}\n'
        'print("RUN", sys.executable, sys.argv[1:])\n'
        "sys.exit(3)\n"
    )
    listed = run_cli(site, "bench", "--list")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines()[1:] == [
        "  x  bench_x_probe.py    Reports how it was started.",
        "  y  bench_y_missing.py  (no description)",
    ]
    done = run_cli(site, "bench", "y", "x")
    assert done.returncode == 3
    run = [line for line in done.stdout.splitlines() if line.startswith("RUN ")]
    assert run == [f"RUN {sys.executable} ['y', 'x']"]
    assert "run_all.py exited with code 3" in done.stderr


# ------------------------------------------------------------------------------ each --help

#: what each command's --help must mention
HELP = {
    "demo": ["--scheduler", "--host", "--port", "--dashboard-address", "--workers", "--delay",
             "--draws", "--chains"],
    "info": ["--scheduler", "--embedded", "--timeout", "--tls-ca-file", "DASK_SCHEDULER_ADDRESS",
             "dasktensor.scheduler-address", "versions"],
    "bench": ["--list", "NAME", "run_all.py", "subprocess", "wheel"],
}  # fmt: skip


@pytest.mark.parametrize("command", HELP)
def test_help_describes_the_command(capsys, command):
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for words in HELP[command]:
        assert words in out
