"""dasktensor's settings live in ``dask.config`` under the ``dasktensor`` key.

The defaults come from ``dasktensor.yaml`` beside this file, loaded the way
``distributed/config.py`` loads its own, so that ``dask.config.set({"dasktensor.x": ...})``,
YAML files in ``~/.config/dask`` and ``DASK_DASKTENSOR__X`` environment variables all work.
"""

from __future__ import annotations

import pathlib

import dask.config
import yaml

_FILE = pathlib.Path(__file__).with_name("dasktensor.yaml")

with _FILE.open() as f:
    _DEFAULTS = yaml.safe_load(f)

dask.config.update_defaults(_DEFAULTS)


def get(key: str):
    """Read ``dasktensor.<key>`` from dask's configuration."""
    return dask.config.get(f"dasktensor.{key}")


def seconds(key: str) -> float:
    """Read a duration setting (``"10s"``, ``"500ms"`` or a number of seconds)."""
    from dask.utils import parse_timedelta

    return parse_timedelta(get(key), default="s")
