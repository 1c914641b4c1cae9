"""Test-only: let a replica's store probes in flight finish before the process exits.

The connector probes a store it has just marked down on a thread of its own and logs ``store.down`` with the
verdict (a probe waits up to 0.25 s per tier). The replica helpers exit with ``os._exit`` right after their last
request, which can be sooner than that: the tests read the event from the replica's log, so they wait for it
here, bounded."""

from __future__ import annotations

import threading
import time


def settle_probes(timeout_s: float = 5.0) -> None:
    # imported here: the replica scripts import this module before they set the engines' environment
    from prefixshare.runtime._runtime import PROBE_THREAD, STALL_PROBE_THREAD

    deadline = time.monotonic() + timeout_s
    for thread in threading.enumerate():
        if thread.name in (PROBE_THREAD, STALL_PROBE_THREAD):
            thread.join(max(0.0, deadline - time.monotonic()))
