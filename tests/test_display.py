"""What Jupyter shows of dasktensor's objects: the drawn plan, and the models on a cluster.

The plan's picture is read back as XML (``xml.etree``: an unescaped name would not parse):
one box per task with the task's dashboard name, one edge per dependency, colours by where
tasks run.  Headless Chromium renders it (``_browser.py``) to check what the text can't:
every text fits in its box and no boxes overlap; that screenshot is how ``docs/plan.png``
is made (``$DASKTENSOR_SCREENSHOT_DIR``).  Remote models and the cluster summary are
asked on a real cluster of worker processes.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import os
import shutil
import xml.etree.ElementTree as ET

import dask
import numpy as np
import pytensor.tensor as pt
import pytest
from _browser import browser_page, chromium_or_skip
from dask.utils import key_split

import dasktensor as dt
from dasktensor._display import COLOURS, plan_html
from dasktensor.cluster import scheduler_workers
from dasktensor.engine._plan import Plan

SVG = "{http://www.w3.org/2000/svg}"
CALLER_ROLES = {"before", "beside", "after"}


def quickstart():
    """The README's quickstart function: four annotated branches and a sum."""
    x = pt.matrix("x", shape=(300, 300))
    branches = []
    for k in range(4):
        with dt.annotate(name="branch", retries=1):
            h = x * (k + 1)
            for _ in range(5):
                h = pt.tanh(h @ x)
        branches.append(h.sum())
    return dt.function([x], sum(branches))


class Site:
    """A remote model's class, for Ops (plans are made without calling it)."""

    def logp_grad(self, params):
        return -0.5 * float(params @ params), -params


def all_three_colours():
    """A function with caller stages, a cluster task and remote-model calls."""
    models = [dt.RemoteModel(Site, name=f"site-{s}") for s in "ab"]
    p = pt.dvector("p")
    with dt.annotate(name="physics"):
        heavy = pt.exp(p * 2)
    calls = sum(m.logp_grad_op("logp_grad", [pt.dvector])(pt.exp(p))[0] for m in models)
    return dt.function([p], [calls + heavy.sum(), calls * 2 + p.sum()])


def tasks_of(svg: str) -> dict[int, ET.Element]:
    root = ET.fromstring(svg)
    return {int(g.get("data-index")): g for g in root.iter(f"{SVG}g") if g.get("class") == "task"}


def texts(box: ET.Element) -> list[str]:
    return [t.text for t in box.iter(f"{SVG}text")]


def expected_colour(task) -> str:
    return "caller" if task.role in CALLER_ROLES else task.role


def test_one_box_per_task_named_as_on_the_dashboard():
    f = quickstart()
    boxes = tasks_of(f.plan._repr_svg_())
    assert sorted(boxes) == [t.index for t in f.plan.tasks]
    names = {i: texts(box)[0] for i, box in boxes.items()}
    assert names == {t.index: t.name for t in f.plan.tasks}
    # the names the task stream shows: the key prefixes of one call's Dask graph (its
    # tasks, and the output picked from the last one)
    graph = f.to_dask(np.zeros((300, 300))).__dask_graph__()
    on_dashboard = {key_split(k) for k in graph} - {"output"}
    assert set(names.values()) == on_dashboard, on_dashboard
    assert list(names.values()).count("branch") == 4


def test_an_edge_per_dependency_and_dependencies_drawn_left_of_their_tasks():
    for f in (quickstart(), all_three_colours()):
        root = ET.fromstring(f.plan._repr_svg_())
        edges = [p for p in root.iter(f"{SVG}path") if p.get("class") == "edge"]
        drawn = sorted((int(e.get("data-from")), int(e.get("data-to"))) for e in edges)
        assert drawn == sorted((d, t.index) for t in f.plan.tasks for d in t.deps)
        assert sum(p.get("class") == "arrow" for p in root.iter(f"{SVG}path")) == len(edges)
        rects = {
            i: [float(box.find(f"{SVG}rect").get(a)) for a in ("x", "y", "width", "height")]
            for i, box in tasks_of(f.plan._repr_svg_()).items()
        }
        for a, b in drawn:
            assert rects[a][0] + rects[a][2] < rects[b][0], (a, b, rects)
        for a in rects:  # no two boxes overlap
            for b in rects:
                xa, ya, w, h = rects[a]
                xb, yb = rects[b][:2]
                overlap = abs(xa - xb) < w and abs(ya - yb) < h
                assert a == b or not overlap, (a, b, rects)


