"""The DASK mode's engine: a rewritten graph planned into tasks, translated, executed.

The data flow, one module a step (each module's docstring argues its part):

* ``_weights.py``: what each node weighs (heavy: alone in a task; costly: worth
  parallel work; cheap), and the flops cost rule;
* ``_plan.py``: the pure planner, ``plan_graph(fgraph) -> Plan``;
* ``_annotate.py``: ``dt.annotate`` blocks, which become one ``Placed`` node each;
* ``_runners.py``: a task's subgraph, compiled once per process (:class:`TaskRunner`);
* ``_translate.py``: a plan and input values become a Dask graph (:class:`TaskGraph`);
* ``_execute.py``: :class:`PlanExecutor` runs a call on a local scheduler or a client;
* ``_resident.py``: cluster tasks kept compiled on the workers (resident stages), called
  through the remote-call channel.

The linker (``dasktensor._linker``) drives these steps; ``dasktensor.sharding`` and
``dasktensor.dataparallel`` build on the runners.
"""

from dasktensor.engine._annotate import Placed as Placed
from dasktensor.engine._annotate import annotate as annotate
from dasktensor.engine._execute import PlanExecutor as PlanExecutor
from dasktensor.engine._plan import Plan as Plan
from dasktensor.engine._plan import Task as Task
from dasktensor.engine._plan import block_dag as block_dag
from dasktensor.engine._plan import colour_by as colour_by
from dasktensor.engine._plan import plan_graph as plan_graph
from dasktensor.engine._plan import toposort_blocks as toposort_blocks
from dasktensor.engine._resident import release_in_background as release_in_background
from dasktensor.engine._runners import TaskRunner as TaskRunner
from dasktensor.engine._runners import compiling as compiling
from dasktensor.engine._translate import FromInput as FromInput
from dasktensor.engine._translate import FromTask as FromTask
from dasktensor.engine._translate import TaskGraph as TaskGraph
from dasktensor.engine._translate import picked as picked
from dasktensor.engine._weights import is_heavy as is_heavy
from dasktensor.engine._weights import mark_heavy as mark_heavy
from dasktensor.engine._weights import work_of as work_of

__all__ = [
    "FromInput",
    "FromTask",
    "Placed",
    "Plan",
    "PlanExecutor",
    "Task",
    "TaskGraph",
    "TaskRunner",
    "annotate",
    "block_dag",
    "colour_by",
    "compiling",
    "is_heavy",
    "mark_heavy",
    "picked",
    "plan_graph",
    "release_in_background",
    "toposort_blocks",
    "work_of",
]
