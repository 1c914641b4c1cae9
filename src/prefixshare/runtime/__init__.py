"""The engine-agnostic connector core: what every engine's connector enforces, and how it is observed.

* :class:`ConnectorRuntime` (``_runtime``): built in each engine process from the connector's extra config;
  fingerprint namespace, admission, the store's health gate and every fallback to recompute;
* stats (``_stats``): counters, their publication off the request path, :func:`read_stats`;
* cost (``_cost``): cost-aware loading, a load-or-recompute choice from running estimates, persisted
  beside the stats;
* reach (``_reach``): the cached TCP probe of the MP server's port on the request path;
* verify (``_verify``): which store hits are set aside for sampled verification, and where they wait
  (the checking half is :mod:`prefixshare.verify`).

Engine adapters (:mod:`prefixshare.adapters`) build on this package; it knows no engine.
"""

from prefixshare.runtime._cost import CostModel, Fit, LoadDecision, info_enabled, store_key
from prefixshare.runtime._reach import PortCheck, port_open
from prefixshare.runtime._runtime import ConnectorRuntime, RequestInfo, load_policy
from prefixshare.runtime._stats import READ_SETTLE_S, VERDICTS, Stats, add_verdicts, read_stats
from prefixshare.runtime._verify import (
    HitSampler,
    VerifyTask,
    default_tolerance,
    find_task,
    keep_task,
    new_token,
    pending_dir,
    pending_tasks,
    read_task,
)

__all__ = [
    "READ_SETTLE_S",
    "VERDICTS",
    "ConnectorRuntime",
    "CostModel",
    "Fit",
    "HitSampler",
    "LoadDecision",
    "PortCheck",
    "RequestInfo",
    "Stats",
    "VerifyTask",
    "add_verdicts",
    "default_tolerance",
    "find_task",
    "info_enabled",
    "keep_task",
    "load_policy",
    "new_token",
    "pending_dir",
    "pending_tasks",
    "port_open",
    "read_stats",
    "read_task",
    "store_key",
]