def test_boxes_are_coloured_by_where_their_task_runs():
    f = all_three_colours()
    roles = {t.index: t.role for t in f.plan.tasks}
    assert {"remote", "cluster"} <= set(roles.values()) and CALLER_ROLES & set(roles.values())
    for t in f.plan.tasks:
        box = tasks_of(f.plan._repr_svg_())[t.index]
        rect = box.find(f"{SVG}rect")
        want = expected_colour(t)
        assert box.get("data-colour") == want
        assert (rect.get("fill"), rect.get("stroke")) == COLOURS[want], (t.name, t.role)
    assert len(set(COLOURS.values())) == 3
    # the legend names exactly the colours used
    legend = [
        r.get("data-colour")
        for r in ET.fromstring(f.plan._repr_svg_()).iter(f"{SVG}rect")
        if r.get("class") == "legend"
    ]
    assert legend == ["caller", "cluster", "remote"]
    v = pt.vector("v")
    single = ET.fromstring(dt.function([v], pt.exp(v).sum()).plan._repr_svg_())
    legend = [
        r.get("data-colour") for r in single.iter(f"{SVG}rect") if r.get("class") == "legend"
    ]
    assert legend == ["caller"]


def test_box_says_what_the_task_is_and_its_placement():
    f = quickstart()
    lines = texts(tasks_of(f.plan._repr_svg_())[0])
    assert lines == ["branch", "heavy on cluster, 1 node", "retries=1"]
    stage = f.plan.tasks[-1]
    assert texts(tasks_of(f.plan._repr_svg_())[stage.index])[1] == (
        f"stage on caller, after, {len(stage.nodes)} nodes"
    )


def test_names_and_reasons_are_escaped():
    f = quickstart()
    odd = 'a<b>&"c'
    tasks = tuple(
        dataclasses.replace(t, name=odd, reason="x < y & z") if t.index == 0 else t
        for t in f.plan.tasks
    )
    plan = Plan(fgraph=f.plan.fgraph, tasks=tasks, sharding="sharded: <never> & always")
    svg = plan._repr_svg_()
    assert texts(tasks_of(svg)[0])[0] == odd  # parsed back: escaped in the XML
    assert "a<b>" not in svg and "a&lt;b&gt;&amp;" in svg
    html = plan._repr_html_()
    assert "a<b>" not in html and "a&lt;b&gt;&amp;&quot;c" in html  # table and alt text
    assert "x &lt; y &amp; z" in html
    assert "<never>" not in html and "&lt;never&gt; &amp; always" in html


def test_html_holds_the_picture_and_the_table_of_tasks():
    f = quickstart()
    html = f.plan._repr_html_()
    # the picture as an image: what JupyterLab keeps of an untrusted notebook's HTML
    assert "<svg" not in html and html.count("<img") == 1
    src = html.split('<img src="')[1].split('"')[0]
    assert src.startswith("data:image/svg+xml;base64,")
    assert base64.b64decode(src.split(",", 1)[1]).decode() == f.plan._repr_svg_()
    assert 'alt="the plan&#x27;s 5 task(s): branch, branch, branch, branch, stage-' in html
    inline = plan_html(f.plan, inline=True)
    assert "<img" not in inline and f.plan._repr_svg_() in inline
    rows = html.split("<tbody>")[1].split("</tbody>")[0].count("<tr")
    assert rows == len(f.plan.tasks)
    assert "not sharded" in html  # the plan's sharding line
    # str() and repr() are still the text of describe()
    assert str(f.plan) == repr(f.plan) == f.plan.describe()


