"""The lookup pump against a real MP server and LMCache's real scheduler adapter.

LMCache's adapter moves a lookup one round trip further only when the scheduler asks for its result (once per
engine pass): left alone, a lookup asked once is still unanswered however long the scheduler is busy (the
control). With prefixshare's pump (``adapters.vllm.connector.LookupPump``) the answer is in the adapter within
milliseconds of the server's reply, so the scheduler's next pass reads it; a request the scheduler forgets is
dropped; and while the server is silent the pump waits on the answer's future instead of spinning."""

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

BLOCK = 32
CHUNK = 32


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LMCacheServer]:
    store = tmp_path_factory.mktemp("pump") / "store"
    policy = Policy.build(chunk_size=CHUNK, l1={"size_gb": 0.1}, l2=[{"type": "fs", "base_path": str(store),
                                                                        "create": True}],
                          server={"port": free_port(), "http_port": free_port(), "start_timeout_s": 90})
    with LMCacheServer(policy, log_path=Path(store.parent / "server.log")) as srv:
        yield srv


@pytest.fixture
def adapter(server: LMCacheServer) -> Iterator[Any]:
    import zmq
    from lmcache.integration.vllm.vllm_multi_process_adapter import LMCacheMPSchedulerAdapter, ParallelStrategy

    context = zmq.Context()
    context.setsockopt(zmq.LINGER, 0)
    a = LMCacheMPSchedulerAdapter(server_urls=[server.url], context=context, model_name="pump-test",
                                  vllm_block_size=BLOCK, parallel_strategy=ParallelStrategy(
                                      mla_only=False, vllm_world_size=1, vllm_worker_id=0, tp_size=1, pp_size=1,
                                      n_servers=1), mq_timeout=5.0,
                                  heartbeat_interval=1.0)
    yield a
    with_close = getattr(a, "close", None) or getattr(a, "shutdown", None)
    if with_close is not None:
        with_close()
    context.destroy(linger=0)


def _tokens(seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 20000 + 10 for i in range(4 * CHUNK)]


def _pump(adapter: Any) -> Any:
    import structlog

    from prefixshare.adapters.vllm import _compat
    from prefixshare.adapters.vllm.connector import LookupPump

    lock = threading.RLock()
    assert _compat.serialize_lookups(adapter, lock)
    return LookupPump(adapter, lock, structlog.get_logger("test"))


def _answered(adapter: Any, rid: str, within_s: float) -> float | None:
    """Seconds until the adapter holds the lookup's answer, without asking it (None: not within ``within_s``)."""
    began = time.monotonic()
    while time.monotonic() - began < within_s:
        if rid in adapter._finished_lookup_results:
            return time.monotonic() - began
        time.sleep(0.001)
    return None


def _ask(adapter: Any, rid: str, seed: int) -> Any:
    adapter.maybe_submit_lookup_request(rid, token_ids=_tokens(seed))
    return adapter.check_lookup_result(rid)


def test_a_lookup_asked_once_stays_unanswered_without_the_pump(adapter: Any) -> None:
    """The control: LMCache alone needs the scheduler to ask again (twice: the acknowledgement, the status)."""
    assert _ask(adapter, "control", 1) is None
    assert _answered(adapter, "control", 0.5) is None
    asks = 1
    while adapter.check_lookup_result("control") is None and asks < 50:
        asks += 1
        time.sleep(0.02)
    assert asks >= 2  # more than one more pass of the scheduler
    assert adapter.check_lookup_result("control") == 0  # a miss
    adapter.cleanup_lookup_result("control")


def test_the_pump_answers_between_scheduler_passes(adapter: Any) -> None:
    pump = _pump(adapter)
    try:
        seconds = []
        for i in range(5):
            rid = f"pumped-{i}"
            assert _ask(adapter, rid, 10 + i) is None
            pump.watch(rid)
            took = _answered(adapter, rid, 2.0)
            assert took is not None, "the pump did not advance the lookup"
            seconds.append(took)
            assert adapter.check_lookup_result(rid) == 0  # the scheduler's next pass reads the miss
            adapter.cleanup_lookup_result(rid)
        assert sorted(seconds)[len(seconds) // 2] < 0.25, seconds
        deadline = time.monotonic() + 1.0
        while pump.pending and time.monotonic() < deadline:
            time.sleep(0.005)
        assert not pump.pending  # answered lookups leave the pump
    finally:
        pump.stop()


def test_a_forgotten_lookup_leaves_the_pump_and_a_silent_server_costs_it_no_cpu(adapter: Any,
                                                                                 server: LMCacheServer) -> None:
    pump = _pump(adapter)
    pid = server.pid
    assert pid is not None
    try:
        os.killpg(pid, signal.SIGSTOP)  # every answer waits: the pump has a future to wait on
        try:
            assert _ask(adapter, "silent", 30) is None
            pump.watch("silent")
            time.sleep(0.1)  # the pump thread is running
            assert pump.thread is not None and pump.thread.native_id is not None
            stat = Path(f"/proc/self/task/{pump.thread.native_id}/stat")
            before = _cpu_s(stat)
            time.sleep(0.6)
            spent = _cpu_s(stat) - before
            assert spent < 0.06, f"the pump spun: {spent:.3f} s of CPU in 0.6 s"
            pump.forget("silent")
            adapter.cleanup_lookup_result("silent")
            assert not pump.pending
        finally:
            os.killpg(pid, signal.SIGCONT)
        # the server answers again: the pump still serves new lookups
        assert _ask(adapter, "after", 31) is None
        pump.watch("after")
        assert _answered(adapter, "after", 3.0) is not None
        adapter.cleanup_lookup_result("after")
    finally:
        pump.stop()


def _cpu_s(stat: Path) -> float:
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
