"""ci/environment.yml against pyproject.toml: the conda environment is the test extra's.

The environment's own instructions are ``pip install --no-deps -e . && pytest``: pip adds
nothing there, so a package the tests import that the environment lacks fails the suite at
import time.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
# conda-forge's name where it is not PyPI's (after normalising - and _)
CONDA_NAMES = {"matplotlib": "matplotlib-base"}


def normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pip_requirements() -> dict[str, str]:
    """``{conda name: lower bound}`` of the dependencies and the test extra, as they apply
    to the line the environment builds (Python >= 3.12)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found = {}
    for line in project["dependencies"] + project["optional-dependencies"]["test"]:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"python_version": "3.12"}):
            continue
        lower = [s.version for s in req.specifier if s.operator == ">="]
        name = normal(req.name)
        found[CONDA_NAMES.get(name, name)] = lower[0] if lower else ""
    return found


def conda_requirements() -> dict[str, str]:
    """``{name: lower bound}`` of ci/environment.yml's conda dependencies."""
    env = yaml.safe_load((ROOT / "ci" / "environment.yml").read_text())
    found = {}
    for entry in env["dependencies"]:
        if not isinstance(entry, str):  # a pip: section
            continue
        name, _, lower = re.match(r"([A-Za-z0-9_.\-]+)\s*(>=\s*)?(.*)", entry).groups()
        found[normal(name)] = lower.split(",")[0].strip()  # (the lower bound of >=A,<B)
    return found


def test_the_conda_environment_has_every_package_the_tests_need():
    pip, conda = pip_requirements(), conda_requirements()
    missing = sorted(set(pip) - set(conda))
    assert not missing, f"ci/environment.yml lacks {missing} (pyproject.toml needs them)"
    bounds = {n: (conda[n], v) for n, v in pip.items() if v and conda[n] != v}
    assert not bounds, f"lower bounds differ, {{name: (environment.yml, pyproject)}}: {bounds}"
    assert conda["python"] == "3.12"


def test_the_comparison_sees_a_missing_package(tmp_path, monkeypatch):
    """The check above fails when the environment lacks a package of the test extra."""
    env = (ROOT / "ci" / "environment.yml").read_text()
    assert "  - zarr>=3\n" in env
    (tmp_path / "ci").mkdir()
    (tmp_path / "ci" / "environment.yml").write_text(env.replace("  - zarr>=3\n", ""))
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    try:
        test_the_conda_environment_has_every_package_the_tests_need()
    except AssertionError as e:
        assert "lacks ['zarr']" in str(e)
    else:
        raise AssertionError("a missing zarr went unnoticed")
