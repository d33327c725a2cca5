"""Sharded likelihoods: sums over data rows, split over the workers.

* ``_analysis.py``: finding, in a rewritten graph, outputs that are exact sums (or other
  reductions) over the rows of data inputs, and splitting the graph there (pure);
* ``_rules.py``: the row-alignment rules of that analysis, one per kind of node;
* ``_policy.py``: whether a function is sharded and into how many shards (settings, the
  cost rule), and what ``print(f.plan)`` says about it;
* ``_executor.py``: running such a function as K shards, one resident stage per worker,
  and combining their partial values on the caller.
"""

from dasktensor.sharding._executor import ShardedExecutor as ShardedExecutor
from dasktensor.sharding._executor import ShardedThunk as ShardedThunk
from dasktensor.sharding._policy import analyse as analyse
from dasktensor.sharding._policy import check_shards as check_shards
from dasktensor.sharding._policy import describe as describe

__all__ = ["ShardedExecutor", "ShardedThunk", "analyse", "check_shards", "describe"]
