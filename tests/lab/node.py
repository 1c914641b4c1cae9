"""Test-only: one lab node's replica and its MP server, in one process tree inside the node's namespace.

``python node.py SPEC.json``: the spec is :mod:`prefixshare.bench._replica`'s, with ``"server_log"`` added. The
node's LMCache MP server is started from the spec's policy (its addresses are the namespace's own loopback, so
the replica reaches it and nothing outside the node does), then the replica runs on the same spec and speaks
the replica's protocol on stdin/stdout (see :class:`prefixshare.bench._procs.ReplicaSession`); the server stops
when the replica ends. The server's L2 tiers are reached over the node's link, which the lab shapes and cuts.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")


def main() -> None:
    spec_path = sys.argv[1]
    spec = json.loads(Path(spec_path).read_text())
    from prefixshare.policies import policy_from_mapping
    from prefixshare.server import LMCacheServer

    policy = policy_from_mapping(spec["policy"], source="lab node spec")
    with LMCacheServer(policy, log_path=Path(spec["server_log"])):
        from prefixshare.bench._replica import main as replica

        sys.argv = [sys.argv[0], spec_path]
        replica()


if __name__ == "__main__":
    main()
