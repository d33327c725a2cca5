"""The ``dasktensor`` command line, run the way the README runs it."""

from __future__ import annotations

import dask
import pytest

from dasktensor.cli import main

SMALL = ["--draws", "15", "--tune", "15", "--delay", "0.002", "--seed", "3"]


@pytest.mark.parametrize("chains", [1, 2])
def test_demo_samples_on_an_embedded_cluster(capsys, chains):
    args = ["demo", "--workers", "2", "--chains", str(chains), "--cores", str(chains)]
    assert main(args + SMALL) == 0
    out = capsys.readouterr().out
    assert "Dashboard: http://127.0.0.1:" in out
    assert "4 remote models (site-a, site-b, site-c, site-d)" in out
    assert "identical draws: True" in out  # remote and serial runs agree draw for draw
    assert "speed-up:" in out
    header, mu, log_sigma = out.split("Posterior (remote run):\n")[1].splitlines()[:3]
    assert header.split() == ["mean", "sd", "hdi_3%", "hdi_97%"]
    assert mu.split()[0] == "mu" and log_sigma.split()[0] == "log_sigma"
    mu_mean = float(mu.split()[1])
    assert 1.3 < mu_mean < 1.7  # the sites' data have mean 1.5


def test_demo_reports_an_unreachable_scheduler():
    with dask.config.set({"dasktensor.connect-timeout": "1s"}):
        with pytest.raises(ConnectionError, match="dask scheduler"):
            main(["demo", "--scheduler", "tcp://127.0.0.1:9"])


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
        "--draws",
        "--chains",
    ):
        assert option in out
