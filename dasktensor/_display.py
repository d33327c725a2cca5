"""Pictures for Jupyter: a plan drawn as SVG, and the HTML around it.

A notebook shows an object through its ``_repr_html_`` / ``_repr_svg_``.  The plan of a
compiled function (``f.plan``) draws itself with :func:`plan_svg`: one box per task, named
as on the dashboard (``task.name``, the prefix of its Dask keys), coloured by where it runs
(stages on the caller, tasks on the cluster's workers, remote-model calls made from the
caller), with an arrow per dependency.  ``Plan.visualize`` writes the same picture to a
file, as ``dask.visualize`` does for a Dask graph.

The layout is drawn here rather than by graphviz: plans have a handful of tasks, and a
layered drawing (a column per dependency depth, left to right; within a column, tasks
ordered by the mean height of what they depend on) takes a few dozen lines, gives the
same picture every time and needs nothing installed.  An edge that skips columns goes
round them, above or below.  Box widths come from the text's length in a monospace font.

This module imports nothing from dasktensor, so that the modules it serves (``_plan``,
``remote._summary``) can import it.
"""

from __future__ import annotations

import base64
import dataclasses
import math
import os
from collections import Counter
from html import escape

#: fill and stroke of a task's box, by where it runs
COLOURS = {
    "caller": ("#dbe9f6", "#3a7ebf"),
    "cluster": ("#fde3c8", "#d9661a"),
    "remote": ("#d6efd0", "#2e8b3a"),
}
LEGEND = {
    "caller": "caller: stages in this process",
    "cluster": "cluster: tasks on workers",
    "remote": "remote: model calls from the caller",
}
_FONT = "DejaVu Sans Mono, Menlo, Consolas, monospace"
# advance of a character of this monospace font at 12 px (names) and 11 px (details),
# rounded up: a box is never narrower than its text
_CHAR, _SMALL_CHAR = 7.3, 6.7
_LINE, _PAD, _GAP_X, _GAP_Y, _TOP, _LEFT = 15, 8, 56, 14, 40, 12


def _colour(task) -> str:
    """``"caller"``, ``"cluster"`` or ``"remote"``: where a task runs, as coloured."""
    return "caller" if task.role in ("before", "beside", "after") else task.role


def _lines(task) -> list[str]:
    """What a task's box says: its name, what it is and where it runs, its placement."""
    nodes = f"{len(task.nodes)} node{'' if len(task.nodes) == 1 else 's'}"
    if task.role == "remote":
        where = "remote call from caller"
    elif task.where == "caller":
        where = f"on caller, {task.role}"
    else:
        where = "on cluster"
    placement = _placement_text(task.placement)
    return [task.name, f"{task.kind} {where}, {nodes}"] + ([placement] if placement else [])


def items(mapping: dict) -> list[str]:
    """``["GPU=1", ...]``: a mapping of resources as Dask's command line writes it."""
    return [f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in mapping.items()]


def _placement_text(placement) -> str:
    """``GPU=1, retries=2``: the options of a placement that differ from their defaults."""
    if not dataclasses.is_dataclass(placement):
        return ""
    shown = []
    for f in dataclasses.fields(placement):
        value = getattr(placement, f.name)
        if value == f.default:
            continue
        if isinstance(value, dict):
            shown.extend(items(value))
        elif isinstance(value, tuple | list):
            shown.append(f"{f.name}={','.join(map(str, value))}")
        else:
            shown.append(f"{f.name}={value}")
    return ", ".join(shown)


