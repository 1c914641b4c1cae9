"""The LMCache MP server lifecycle against the real server: start, health, a real store + retrieve round
trip from separate processes, a second server on the same fs directory, reuse, failures, stop."""

from __future__ import annotations

import json
import re
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import free_port, run_mp_client
from prefixshare.errors import ServerError
from prefixshare.policies import Policy
from prefixshare.server import LMCacheServer

pytestmark = pytest.mark.server


def make_policy(store: Path, **overrides: object) -> Policy:
    port = free_port()
    fields: dict = {
        "chunk_size": 32,
        "l1": {"size_gb": 0.1},
        "l2": [{"type": "fs", "base_path": str(store), "create": True}],
        "server": {"port": port, "http_port": free_port(), "start_timeout_s": 90},
    }
    fields.update(overrides)
    return Policy.build(**fields)


def hits(result: str) -> tuple[int, int]:
    match = re.search(r"hit_chunks=(\d+)/(\d+)", result)
    assert match, result
    return int(match.group(1)), int(match.group(2))


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("store") / "kv"


@pytest.fixture(scope="module")
def server_a(store: Path) -> Iterator[LMCacheServer]:
    with LMCacheServer(make_policy(store)) as server:
        yield server


def test_start_health_and_status(server_a: LMCacheServer, store: Path) -> None:
    assert server_a.owned and server_a.healthy()
    status = server_a.status()
    assert status["chunk_size"] == 32 and status["hash_algorithm"] == "blake3"
    assert store.is_dir() and (store.stat().st_mode & 0o777) == 0o750  # created by the policy's tier


def test_the_servers_threads_carry_their_python_names_and_idle_quietly(server_a: LMCacheServer) -> None:
    """The server names its kernel threads after its Python threads (what wakes in it can be told from
    outside; the replica-side reading names them the same way), and on a host with no GPU its GPU completion
    dispatcher does not wake 200 times a second."""
    from prefixshare.bench._replica import thread_counters

    threads = thread_counters(server_a.pid)
    names = {row["name"] for row in threads.values()}
    assert len(threads) > 5 and any(n.startswith("Thread-") or "Periodic" in n or "lmcache" in n.lower()
                                    for n in names), names
    assert sum(1 for n in names if n == "python") < len(threads) // 2, names  # most are named, not "python"
    # the GPU completion dispatcher polls once a second on this GPU-less host, not every 5 ms (200 wakeups/s)
    import time

    before = thread_counters(server_a.pid)
    time.sleep(2.0)
    after = thread_counters(server_a.pid)
    dispatcher = [tid for tid, row in after.items() if row["name"].startswith("DeviceHostFunc")]
    assert len(dispatcher) == 1, names
    woke = after[dispatcher[0]]["voluntary"] - before[dispatcher[0]]["voluntary"]
    assert woke <= 6, woke  # 2 s at 1 s intervals (LMCache's own 5 ms: ~400)
    here = thread_counters()
    assert {row["name"] for row in here.values()} >= {"MainThread"}
    assert all(row["cpu_s"] >= 0 and row["voluntary"] >= 0 for row in here.values())


def test_round_trip_through_the_server_from_fresh_processes(server_a: LMCacheServer, store: Path) -> None:
    stored = run_mp_client("store", server_a.url)
    assert stored.returncode == 0 and "STORE ok = True" in stored.stdout, stored.stderr[-2000:]
    files = sorted(store.glob("*.data"))
    assert len(files) == 4  # 128 tokens / chunk 32, one file per chunk
    fetched = run_mp_client("fetch", server_a.url)  # a fresh process: nothing shared but the server
    assert fetched.returncode == 0, fetched.stdout + fetched.stderr[-2000:]
    assert "bytes_equal = True" in fetched.stdout and hits(fetched.stdout) == (4, 4)
    # the copies went through the server's shared memory (server.shm_name: auto), not pickled over the socket
    # (a /dev/shm without room for L1 turns shared memory off with a warning: then this says how full it was)
    assert server_a.policy.server.shm_segment is not None, f"/dev/shm: {shutil.disk_usage('/dev/shm')}"
    assert "Using shm non-GPU transfer strategy" in server_a.log_path.read_text(errors="replace")
    # negative controls: another model name and another salt are other namespaces
    assert hits(run_mp_client("lookup", server_a.url, model="other/model").stdout) == (0, 4)
    assert hits(run_mp_client("lookup", server_a.url, salt="tenant-b").stdout) == (0, 4)


