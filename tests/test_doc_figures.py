"""Every timing the documentation states comes from a benchmark's result file.

The benchmarks write their rows to ``benchmarks/results/<line>/<name>.json``
(``save_results`` in ``benchmarks/_common.py``); the performance page's tables and its
``{result}`` figures are made from those files when the site is built
(``docs/_ext/dasktensor_results.py``).  These tests read the pages with the same code: a
page that states a timing (a number with s, ms or µs, a ratio such as ``1.9x``, a rate in
calls/s) outside code that no result file has fails, naming the page and the line, and so
does a ``{result}`` role naming a row no file has.  Numbers that are not measurements of
this project (a setting's default, a benchmark model's designed cost, a goal) are listed in
``NOT_MEASUREMENTS`` with the reason.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs" / "_ext"))
sys.path.insert(0, str(ROOT / "benchmarks"))

results = importlib.import_module("dasktensor_results")

#: (page, literal as written) -> why it is not a measurement to be found in the results
NOT_MEASUREMENTS = {
    ("README.md", "20 ms"): "the example model's designed cost (it sleeps 20 ms a call)",
    ("docs/getting-started.md", "20 ms"): "the example model's designed cost (a sleep)",
    ("docs/user-guide/batching.md", "5 ms"): "the value of the wait=0.005 example (an option)",
    ("docs/user-guide/dashboard.md", "30 s"): "the stream's window, a constant of the page",
    ("docs/user-guide/dashboard.md", "0.5 ms"): "the histogram's lowest bucket bound",
    ("docs/user-guide/dashboard.md", "60 s"): "the histogram's highest bucket bound",
    ("docs/user-guide/dashboard.md", "5 s"): "the gauge's averaging window",
    ("docs/user-guide/deployments.md", "5 s"): "dt.Adaptive's window of calls in flight",
    ("docs/user-guide/deployments.md", "30 s"): "the window in which a replica counts as used",
    ("docs/user-guide/pipelines.md", "5x"): "P26's stage costs, set by the benchmark (sleeps)",
    ("docs/user-guide/troubleshooting.md", "60 s"): "the argument of the faulthandler example",
}


def pages() -> list[Path]:
    found = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    skip = ("_build", "generated", ".ipynb_checkpoints")
    return [p for p in found if not any(part in p.parts for part in skip)]


def unsourced(page: Path, text: str, known: set[str]) -> list[str]:
    name = page.relative_to(ROOT).as_posix() if page.is_relative_to(ROOT) else page.name
    return [
        f"{name}:{number}: {literal!r}"
        for number, literal in results.timing_literals(text)
        if results.normalized(literal) not in known
        and (name, literal.lstrip("~≈")) not in NOT_MEASUREMENTS
    ]


def test_every_entry_of_the_list_of_non_measurements_is_still_on_its_page():
    stale = [
        f"{page}: {literal!r}"
        for page, literal in NOT_MEASUREMENTS
        if literal
        not in [lit.lstrip("~≈") for _, lit in results.timing_literals((ROOT / page).read_text())]
    ]
    assert not stale, f"entries of NOT_MEASUREMENTS no page states any more: {stale}"


def test_the_pages_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in pages()}
    assert {"README.md", "docs/performance.md", "docs/architecture.md"} <= names
    assert "docs/user-guide/sampling.md" in names


def test_every_timing_a_page_states_is_in_the_results():
    known = results.measured_literals()
    found = [f for page in pages() for f in unsourced(page, page.read_text("utf-8"), known)]
    assert not found, (
        "timings on the pages that no result file in benchmarks/results has (use the "
        "{result} role on docs/performance.md, link to its section elsewhere, or run the "
        "benchmark that measures it):\n" + "\n".join(found)
    )


def test_a_planted_timing_fails_and_names_page_and_line(tmp_path):
    known = results.measured_literals()
    page = ROOT / "docs" / "user-guide" / "planted.md"
    text = "# A page\n\nA call takes 12345.6 µs here, and batching gives 987.6x.\n"
    text += "```python\nx = '1.5 ms in code is not prose'\n```\nAnd `2.5 s` in code.\n"
    assert unsourced(page, text, known) == [
        "docs/user-guide/planted.md:3: '12345.6 µs'",
        "docs/user-guide/planted.md:3: '987.6x'",
    ]


def test_a_row_value_is_accepted_as_the_table_prints_it():
    known = results.measured_literals()
    line, record = next(iter(results.all_results()))
    timed = next(r for r in record["rows"] if r["unit"] == "s")
    text = f"It took {results.value_text(timed)}.\n"
    assert unsourced(ROOT / "docs" / "x.md", text, known) == []
    # the same value in another unit or rounded otherwise is not accepted
    assert unsourced(ROOT / "docs" / "x.md", "It took 0.0000001 s.\n", known)


def test_the_scanner_finds_each_kind_of_timing():
    text = "a 44.7 µs b 1.09 ms c 2.5 s d 1.9x e 0.86x f 10,291 calls/s g 30.3 us h 2×\n"
    found = [literal for _, literal in results.timing_literals(text)]
    assert found == [
        "44.7 µs",
        "1.09 ms",
        "2.5 s",
        "1.9x",
        "0.86x",
        "10,291 calls/s",
        "30.3 us",
        "2×",
    ]
    assert not list(results.timing_literals("P16 and 2,000,000 rows on 4 workers, 10^5 calls\n"))


def test_every_result_role_names_a_row_that_a_file_has():
    missing = [
        f"{page.relative_to(ROOT)}:{number}: {{result}}`{ref}`"
        for page in pages()
        for number, ref in results.roles(page.read_text("utf-8"))
        if results.resolve(ref)[1] is None
    ]
    assert not missing, "roles naming rows no result file has:\n" + "\n".join(missing)


def test_a_role_naming_a_missing_row_is_found():
    assert results.resolve("p1:no such metric")[1] is None
    with pytest.raises(KeyError, match="no benchmark"):
        results.resolve("p999:dasktensor call")


def test_the_performance_page_makes_its_tables_from_the_results():
    text = (ROOT / "docs" / "performance.md").read_text("utf-8")
    assert "{benchmark-machines}" in text
    assert text.count("{benchmark-results}") >= 15
    for key in ("p1", "p27", "p9", "p10", "p16"):
        assert f"{{benchmark-results}} {key}\n" in text


def test_a_table_shows_each_line_or_says_it_was_not_measured():
    record = results.load_result("p1", "python3.12")
    assert record is not None, "benchmarks/results/python3.12/p1-latency.json is missing"
    row = results.find_row(record, "dasktensor call")
    header, body, runs = results.table_cells("p1", ["dasktensor call", "no such metric"])
    assert header[2].startswith("Python 3.11") and header[4].startswith("Python 3.12")
    found, missing = body
    assert found[0] == "dasktensor call" and found[4] == results.value_text(row)
    assert missing[2] == missing[4] == results.NOT_MEASURED  # on both lines
    assert f"``{record['command']}``" in runs[1]


def test_result_files_describe_the_run_and_the_machine():
    seen = 0
    for line, record in results.all_results():
        seen += 1
        where = f"{line}/{record['benchmark']}"
        assert line in results.LINES, where
        assert line == "python" + ".".join(record["versions"]["python"].split(".")[:2]), where
        for key in ("pymc", "pytensor", "dask", "distributed", "numpy"):
            assert record["versions"][key], where
        machine = record["machine"]
        assert machine["cpu"] and machine["logical_cores"] >= 1 and machine["memory_gib"] > 0
        assert record["command"].startswith("python benchmarks/"), where
        assert record["default_options"] == (not record["options"]), where
        assert record["rows"], where
        for row in record["rows"]:
            assert set(row) >= {"metric", "measured", "unit", "target", "met", "measured_text"}
    assert seen >= 2


def test_save_results_writes_the_default_run_apart_from_runs_with_options(tmp_path, monkeypatch):
    import _common

    monkeypatch.setattr(_common, "RESULTS", str(tmp_path))
    monkeypatch.delenv("DASKTENSOR_BENCH_NO_SAVE", raising=False)
    rows = [_common.Row("x-probe", "a call", 4.47e-5, 1e-4, unit="s")]
    default = _common.save_results("x-probe", rows, [], command="python benchmarks/x.py")
    other = _common.save_results("x-probe", rows, ["--rows", "1000"])
    line = _common.line_name()
    assert Path(default) == tmp_path / line / "x-probe.json"
    assert Path(other) == tmp_path / line / "x-probe--rows-1000.json"
    saved = json.loads(Path(default).read_text())
    assert saved["rows"][0]["measured_text"] == "44.7 us" and saved["rows"][0]["met"] == "yes"
    assert saved["command"] == "python benchmarks/x.py" and saved["default_options"]
    assert not json.loads(Path(other).read_text())["default_options"]
    monkeypatch.setenv("DASKTENSOR_BENCH_NO_SAVE", "1")
    assert _common.save_results("x-probe", rows, ["--other"]) is None
    assert sorted(p.name for p in (tmp_path / line).iterdir()) == [
        "x-probe--rows-1000.json",
        "x-probe.json",
    ]


def test_every_benchmark_saves_its_rows_when_run_as_a_script():
    """Each ``bench_*.py``'s ``__main__`` block calls ``save_results`` (run_all.py too)."""
    import ast

    lacking = []
    for script in sorted((ROOT / "benchmarks").glob("bench_*.py")) + [
        ROOT / "benchmarks" / "run_all.py"
    ]:
        tree = ast.parse(script.read_text("utf-8"))
        mains = [
            node
            for node in tree.body
            if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)
        ]
        where = mains if script.name.startswith("bench_") else tree.body
        calls = {
            n.func.id
            for m in where
            for n in ast.walk(m)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
        }
        if "save_results" not in calls:
            lacking.append(script.name)
    assert not lacking, f"benchmarks that do not save their results: {lacking}"