def test_visualize_writes_svg_or_html_and_returns_the_picture(tmp_path):
    from IPython.display import SVG as IPythonSVG

    plan = quickstart().plan
    shown = plan.visualize()
    assert isinstance(shown, IPythonSVG)
    assert tasks_of(shown.data).keys() == tasks_of(plan._repr_svg_()).keys()
    assert not list(tmp_path.iterdir())  # no filename, no file

    plan.visualize(tmp_path / "plan")  # no extension: SVG
    assert len(tasks_of((tmp_path / "plan.svg").read_text())) == len(plan.tasks)
    plan.visualize(str(tmp_path / "plan.html"))
    page = (tmp_path / "plan.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page and "<table>" in page
    plan.visualize(tmp_path / "picture.txt", format="svg")
    assert (tmp_path / "picture.txt").read_text().startswith("<svg")
    with pytest.raises(ValueError, match="expected format 'svg' or 'html', got 'png'"):
        plan.visualize(tmp_path / "plan.png")
    assert not (tmp_path / "plan.png").exists()


# ----------------------------------------------------------------------------- models


class Scaled:
    def __init__(self, factor):
        self.factor = factor

    def scale(self, x):
        return x * self.factor


def model_rows(html: str) -> dict[str, tuple[str, list[str]]]:
    """``{worker name: (row class, cells)}`` of a model's HTML table (read as XML)."""
    table = ET.fromstring(html[html.index("<table>") : html.index("</table>") + 8])
    rows = table.find("tbody").findall("tr")
    return {r[0].text: (r.get("class"), [td.text for td in r]) for r in rows}


@pytest.mark.slow
def test_remote_model_html_lists_the_workers_holding_replicas(client):
    import functools

    workers = {a: str(w["name"]) for a, w in scheduler_workers(client).items()}
    model = dt.RemoteModel(
        functools.partial(Scaled, 2.0), name="scaled", replicas=1, retries=1, scheduler=client
    )
    other = dt.RemoteModel(functools.partial(Scaled, 3.0), name="tripled", scheduler=client)
    try:
        (holder,) = model.start()
        other.start()
        for k in range(5):
            assert model.call("scale", float(k)) == 2.0 * k
        html = model._repr_html_()
        assert "<b>RemoteModel scaled</b>" in html and "retries 1" in html
        rows = model_rows(html)
        assert set(rows) == set(workers.values())
        assert {n for n, (cls, _) in rows.items() if cls == "holds"} == {workers[holder]}
        cls, cells = rows[workers[holder]]
        assert cells[1:5] == ["yes", "1", "5", "0"]  # holds, builds, calls, errors
        assert "held by 1 of 2 worker(s), 5 call(s) answered so far" in html
        for name, (_, cells) in rows.items():
            if name != workers[holder]:
                assert cells[1:4] == ["no", "0", "0"]

        summary = dt.cluster_summary(client)
        assert {w.name for w in summary.workers} == set(workers.values())
        by_name = {r[0]: r for r in summary.rows()}
        assert by_name[workers[holder]][1] == "scaled, tripled"
        assert "scaled: 5" in by_name[workers[holder]][2]
        assert "tripled" in str(summary) and "<table>" in summary._repr_html_()
        assert repr(summary) == str(summary) and holder not in repr(summary)  # no addresses
    finally:
        model.close()
        other.close()
    rows = model_rows(model._repr_html_())  # released: no worker holds it any more
    assert {cls for cls, _ in rows.values()} == {"other"}


def test_remote_model_html_without_a_cluster_says_why():
    model = dt.RemoteModel(Site, name="lonely", resources={"GPU": 1})
    with dask.config.set(scheduler="sync"):
        html = model._repr_html_()
    assert "<b>RemoteModel lonely</b>" in html and "resources GPU=1" in html
    assert "cluster not reachable (RemoteModelError" in html and "dt.connect()" in html


# ----------------------------------------------------------------------------- in a browser

FITS_JS = r"""
(() => Array.from(document.querySelectorAll("svg.dasktensor-plan g.task")).map((g) => {
  const rect = g.querySelector("rect").getBBox();
  const widest = Math.max(...Array.from(g.querySelectorAll("text")).map((t) => {
    const b = t.getBBox();
    return b.x + b.width;
  }));
  return {name: g.querySelector("text").textContent, right: rect.x + rect.width, widest};
}))()
"""
SVG_BOX_JS = r"""
(() => { const r = document.querySelector("svg.dasktensor-plan").getBoundingClientRect();
         return {x: r.left, y: r.top, width: r.width, height: r.height}; })()
"""


async def render(chromium: str, page_url: str):
    """Each task box's name, right edge and widest text in a 1000 x 700 page; a PNG of the plan."""
    async with browser_page(chromium, 1000, 700) as page:
        await page.goto(page_url)
        await page.evaluate("document.fonts.ready.then(() => null)")  # the text's own font
        boxes = await page.evaluate(FITS_JS)
        clip = await page.evaluate(SVG_BOX_JS)
        return boxes, await page.screenshot(clip=clip)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_drawn_plan_in_a_browser_keeps_its_text_inside_the_boxes(tmp_path):
    chromium = chromium_or_skip()
    plan = quickstart().plan
    plan.visualize(tmp_path / "plan.html")
    boxes, png = asyncio.run(
        asyncio.wait_for(render(chromium, (tmp_path / "plan.html").as_uri()), 60)
    )
    (tmp_path / "plan.png").write_bytes(png)
    if os.environ.get("DASKTENSOR_SCREENSHOT_DIR"):
        shutil.copy(tmp_path / "plan.png", os.environ["DASKTENSOR_SCREENSHOT_DIR"])
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    assert [b["name"] for b in boxes] == [t.name for t in plan.tasks]
    for b in boxes:
        assert b["widest"] <= b["right"] - 2, b
