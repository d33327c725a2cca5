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

import hashlib
import html.parser
import subprocess
import sys
import tempfile
from pathlib import Path

import filelock
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
    with _docs_lock():
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


def _docs_lock() -> filelock.FileLock:
    """Held while the site builds: every build of this checkout writes the API stubs into
    the same ``docs/generated/`` (removed first), so two runs of the suite at once (CI's two
    Python lines) take turns there."""
    digest = hashlib.sha1(str(DOCS).encode()).hexdigest()[:12]
    return filelock.FileLock(Path(tempfile.gettempdir()) / f"dasktensor-docs-{digest}.lock")


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


# -- the pages a user looks for ------------------------------------------------------------

PYPROJECT = ROOT / "pyproject.toml"
USER_PAGES = ["installation", "limitations", "glossary", "comparison", "citing",
              "user-guide/troubleshooting", "user-guide/journey-of-a-call"]  # fmt: skip


def _project() -> dict:
    import tomllib

    return tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]


def _table_rows(page: Path, header: str) -> list[list[str]]:
    """The cells of the Markdown table whose header row starts with ``| header |``."""
    lines = page.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {header} |"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def test_the_installation_page_lists_every_extra_and_no_other():
    extras = set(_project()["optional-dependencies"])
    listed = {row[0].strip("`") for row in _table_rows(DOCS / "installation.md", "extra")}
    assert listed == extras, (
        f"only in pyproject.toml: {extras - listed}; only on the page: {listed - extras}"
    )


def test_zarr_and_umbridge_are_in_user_facing_extras():
    extras = _project()["optional-dependencies"]
    assert any(r.startswith("zarr") for r in extras["zarr"])
    assert any(r.startswith("umbridge") for r in extras["umbridge"])
    assert extras["all"] == ["dasktensor[dashboard,jax,zarr,umbridge]"]


def test_the_installation_page_states_the_pinned_lines():
    """The two lines of the page are the bounds of pyproject.toml's requirements."""
    import re

    bounds = {}  # (package, "old" | "new") -> the lower bound
    for requirement in _project()["dependencies"]:
        pattern = r"(pymc|pytensor)>=([\d.]+)(?:,<[\d.]+)?; python_version ([<>]=?) '3.12'"
        m = re.match(pattern, requirement)
        if m:
            bounds[m[1], "old" if m[3] == "<" else "new"] = m[2]
    assert len(bounds) == 4, bounds
    rows = {row[0]: row for row in _table_rows(DOCS / "installation.md", "line")}
    new = [">= 3.12", f">= {bounds['pymc', 'new']}", f">= {bounds['pytensor', 'new']}"]
    old = ["3.11", f"{bounds['pymc', 'old']}.x", f"{bounds['pytensor', 'old']}.x"]
    assert rows["current"][1:4] == new and rows["previous"][1:4] == old, rows
    assert _project()["requires-python"] == ">=3.11"


def test_the_api_reference_lists_public_names_and_one_returned_class():
    """Every entry of docs/api.rst is a name of dasktensor.__all__, except the class of what
    serve_umbridge returns, which the page says is not one."""
    import inspect

    import dasktensor.remote

    entries = []
    for block in (DOCS / "api.rst").read_text(encoding="utf-8").split(".. autosummary::")[1:]:
        for line in block.splitlines()[1:]:
            if line.startswith("   ") and not line.strip().startswith(":"):
                entries.append(line.strip())
            elif line.strip() and not line.startswith("   "):
                break
    others = sorted(e for e in entries if e not in dasktensor.__all__)
    assert others == ["remote.UMBridgeServer"], others
    returned = inspect.signature(dasktensor.serve_umbridge).return_annotation
    assert returned in (dasktensor.remote.UMBridgeServer, "UMBridgeServer")
    assert "remote.UMBridgeServer``, the\ntype of what :func:`serve_umbridge` returns" in (
        DOCS / "api.rst"
    ).read_text(encoding="utf-8")


def test_the_pages_users_look_for_are_in_the_site(site):
    for page in USER_PAGES:
        assert (site / f"{page}.html").exists(), f"docs/{page}.md is not in the site"


def test_the_glossary_defines_the_words_the_guide_uses(site):
    ids = ids_of(site / "glossary.html")
    words = ["replica", "channel", "resident-stage", "shard", "segment", "lease", "placement",
             "line", "call-server", "stage", "batch"]  # fmt: skip
    missing = [w for w in words if f"term-{w}" not in ids]
    assert not missing, f"the glossary does not define {missing}"


def test_the_journey_of_a_call_is_a_drawn_figure(site):
    import xml.etree.ElementTree as ET

    figure = DOCS / "journey-of-a-call.svg"
    root = ET.parse(figure).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    texts = " ".join(t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}text"))
    for part in ("Caller process", "Dask scheduler", "Dask worker", "call server", "replica"):
        assert part in texts, f"the figure shows no {part!r}"
    page = (site / "user-guide" / "journey-of-a-call.html").read_text(encoding="utf-8")
    assert "journey-of-a-call.svg" in page and (site / "_images" / figure.name).exists()


def test_the_performance_page_shows_the_benchmarks_tables_and_figures(site):
    """Its tables and figures are made from benchmarks/results/ (docs/_ext/
    dasktensor_results.py; tests/test_doc_figures.py checks the pages' figures)."""
    import json

    page = (site / "performance.html").read_text(encoding="utf-8")
    assert "list-table" not in page and "{benchmark-results}" not in page
    assert page.count('<table class="benchmark-results') >= 15
    saved = json.loads((ROOT / "benchmarks/results/python3.12/p1-latency.json").read_text())
    call = next(r for r in saved["rows"] if r["metric"] == "dasktensor call")
    assert call["measured_text"].replace(" us", " µs") in page
    script = saved["command"].split()[1]  # the literal's words are spans of their own
    assert f'<span class="pre">{script}</span>' in page and saved["machine"]["cpu"] in page


def test_guides_state_no_machine_specific_timings():
    """Figures belong on the performance page, with the machine described; the other pages
    link to it. (The architecture records measured reasons for its decisions.)"""
    import re

    pages = [ROOT / "README.md", *DOCS.glob("*.md"), *(DOCS / "user-guide").glob("*.md")]
    pages = [p for p in pages if p.name not in ("performance.md", "architecture.md")]
    banned = re.compile(r"\d\s?µs|2-core|shared machine|this release|previous release|\d ms here")
    found = [
        f"{page.relative_to(ROOT)}:{number}: {line.strip()}"
        for page in pages
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
        if banned.search(line)
    ]
    assert not found, "timings or wording of one machine outside the performance page:\n" + (
        "\n".join(found)
    )
