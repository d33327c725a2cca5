"""The habits CI enforces besides the tests: ruff's lint and format, and mypy on the public API.

The rules and the modules checked are in ``pyproject.toml`` (``[tool.ruff]``,
``[tool.mypy]``); ``.pre-commit-config.yaml`` runs the same checks on each commit, and
docs/contributing.md says how to run them by hand.  Each check runs as the command a
contributor types, in a subprocess from the repository's root, and a failure shows its
output.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run(*command: str, timeout: float = 240) -> None:
    done = subprocess.run(
        [sys.executable, "-m", *command],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if done.returncode != 0:
        pytest.fail(
            f"`{' '.join(command)}` exited with {done.returncode}:\n{done.stdout}{done.stderr}",
            pytrace=False,
        )


def test_ruff_check():
    run("ruff", "check", "--no-cache", "--output-format", "concise", ".")


def test_ruff_format():
    run("ruff", "format", "--no-cache", "--check", ".")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_mypy_on_the_public_api():
    # the files and options are [tool.mypy]'s; the first run analyses PyTensor too (a minute
    # or two), later ones use .mypy_cache
    run("mypy", timeout=540)
