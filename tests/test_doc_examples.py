"""Every Python example of the documentation runs, as a reader would run it.

A page's Python blocks (```` ```python ```` fences in ``README.md`` and the Markdown pages
of ``docs/``) are run in order in one interpreter, as a notebook runs its cells: each page
becomes one script, run in a subprocess of this interpreter (``python PAGE.py``, so that
its ``if __name__ == "__main__":`` guards hold and spawned workers re-import it as they
would a reader's script), in a temporary directory, with a timeout.

The script keeps the page's line numbers (the lines between blocks are left blank), so a
failure names the page and the line, e.g. ``docs/user-guide/umbridge.md, line 73``.

A block that cannot run here (a command for a real cluster, certificates, a queue)
starts with a comment line ``# not run: <why>``; the reason shows on the page, and the
block is left out of the script.  ``docs/contributing.md`` documents the convention.

Some pages first start something in a shell, as their reader would: those commands are
in ``SHELL``, and run before the page's script (and stopped after it).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from _clusters import free_port

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

#: the mark of a block left out, and the reason it must give
NOT_RUN = re.compile(r"^\s*# not run: (?P<why>\S.*)$")
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<info>.*)$")

#: pages whose blocks are not run, and why (the blocks that need a GPU are marked
#: '# not run' on the GPU page itself; its other blocks run here)
SKIPPED: dict[str, str] = {}

#: what a page's reader starts in a shell before its Python blocks (run from the repository
#: root; stopped when the page's script ends), and the port the page has it serve.  The
#: test serves on a free port instead ("{port}" in the command, the page's ":PORT" in its
#: script), so that two runs of the suite at once (CI's two Python lines) do not meet there
SHELL = {
    "docs/user-guide/umbridge.md": (
        [sys.executable, "docs/examples/decay_server.py", "{port}"],
        4242,
    ),
}

#: seconds a page's script may take (the embedded clusters, sampling, compiling)
TIMEOUT = 300


@dataclass
class Block:
    line: int  # the page's line of the block's first line of code (1-based)
    code: list[str]
    why_not_run: str | None


def python_blocks(text: str) -> list[Block]:
    """The page's ```` ```python ```` blocks, in order (code dedented by the fence's)."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, indent, info = m["fence"], len(m["indent"]), m["info"].strip()
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        if info in ("python", "py", "{code-block} python", "{code-cell} python"):
            code = [line[indent:] for line in lines[i + 1 : end]]
            while code and code[0].lstrip().startswith(":"):  # a directive's options
                code = [""] + code[1:]
            first = next((line for line in code if line.strip()), "")
            why = NOT_RUN.match(first)
            blocks.append(Block(i + 2, code, why["why"] if why else None))
        i = end + 1
    return blocks


def pages() -> list[str]:
    found = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
    found = [p for p in found if "_build" not in p.parts and "generated" not in p.parts]
    return [str(p.relative_to(ROOT)) for p in found]


def script_of(text: str) -> str | None:
    """A page's runnable blocks as one script whose line N is the page's line N."""
    run = [b for b in python_blocks(text) if b.why_not_run is None]
    if not run:
        return None
    lines: list[str] = []
    for block in run:
        lines += [""] * (block.line - 1 - len(lines))
        lines += block.code
    return "\n".join(lines) + "\n"


def _where(page: str, script: Path, output: str) -> str:
    """The page's line of the innermost frame of the script in a traceback."""
    frames = re.findall(rf'File "[^"]*{re.escape(script.name)}", line (\d+)', output)
    return f"{page}, line {frames[-1]}" if frames else page


def _wait_for_port(port: int, process: subprocess.Popen, page: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"{page}: the server {process.args} exited ({process.returncode})")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGTERM)
    pytest.fail(f"{page}: the server {process.args} did not listen on {port} within 60 s")


PAGES = pages()
WITH_CODE = [p for p in PAGES if any(python_blocks((ROOT / p).read_text(encoding="utf-8")))]


