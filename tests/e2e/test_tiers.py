"""Beyond one node: Redis/Valkey, S3 and Mooncake Store tiers against real servers on loopback.

Two MP servers ("nodes") share one Redis: KV stored through node 1 is read through node 2, bit for bit
(raw MP client) and by a fresh vLLM replica with the cold engine's output. The store's server is then
killed and frozen mid-run: requests are still answered with the cold output, within a bounded delay.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import free_port, run_mp_client
from e2e.common import document_ids, policy_for, run_replica, same_output
from faults._common import process_state, wait_state
from faults._matrix import Row, record
from load.fleet import _process_table, _tree
from prefixshare.errors import ServerError
from prefixshare.policies import Policy
from prefixshare.server import LMCacheServer

pytestmark = [pytest.mark.server]

REDIS = shutil.which("redis-server")


def start_redis(tmp_path: Path, *flags: str) -> tuple[int, subprocess.Popen[bytes]]:
    """A Redis on a free loopback port (its port accepting connections, or 10 s gone), with ``flags``."""
    if REDIS is None:
        pytest.skip("redis-server is not installed (make test installs it)")
    import socket

    port = free_port()
    proc = subprocess.Popen([REDIS, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path), *flags], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    return port, proc


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[dict[str, Any]]:
    port, proc = start_redis(tmp_path)
    yield {"port": port, "proc": proc}
    if proc.poll() is None:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
    proc.wait(timeout=10)


def tier_policy(kind: str, port: int, **overrides: Any) -> Policy:
    tier = ({"type": "resp", "host": "127.0.0.1", "port": port} if kind == "resp"
            else {"type": "valkey", "startup_nodes": [f"127.0.0.1:{port}"], "request_timeout_s": 1.0})
    fields: dict[str, Any] = {"chunk_size": 32, "l1": {"size_gb": 0.1}, "l2": [tier],
                              "server": {"port": free_port(), "http_port": free_port(), "start_timeout_s": 90}}
    fields.update(overrides)
    return Policy.build(**fields)


#: the documents the vLLM tests below send, by seed (600 tokens each); one cold run answers them all
DOC_SEEDS = {"redis": (21, 22, 23), "frozen": (31, 32), "mooncake": (41, 42, 43, 44)}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from prefixshare.model import create_model

    return create_model(tmp_path_factory.mktemp("tiers-model") / "m", shape="tiny", seed=0)


@pytest.fixture(scope="module")
def cold(tmp_path_factory: pytest.TempPathFactory, model: Path) -> dict[int, dict[str, Any]]:
    """The raw engine's answer to every document, {seed: result}, from one process. A short request goes first,
    so no document pays the process's first-request cost that a fault row would count as added latency."""
    seeds = [seed for group in DOC_SEEDS.values() for seed in group]
    requests = [{"prompt_token_ids": document_ids(model, 20, 40)}] + [
        {"prompt_token_ids": document_ids(model, seed, 600)} for seed in seeds]
    out = run_replica(tmp_path_factory.mktemp("tiers-cold"), "cold", model, None, requests)
    return dict(zip(seeds, out["results"][1:], strict=True))


def hits(out: str) -> tuple[int, int]:
    match = re.search(r"hit_chunks=(\d+)/(\d+)", out)
    assert match, out
    return int(match.group(1)), int(match.group(2))


@pytest.mark.parametrize("kind", ["resp", "valkey"])
def test_two_nodes_share_through_one_redis(redis: dict[str, Any], kind: str) -> None:
    with LMCacheServer(tier_policy(kind, redis["port"])) as node1:
        stored = run_mp_client("store", node1.url)
        assert stored.returncode == 0 and "STORE ok = True" in stored.stdout, stored.stderr[-2000:]
    # node 1 is gone (its memory with it): node 2 can only read what Redis holds
    with LMCacheServer(tier_policy(kind, redis["port"])) as node2:
        fetched = run_mp_client("fetch", node2.url)
        assert fetched.returncode == 0 and "bytes_equal = True" in fetched.stdout, fetched.stdout + fetched.stderr[-2000:]
        assert hits(fetched.stdout) == (4, 4)
        assert hits(run_mp_client("lookup", node2.url, model="other/model").stdout) == (0, 4)


