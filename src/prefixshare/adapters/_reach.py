"""Is the node's LMCache MP server still there? A TCP connect to its request port, cached for a moment.

LMCache's connectors notice a dead server only at their next heartbeat (once a second); until then every
lookup and every store RPC waits out its timeout inside the engine step. A connect to a dead local server is
refused at once (~50 us), so the connectors check before each lookup and skip the store when it refuses.
"""

from __future__ import annotations

import socket
import time

#: how long a reachability check may wait for the server's TCP port (a dead local server refuses at once)
CONNECT_TIMEOUT_S = 0.25
#: a port seen open this recently is not checked again (a connect costs ~50-100 us; P5 budgets 50 us a request)
SEEN_OPEN_TTL_S = 0.1


def port_open(address: tuple[str, int] | None, timeout: float = CONNECT_TIMEOUT_S) -> bool:
    """True when the server accepts a TCP connection (no request is sent; ZMQ drops the bare connection).
    ``None`` (a transport without a TCP port, e.g. ipc://) counts as open: there is nothing to check."""
    if address is None:
        return True
    try:
        with socket.create_connection(address, timeout=timeout):
            return True
    except OSError:
        return False


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
