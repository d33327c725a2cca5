"""The benchmarks' figures in the documentation, made at build time from their result files.

Each benchmark writes its rows to ``benchmarks/results/<line>/<name>.json`` (``line``:
``python3.11``, ``python3.12``, one per supported line; ``save_results`` in
``benchmarks/_common.py``), with the command that ran it, the date, the machine and the
versions.  Nothing on the performance page is copied from a terminal by hand:

.. code-block:: rst

   .. benchmark-results:: p1
      :metrics:
         dasktensor call
         raw echo

writes a table of benchmark ``p1``'s rows (``run_all.py``'s short names), a column per
supported line, with each row's target and whether it was met, and under it each line's
date, command and load; without ``:metrics:`` every row the files have.  ``:options:
--gpu`` shows the run with those options instead of the default run.

.. code-block:: rst

   .. benchmark-machines::

describes the machine(s) the result files were measured on, once, and the role
``{result}`p1:dasktensor call``` (MyST; ``:result:`` in reStructuredText) puts one row's
value into prose, as the table prints it; ``p1@3.11:...`` takes the 3.11 line's (the
newest line's by default), ``p27[--gpu]:...`` a run with options.  A row no file has is
shown as "not measured on this line" (the build does not fail); ``tests/test_doc_figures.py``
fails instead, and also when a page states a timing that no result file has, using the
plain functions below.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterator, Sequence
from functools import cache
from pathlib import Path

from docutils import nodes
from sphinx.util.docutils import SphinxDirective, SphinxRole

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
RESULTS = BENCHMARKS / "results"
#: the supported lines, oldest first: the tables' columns
LINES = ("python3.11", "python3.12")
NOT_MEASURED = "not measured on this line"


# ----------------------------------------------------------------------------- loading


@cache
def benchmark_names() -> dict[str, str]:
    """``{short name: result name}`` from ``run_all.py``'s ``BENCHMARKS``
    (``"p1": "p1-latency"``; the module ``bench_p1_latency`` saves as ``p1-latency``)."""
    tree = ast.parse((BENCHMARKS / "run_all.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "BENCHMARKS":
            modules = ast.literal_eval(node.value)
            return {k: m.removeprefix("bench_").replace("_", "-") for k, m in modules.items()}
    raise ValueError("run_all.py has no BENCHMARKS")


def options_slug(options: Sequence[str]) -> str:
    """As ``_common._options_slug``: ``["--rows", "1000"]`` -> ``rows-1000``."""
    text = "-".join(a.lstrip("-") for a in options)
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)


def result_file(key: str, line: str, options: Sequence[str] = ()) -> Path:
    """The result file of benchmark ``key`` (``p1``) on ``line`` (``python3.12``)."""
    names = benchmark_names()
    if key not in names:
        raise KeyError(f"no benchmark {key!r} in benchmarks/run_all.py (one of {sorted(names)})")
    stem = names[key] + (f"--{options_slug(options)}" if options else "")
    return RESULTS / line / f"{stem}.json"


def load_result(key: str, line: str, options: Sequence[str] = ()) -> dict | None:
    """The saved run of benchmark ``key`` on ``line``, or None when there is none."""
    path = result_file(key, line, options)
    if not path.exists():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def all_results() -> Iterator[tuple[str, dict]]:
    """``(line, record)`` of every result file, default runs and runs with options."""
    for path in sorted(RESULTS.glob("*/*.json")):
        yield path.parent.name, json.loads(path.read_text(encoding="utf-8"))


def find_row(record: dict | None, metric: str) -> dict | None:
    if record is None:
        return None
    return next((r for r in record["rows"] if r["metric"] == metric), None)


# ----------------------------------------------------------------------------- formatting


def value_text(row: dict) -> str:
    """A row's measured value as the benchmark printed it (``44.7 µs``, ``1.935``)."""
    return row["measured_text"].replace(" us", " µs")


def target_text(row: dict) -> str:
    return "" if row["target"] is None else row["target_text"].replace(" us", " µs")


def line_label(line: str, record: dict | None = None) -> str:
    """``Python 3.12 / PyMC 6.4.0 / PyTensor 3.3.0``, or ``Python 3.12`` with no record."""
    text = "Python " + line.removeprefix("python")
    if record:
        v = record["versions"]
        text += f" / PyMC {v.get('pymc', '?')} / PyTensor {v.get('pytensor', '?')}"
    return text


def machine_text(record: dict) -> str:
    m = record["machine"]
    return f"{m['cpu']}, {m['logical_cores']} logical cores, {m['memory_gib']} GiB, {m['os']}"