def test_a_valkey_password_reaches_the_server_but_not_its_command_line(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Every local user reads a process's command line; only its owner reads its environment. A Redis that
    requires a password: the node's server stores and a second node's fetches byte-equal chunks through it
    (LMCache alone swaps glide's user and password, and its server exits: ``plugins.valkey_auth``), and no
    process of either server carries the password in its command line; with a wrong password (the control)
    Redis refuses the server."""
    import secrets

    password = f"pw-{secrets.token_hex(8)}"
    port, proc = start_redis(tmp_path, "--requirepass", password)
    try:
        valkey = {"type": "valkey", "startup_nodes": [f"127.0.0.1:{port}"], "request_timeout_s": 1.0,
                  "password_env": "TEST_VALKEY_PW"}
        monkeypatch.setenv("TEST_VALKEY_PW", password)
        with LMCacheServer(tier_policy("valkey", port, l2=[valkey])) as node1:
            stored = run_mp_client("store", node1.url)
            assert stored.returncode == 0 and "STORE ok = True" in stored.stdout, stored.stderr[-2000:]
            assert node1.pid is not None
            for pid in _tree(_process_table(), node1.pid):  # the server and every process under it
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                assert b"--l2-adapter" in cmdline or pid != node1.pid
                assert password.encode() not in cmdline
        with LMCacheServer(tier_policy("valkey", port, l2=[valkey])) as node2:
            fetched = run_mp_client("fetch", node2.url)
            assert "bytes_equal = True" in fetched.stdout and hits(fetched.stdout) == (4, 4), fetched.stdout
        monkeypatch.setenv("TEST_VALKEY_PW", "wrong")
        with pytest.raises(ServerError, match="WRONGPASS"):  # the control: Redis checks the password we send
            with LMCacheServer(tier_policy("valkey", port, l2=[valkey])):
                pass
    finally:
        proc.kill()
        proc.wait(timeout=10)


@pytest.mark.engine
def test_vllm_replicas_on_two_nodes_share_through_redis_and_survive_its_death(
    tmp_path: Path, redis: dict[str, Any], model: Path, cold: dict[int, dict[str, Any]]
) -> None:
    doc, second, third = (document_ids(model, seed, 600) for seed in DOC_SEEDS["redis"])
    cold_doc, cold_second, cold_third = (cold[seed] for seed in DOC_SEEDS["redis"])
    policy = tier_policy("resp", redis["port"], chunk_size=64, load={"timeout_s": 2.0})
    with LMCacheServer(policy) as node1:
        run_replica(tmp_path, "a", model, node1.policy, [{"prompt_token_ids": doc}])
    node2_policy = tier_policy("resp", redis["port"], chunk_size=64, load={"timeout_s": 2.0})
    with LMCacheServer(node2_policy) as node2:
        pid = redis["proc"].pid
        # (instance names are unique in this module: the counters are read by instance from one run dir)
        out = run_replica(tmp_path, "b-redis", model, node2.policy,
                          [{"prompt_token_ids": doc}, {"prompt_token_ids": second}, {"prompt_token_ids": third}],
                          kill_before={"1": pid})
    b_doc, b_second, b_third = out["results"]
    assert b_doc["num_cached_tokens"] >= 576 and same_output(b_doc, cold_doc)  # through Redis, from node 1
    # Redis killed before the second request: answered like a cold engine, within a bounded delay
    assert b_second["num_cached_tokens"] == 0 and same_output(b_second, cold_second)
    assert b_second["seconds"] <= cold_second["seconds"] + 2.0 + 5.0, b_second["seconds"]
    # and the next request does not pay the timeout again: the tier is skipped until it answers
    assert same_output(b_third, cold_third)
    assert b_third["seconds"] <= cold_third["seconds"] + 1.0, (b_third["seconds"], cold_third["seconds"])
    print(f"FIGURES redis-killed: cold {cold_second['seconds']:.3f}s -> {b_second['seconds']:.3f}s, "
          f"next {cold_third['seconds']:.3f}s -> {b_third['seconds']:.3f}s")
    # the row's counters: the connector's, minus the request before the kill (a hit, no fallback)
    stats = out["stats"]
    assert stats["hits"] >= 1 and redis["proc"].poll() is not None  # the fault happened: Redis is gone
    during = _after_first(stats, b_doc)
    record(Row("store down", "Redis (resp tier) killed between two requests; two MP servers as two nodes",
               "every request after it recomputes (the tier's lookups fail as misses, not counted as fallbacks, "
               "and cost no timeout); answers identical to cold", tier="resp", **during,
               identical_to_cold=same_output(b_second, cold_second) and same_output(b_third, cold_third),
               max_added_latency_s=round(max(b_second["seconds"] - cold_second["seconds"],
                                             b_third["seconds"] - cold_third["seconds"]), 3),
               budget_s=node2_policy.load.timeout_s,
               extra={"hit_before_the_kill_tokens": b_doc["num_cached_tokens"],
                      "fallback_reasons": stats["fallbacks"], "redis_exit_status": redis["proc"].poll()}))


def _after_first(stats: dict[str, Any], first: dict[str, Any]) -> dict[str, Any]:
    """A replica's final counters without its first request (served before the fault: a hit, no fallback)."""
    return {"requests": stats["requests"] - 1, "hits": stats["hits"] - (1 if first["num_cached_tokens"] else 0),
            "fallbacks": sum(stats["fallbacks"].values()),
            "tokens_loaded": stats["tokens_loaded"] - first["num_cached_tokens"]}


@pytest.mark.engine
def test_a_replica_on_a_redis_store_explains_a_mismatch_from_the_shared_manifests(
    tmp_path: Path, redis: dict[str, Any], model: Path
) -> None:
    """Redis holds no files, so fingerprints are recorded at fingerprint.manifests: a replica with another KV
    dtype loads nothing from the shared Redis and says which field differs."""
    doc = document_ids(model, 24, 600)
    manifests = tmp_path / "manifests"
    policy = tier_policy("resp", redis["port"], chunk_size=64, fingerprint={"manifests": str(manifests)})
    with LMCacheServer(policy) as node:
        run_replica(tmp_path, "fp-a", model, node.policy, [{"prompt_token_ids": doc}])
        same = run_replica(tmp_path, "fp-same", model, node.policy, [{"prompt_token_ids": doc}])
        other = run_replica(tmp_path, "fp-bf16", model, node.policy, [{"prompt_token_ids": doc}],
                            engine={"dtype": "bfloat16"})
    assert same["results"][0]["num_cached_tokens"] >= 576  # the control: same fingerprint, loaded from Redis
    assert not [e for e in same["events"] if e.get("event") == "store.incompatible"]
    assert other["results"][0]["num_cached_tokens"] == 0 and other["stats"]["tokens_loaded"] == 0
    warnings = [e for e in other["events"] if e.get("event") == "store.incompatible"]
    assert len(warnings) == 1 and any("kv_dtype" in d for d in warnings[0]["differences"]), other["events"]
    assert len(list((manifests / ".prefixshare" / "manifests").glob("*.json"))) == 2  # one per fingerprint


@pytest.mark.engine
def test_a_frozen_redis_costs_at_most_the_timeout(
    tmp_path: Path, redis: dict[str, Any], model: Path, cold: dict[int, dict[str, Any]]
) -> None:
    first, second = (document_ids(model, seed, 600) for seed in DOC_SEEDS["frozen"])
    cold_results = [cold[seed] for seed in DOC_SEEDS["frozen"]]
    policy = tier_policy("resp", redis["port"], chunk_size=64, load={"timeout_s": 2.0})
    with LMCacheServer(policy) as node:
        redis["proc"].send_signal(signal.SIGSTOP)  # frozen: connections open, nothing answers
        try:
            state = wait_state(redis["proc"].pid, "T", 5.0)
            out = run_replica(tmp_path, "frozen", model, node.policy,
                              [{"prompt_token_ids": first}, {"prompt_token_ids": second}])
            still = process_state(redis["proc"].pid)
        finally:
            redis["proc"].send_signal(signal.SIGCONT)
    assert state == still == "T", (state, still)  # the fault held for the whole run
    for got, want in zip(out["results"], cold_results, strict=True):
        assert same_output(got, want) and got["num_cached_tokens"] == 0
    assert out["results"][0]["seconds"] <= cold_results[0]["seconds"] + 2.0 + 5.0
    print("FIGURES redis-frozen: " + ", ".join(
        f"cold {w['seconds']:.3f}s -> {g['seconds']:.3f}s" for g, w in zip(out["results"], cold_results, strict=True)))
    added = [g["seconds"] - w["seconds"] for g, w in zip(out["results"], cold_results, strict=True)]
    # "then skipped": the second request did not look the frozen tier up (the health gate's store_down), and
    # the connector said why
    stats = out["stats"]
    assert stats["fallbacks"].get("store_down", 0) >= 1, stats["fallbacks"]
    down = [e for e in out["events"] if e.get("event") == "store.down"]
    assert down and all("resp" in str(e.get("probe")) for e in down), down
    record(Row("store down", "Redis (resp tier) frozen (SIGSTOP: connections open, nothing answers)",
               "the first request waits out its lookup (load timeout) and recomputes; the tier is then skipped "
               "(a PING probe tells frozen from alive); answers identical to cold", tier="resp",
               requests=stats["requests"], hits=stats["hits"], fallbacks=sum(stats["fallbacks"].values()),
               tokens_loaded=stats["tokens_loaded"],
               identical_to_cold=all(same_output(g, w) for g, w in zip(out["results"], cold_results, strict=True)),
               max_added_latency_s=round(max(added), 3), budget_s=policy.load.timeout_s,
               extra={"added_s": [round(a, 3) for a in added], "fallback_reasons": stats["fallbacks"],
                      "redis_state_during": state, "store_down_probe": down[0].get("probe")}))


def test_tier_probes_tell_alive_frozen_and_dead_apart(redis: dict[str, Any], tmp_path: Path) -> None:
    """The health gate's probe: a frozen server accepts connections but never answers PING."""
    for kind in ("resp", "valkey"):
        tier = tier_policy(kind, redis["port"]).l2[0]
        assert tier.probe() is None
        redis["proc"].send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            assert "does not answer PING" in (tier.probe(timeout_s=0.2) or "")
            assert time.monotonic() - started < 1.0
        finally:
            redis["proc"].send_signal(signal.SIGCONT)
    redis["proc"].kill()
    redis["proc"].wait()
    assert tier_policy("resp", redis["port"]).l2[0].probe() is not None
    fs = Policy.build(l2=[{"type": "fs", "base_path": str(tmp_path)}]).l2[0]
    assert fs.probe() is None


# --- S3 ----------------------------------------------------------------------------------------------------


def _namespace_launcher(hosts: Path) -> list[str] | None:
    """LMCache's S3 client addresses buckets by virtual host (BUCKET.host): the test server runs in a private
    mount namespace whose /etc/hosts maps the bucket's name to loopback (the real file is untouched)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    launcher = [unshare, "--mount", "--propagation", "private", "sh", "-c",
                f'mount --bind "{hosts}" /etc/hosts && exec "$@"', "sh"]
    probe = subprocess.run([*launcher, "true"], capture_output=True)
    return launcher if probe.returncode == 0 else None


@pytest.fixture
def s3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    moto = shutil.which("moto_server") or str(Path(os.sys.executable).parent / "moto_server")
    if not Path(moto).exists():
        pytest.skip("moto_server is not installed (the test extra installs it)")
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost kvstore.localhost\n")
    launcher = _namespace_launcher(hosts)
    if launcher is None:
        pytest.skip("cannot give the test server its own /etc/hosts (unshare --mount not permitted here)")
    port = free_port()
    proc = subprocess.Popen([moto, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")  # the local server accepts any credentials
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    import boto3

    client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1")
    deadline = time.monotonic() + 20
    while True:
        try:
            client.create_bucket(Bucket="kvstore")
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    yield {"port": port, "client": client, "launcher": launcher}
    proc.kill()
    proc.wait(timeout=10)


def test_two_nodes_share_through_s3(s3: dict[str, Any]) -> None:
    def policy() -> Policy:
        return Policy.build(chunk_size=32, l1={"size_gb": 0.1},
                            l2=[{"type": "s3", "endpoint": f"kvstore.localhost:{s3['port']}", "region": "us-east-1",
                                 "disable_tls": True}],
                            server={"port": free_port(), "http_port": free_port(), "start_timeout_s": 90})

    with LMCacheServer(policy(), launcher=s3["launcher"]) as node1:
        stored = run_mp_client("store", node1.url)
        assert stored.returncode == 0 and "STORE ok = True" in stored.stdout, stored.stderr[-2000:]
    keys = [o["Key"] for o in s3["client"].list_objects_v2(Bucket="kvstore").get("Contents", [])]
    assert len(keys) == 4  # 128 tokens in full 32-token chunks: one object each
    with LMCacheServer(policy(), launcher=s3["launcher"]) as node2:  # empty L1: only the bucket has the bytes
        fetched = run_mp_client("fetch", node2.url)
        assert fetched.returncode == 0 and "bytes_equal = True" in fetched.stdout, fetched.stdout + fetched.stderr[-2000:]
        assert hits(run_mp_client("lookup", node2.url, model="other/model").stdout) == (0, 4)


# --- Mooncake Store ----------------------------------------------------------------------------------------
#
# One mooncake_master (with its built-in HTTP metadata server) and one standalone `mooncake_client` that holds
# the memory segment, all on loopback with random ports. The nodes' MP servers contribute no memory
# (global_segment_size: 0), so what node 1 stored outlives node 1, as with a Redis server.


def _mooncake_tool(name: str) -> str | None:
    found = shutil.which(name) or str(Path(sys.executable).parent / name)
    return found if Path(found).exists() else None


def _wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 20) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{what} exited with code {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"{what} did not listen on {port} within {timeout} s")


@pytest.fixture
def mooncake(tmp_path: Path) -> Iterator[dict[str, Any]]:
    pytest.importorskip("mooncake.store", reason="Mooncake's client (prefixshare[mooncake], Debian libibverbs1)")
    master, holder = _mooncake_tool("mooncake_master"), _mooncake_tool("mooncake_client")
    if master is None or holder is None:
        pytest.skip("mooncake_master / mooncake_client are not installed (prefixshare[mooncake])")
    rpc, http, metrics, holder_port = (free_port() for _ in range(4))
    metadata = f"http://127.0.0.1:{http}/metadata"
    log = (tmp_path / "mooncake.log").open("w")
    procs = [subprocess.Popen(
        [master, "--rpc_address=127.0.0.1", f"--rpc_port={rpc}", "--enable_http_metadata_server=true",
         "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={http}",
         "--metrics_host=127.0.0.1", f"--metrics_port={metrics}"], stdout=log, stderr=subprocess.STDOUT)]
    _wait_port(rpc, procs[0], "mooncake_master")
    _wait_port(http, procs[0], "mooncake_master's metadata server")
    procs.append(subprocess.Popen(
        [holder, "--host=127.0.0.1", f"--port={holder_port}", "--global_segment_size=512MB",
         "--local_buffer_size=16MB", f"--master_server_address=127.0.0.1:{rpc}", f"--metadata_server={metadata}",
         "--protocol=tcp"], stdout=log, stderr=subprocess.STDOUT))
    _wait_port(holder_port, procs[1], "mooncake_client (the segment holder)")
    time.sleep(0.5)  # its segment is mounted right after the service starts listening
    yield {"rpc": rpc, "metadata": metadata, "master": procs[0], "holder": procs[1]}
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
    log.close()


def mooncake_tier(m: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    return {"type": "mooncake_store", "master_server_addr": f"127.0.0.1:{m['rpc']}", "metadata_server": m["metadata"],
            "global_segment_size": 0, "local_buffer_size": "64MiB", **overrides}


def mooncake_policy(m: dict[str, Any], **overrides: Any) -> Policy:
    fields: dict[str, Any] = {"chunk_size": 32, "l1": {"size_gb": 0.1}, "l2": [mooncake_tier(m)],
                              "server": {"port": free_port(), "http_port": free_port(), "start_timeout_s": 90}}
    fields.update(overrides)
    return Policy.build(**fields)


def test_two_nodes_share_through_mooncake(mooncake: dict[str, Any]) -> None:
    assert mooncake_policy(mooncake).l2[0].probe() is None
    with LMCacheServer(mooncake_policy(mooncake)) as node1:
        stored = run_mp_client("store", node1.url)
        assert stored.returncode == 0 and "STORE ok = True" in stored.stdout, stored.stderr[-2000:]
    # node 1 is gone: node 2 reads what the segment holder keeps
    with LMCacheServer(mooncake_policy(mooncake)) as node2:
        fetched = run_mp_client("fetch", node2.url)
        assert fetched.returncode == 0 and "bytes_equal = True" in fetched.stdout, fetched.stdout + fetched.stderr[-2000:]
        assert hits(fetched.stdout) == (4, 4)
        assert hits(run_mp_client("lookup", node2.url, model="other/model").stdout) == (0, 4)


class _Chunk:
    """What the adapter uses of an LMCache MemoryObj: a buffer's bytes and address."""

    def __init__(self, size: int, fill: int | None = None) -> None:
        import ctypes

        self.raw = ctypes.create_string_buffer(size)
        if fill is not None:
            ctypes.memset(self.raw, fill, size)
        self.byte_array = memoryview(self.raw).cast("B")[:size]
        self.data_ptr = ctypes.addressof(self.raw)


def _wait_task(fd: int, query: Any, timeout: float = 60) -> Any:
    import select

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        select.select([fd], [], [], 0.05)
        result = query()
        if result:
            return result
    raise AssertionError("adapter task did not complete")


def test_mooncake_adapter_throughput_and_no_false_hits_without_master(mooncake: dict[str, Any]) -> None:
    """Two adapters (two nodes' worth of clients) round-trip TOTAL_MB through the segment holder, timed; then the
    master is killed and lookups of keys that exist must be misses (Mooncake answers -900, not 0)."""
    from lmcache.v1.distributed.api import ObjectKey

    from prefixshare.server.plugins.mooncake import MooncakeStoreL2Adapter

    params = mooncake_policy(mooncake).l2[0].server_config()["adapter_params"]
    writer, reader = MooncakeStoreL2Adapter(params), MooncakeStoreL2Adapter(params)
    try:
        chunk_mb, total_mb = 4, 128  # 4 MiB is about one 256-token chunk of an 8B model in bf16
        n = total_mb // chunk_mb
        keys = [ObjectKey(chunk_hash=i.to_bytes(16, "big"), model_name="bench/m", kv_rank=0) for i in range(n)]
        src = [_Chunk(chunk_mb << 20, fill=i) for i in range(n)]
        started = time.perf_counter()
        tid = writer.submit_store_task(keys, src)
        done = _wait_task(writer.get_store_event_fd(), writer.pop_completed_store_tasks)
        store_s = time.perf_counter() - started
        assert done[tid].is_successful() and done[tid].bytes_transferred() == total_mb << 20
        dst = [_Chunk(chunk_mb << 20) for _ in range(n)]
        started = time.perf_counter()
        tid = reader.submit_lookup_and_lock_task(keys, {})
        found = _wait_task(reader.get_lookup_and_lock_event_fd(), lambda: reader.query_lookup_and_lock_result(tid))
        lookup_s = time.perf_counter() - started
        started = time.perf_counter()
        tid = reader.submit_load_task(keys, dst)
        got = _wait_task(reader.get_load_event_fd(), lambda: reader.query_load_result(tid))
        load_s = time.perf_counter() - started
        assert found.get_indices_list() == got.get_indices_list() == list(range(n))
        assert all(bytes(d.byte_array) == bytes(s.byte_array) for d, s in zip(dst, src, strict=True))
        print(f"FIGURES mooncake adapter (tcp, loopback, {n} x {chunk_mb} MiB): store {total_mb / store_s:.0f} MiB/s, "
              f"lookup {lookup_s * 1e3:.1f} ms, load {total_mb / load_s:.0f} MiB/s")

        mooncake["master"].kill()
        mooncake["master"].wait()
        started = time.perf_counter()
        tid = reader.submit_lookup_and_lock_task(keys[:2], {})
        found = _wait_task(reader.get_lookup_and_lock_event_fd(), lambda: reader.query_lookup_and_lock_result(tid))
        assert found.get_indices_list() == []  # exists, but unconfirmable: a miss, never a hit
        print(f"FIGURES mooncake master killed: lookup answered 'miss' in {time.perf_counter() - started:.2f} s")
    finally:
        writer.close()
        reader.close()


@pytest.mark.engine
def test_vllm_replicas_on_two_nodes_share_through_mooncake_and_survive_its_master(
    tmp_path: Path, mooncake: dict[str, Any], model: Path, cold: dict[int, dict[str, Any]]
) -> None:
    docs = [document_ids(model, seed, 600) for seed in DOC_SEEDS["mooncake"]]
    cold_results = [cold[seed] for seed in DOC_SEEDS["mooncake"]]
    with LMCacheServer(mooncake_policy(mooncake, chunk_size=64, load={"timeout_s": 2.0})) as node1:
        run_replica(tmp_path, "a", model, node1.policy, [{"prompt_token_ids": docs[0]}])
    node2_policy = mooncake_policy(mooncake, chunk_size=64, load={"timeout_s": 2.0})
    with LMCacheServer(node2_policy) as node2:
        out = run_replica(tmp_path, "b-mooncake", model, node2.policy, [{"prompt_token_ids": p} for p in docs],
                          kill_before={"1": mooncake["master"].pid})
    b = out["results"]
    assert b[0]["num_cached_tokens"] >= 576 and same_output(b[0], cold_results[0])  # through Mooncake, from node 1
    # master killed before the second request: every later request is answered like a cold engine. Mooncake's
    # client answers the first lookup at once (-900: a miss), then blocks ~4 s per call while it retries: that
    # lookup outlives load.timeout_s once, the health gate probes the master and skips the tier from then on.
    for got, want in zip(b[1:], cold_results[1:], strict=True):
        assert got["num_cached_tokens"] == 0 and same_output(got, want)
        assert got["seconds"] <= want["seconds"] + 2.0 + 5.0, (got["seconds"], want["seconds"])
    down = [e for e in out["events"] if e.get("event") == "store.down"]
    assert down and all("mooncake_store" in e["probe"] for e in down), down
    assert b[3]["seconds"] <= cold_results[3]["seconds"] + 1.5, (b[3]["seconds"], cold_results[3]["seconds"])
    print("FIGURES mooncake: doc cold {:.3f}s -> via node 2 {:.3f}s; master killed: ".format(
        cold_results[0]["seconds"], b[0]["seconds"]) + ", ".join(
        f"cold {w['seconds']:.3f}s -> {g['seconds']:.3f}s" for g, w in zip(b[1:], cold_results[1:], strict=True)))
    added = [g["seconds"] - w["seconds"] for g, w in zip(b[1:], cold_results[1:], strict=True)]
    during = _after_first(out["stats"], b[0])
    assert mooncake["master"].poll() is not None  # the fault happened: the master is gone
    record(Row("store down", "Mooncake master killed between requests; two MP servers as two nodes",
               "recompute, answers identical to cold; one lookup outlives the load timeout (Mooncake's client "
               "retries ~4 s), then the health gate skips the tier", tier="mooncake_store", **during,
               identical_to_cold=all(same_output(g, w) for g, w in zip(b[1:], cold_results[1:], strict=True)),
               max_added_latency_s=round(max(added), 3), budget_s=node2_policy.load.timeout_s,
               extra={"added_s": [round(a, 3) for a in added], "fallback_reasons": out["stats"]["fallbacks"],
                      "master_exit_status": mooncake["master"].poll()}))


# --- Throughput of every tier (`prefixshare bench --tiers`) ------------------------------------------------
#
# Each tier's adapter is built from its rendering by LMCache's parser and factory and timed (store, lookup,
# load, bytes compared), with a raw baseline for fs and Redis. The default run is small and asserts only that
# figures come out and are sane. PREFIXSHARE_BENCH_TIERS_FULL=1 runs the published measurement (16 chunks of
# 6 MiB, 5 repetitions) and writes docs/benchmarks/tiers.json and the "Measured throughput" section of
# docs/tiers.md.

BENCH_FULL_ENV = "PREFIXSHARE_BENCH_TIERS_FULL"
BENCH_FULL_COMMAND = (f"{BENCH_FULL_ENV}=1 .venv/bin/python -m pytest tests/e2e/test_tiers.py "
                      "-k test_tier_throughput_bench -s   # starts Redis, moto S3, mooncake_master + mooncake_client")


def _optional_fixture(request: pytest.FixtureRequest, name: str, required: bool) -> Any:
    try:
        return request.getfixturevalue(name)
    except pytest.skip.Exception:
        if required:
            raise
        return None


def test_tier_throughput_bench(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Every tier the box can run (fs checked and plain always; Redis, S3, Mooncake when installed) through
    `prefixshare bench --tiers` in a fresh process (under the S3 server's private /etc/hosts, when there is one)."""
    import json

    import yaml

    full = os.environ.get(BENCH_FULL_ENV) == "1"
    redis_ = _optional_fixture(request, "redis", full)
    s3_ = _optional_fixture(request, "s3", full)
    mooncake_ = _optional_fixture(request, "mooncake", full)
    tiers: list[dict[str, Any]] = []
    for name, integrity in (("fs-xxh3", "xxh3"), ("fs-blake3", "blake3"), ("fs-plain", "none")):
        (tmp_path / name).mkdir()
        tiers.append({"type": "fs", "base_path": str(tmp_path / name), "integrity": integrity})
    if redis_:
        tiers.append({"type": "resp", "host": "127.0.0.1", "port": redis_["port"]})
    if s3_:
        tiers.append({"type": "s3", "endpoint": f"kvstore.localhost:{s3_['port']}", "region": "us-east-1",
                      "disable_tls": True})
    if mooncake_:
        tiers.append(mooncake_tier(mooncake_))
    policy_file = tmp_path / "tiers.yaml"
    policy_file.write_text(yaml.safe_dump({"l2": tiers}))
    sizes = [] if full else ["--tier-chunks", "4", "--tier-chunk-tokens", "16", "--shape", "tiny"]  # 64 KiB
    argv = [*(s3_["launcher"] if s3_ else []), sys.executable, "-c", "from prefixshare.cli import main; main()",
            "bench", "--tiers", str(policy_file), *sizes, "--out", str(tmp_path / "out"), "--no-docs", "--json"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900 if full else 120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(done.stdout)
    assert results["tiers"] == json.loads((tmp_path / "out" / "tiers.json").read_text())["tiers"]
    st = results["settings"]
    assert [t["type"] for t in results["tiers"]] == [t["type"] for t in tiers]
    for t in results["tiers"]:
        assert "error" not in t, t
        assert t["bytes_equal"] is True and t["chunks_loaded"] == f"{st['chunks']}/{st['chunks']}", t
        for key in ("store_mbps", "load_mbps", "lookup_ms", *(("load_evicted_mbps",) if t["type"] == "fs" else ())):
            assert t[key]["n"] == st["reps"] >= 3 and 0 < t[key]["min"] <= t[key]["median"] <= t[key]["max"], (key, t)
        if t["type"] in ("fs", "resp"):
            assert t["raw"]["store_mbps"]["median"] > 0 and t["raw"]["load_mbps"]["median"] > 0, t
            assert all(r > 0 for r in t["adapter_over_raw"].values()), t
    checked = "prefixshare.server.plugins.fs.CheckedFSL2Adapter"
    assert [t["adapter"] for t in results["tiers"][:3]] == [checked, checked, "lmcache fs"]
    print("FIGURES tiers: " + "; ".join(
        f"{t['tier']} store {t['store_mbps']['median']:.0f} / load {t['load_mbps']['median']:.0f} MB/s"
        for t in results["tiers"]))
    if full:
        from prefixshare.bench._tiers import write_docs, write_results

        repo = Path(__file__).resolve().parents[2]
        results["command"] = BENCH_FULL_COMMAND
        volatile = ("base_path", "host", "port", "endpoint", "master_server_addr", "metadata_server")
        results["notes"] = [
            "Services as the tests start them, all on loopback: Redis 7.0 (`--save ''`), moto's S3 server (a Python "
            "process), `mooncake_master` + one `mooncake_client` holding a 512 MB segment (TCP); fs on the "
            "test's temporary directory. The tiers' policy: "
            + "; ".join(f"`{json.dumps({k: v for k, v in t.items() if k not in volatile})}`" for t in tiers) + "."
        ]
        results.pop("results_path", None)
        write_results(results, repo / "docs" / "benchmarks" / "tiers.json")
        write_docs(results, repo / "docs" / "tiers.md")
