"""The documentation site builds without a warning, and holds what it promises.

The site is built once per test session, as a reader would build it (``python -m sphinx
-W -b html docs OUT``, in a subprocess of this interpreter): warnings are errors, so a
broken cross-reference, a docstring numpydoc cannot read or a page left out of every
toctree fails here.  The build reaches no network (no intersphinx) and does not execute
the notebooks; it writes into a temporary directory, except the API reference's stubs,
which Sphinx generates into ``docs/generated/`` (ignored by git).  The test extra installs
what the build needs (the packages of the docs extra), so nothing here is skipped.
"""

from __future__ import annotations

import html.parser
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import dasktensor

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
NOTEBOOKS = sorted(p.stem for p in (ROOT / "notebooks").glob("[0-9][0-9]-*.ipynb"))


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The built site (HTML), built once for this module's tests."""
    out = tmp_path_factory.mktemp("docs") / "html"  # myst-nb writes beside it, not in docs/
    command = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html"]
    build = subprocess.run(
        [*command, str(DOCS), str(out)],
        check=False,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert build.returncode == 0, f"the docs build failed:\n{build.stderr}\n{build.stdout}"
    return out


class _Ids(html.parser.HTMLParser):
    """Every ``id`` attribute of a page."""

    def __init__(self):
        super().__init__()
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        self.ids.update(value for name, value in attrs if name == "id" and value)


def ids_of(page: Path) -> set[str]:
    parser = _Ids()
    parser.feed(page.read_text(encoding="utf-8"))
    return parser.ids


def test_the_site_builds_without_warnings(site):
    assert (site / "index.html").exists()


def test_the_api_reference_has_an_anchor_for_every_public_name(site):
    anchors = set()
    for page in [site / "api.html", *(site / "generated").glob("*.html")]:
        anchors |= ids_of(page)
    missing = sorted(n for n in dasktensor.__all__ if f"dasktensor.{n}" not in anchors)
    assert not missing, f"no API entry (anchor dasktensor.<name>) for {missing}"


def _leaf_keys(tree: dict, prefix: str) -> list[str]:
    keys = []
    for name, value in tree.items():
        key = f"{prefix}.{name}"
        keys += _leaf_keys(value, key) if isinstance(value, dict) else [key]
    return keys


def test_the_settings_page_lists_every_setting(site):
    defaults = yaml.safe_load((ROOT / "dasktensor" / "dasktensor.yaml").read_text())
    keys = _leaf_keys(defaults["dasktensor"], "dasktensor")
    ids = ids_of(site / "settings.html")
    missing = [k for k in keys if f"confval-{k}" not in ids]
    assert keys and not missing, f"the settings page has no entry for {missing}"


def test_every_notebook_has_a_page(site):
    assert len(NOTEBOOKS) == 5, NOTEBOOKS
    for name in NOTEBOOKS:
        page = site / "notebooks" / f"{name}.html"
        assert page.exists(), f"no page for notebooks/{name}.ipynb"
        text = page.read_text(encoding="utf-8")
        assert "<img" in text, f"{page.name} shows none of the notebook's stored figures"
    gallery = (site / "notebooks.html").read_text(encoding="utf-8")
    assert all(f'href="notebooks/{name}.html"' in gallery for name in NOTEBOOKS)


def test_the_build_leaves_nothing_in_the_repository_but_the_ignored_stubs(site):
    """Sphinx and myst-nb write into the output directory; the API stubs are ignored."""
    status = subprocess.run(
        ["git", "status", "--porcelain", "--ignored", "--", "docs", "notebooks"],
        check=False,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if status.returncode != 0:
        pytest.skip("not a git checkout")
    ignored = [line[3:] for line in status.stdout.splitlines() if line.startswith("!! ")]
    unexpected = [p for p in ignored if not p.startswith(("docs/generated/", "docs/_build/"))]
    unexpected = [p for p in unexpected if "__pycache__" not in p]
    assert not unexpected, f"the build left {unexpected} in the repository"