def test_second_server_on_the_same_directory_sees_the_chunks(server_a: LMCacheServer, store: Path) -> None:
    if not list(store.glob("*.data")):
        assert run_mp_client("store", server_a.url).returncode == 0
    with LMCacheServer(make_policy(store)) as server_b:  # a second "node" on the shared directory
        assert server_b.owned and server_b.url != server_a.url
        fetched = run_mp_client("fetch", server_b.url)
        assert fetched.returncode == 0, fetched.stdout + fetched.stderr[-2000:]
        assert hits(fetched.stdout) == (4, 4) and "bytes_equal = True" in fetched.stdout


def test_corrupted_chunk_bytes_reach_the_reader_unless_checked(tmp_path: Path) -> None:
    """Negative control: the bytes really come from the store (flip them and a reader without integrity checks
    gets the flipped bytes); the fs tier's default integrity check refuses every flipped chunk instead."""
    store = tmp_path / "kv"
    with LMCacheServer(make_policy(store)) as writer:
        assert run_mp_client("store", writer.url).returncode == 0
    for f in store.glob("*.data"):
        data = bytearray(f.read_bytes())
        data[100:108] = b"\xff" * 8
        f.write_bytes(bytes(data))
    unchecked = make_policy(store, l2=[{"type": "fs", "base_path": str(store), "integrity": "none"}])
    with LMCacheServer(unchecked) as reader:  # fresh L1: must read the L2 files
        fetched = run_mp_client("fetch", reader.url)
    assert "bytes_equal = False" in fetched.stdout and hits(fetched.stdout) == (4, 4), fetched.stdout
    with LMCacheServer(make_policy(store)) as reader:
        fetched = run_mp_client("lookup", reader.url)
    assert hits(fetched.stdout) == (0, 4), fetched.stdout  # the first chunk is damaged: nothing loads
    assert len(list(store.glob("*.data.corrupt"))) == 4  # every chunk read in the batch is set aside


def test_shared_memory_turns_itself_off_when_dev_shm_is_too_small(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil
    from collections import namedtuple

    from prefixshare.server import _process

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: usage(64 << 20, 0, 64 << 20))  # a container's default
    auto = LMCacheServer(make_policy(tmp_path / "kv"))
    auto._prepare_shm()
    assert auto.policy.server.shm_segment is None  # falls back to the socket, with a warning
    named = LMCacheServer(make_policy(tmp_path / "kv", server={"port": free_port(), "http_port": free_port(),
                                                                  "shm_name": "kv-node1"}))
    with pytest.raises(ServerError, match=r"server.shm_name 'kv-node1': /dev/shm has 0.07 GB free.*--shm-size"):
        named._prepare_shm()
    assert _process.shm_path("kv-node1") == _process.SHM_DIR / "lmcache_l1_pool_kv-node1"


def test_reuse_a_compatible_server_and_refuse_an_incompatible_one(server_a: LMCacheServer, store: Path) -> None:
    same = LMCacheServer(server_a.policy).start()
    assert not same.owned  # reused: several engines on a node share one server
    same.stop()  # stopping a reused server leaves it running
    assert server_a.healthy()
    other = server_a.policy.model_copy(update={"chunk_size": 64})
    with pytest.raises(ServerError, match=r"not compatible.*chunk_size 32 \(policy: 64\)"):
        LMCacheServer(other).start()
    with pytest.raises(ServerError, match="already running"):
        LMCacheServer(server_a.policy).start(reuse=False)


def test_adapters_added_by_extra_args_count_among_the_servers_tiers() -> None:
    """A server started with ``server.extra_args`` adding an L2 adapter (a benchmark's slow store) is the policy's:
    the reuse check expects those adapters after the policy's tiers, in argv order."""
    from prefixshare.server._process import _extra_l2_types

    argv = ["--max-workers", "2", "--l2-adapter", json.dumps({"type": "plugin", "adapter_params": {}}),
            '--l2-adapter={"type": "fs"}', "--l2-adapter", "not json"]
    assert _extra_l2_types(argv) == ["plugin", "fs", "?"]
    assert _extra_l2_types(["--l2-adapter"]) == []


def test_a_port_held_by_another_program_is_named(tmp_path: Path) -> None:
    policy = make_policy(tmp_path / "kv")
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", policy.server.port))
        blocker.listen()
        with pytest.raises(ServerError, match=r"server\.port .* not an LMCache server"):
            LMCacheServer(policy).start()


