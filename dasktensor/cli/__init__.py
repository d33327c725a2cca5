"""The ``dasktensor`` command: ``demo``, ``info``, ``bench`` and ``serve-umbridge``
(``dasktensor --help``).

The parser and ``demo`` are in ``_main.py``, the other verbs in a module each (``_info.py``,
``_bench.py``, ``_serve.py``); ``_demo.py`` holds the demo's model.
"""

from dasktensor.cli._main import main as main

__all__ = ["main"]