def run_text(line: str, record: dict | None) -> str:
    """One line under a table: when and how a line's figures were measured."""
    if record is None:
        return f"{line_label(line)}: {NOT_MEASURED}."
    m = record["machine"]
    v = record["versions"]
    return (
        f"{line_label(line)}: ``{record['command']}``, {record['date_utc'][:10]}, "
        f"load {m['load_avg_1min_before']} → {m['load_avg_1min_after']} "
        f"(Dask {v.get('dask', '?')}, NumPy {v.get('numpy', '?')})."
    )


def parse_reference(text: str) -> tuple[str, str | None, tuple[str, ...], str]:
    """``p27@3.11[--gpu]:metric`` -> ``("p27", "python3.11", ("--gpu",), "metric")``."""
    match = re.fullmatch(r"\s*(\w+)(?:@([\d.]+))?(?:\[([^\]]*)\])?:(.+)", text, re.S)
    if not match:
        raise ValueError(f"not a result reference: {text!r} (expected 'p1:metric')")
    key, line, options, metric = match.groups()
    return (
        key,
        f"python{line}" if line else None,
        tuple(options.split()) if options else (),
        " ".join(metric.split()),
    )


def resolve(text: str) -> tuple[str, dict | None]:
    """A role's reference -> (its line, the row or None)."""
    key, line, options, metric = parse_reference(text)
    line = line or LINES[-1]
    return line, find_row(load_result(key, line, options), metric)


# ----------------------------------------------------------------------------- pages

#: a number with a time unit, a speed-up ratio, or a rate in calls/s
TIMING = re.compile(
    r"(?<![\w.])(?:~|≈)?\d[\d,]*(?:\.\d+)?(?:\s?(?:µs|us|ms|s)(?![\w/])|x(?!\w)|×|\s?calls/s)"
)
_CODE_SPAN = re.compile(r"(`+).*?\1")
_LINK_TARGET = re.compile(r"\]\([^)]*\)")


def prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of a Markdown page outside fenced blocks and directives,
    with inline code, roles and link targets removed."""
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.lstrip()
        if fence:
            if stripped.startswith(fence):
                fence = None
            continue
        match = re.match(r"(```+|~~~+|:::+)", stripped)
        if match:
            fence = match.group(1)
            continue
        yield number, _LINK_TARGET.sub("]", _CODE_SPAN.sub(" ", line))


def timing_literals(text: str) -> Iterator[tuple[int, str]]:
    """Every timing a page states in its prose: ``(line number, literal)``."""
    for number, line in prose_lines(text):
        for match in TIMING.finditer(line):
            yield number, match.group(0)


def roles(text: str) -> Iterator[tuple[int, str]]:
    """``(line number, reference)`` of every ``{result}`` role on a Markdown page."""
    for number, line in enumerate(text.splitlines(), 1):
        for match in re.finditer(r"\{result\}`([^`]+)`", line):
            yield number, match.group(1)


def normalized(literal: str) -> str:
    text = literal.lstrip("~≈").replace(",", "").replace(" ", "").replace("×", "x")
    return text.replace("us", "µs")


def row_literals(row: dict) -> set[str]:
    """The ways a page may state a row's value: as the table prints it, with the unit the
    row's metric names ("(s)", "calls/s") or, for a plain number, as a ratio (``1.935x``)."""
    value = value_text(row)
    found = {normalized(value)}
    if not row["unit"]:
        metric = row["metric"]
        if "(s)" in metric:
            found.add(normalized(value + " s"))
        if "calls/s" in metric or "requests/s" in metric:
            found.add(normalized(value + " calls/s"))
        found.add(normalized(value + "x"))
    return found


def measured_literals() -> set[str]:
    """Every literal :func:`row_literals` allows, over every result file."""
    return {t for _, record in all_results() for row in record["rows"] for t in row_literals(row)}


# ----------------------------------------------------------------------------- Sphinx


def _metrics(record_by_line: dict[str, dict | None], wanted: list[str]) -> list[str]:
    if wanted:
        return wanted
    seen: dict[str, None] = {}
    for record in record_by_line.values():
        for row in (record or {}).get("rows", []):
            seen.setdefault(row["metric"], None)
    return list(seen)