class _Layout:
    """Where every box goes (a column per dependency depth) and how edges run."""

    def __init__(self, plan):
        self.tasks = {t.index: t for t in plan.tasks}
        self.lines = {i: _lines(t) for i, t in self.tasks.items()}
        longest = max(
            (
                len(text) * (_CHAR if n == 0 else _SMALL_CHAR)
                for lines in self.lines.values()
                for n, text in enumerate(lines)
            ),
            default=0.0,
        )
        self.width = max(150.0, math.ceil(longest) + 2 * _PAD)
        rows = max((len(lines) for lines in self.lines.values()), default=2)
        self.height = float(rows * _LINE + 2 * _PAD)
        self.depth: dict[int, int] = {}
        for t in plan.tasks:  # in topological order
            self.depth[t.index] = 1 + max((self.depth[d] for d in t.deps), default=-1)
        self.columns: list[list[int]] = [
            [] for _ in range(max(self.depth.values(), default=0) + 1)
        ]
        for i, d in sorted(self.depth.items()):
            self.columns[d].append(i)
        tallest = max(len(c) for c in self.columns)
        self.area = tallest * (self.height + _GAP_Y) + _GAP_Y  # a gap above and below
        self.corners: dict[int, tuple[float, float]] = {}
        for c, column in enumerate(self.columns):
            column.sort(key=lambda i: (self._mean_dep_y(i), i))
            top = _TOP + (self.area - len(column) * (self.height + _GAP_Y) + _GAP_Y) / 2
            for r, i in enumerate(column):
                x = _LEFT + c * (self.width + _GAP_X)
                self.corners[i] = (x, top + r * (self.height + _GAP_Y))

    def _mean_dep_y(self, i: int) -> float:
        ys = [self.corners[d][1] for d in self.tasks[i].deps]
        return sum(ys) / len(ys) if ys else -1.0

    def entry(self, a: int, b: int) -> tuple[float, float]:
        """Where the edge from ``a`` meets ``b``'s box: edges spread down its left side, in
        the order of their sources' heights, so that they do not cross there."""
        deps = sorted(self.tasks[b].deps, key=lambda d: (self.corners[d][1], d))
        step = min(10.0, (self.height - 16) / max(len(deps) - 1, 1))
        x, y = self.corners[b]
        return x, y + self.height / 2 + (deps.index(a) - (len(deps) - 1) / 2) * step

    def edge_path(self, a: int, b: int) -> str:
        """An SVG path from the right side of task ``a``'s box to the left of ``b``'s."""
        xa, ya = self.corners[a]
        x1, y1 = xa + self.width, ya + self.height / 2
        x2, y2 = self.entry(a, b)
        x2 -= 6  # the arrowhead covers the last 6 px
        between = [i for c in self.columns[self.depth[a] + 1 : self.depth[b]] for i in c]
        if not between:
            c = (x2 - x1) / 2
            return f"M{x1:g},{y1:g} C{x1 + c:g},{y1:g} {x2 - c:g},{y2:g} {x2:g},{y2:g}"
        # round the columns in between: above their top box or below their bottom one
        above = min(self.corners[i][1] for i in between) - _GAP_Y / 2
        below = max(self.corners[i][1] for i in between) + self.height + _GAP_Y / 2
        yw = above if abs((y1 + y2) / 2 - above) <= abs(below - (y1 + y2) / 2) else below
        left = min(self.corners[i][0] for i in between) - _GAP_X / 4
        right = max(self.corners[i][0] for i in between) + self.width + _GAP_X / 4
        c1, c2 = (left - x1) / 2, (x2 - right) / 2
        return (
            f"M{x1:g},{y1:g} C{x1 + c1:g},{y1:g} {left - c1:g},{yw:g} {left:g},{yw:g} "
            f"L{right:g},{yw:g} C{right + c2:g},{yw:g} {x2 - c2:g},{y2:g} {x2:g},{y2:g}"
        )


