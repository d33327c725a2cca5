"""The ``dasktensor`` command line, run the way the README runs it."""

from __future__ import annotations

import dask
import pytest

from dasktensor.cli import main


def test_demo_runs_on_an_embedded_cluster_and_checks_its_result(capsys):
    assert main(["demo", "--workers", "2", "--delay", "0.02", "--calls", "2"]) == 0
    out = capsys.readouterr().out
    assert "Dashboard: http://127.0.0.1:" in out
    assert "slow-model" in out and "on cluster" in out  # the plan
    assert "Result check against PyTensor's default mode: OK" in out
    assert "speed-up:" in out


def test_demo_reports_an_unreachable_scheduler():
    with dask.config.set({"dasktensor.connect-timeout": "1s"}):
        with pytest.raises(ConnectionError, match="dask scheduler"):
            main(["demo", "--scheduler", "tcp://127.0.0.1:9", "--calls", "1"])


def test_help_describes_the_demo(capsys):
    with pytest.raises(SystemExit) as info:
        main(["demo", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for option in (
        "--scheduler",
        "--host",
        "--port",
        "--dashboard-address",
        "--workers",
        "--delay",
    ):
        assert option in out
