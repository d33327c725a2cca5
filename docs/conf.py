"""Sphinx configuration of dasktensor's documentation.

Build it with ``python -m sphinx -b html docs docs/_build/html`` (``pip install -e
".[docs]"`` first); ``tests/test_docs.py`` builds it with ``-W``, so a warning, such as a
broken cross-reference, fails the test suite.  The build reaches no network: there is no
intersphinx, and the notebooks are rendered from their stored outputs, not executed.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))  # dasktensor_settings.py, dasktensor_results.py

import dasktensor  # noqa: E402  the version (autodoc imports it anyway); after sys.path above

project = "dasktensor"
author = "dasktensor developers"
copyright = "dasktensor developers"
release = dasktensor.__version__
version = release.split("+")[0]

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "numpydoc",
    "myst_nb",  # Markdown pages (MyST) and the notebooks
    "dasktensor_settings",
    "dasktensor_results",  # the benchmarks' tables, from benchmarks/results/
]

root_doc = "index"
templates_path = ["_templates"]
exclude_patterns = [
    "_build",
    "**/.ipynb_checkpoints",
    # docs/notebooks links to ../notebooks: its README and runner are not pages of the site
    "notebooks/README.md",
    "notebooks/execute.py",
]
suppress_warnings: list[str] = []

# -- MyST and the notebooks -------------------------------------------------------------
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3  # [text](architecture.md#5-execution-model) links to a heading
nb_execution_mode = "off"  # notebooks are stored executed (notebooks/execute.py)
nb_merge_streams = True

# -- API reference ----------------------------------------------------------------------
autosummary_generate = True
autosummary_imported_members = True
autodoc_typehints = "none"  # numpydoc's Parameters sections give the types
autodoc_member_order = "bysource"
numpydoc_show_class_members = False  # the class template lists the members
numpydoc_validation_checks: set[str] = set()
add_module_names = False

# -- HTML -------------------------------------------------------------------------------
html_theme = "pydata_sphinx_theme"
html_title = f"dasktensor {version}"
html_static_path: list[str] = []
html_show_sourcelink = False
html_theme_options = {
    "github_url": "https://github.com/dasktensor/dasktensor",
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "header_links_before_dropdown": 5,
    "navbar_align": "left",
    "footer_start": ["copyright"],
    "footer_end": ["sphinx-version"],
}
html_context = {"default_mode": "light"}
# pages without sub-pages need no section navigation
html_sidebars = {
    page: []
    for page in ["index", "installation", "getting-started", "api", "settings", "performance",
                 "limitations", "glossary", "comparison", "architecture", "contributing",
                 "changelog", "citing"]
}  # fmt: skip
html_copy_source = False

# -- Objects without a docstring of their own -------------------------------------------
#: a module-level instance shows its class's docstring; these say what the object is
DOCSTRINGS = {
    "dasktensor.DASK": [
        'The ``"DASK"`` mode: ``dask_mode()`` with its defaults, registered with PyTensor',
        "when dasktensor is imported.",
        "",
        '``pytensor.function(..., mode="DASK")`` and',
        '``pm.sample(compile_kwargs={"mode": "DASK"})`` compile with it;',
        ":func:`dask_mode` makes one with options.",
    ],
}


def _own_docstring(app, what, name, obj, options, lines):
    if name in DOCSTRINGS:
        lines[:] = DOCSTRINGS[name]


def _fresh_stubs(app):
    """Remove the API stubs of an earlier build before autosummary writes them again: a stub
    left from a name no longer in the API would be a page outside every toctree."""
    shutil.rmtree(HERE / "generated", ignore_errors=True)


def setup(app):
    app.connect("builder-inited", _fresh_stubs, priority=100)  # before autosummary's (500)
    app.connect("autodoc-process-docstring", _own_docstring)
