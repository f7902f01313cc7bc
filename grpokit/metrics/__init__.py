"""Metrics: every name a run logs (names.py, which imports nothing) and how a step's tensors become them
(compute.py: the trainer's metric dicts, the means over micro-batches, the one reader of metrics.jsonl).
docs/metrics.md defines each name.

    from grpokit import metrics as M             # every name: M.REWARD_MEAN == "reward/mean"
    from grpokit.metrics.compute import read_metrics, rollout_metrics, MeanAccumulator

This package's own namespace is the names only, so that the shared types (grpokit/types.py) can name
metrics without loading the computation.
"""

from grpokit.metrics.names import *  # noqa: F403 (every metric name)
