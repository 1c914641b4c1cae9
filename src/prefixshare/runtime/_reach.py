"""Is the node's LMCache MP server still there? A TCP connect to its request port, cached for a moment.

(The probe itself is :func:`prefixshare._net.port_open`; this module caches it for the request path.)

LMCache's connectors notice a dead server only at their next heartbeat (once a second); until then every
lookup and every store RPC waits out its timeout inside the engine step. A connect to a dead local server is
refused at once (~50 us), so the connectors check before each lookup and skip the store when it refuses.
"""

from __future__ import annotations

import time

from prefixshare._net import CONNECT_TIMEOUT_S, port_open

#: a port seen open this recently is not checked again (a connect costs ~50-100 us; P5 budgets 50 us a request)
SEEN_OPEN_TTL_S = 0.1


class PortCheck:
    """``port_open`` for the request path: a port seen open within ``ttl_s`` is not checked again."""

    def __init__(self, address: tuple[str, int] | None, ttl_s: float = SEEN_OPEN_TTL_S) -> None:
        self.address = address
        self.ttl_s = ttl_s
        self._seen_open_at = -1.0

    def ok(self) -> bool:
        now = time.monotonic()
        if now - self._seen_open_at < self.ttl_s:
            return True
        if not port_open(self.address):
            return False
        self._seen_open_at = now
        return True


__all__ = ["CONNECT_TIMEOUT_S", "SEEN_OPEN_TTL_S", "PortCheck", "port_open"]