def plan_svg(plan) -> str:
    """The plan drawn as an SVG picture: a box per task, an arrow per dependency.

    A box holds the task's name (its name on the dashboard), what it is and where it runs,
    and its placement; it is coloured by where it runs (see the legend).  Hovering a box
    shows why the planner made the task and its op types.

    Examples
    --------
    >>> import pytensor.tensor as pt
    >>> import dasktensor as dt
    >>> x = pt.vector("x")
    >>> with dt.annotate(name="heavy-part", retries=2):
    ...     y = pt.exp(x)
    >>> f = dt.function([x], y.sum())
    >>> svg = f.plan._repr_svg_()
    >>> svg.count('class="task"'), svg.count('class="edge"'), "heavy-part" in svg
    (2, 1, True)
    """
    lay = _Layout(plan)
    used = [k for k in COLOURS if any(_colour(t) == k for t in plan.tasks)]
    title = f"Plan: {len(plan.fgraph.apply_nodes)} nodes \u2192 {len(plan.tasks)} task(s)"
    x = _LEFT + len(title) * _CHAR + 30
    legend = []
    for k in used:
        fill, stroke = COLOURS[k]
        legend.append(
            f'<rect class="legend" data-colour="{k}" x="{x:g}" y="11" width="14" height="14" '
            f'rx="3" fill="{fill}" stroke="{stroke}"/>'
            f'<text x="{x + 20:g}" y="22" fill="#444">{escape(LEGEND[k])}</text>'
        )
        x += 20 + len(LEGEND[k]) * _CHAR + 24
    width = max(len(lay.columns) * (lay.width + _GAP_X) - _GAP_X + 2 * _LEFT, x)
    height = _TOP + lay.area
    out = [
        (
            f'<svg xmlns="http://www.w3.org/2000/svg" class="dasktensor-plan" '
            f'width="{width:g}" height="{height:g}" viewBox="0 0 {width:g} {height:g}" '
            f'font-family="{_FONT}" font-size="12">'
        ),
        f'<rect width="{width:g}" height="{height:g}" fill="#ffffff"/>',
        f'<text x="{_LEFT}" y="22" font-weight="bold" fill="#222">{escape(title)}</text>',
        *legend,
    ]
    for t in plan.tasks:
        for d in t.deps:
            tx, ty = lay.entry(d, t.index)
            out.append(
                f'<path class="edge" data-from="{d}" data-to="{t.index}" '
                f'd="{lay.edge_path(d, t.index)}" fill="none" stroke="#777" stroke-width="1.4"/>'
                f'<path class="arrow" d="M{tx:g},{ty:g} l-7,-4 l0,8 z" fill="#777"/>'
            )
    ran = getattr(plan, "ran", None) or {}
    out.extend(_box(t, lay, ran.get(t.index, ())) for t in plan.tasks)
    out.append("</svg>")
    return "\n".join(out)


def _box(task, lay: _Layout, ran: tuple[str, ...] = ()) -> str:
    x, y = lay.corners[task.index]
    colour = _colour(task)
    fill, stroke = COLOURS.get(colour, ("#eeeeee", "#888888"))
    ops = Counter(type(n.op).__name__ for n in task.nodes)
    tip = f"[{task.index}] {task.name}: {task.reason}\n" + ", ".join(
        f"{k} x{v}" if v > 1 else k for k, v in ops.most_common(6)
    )
    if ran:  # where it ran, once called on a cluster: workers and their devices
        tip += "\nran on: " + "; ".join(ran)
    texts = [
        f'<text x="{x + _PAD:g}" y="{y + _PAD + 11 + n * _LINE:g}" '
        + ('fill="#111" font-weight="bold">' if n == 0 else 'fill="#444" font-size="11">')
        + f"{escape(line)}</text>"
        for n, line in enumerate(lay.lines[task.index])
    ]
    return (
        f'<g class="task" data-index="{task.index}" data-role="{escape(task.role)}" '
        f'data-colour="{escape(colour)}"><title>{escape(tip)}</title>'
        f'<rect x="{x:g}" y="{y:g}" width="{lay.width:g}" height="{lay.height:g}" rx="5" '
        f'fill="{fill}" stroke="{stroke}" stroke-width="1.5"/>' + "".join(texts) + "</g>"
    )


