"""``prefixshare bench``: cross-replica prefill cost cut against the physical limit, and cost-aware loading.

Nothing here is imported by ``import prefixshare``; the CLI imports :mod:`prefixshare.bench._run` when the
command runs. Replicas are fresh processes (:mod:`prefixshare.bench._replica`); the throttled store used for
cost-aware loading is an LMCache L2 plugin (:mod:`prefixshare.bench._throttle`) loaded by the MP server.
"""