def table_cells(
    key: str, metrics: list[str], options: Sequence[str] = ()
) -> tuple[list[str], list[list[str]], list[str]]:
    """A benchmark's table as text: its header, its rows (metric, target, then value and
    met? for each line; ``NOT_MEASURED`` where a line has no such row) and one line per
    supported line saying how its figures were measured (:func:`run_text`)."""
    records = {line: load_result(key, line, options) for line in LINES}
    metrics = _metrics(records, metrics)
    header = ["metric", "target"]
    for line in LINES:
        header += [line_label(line, records[line]), "met?"]
    body = []
    for metric in metrics:
        rows = {line: find_row(records[line], metric) for line in LINES}
        target = next((target_text(r) for r in rows.values() if r), "")
        cells = [metric, target or "(info)"]
        for line in LINES:
            row = rows[line]
            cells += [value_text(row), row["met"]] if row else [NOT_MEASURED, ""]
        body.append(cells)
    return header, body, [run_text(line, records[line]) for line in LINES]


def _entry(text: str) -> nodes.entry:
    entry = nodes.entry()
    if text == NOT_MEASURED:
        entry += nodes.paragraph("", "", nodes.emphasis(text=text))
    else:
        entry += nodes.paragraph(text=text)
    return entry


def _row(cells: list[str]) -> nodes.row:
    row = nodes.row()
    for text in cells:
        row += _entry(text)
    return row


def _with_literals(text: str) -> nodes.paragraph:
    """A paragraph of ``text`` whose double-backquoted parts are inline literals."""
    para = nodes.paragraph()
    for i, part in enumerate(text.split("``")):
        if part:
            para += nodes.literal(text=part) if i % 2 else nodes.Text(part)
    return para


def table_nodes(key: str, metrics: list[str], options: Sequence[str] = ()) -> list[nodes.Node]:
    header, body, runs = table_cells(key, metrics, options)
    table = nodes.table(classes=["benchmark-results"])
    group = nodes.tgroup(cols=len(header))
    table += group
    for i in range(len(header)):
        group += nodes.colspec(colwidth=4 if i == 0 else 1)
    head = nodes.thead()
    head += _row(header)
    group += head
    rows = nodes.tbody()
    for cells in body:
        rows += _row(cells)
    group += rows
    under = nodes.container(classes=["benchmark-runs"])
    for text in runs:
        under += _with_literals(text)
    return [table, under]


class ResultsDirective(SphinxDirective):
    """``.. benchmark-results:: p1``: a benchmark's rows, a column per supported line."""

    required_arguments = 1
    option_spec = {"metrics": str, "options": str}

    def run(self):
        key = self.arguments[0]
        options = tuple((self.options.get("options") or "").split())
        for line in LINES:
            self.env.note_dependency(str(result_file(key, line, options)))
        metrics = [" ".join(m.split()) for m in (self.options.get("metrics") or "").splitlines()]
        metrics = [m for m in metrics if m]
        return table_nodes(key, metrics, options)


class MachinesDirective(SphinxDirective):
    """``.. benchmark-machines::``: the machines and versions of the result files."""

    def run(self):
        seen: dict[str, list[str]] = {}
        dates: dict[str, list[str]] = {}
        for line, record in all_results():
            seen.setdefault(machine_text(record), [])
            if line not in seen[machine_text(record)]:
                seen[machine_text(record)].append(line)
            dates.setdefault(line, []).append(record["date_utc"][:10])
        for path in RESULTS.glob("*/*.json"):
            self.env.note_dependency(str(path))
        items = nodes.bullet_list()
        for text, lines in seen.items():
            labels = ", ".join(line_label(line) for line in sorted(lines))
            para = nodes.paragraph(text=f"{text} ({labels})")
            items += nodes.list_item("", para)
        for line in LINES:
            records = [r for ln, r in all_results() if ln == line]
            if records:
                v = records[0]["versions"]
                what = ", ".join(f"{k} {v[k]}" for k in v)
                span = f"{min(dates[line])} to {max(dates[line])}"
                text = f"{line_label(line)}: {what}; measured {span}."
            else:
                text = f"{line_label(line)}: {NOT_MEASURED}."
            items += nodes.list_item("", nodes.paragraph(text=text))
        return [items]


class ResultRole(SphinxRole):
    """``{result}`p1:dasktensor call```: one row's value, as its table prints it."""

    def run(self):
        line, row = resolve(self.text)
        key, _, options, _ = parse_reference(self.text)
        self.env.note_dependency(str(result_file(key, line, options)))
        if row is None:
            return [nodes.emphasis(text=f"({NOT_MEASURED})")], []
        node = nodes.inline(text=value_text(row), classes=["benchmark-result"])
        return [node], []


def setup(app):
    app.add_directive("benchmark-results", ResultsDirective)
    app.add_directive("benchmark-machines", MachinesDirective)
    app.add_role("result", ResultRole())
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
