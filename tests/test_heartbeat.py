"""The engine-side heartbeat against a real MP server whose answers are late: LMCache's own heartbeat (its interval
as the ping's deadline, one miss to degrade) calls a server that answers 1.5 s late unhealthy, which makes the worker
drop every store in flight; prefixshare's (``adapters.vllm._compat.patient_heartbeat``) keeps it healthy, and still
calls a server that stops answering unhealthy after two missed pings, one whose port refuses at once, and either
healthy again once it answers.

The server is made late by stopping its process (SIGSTOP) and continuing it (SIGCONT): its port stays open and
every request waits, as behind a busy worker pool."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import free_port
from prefixshare.policies import Policy
from prefixshare.server import LMCacheServer

pytestmark = pytest.mark.server

INTERVAL_S = 0.3
LATE_S = 1.5


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LMCacheServer]:
    store = tmp_path_factory.mktemp("heartbeat") / "store"
    policy = Policy.build(chunk_size=32, l1={"size_gb": 0.1}, l2=[{"type": "fs", "base_path": str(store),
                                                                     "create": True}],
                          server={"port": free_port(), "http_port": free_port(), "start_timeout_s": 90})
    with LMCacheServer(policy, log_path=Path(store.parent / "server.log")) as srv:
        yield srv


def _heartbeat(cls: Any, url: str) -> tuple[Any, threading.Event, Any]:
    import zmq
    from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

    context = zmq.Context()
    context.setsockopt(zmq.LINGER, 0)
    event = threading.Event()
    event.set()
    beat = cls(req_client=RequestClientFactory.create(url, context=context), health_event=event, interval=INTERVAL_S)
    return beat, event, context


class _Watch(threading.Thread):
    """Records every moment the health flag was seen cleared."""

    def __init__(self, event: threading.Event) -> None:
        super().__init__(daemon=True)
        self.event, self.cleared, self.stop = event, 0, threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.01):
            self.cleared += not self.event.is_set()


def _stopped(pid: int) -> bool:
    """The process's kernel state became 'T' (stopped) within a second."""
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T":
            return True
        time.sleep(0.005)
    return False


def _pause(pid: int, seconds: float) -> None:
    os.killpg(pid, signal.SIGSTOP)
    try:
        assert _stopped(pid)  # the fault is real
        time.sleep(seconds)
    finally:
        os.killpg(pid, signal.SIGCONT)


def test_a_late_server_stays_healthy_and_a_silent_one_degrades_after_two_misses(server: LMCacheServer) -> None:
    from lmcache.integration.vllm import vllm_multi_process_adapter as adapter

    from prefixshare.adapters.vllm import _compat

    assert _compat.patient_heartbeat()
    patient_cls = adapter.HeartbeatThread
    lmcache_cls = patient_cls.__mro__[1]
    assert getattr(patient_cls, "prefixshare_patient", False) and lmcache_cls.__name__ == "HeartbeatThread"
    pid = server.pid
    assert pid is not None
    beats = {name: _heartbeat(cls, server.url) for name, cls in (("lmcache", lmcache_cls), ("patient", patient_cls))}
    watches = {name: _Watch(event) for name, (_, event, _) in beats.items()}
    try:
        for (beat, _, _), watch in zip(beats.values(), watches.values(), strict=True):
            beat.start()
            watch.start()
        time.sleep(1.0)  # a few answered pings
        assert all(event.is_set() for _, event, _ in beats.values())
        for _ in range(2):
            _pause(pid, LATE_S)
            time.sleep(1.0)
        # LMCache's own heartbeat degraded (it drops in-flight stores then); prefixshare's never did
        assert watches["lmcache"].cleared > 0
        assert watches["patient"].cleared == 0
        assert all(event.is_set() for _, event, _ in beats.values())  # both healthy again once it answers

        # a server that stops answering: unhealthy after two missed pings, healthy again after SIGCONT
        patient, event, _ = beats["patient"]
        patient.prefixshare_deadline_s = 0.5
        os.killpg(pid, signal.SIGSTOP)
        try:
            assert _stopped(pid)
            started = time.monotonic()
            while event.is_set() and time.monotonic() - started < 10:
                time.sleep(0.02)
            took = time.monotonic() - started
        finally:
            os.killpg(pid, signal.SIGCONT)
        assert took < 10, "never degraded"
        assert 2 * 0.5 <= took < 2 * (0.5 + INTERVAL_S) + 1.0, took
        assert patient.prefixshare_missed >= 2
        started = time.monotonic()
        while not event.is_set() and time.monotonic() - started < 10:
            time.sleep(0.02)
        assert event.is_set(), "never healthy again"

        # a server that is gone (its port refuses): unhealthy at the next cycle, not after two deadlines, and
        # healthy again soon after a new server starts on the same port
        patient.prefixshare_deadline_s = 5.0
        patient.prefixshare_address = (server.policy.server.host, server.policy.server.port)
        server.stop()
        started = time.monotonic()
        while event.is_set() and time.monotonic() - started < 10:
            time.sleep(0.02)
        assert time.monotonic() - started < 2 * INTERVAL_S + 1.0, "a refused port waited for patience"
        server.start(reuse=False)
        started = time.monotonic()
        while not event.is_set() and time.monotonic() - started < 10:
            time.sleep(0.02)
        assert event.is_set(), "never healthy again after the restart"
    finally:
        for watch in watches.values():
            watch.stop.set()
        for beat, _, context in beats.values():
            beat.stop(timeout=5)
            beat._req_client.close()
            context.term()