def plan_html(plan, inline: bool = False) -> str:
    """The plan for Jupyter: the picture of :func:`plan_svg`, and its tasks as a table.

    The table, folded under the picture, holds what ``print(plan)`` prints: each task's
    name, kind, where it runs, nodes, dependencies, reason and placement (and, once the
    function was called on a cluster, the workers each cluster task ran on with their
    devices), and whether the function is split into data shards.

    The picture is an ``<img>`` of the SVG (a ``data:`` URI): JupyterLab sanitizes the HTML
    outputs of a notebook it does not trust (any notebook opened from a fresh clone) and
    drops inline ``<svg>`` elements, leaving their text run together; an image survives.
    ``inline=True`` puts the SVG itself in the page (its boxes' tooltips work there), for
    a page of one's own (``Plan.visualize("plan.html")``).

    Examples
    --------
    >>> import pytensor.tensor as pt
    >>> import dasktensor as dt
    >>> x = pt.vector("x")
    >>> page = dt.function([x], pt.exp(x).sum()).plan._repr_html_()
    >>> page.count('<img src="data:image/svg+xml;base64,'), page.count("<tr")  # 1 task
    (1, 2)
    """
    rows = [
        [
            str(t.index),
            t.name,
            t.kind,
            "remote call" if t.role == "remote" else f"on {t.where} ({t.role})",
            str(len(t.nodes)),
            ",".join(map(str, t.deps)) or "-",
            t.reason,
            _placement_text(t.placement) or "-",
        ]
        for t in plan.tasks
    ]
    head = ["#", "task", "kind", "runs", "nodes", "deps", "reason", "placement"]
    ran = getattr(plan, "ran", None) or {}
    if ran:
        head.append("ran on (worker: device)")
        for t, row in zip(plan.tasks, rows, strict=True):
            row.append("; ".join(ran.get(t.index, ())) or "-")
    notes = "".join(f"<p>{escape(line)}</p>" for line in (plan.sharding or "").splitlines())
    svg = plan_svg(plan)
    if not inline:
        alt = f"the plan's {len(plan.tasks)} task(s): " + ", ".join(t.name for t in plan.tasks)
        data = base64.b64encode(svg.encode()).decode()
        svg = f'<img src="data:image/svg+xml;base64,{data}" alt="{escape(alt)}"/>'
    return (
        f'<div class="dasktensor-plan">{svg}<details><summary>'
        f"{len(plan.tasks)} task(s), as <code>print(plan)</code> lists them</summary>"
        f"{table(head, rows)}{notes}</details></div>"
    )


def table(head: list[str], rows: list[list[str]], classes: list[str] | None = None) -> str:
    """An HTML table of text (escaped), each row of class ``classes[i]`` if given."""
    cell = '<{0} style="text-align:left">{1}</{0}>'
    body = "".join(
        (f'<tr class="{classes[n]}">' if classes else "<tr>")
        + "".join(cell.format("td", escape(c)) for c in row)
        + "</tr>"
        for n, row in enumerate(rows)
    )
    head_row = "".join(cell.format("th", escape(h)) for h in head)
    return f"<table><thead><tr>{head_row}</tr></thead><tbody>{body}</tbody></table>"


def visualize(plan, filename=None, format: str | None = None):
    """Draw the plan (as Jupyter shows it), and write it to ``filename`` if one is given.

    Like ``dask.visualize``, for the tasks of a compiled function rather than a Dask
    graph: a box per task, named as on the dashboard, coloured by where it runs, with
    an arrow per dependency.

    Parameters
    ----------
    filename : str or path-like, optional
        Where to write the picture; nothing is written without one.  A name without an
        extension gets ``.svg``.
    format : {"svg", "html"}, optional
        What to write: the SVG picture, or a page holding it and the table of tasks.
        By default, the filename's extension.

    Returns
    -------
    IPython.display.SVG or None
        The picture, which Jupyter displays; None where IPython is not installed (as
        ``dask.visualize`` returns).

    Examples
    --------
    >>> import os, tempfile
    >>> import pytensor.tensor as pt
    >>> import dasktensor as dt
    >>> x = pt.vector("x")
    >>> with dt.annotate(name="heavy-part"):
    ...     y = pt.exp(x)
    >>> f = dt.function([x], y.sum())
    >>> path = os.path.join(tempfile.mkdtemp(), "plan.svg")
    >>> _ = f.plan.visualize(path)
    >>> with open(path) as file:
    ...     file.read().count('class="task"')
    2
    """
    svg = plan_svg(plan)
    if filename is not None:
        filename = os.fspath(filename)
        extension = os.path.splitext(filename)[1]
        if not extension:
            filename += ".svg"
        format = format or extension[1:].lower() or "svg"
        if format not in ("svg", "html"):
            raise ValueError(
                f"Plan.visualize expected format 'svg' or 'html', got {format!r} (from "
                f"{filename!r}); for a PNG, open the SVG in a browser or convert it "
                "(`rsvg-convert plan.svg -o plan.png`)"
            )
        text = svg if format == "svg" else _page(plan_html(plan, inline=True))
        with open(filename, "w", encoding="utf-8") as file:
            file.write(text)
    try:
        from IPython.display import SVG
    except ImportError:
        return None
    return SVG(data=svg)


def _page(body: str) -> str:
    return (
        '<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>dasktensor plan</title>'
        "<style>body{font-family:sans-serif;margin:1em} td,th{padding:2px 8px}</style>"
        f"</head><body>{body}</body></html>\n"
    )
