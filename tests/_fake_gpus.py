"""A fake ``nvidia-smi`` for machines without a GPU: an executable put first on ``PATH``
that lists the devices named in ``DASKTENSOR_FAKE_GPUS`` (``"NAME;NAME"``), as
``nvidia-smi -L`` and ``nvidia-smi --query-gpu=... --format=csv,noheader,nounits`` print
them.  Nothing else of the GPU features is faked: workers, environments and placement
are real."""

from __future__ import annotations

import os
import stat
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    """\
    #!{python}
    import os, sys
    names = [n for n in os.environ.get("DASKTENSOR_FAKE_GPUS", "").split(";") if n]
    args = sys.argv[1:]
    if args == ["-L"]:
        for i, name in enumerate(names):
            print(f"GPU {{i}}: {{name}} (UUID: GPU-{{i:08d}}-fake-{{i:04d}})")
            if "MIG" in name:
                print(f"  MIG 1g.10gb     Device  0: (UUID: MIG-{{i:08d}})")
    elif args and args[0].startswith("--query-gpu="):
        for i, name in enumerate(names):
            print(f"{{i}}, GPU-{{i:08d}}-fake-{{i:04d}}, {{name}}, 81559, {{100 + i}}")
    else:
        print("fake nvidia-smi: unsupported arguments", args, file=sys.stderr)
        sys.exit(2)
    """
)


def install(folder: Path) -> Path:
    """Write the fake ``nvidia-smi`` into ``folder``; returns its path."""
    folder.mkdir(parents=True, exist_ok=True)
    exe = folder / "nvidia-smi"
    exe.write_text(SCRIPT.format(python=sys.executable))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return exe


def environ(folder: Path, names: list[str]) -> dict[str, str]:
    """The variables that put the fake first on PATH, listing ``names``."""
    return {
        "PATH": f"{folder}{os.pathsep}{os.environ.get('PATH', '')}",
        "DASKTENSOR_FAKE_GPUS": ";".join(names),
    }
