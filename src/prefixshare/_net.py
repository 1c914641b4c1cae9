"""The one TCP reachability probe: does ``host:port`` accept a connection? (No request is sent.)"""

from __future__ import annotations

import socket

#: how long a probe may wait for the port (a dead local server refuses at once)
CONNECT_TIMEOUT_S = 0.25


def connect_error(host: str, port: int, timeout: float = CONNECT_TIMEOUT_S) -> OSError | None:
    """None when ``host:port`` accepts a TCP connection within ``timeout``, else the error."""
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return None
    except OSError as exc:
        return exc


def port_open(address: tuple[str, int] | None, timeout: float = CONNECT_TIMEOUT_S) -> bool:
    """True when the address accepts a TCP connection. ``None`` (a transport without a TCP port, e.g.
    ipc://) counts as open: there is nothing to check."""
    return address is None or connect_error(address[0], address[1], timeout) is None
