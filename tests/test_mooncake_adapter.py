"""The Mooncake Store L2 adapter's own logic against a scripted client (no master needed): Mooncake's result
codes, its key names, and the task / event-fd contract LMCache's controllers rely on.

The real round trip (a real mooncake_master, two MP servers, vLLM replicas) is in tests/e2e/test_tiers.py.
"""

from __future__ import annotations

import ctypes
import select
import time
from typing import Any

import pytest

pytest.importorskip("lmcache.v1.distributed.l2_adapters.base")

from lmcache.v1.distributed.api import ObjectKey  # noqa: E402

from prefixshare.server.plugins import mooncake as mc  # noqa: E402

PARAMS = {"master_server_addr": "127.0.0.1:50051", "metadata_server": "http://127.0.0.1:8080/metadata"}


class Buf:
    """What the adapter uses of an LMCache MemoryObj: its bytes and their address."""

    def __init__(self, data: bytes) -> None:
        self.raw = ctypes.create_string_buffer(data, len(data))
        self.byte_array = memoryview(self.raw).cast("B")[: len(data)]
        self.data_ptr = ctypes.addressof(self.raw)


class ScriptedStore:
    """Mooncake's client API surface the adapter uses, answering with scripted codes."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.exist_codes: list[int] | None = None
        #: what batch_remove answers instead of removing (e.g. a master refusing to remove a leased object)
        self.remove_codes: list[int] | None = None
        self.calls: list[str] = []

    def batch_put_from(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        self.calls.append("put")
        for key, ptr, size in zip(keys, ptrs, sizes, strict=True):
            self.objects[key] = ctypes.string_at(ptr, size)
        return [0] * len(keys)

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        return self.exist_codes if self.exist_codes is not None else [int(k in self.objects) for k in keys]

    def batch_get_into(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        out = []
        for key, ptr, size in zip(keys, ptrs, sizes, strict=True):
            data = self.objects.get(key)
            if data is None:
                out.append(-704)  # OBJECT_NOT_FOUND
            elif len(data) > size:
                out.append(-600)  # buffer too small
            else:
                ctypes.memmove(ptr, data, len(data))
                out.append(len(data))
        return out

    def batch_remove(self, keys: list[str]) -> list[int]:
        if self.remove_codes is not None:
            return self.remove_codes
        return [0 if self.objects.pop(k, None) is not None else -704 for k in keys]

    def close(self) -> int:
        self.calls.append("close")
        return 0


def key(i: int, salt: str = "") -> ObjectKey:
    return ObjectKey(chunk_hash=bytes([i]) * 16, model_name="org/model", kv_rank=0, object_group_id=0,
                     cache_salt=salt)


def wait(fd: int, query: Any, timeout: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        select.select([fd], [], [], 0.1)
        result = query()
        if result:
            return result
    raise AssertionError("task did not complete")


@pytest.fixture
def adapter() -> Any:
    store = ScriptedStore()
    a = mc.MooncakeStoreL2Adapter(PARAMS, store=store)
    a.scripted = store
    yield a
    a.close()


def test_store_lookup_load_round_trip(adapter: Any) -> None:
    data = [bytes(range(256)) * 4, b"\x07" * 1024]
    tid = adapter.submit_store_task([key(1), key(2, "t1")], [Buf(d) for d in data])
    done = wait(adapter.get_store_event_fd(), adapter.pop_completed_store_tasks)
    assert done[tid].is_successful() and done[tid].bytes_transferred() == 2048
    assert set(adapter.scripted.objects) == {
        "prefixshare/org/model@0x00000000@0@" + "01" * 16, "prefixshare/org/model@0x00000000@0@" + "02" * 16 + "@t1"}
    tid = adapter.submit_lookup_and_lock_task([key(1), key(3), key(2, "t1")], {})
    bits = wait(adapter.get_lookup_and_lock_event_fd(), lambda: adapter.query_lookup_and_lock_result(tid))
    assert bits.get_indices_list() == [0, 2]
    bufs = [Buf(b"\0" * 1024), Buf(b"\0" * 1024), Buf(b"\0" * 2048)]
    tid = adapter.submit_load_task([key(1), key(3), key(2, "t1")], bufs)
    bits = wait(adapter.get_load_event_fd(), lambda: adapter.query_load_result(tid))
    # key 3 is absent; key 2 fits into a larger buffer but is not a full chunk: neither counts as loaded
    assert bits.get_indices_list() == [0]
    assert bytes(bufs[0].byte_array) == data[0]
    assert adapter.get_usage().total_bytes_used == 2048
    adapter.delete([key(1)])
    assert adapter.get_usage().total_bytes_used == 1024


def test_a_refused_delete_is_logged_and_the_object_still_counted(adapter: Any) -> None:
    """Mooncake keeps an object a reader holds a lease on (10 s after a read, by default): the delete is refused,
    the bytes stay in the store and in our usage, and the log says why (seen in the network lab: deletes right after
    loads freed nothing until a put found the segment full)."""
    from structlog.testing import capture_logs

    tid = adapter.submit_store_task([key(1), key(2)], [Buf(b"\x01" * 1024), Buf(b"\x02" * 1024)])
    assert wait(adapter.get_store_event_fd(), adapter.pop_completed_store_tasks)[tid].is_successful()
    adapter.scripted.remove_codes = [-706, -704]
    with capture_logs() as logs:
        adapter.delete([key(1), key(2)])
    refused = [e for e in logs if e["event"] == "mooncake_delete_refused"]
    assert len(refused) == 1 and refused[0]["chunks"] == 1 and refused[0]["codes"] == [-706], logs
    assert "default_kv_lease_ttl" in refused[0]["hint"]
    assert adapter.get_usage().total_bytes_used == 2048  # nothing was freed
    adapter.scripted.remove_codes = None
    with capture_logs() as logs:
        adapter.delete([key(1), key(2)])
    assert not [e for e in logs if e["event"] == "mooncake_delete_refused"]
    assert adapter.get_usage().total_bytes_used == 0


def test_an_exist_error_code_is_a_miss_never_a_hit(adapter: Any) -> None:
    """batch_is_exist answers -900 (RPC failure) when the master is down: counted as present, it is a false
    hit (LMCache's in-process connector does exactly that)."""
    adapter.scripted.exist_codes = [-900, 1, 0, -1]
    tid = adapter.submit_lookup_and_lock_task([key(i) for i in range(4)], {})
    bits = wait(adapter.get_lookup_and_lock_event_fd(), lambda: adapter.query_lookup_and_lock_result(tid))
    assert bits.get_indices_list() == [1]
    assert [mc.present(c) for c in (-900, -1, 0, 1, 2)] == [False, False, False, True, False]
    assert not mc.loaded(-900, 0)  # an error code never equals a size


def test_a_failing_client_fails_the_task_not_the_server(adapter: Any) -> None:
    def boom(*_: Any) -> list[int]:
        raise RuntimeError("transfer engine gone")

    adapter.scripted.batch_is_exist = boom
    adapter.scripted.batch_put_from = boom
    tid = adapter.submit_lookup_and_lock_task([key(1)], {})
    bits = wait(adapter.get_lookup_and_lock_event_fd(), lambda: adapter.query_lookup_and_lock_result(tid))
    assert bits.get_indices_list() == []
    tid = adapter.submit_store_task([key(1)], [Buf(b"x" * 8)])
    done = wait(adapter.get_store_event_fd(), adapter.pop_completed_store_tasks)
    assert not done[tid].is_successful()


def test_event_fds_are_distinct_and_close_closes_the_client(adapter: Any) -> None:
    fds = {adapter.get_store_event_fd(), adapter.get_lookup_and_lock_event_fd(), adapter.get_load_event_fd()}
    assert len(fds) == 3
    adapter.close()
    assert adapter.scripted.calls[-1] == "close"


@pytest.mark.parametrize("wrong", ["master_server_address", "mooncake_master_server_addr"])
def test_the_silently_ignored_master_keys_are_refused(wrong: str) -> None:
    params = {**PARAMS, wrong: PARAMS["master_server_addr"]}
    with pytest.raises(ValueError, match="rename it to 'master_server_addr'"):
        mc.MooncakeStoreL2Adapter(params, store=ScriptedStore())
    with pytest.raises(ValueError, match="unknown Mooncake adapter params"):
        mc.check_params({**PARAMS, "global_segment_sise": 1})


def test_setup_config_uses_mooncakes_keys_and_logs_show_host_port_only() -> None:
    cfg = mc.setup_config({**PARAMS, "global_segment_size": 0, "num_workers": 2, "rdma_devices": ""})
    assert cfg["master_server_addr"] == "127.0.0.1:50051" and cfg["global_segment_size"] == "0"
    assert "num_workers" not in cfg and "rdma_devices" not in cfg
    assert mc.where("http://u:pw@10.0.0.1:8080/metadata?x=1") == "10.0.0.1:8080"
    assert mc.where("etcd://u:pw@etcd:2379") == "etcd:2379"


def test_an_unreachable_master_fails_fast_with_its_address() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        started = time.monotonic()
        with pytest.raises(ConnectionError, match=f"127.0.0.1:{port} is not reachable"):
            mc._wait_for_master(f"127.0.0.1:{port}", timeout_s=0.5)
        assert time.monotonic() - started < 3


def test_a_refused_delete_is_retried_once_the_lease_has_ended() -> None:
    """The master's lease (measured in the network lab: a delete right after a load freed nothing, the same
    delete 11 s later did): a refused delete is tried again after lease_ttl_s, and the bytes leave our usage
    only when the object is really gone; a delete refused every time is given up after DELETE_RETRIES."""
    import logging

    import structlog
    from structlog.testing import capture_logs

    store = ScriptedStore()
    a = mc.MooncakeStoreL2Adapter({**PARAMS, "lease_ttl_s": 0.01}, store=store)  # retried ~1 s later
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))  # the retries log INFO
    a._lease_s = 0.2  # the +1 s margin is for a real master; here the scripted lease ends at once
    try:
        tid = a.submit_store_task([key(1), key(2)], [Buf(b"\x01" * 1024), Buf(b"\x02" * 1024)])
        assert wait(a.get_store_event_fd(), a.pop_completed_store_tasks)[tid].is_successful()
        store.remove_codes = [-706, -706]
        with capture_logs() as logs:
            a.delete([key(1), key(2)])
            assert a.get_usage().total_bytes_used == 2048  # refused: still there, still counted
            store.remove_codes = None  # the lease ends
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline and not any(e["event"] == "mooncake_delete_retried" for e in logs):
                time.sleep(0.02)
        assert a.get_usage().total_bytes_used == 0 and not store.objects
        [retried] = [e for e in logs if e["event"] == "mooncake_delete_retried"]
        assert retried["chunks"] == 2 and retried["freed"] == 2 and retried["abandoned"] == 0, retried
        # refused on every try: given up after DELETE_RETRIES tries, counted still, the thread idle
        tid = a.submit_store_task([key(3)], [Buf(b"\x03" * 1024)])
        assert wait(a.get_store_event_fd(), a.pop_completed_store_tasks)[tid].is_successful()
        store.remove_codes = [-706]
        with capture_logs() as logs:
            a.delete([key(3)])
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline and not any(
                    e["event"] == "mooncake_delete_retried" and e["abandoned"] for e in logs):
                time.sleep(0.02)
            time.sleep(0.5)  # nothing more is tried
        tries = [e for e in logs if e["event"] == "mooncake_delete_retried"]
        assert len(tries) == mc.DELETE_RETRIES and tries[-1]["abandoned"] == 1, tries
        assert a.get_usage().total_bytes_used == 1024
    finally:
        a.close()
