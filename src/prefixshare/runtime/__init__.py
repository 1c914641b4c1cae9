"""The engine-agnostic connector core: what every engine's connector enforces, and how it is observed.

* :class:`ConnectorRuntime` (``_runtime``): built in each engine process from the connector's extra config;
  fingerprint namespace, admission, the store's health gate and every fallback to recompute;
* stats (``_stats``): counters, their publication off the request path, :func:`read_stats`;
* cost (``_cost``): cost-aware loading, a load-or-recompute choice from running estimates, persisted
  beside the stats;
* reach (``_reach``): the cached TCP probe of the MP server's port on the request path.

Engine adapters (:mod:`prefixshare.adapters`) build on this package; it knows no engine.
"""

from prefixshare.runtime._cost import CostModel, LoadDecision, info_enabled, store_key
from prefixshare.runtime._reach import PortCheck, port_open
from prefixshare.runtime._runtime import ConnectorRuntime, RequestInfo, load_policy
from prefixshare.runtime._stats import READ_SETTLE_S, Stats, read_stats

__all__ = [
    "READ_SETTLE_S",
    "ConnectorRuntime",
    "CostModel",
    "LoadDecision",
    "PortCheck",
    "RequestInfo",
    "Stats",
    "info_enabled",
    "load_policy",
    "port_open",
    "read_stats",
    "store_key",
]