def test_the_pages_with_python_blocks_are_found():
    assert "README.md" in WITH_CODE and "docs/getting-started.md" in WITH_CODE
    assert len(WITH_CODE) >= 12, WITH_CODE


@pytest.mark.parametrize("page", WITH_CODE)
def test_every_block_left_out_says_why(page):
    for block in python_blocks((ROOT / page).read_text(encoding="utf-8")):
        first = next((line for line in block.code if line.strip()), "")
        if "not run" in first.lower():
            assert block.why_not_run, (
                f"{page}, line {block.line}: a block left out starts with "
                f"'# not run: <why>', got {first.strip()!r}"
            )


def test_blocks_left_out_are_few():
    """Fragments are rare: most blocks run."""
    blocks = [b for p in WITH_CODE for b in python_blocks((ROOT / p).read_text("utf-8"))]
    left_out = [b for b in blocks if b.why_not_run]
    assert len(left_out) * 4 <= len(blocks), f"{len(left_out)} of {len(blocks)} not run"


def run_page(page: str, text: str, tmp_path: Path, timeout: float = TIMEOUT) -> str | None:
    """Run the page's script (``text`` is the page's Markdown); ``None`` if it ran, else
    what failed, starting with the page and the line."""
    source = script_of(text)
    if source is None:
        return None
    if page in SHELL:
        command, page_port = SHELL[page]
        port = free_port()
        command = [part.format(port=port) for part in command]
        source = source.replace(f":{page_port}", f":{port}")
    script = tmp_path / (page.replace("/", "__") + ".py")
    script.write_text(source, encoding="utf-8")
    env = dict(os.environ)
    # docs/examples holds the modules the pages import (lotka_volterra); the workers
    # the pages start inherit the path
    env["PYTHONPATH"] = os.pathsep.join(
        [str(DOCS / "examples"), *filter(None, [env.get("PYTHONPATH")])]
    )
    env["MPLBACKEND"] = "Agg"
    env.pop("DASK_SCHEDULER_ADDRESS", None)
    shell = None
    if page in SHELL:
        shell = subprocess.Popen(command, cwd=ROOT, env=env, start_new_session=True)
        _wait_for_port(port, shell, page)
    try:
        run = subprocess.run(
            [sys.executable, script.name],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as e:
        out = [
            (o.decode(errors="replace") if isinstance(o, bytes) else o) or ""
            for o in (e.stdout, e.stderr)
        ]
        return f"{page}: did not finish within {timeout} s\n{out[0][-3000:]}\n{out[1][-3000:]}"
    finally:
        if shell is not None:
            os.killpg(shell.pid, signal.SIGTERM)
            shell.wait(timeout=30)
    output = run.stdout + run.stderr
    if run.returncode == 0:
        return None
    return (
        f"{_where(page, script, output)}: the page's example failed "
        f"(exit status {run.returncode})\n{output[-6000:]}"
    )


def test_a_failure_names_the_page_and_the_line(tmp_path):
    page = """# A page

```python
import math
x = 1
```

Some text, then a block left out:

```python
# not run: needs a cluster
y = undefined_too
```

```python
if __name__ == "__main__":
    print(math.sqrt(x))
    z = undefined
```
"""
    assert [b.line for b in python_blocks(page)] == [4, 11, 16]
    failure = run_page("docs/a-page.md", page, tmp_path, timeout=60)
    assert failure is not None and failure.startswith("docs/a-page.md, line 18:"), failure
    assert "NameError: name 'undefined' is not defined" in failure
    assert run_page("docs/a-page.md", page.replace("z = undefined", "pass"), tmp_path) is None


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT + 60)
@pytest.mark.parametrize("page", WITH_CODE)
def test_the_page_runs(page, tmp_path):
    if page in SKIPPED:
        pytest.skip(f"{page}: {SKIPPED[page]}")
    text = (ROOT / page).read_text(encoding="utf-8")
    if script_of(text) is None:
        pytest.skip(f"{page}: every block is marked '# not run'")
    failure = run_page(page, text, tmp_path)
    if failure:
        pytest.fail(failure, pytrace=False)
