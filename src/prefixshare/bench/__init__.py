"""``prefixshare bench``: cross-replica prefill cost cut against the physical limit, and cost-aware loading.

Nothing here is imported by ``import prefixshare``; the CLI imports this package when the command runs.
Replicas are fresh processes (:mod:`prefixshare.bench._replica`); the throttled store used for cost-aware
loading is an LMCache L2 plugin (:mod:`prefixshare.bench._throttle`) loaded by the MP server.
"""

from prefixshare.bench._load import Workload, run_load
from prefixshare.bench._measured import (
    TierLink,
    flat_prefill,
    measure_tier_links,
    measured_plan,
    measured_prefill,
    persisted_prefill,
    prefill_lengths,
)
from prefixshare.bench._run import Settings, render_results, run_bench
from prefixshare.bench._tiers import TierBenchSettings, measure_tiers, write_docs, write_results

__all__ = ["Settings", "TierBenchSettings", "TierLink", "Workload", "flat_prefill", "measure_tier_links",
           "measure_tiers", "measured_plan", "measured_prefill", "persisted_prefill", "prefill_lengths",
           "render_results", "run_bench", "run_load", "write_docs", "write_results"]
