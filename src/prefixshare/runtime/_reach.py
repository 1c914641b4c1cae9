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
    """``port_open`` for the request path: a port seen open within ``ttl_s`` is not checked again.

    What was seen is shared by every check of the same address in the process (the scheduler side's before a
    lookup and the worker side's before the transfers that follow it, in an in-process engine), so a request
    pays at most one connect per ``ttl_s``; a refused connect is forgotten at once, so every side checks
    again."""

    #: address -> when it was last seen open (time.monotonic), per process
    _seen: dict[tuple[str, int] | None, float] = {}

    def __init__(self, address: tuple[str, int] | None, ttl_s: float = SEEN_OPEN_TTL_S) -> None:
        self.address = address
        self.ttl_s = ttl_s

    def ok(self) -> bool:
        now = time.monotonic()
        if now - self._seen.get(self.address, -1e9) < self.ttl_s:
            return True
        if not port_open(self.address):
            self._seen.pop(self.address, None)
            return False
        self._seen[self.address] = now
        return True


__all__ = ["CONNECT_TIMEOUT_S", "SEEN_OPEN_TTL_S", "PortCheck", "port_open"]