def test_start_failure_shows_the_log_and_the_likely_cause(tmp_path: Path) -> None:
    policy = make_policy(tmp_path / "kv", server={
        "port": free_port(), "http_port": free_port(), "start_timeout_s": 90,
        "extra_args": ["--l2-adapter", '{"type": "fs"}'],  # LMCache rejects this: no base_path
    })
    with pytest.raises(ServerError) as info:
        LMCacheServer(policy).start()
    text = str(info.value)
    assert "exited with code" in text
    assert "likely cause: LMCache rejected an l2 tier" in text
    assert "base_path must be a non-empty string" in text  # the server's own words, from its log


def test_stop_ends_the_process(tmp_path: Path) -> None:
    server = LMCacheServer(make_policy(tmp_path / "kv")).start()
    process = server.process
    assert process is not None and process.poll() is None
    server.stop()
    assert process.poll() is not None and not server.healthy()
    assert not server.state_path.exists()


def test_port_checks_of_one_address_share_what_they_saw(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler side's and the worker side's checks of one server: one connect per TTL between them, and a
    refused connect makes every check look again (a dead server is never taken for alive from the cache)."""
    from prefixshare.runtime import _reach
    from prefixshare.runtime._reach import PortCheck

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    address = listener.getsockname()
    connects: list[tuple[str, int]] = []
    real = _reach.port_open

    def counted(addr: tuple[str, int] | None) -> bool:
        connects.append(addr)  # type: ignore[arg-type]
        return real(addr)

    monkeypatch.setattr(_reach, "port_open", counted)
    monkeypatch.setattr(PortCheck, "_seen", {})
    scheduler, worker = PortCheck(address, ttl_s=60), PortCheck(address, ttl_s=60)
    assert scheduler.ok() and worker.ok() and scheduler.ok()
    assert len(connects) == 1
    listener.close()
    expired = PortCheck(address, ttl_s=0.0)
    assert not expired.ok()  # the port refuses now: forgotten for every check of it
    assert not worker.ok() and len(connects) == 3


def test_a_keyed_store_is_read_only_by_servers_holding_its_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the real server: chunks written under the store key load on a server with the key; a server
    without a key loads none and leaves them in place (it cannot judge them); a server whose key variable is
    missing does not start, and says which variable."""
    from prefixshare.server.plugins.integrity import Keyring, StoreKeyError, verify_file

    store = tmp_path / "kv"
    key = bytes(range(32))
    keyed = [{"type": "fs", "base_path": str(store), "create": True, "key_env": "PS_TEST_KEY"}]
    monkeypatch.setenv("PS_TEST_KEY", key.hex())
    with LMCacheServer(make_policy(store, l2=keyed)) as writer:
        assert run_mp_client("store", writer.url).returncode == 0
    files = sorted(store.glob("*.data"))
    assert len(files) == 4 and all(verify_file(f, Keyring(key, (key,))).verdict == "ok" for f in files)
    with LMCacheServer(make_policy(store)) as unkeyed:  # integrity: blake3, no key
        assert hits(run_mp_client("lookup", unkeyed.url).stdout) == (0, 4)
        log = unkeyed.log_path.read_text(errors="replace")
    assert "store.keyed_chunk" in log and not list(store.glob("*.corrupt"))  # refused, not set aside
    with LMCacheServer(make_policy(store, l2=keyed)) as reader:
        fetched = run_mp_client("fetch", reader.url)
    assert hits(fetched.stdout) == (4, 4) and "bytes_equal = True" in fetched.stdout, fetched.stdout
    monkeypatch.delenv("PS_TEST_KEY")
    with pytest.raises(StoreKeyError, match="PS_TEST_KEY is not set"):
        LMCacheServer(make_policy(store, l2=keyed)).start()


def test_a_store_path_that_is_a_file_fails_the_start_with_its_cause(tmp_path: Path) -> None:
    # what a server restarted while its store is replaced or unmounted meets (the fleet load test found it)
    store = tmp_path / "kv"
    policy = make_policy(store, server={"port": free_port(), "http_port": free_port(), "start_timeout_s": 90})
    store.rmdir() if store.is_dir() else None  # valid when the policy was read (it refuses a file), then replaced
    store.write_text("not a directory\n")
    with pytest.raises(ServerError) as info:
        LMCacheServer(policy).start()
    text = str(info.value)
    assert "exists but is not a directory" in text and str(store) in text, text
    assert store.read_text() == "not a directory\n"  # nothing was lost or replaced
