"""Policy: construction, YAML and presets, field-level errors, and renderings LMCache itself accepts."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from helpers.lmcache_parsers import parse_adapter, parse_server_argv
from prefixshare.errors import MissingExtraError, PolicyError
from prefixshare.policies import MinTokens, Pinned
from prefixshare.policies import Policy, legacy_config, legacy_yaml, list_presets, server_argv, server_env
from prefixshare.policies import resolve_secrets
from prefixshare.tiers import known_tiers, register_tier, require_client, tier_class


def _tier_examples(tmp_path: Path) -> dict[str, dict]:
    return {
        "fs": {"type": "fs", "base_path": str(tmp_path), "read_ahead_size": 1 << 20},
        "resp": {"type": "resp", "host": "127.0.0.1", "port": 6379},
        "valkey": {"type": "valkey", "startup_nodes": "127.0.0.1:6379,127.0.0.1:6380", "cluster_mode": True, "ttl_s": 3600},
        "s3": {"type": "s3", "endpoint": "kv-bucket.s3.us-east-1.amazonaws.com", "region": "us-east-1"},
        "mooncake_store": {
            "type": "mooncake_store",
            "master_server_addr": "127.0.0.1:50051",
            "metadata_server": "http://127.0.0.1:8080/metadata",
            "global_segment_size": "1GiB",
        },
        "nixl_store": {"type": "nixl_store", "file_path": str(tmp_path), "file_size": "64MiB"},
    }


def _problems(exc: PolicyError) -> dict[str, str]:
    return {p.loc: str(p) for p in exc.problems}


# --- rendering accepted by LMCache's own parsers ------------------------------------------------------


def test_default_policy_argv_is_accepted_by_lmcache(tmp_path: Path) -> None:
    policy = Policy.build(chunk_size=64, l2=[{"type": "fs", "base_path": str(tmp_path)}])
    argv = server_argv(policy)
    assert argv[1:4] == ["-m", "prefixshare.server.plugins.main", "server"]
    parsed = parse_server_argv(argv[4:])
    mp, storage = parsed["mp"], parsed["storage"]
    assert mp.chunk_size == 64 and mp.port == policy.server.port and mp.host == "127.0.0.1"
    assert mp.hash_algorithm == "blake3"
    assert mp.supported_transfer_mode == "auto"
    assert parsed["http"].http_port == policy.server.http_port
    adapters = storage.l2_adapter_config.adapters
    # the fs tier runs as prefixshare's checked fs adapter (integrity data), through LMCache's plugin type
    assert len(adapters) == 1 and adapters[0].adapter_params == {"base_path": str(tmp_path), "io_threads": 4,
                                                                "fsync": False, "digest": "xxh3"}
    assert (adapters[0].module_path, adapters[0].class_name) == ("prefixshare.server.plugins.fs", "CheckedFSL2Adapter")
    assert adapters[0].shared is True and adapters[0].persist_config.persist_enabled is True


def test_fs_tier_without_integrity_is_lmcaches_own_adapter(tmp_path: Path) -> None:
    policy = Policy.build(l2=[{"type": "fs", "base_path": str(tmp_path), "integrity": "none", "use_odirect": True}])
    [adapter] = parse_server_argv(server_argv(policy)[4:])["storage"].l2_adapter_config.adapters
    assert adapter.base_path == str(tmp_path) and adapter.use_odirect is True
    with pytest.raises(PolicyError, match="use_odirect cannot be combined with integrity checks"):
        Policy.build(l2=[{"type": "fs", "base_path": str(tmp_path), "use_odirect": True}])


@pytest.mark.parametrize("kind", ["fs", "resp", "valkey", "s3", "mooncake_store", "nixl_store"])
def test_each_tier_renders_an_adapter_lmcache_parses(tmp_path: Path, kind: str) -> None:
    tier = tier_class(kind).model_validate(_tier_examples(tmp_path)[kind])
    cfg = tier.server_config()
    assert cfg["type"] in (kind, "plugin")
    try:
        parsed = parse_adapter(cfg)
    except (ImportError, ValueError) as exc:
        if kind == "nixl_store" and "nixl" in str(exc).lower() or "unknown adapter type" in str(exc):
            pytest.skip(f"LMCache cannot load its {kind} adapter here: {exc}")
        raise
    if kind == "fs":
        assert parsed.adapter_params == {"base_path": str(tmp_path), "read_ahead_size": 1 << 20, "io_threads": 4,
                                         "fsync": False, "digest": "xxh3"}
    if kind == "valkey":
        assert parsed.startup_nodes == [("127.0.0.1", 6379), ("127.0.0.1", 6380)]
        assert parsed.cluster_mode is True
    if kind == "mooncake_store":
        # our adapter over Mooncake's Python client, through LMCache's plug-in type; Mooncake's own key names
        assert (parsed.module_path, parsed.class_name) == ("prefixshare.server.plugins.mooncake",
                                                           "MooncakeStoreL2Adapter")
        assert parsed.adapter_params["master_server_addr"] == "127.0.0.1:50051"
        assert parsed.adapter_params["global_segment_size"] == 2**30
        assert cfg["shared"] is True


def test_full_argv_with_every_parseable_tier(tmp_path: Path) -> None:
    examples = _tier_examples(tmp_path)
    policy = Policy.build(l2=[examples[k] for k in ("fs", "resp", "valkey", "s3", "mooncake_store")])
    parsed = parse_server_argv(server_argv(policy)[4:])
    assert len(parsed["storage"].l2_adapter_config.adapters) == 5


def test_every_preset_loads_and_renders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert {"single-node", "shared-nfs", "mooncake", "valkey", "redis", "s3"} <= set(list_presets())
    for name in list_presets():
        overrides = {}
        if name == "shared-nfs":  # its mount does not exist on a build machine
            overrides = {"l2": [{"type": "fs", "base_path": str(tmp_path)}]}
        policy = Policy.from_preset(name, **overrides)
        parsed = parse_server_argv(server_argv(policy)[4:])
        assert parsed["mp"].chunk_size == policy.chunk_size


def test_legacy_config_is_accepted_by_lmcache(tmp_path: Path) -> None:
    from lmcache.v1.config import LMCacheEngineConfig

    policy = Policy.build(chunk_size=128, l1={"size_gb": 0.5}, l2=[{"type": "fs", "base_path": str(tmp_path)}])
    cfg = legacy_config(policy)
    # what the in-process path cannot do is said, not dropped silently
    assert cfg.pop("_notes") == ["the in-process engine's fs connector writes and loads chunks without integrity "
                                 "checks"]
    unknown = set(cfg) - set(LMCacheEngineConfig._config_definitions)
    assert not unknown, f"LMCache would drop these keys with only a warning: {unknown}"
    engine_cfg = LMCacheEngineConfig.from_dict(cfg)
    engine_cfg.validate()
    assert engine_cfg.chunk_size == 128
    assert engine_cfg.remote_url == f"fs://localhost:0{tmp_path}"
    assert engine_cfg.max_local_cpu_size == 0.5
    # deterministic across replicas by construction (the default, Python's hash(), is seeded per process)
    assert engine_cfg.pre_caching_hash_algorithm == "sha256_cbor"
    assert "chunk_size: 128" in legacy_yaml(policy)


def test_legacy_config_explains_what_it_leaves_out(tmp_path: Path) -> None:
    ex = _tier_examples(tmp_path)
    policy = Policy.build(l2=[ex["nixl_store"], ex["mooncake_store"], ex["fs"]], tenant="acme")
    cfg = legacy_config(policy)
    assert cfg["remote_url"] == "mooncakestore://127.0.0.1:50051/"
    # the in-process engine reads mooncake_master_server_addr; the documented key is silently ignored
    assert cfg["extra_config"]["mooncake_master_server_addr"] == "127.0.0.1:50051"
    notes = " ".join(cfg["_notes"])
    assert "nixl_store" in notes and "one remote" in notes and "tenant" in notes


# --- secrets ------------------------------------------------------------------------------------------


def test_secrets_come_from_the_environment_and_are_redacted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KV_PW", "hunter2")
    policy = Policy.build(
        l2=[
            {"type": "valkey", "startup_nodes": ["127.0.0.1:6379"], "password_env": "KV_PW"},
            {"type": "resp", "host": "127.0.0.1", "port": 6380, "password_env": "KV_PW"},
        ]
    )
    real = server_argv(policy)
    shown = server_argv(policy, redact=True)
    env = server_env(policy)
    # the command line (every local user reads /proc/<pid>/cmdline) names the variable that holds the password
    assert not any("hunter2" in a for a in real + shown)
    assert env["PREFIXSHARE_L2_0_PASSWORD"] == "hunter2"
    # the server's entry point puts it in place: the valkey adapter only takes it in its config
    resolved = resolve_secrets(real, env)
    assert any('"password":"hunter2"' in a for a in resolved) and resolved != real
    with pytest.raises(ValueError, match="PREFIXSHARE_L2_0_PASSWORD"):
        resolve_secrets(real, {})
    assert resolve_secrets(server_argv(Policy.build()), {}) == server_argv(Policy.build())  # nothing to resolve
    assert env["LMCACHE_RESP_PASSWORD"] == "hunter2"  # resp: LMCache reads it from the environment
    assert server_env(policy)["LMCACHE_TRACK_USAGE"] == "false"
    assert "hunter2" not in json.dumps(policy.to_dict())


def test_mooncake_tier_probes_the_master_and_keeps_credentials_out() -> None:
    import socket

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        tier = Policy.build(l2=[{"type": "mooncake_store", "master_server_addr": f"127.0.0.1:{port}",
                                 "metadata_server": "http://10.0.0.1:8080/metadata"}]).l2[0]
        assert tier.probe() is None  # the master's RPC port answers
    assert f"127.0.0.1:{port} unreachable" in (tier.probe() or "")
    assert tier.describe() == f"mooncake_store:127.0.0.1:{port}"
    with pytest.raises(PolicyError, match=r"l2\[0\]\.metadata_server: .*contains credentials"):
        Policy.build(l2=[{"type": "mooncake_store", "master_server_addr": "h:1",
                          "metadata_server": "http://kv:s3cret@10.0.0.1:8080/metadata"}])


# --- YAML, presets, keyword construction ---------------------------------------------------------------


def test_yaml_extends_a_preset(tmp_path: Path) -> None:
    store = tmp_path / "kv"
    path = tmp_path / "p.yaml"
    path.write_text(
        textwrap.dedent(
            f"""
            preset: single-node
            chunk_size: 128
            l1: {{size_gb: 2}}
            l2:
              - type: fs
                base_path: {store}
                create: true
            admission:
              any:
                - pinned: ["manual-*"]
                - min_tokens: 1024
            """
        )
    )
    policy = Policy.from_yaml(str(path))
    assert policy.chunk_size == 128
    assert policy.l1.size_gb == 2 and policy.l1.eviction == "LRU"  # merged, not replaced
    assert policy.server.port == 5555  # from the preset
    assert [t.describe() for t in policy.l2] == [f"fs:{store}"]
    assert not store.exists()  # validation has no side effects; the server creates it
    policy.l2[0].prepare()
    assert store.is_dir() and (store.stat().st_mode & 0o777) == 0o750
    rule = policy.admission_rule()
    assert rule == (Pinned("manual-*") | MinTokens(1024))


def test_keyword_construction_accepts_rule_objects(tmp_path: Path) -> None:
    policy = Policy(admission=MinTokens(300) & ~Pinned("secret-*"), chunk_size=32)
    rule = policy.admission_rule()
    assert rule is not None
    assert policy.to_dict()["admission"] == rule.to_config()
    round_trip = Policy.build(**policy.to_dict())
    assert round_trip.admission_rule() == rule


def test_policy_round_trips_through_dict(tmp_path: Path) -> None:
    ex = _tier_examples(tmp_path)
    policy = Policy.build(l2=[ex["fs"], ex["valkey"]], tenant="t1", load={"timeout_s": 1.5})
    again = Policy.build(**policy.to_dict())
    assert again == policy
    assert server_argv(again) == server_argv(policy)


# --- errors name the field, the value and the fix -------------------------------------------------------


def test_missing_directory_error_names_field_and_fix() -> None:
    with pytest.raises(PolicyError) as info:
        Policy.build(l2=[{"type": "fs", "base_path": str(Path("/tmp"))}, {"type": "fs", "base_path": "/nfs/kv"}])
    assert str(info.value.problems[0]) == "l2[1].base_path: '/nfs/kv' does not exist; create it or set create: true"


@pytest.mark.parametrize(
    ("fields", "loc", "needle"),
    [
        ({"chunk_size": 0}, "chunk_size", "greater than 0"),
        ({"chunk_size": "many"}, "chunk_size", "integer"),
        ({"l1": {"evictoin": "LRU"}}, "l1.evictoin", "did you mean 'eviction'"),
        ({"l1": {"eviction": "FIFO"}}, "l1.eviction", "use one of"),
        ({"l2": [{"type": "fss", "base_path": "/x"}]}, "l2[0].type", "did you mean 'fs'"),
        ({"l2": [{"base_path": "/x"}]}, "l2[0].type", "add type"),
        ({"l2": [{"type": "fs", "base_path": "relative/dir"}]}, "l2[0].base_path", "absolute"),
        ({"l2": [{"type": "fs"}]}, "l2[0].base_path", "required"),
        ({"l2": [{"type": "valkey", "startup_nodes": ["redis"]}]}, "l2[0].startup_nodes", "host:port"),
        ({"l2": [{"type": "s3", "endpoint": "s3://bucket", "region": "x"}]}, "l2[0].endpoint", "virtual host"),
        ({"l2": [{"type": "nixl_store", "file_path": "/x", "file_size": "lots"}]}, "l2[0].file_size", "size"),
        ({"server": {"port": 7000, "http_port": 7000}}, "server", "own port"),
        ({"l2": [{"type": "valkey", "startup_nodes": "a:1,b:2"}]}, "l2[0]", "cluster_mode: true"),
        ({"server": {"hash_algorithm": "builtin"}}, "server.hash_algorithm", "blake3"),
        ({"tenant": "a/b"}, "tenant", "without '@'"),
        ({"admission": {"min_tokenz": 5}}, "admission", "min_tokens"),
        ({"admission": {"all": [{"min_tokens": -1}]}}, "admission.all[0].min_tokens", "positive"),
        ({"bogus": 1}, "bogus", "known fields"),
        ({"fingerprint": {"manifests": "shared/manifests"}}, "fingerprint.manifests", "absolute"),
        ({"fingerprint": {"manifests": "nfsx://host/dir"}}, "fingerprint.manifests", "s3://"),
        # Mooncake ignores these keys silently (90 s of retries, nothing stored): refused with the rename
        ({"l2": [{"type": "mooncake_store", "master_server_address": "h:1", "metadata_server": "P2PHANDSHAKE"}]},
         "l2[0]", "rename 'master_server_address' to 'master_server_addr'"),
        ({"l2": [{"type": "mooncake_store", "mooncake_master_server_addr": "h:1", "metadata_server": "x"}]},
         "l2[0]", "rename 'mooncake_master_server_addr' to 'master_server_addr'"),
        ({"l2": [{"type": "mooncake_store", "master_server_addr": "http://h:1", "metadata_server": "x"}]},
         "l2[0].master_server_addr", "127.0.0.1:50051"),
        ({"l2": [{"type": "mooncake_store", "master_server_addr": "h:1", "metadata_server": "http://h:2"}]},
         "l2[0].metadata_server", "/metadata"),
    ],
)
def test_field_errors(fields: dict, loc: str, needle: str) -> None:
    with pytest.raises(PolicyError) as info:
        Policy.build(**fields)
    problems = _problems(info.value)
    matching = [text for where, text in problems.items() if where.startswith(loc)]
    assert matching, f"no problem at {loc}: {problems}"
    assert any(needle in text for text in matching), matching


def test_all_problems_are_reported_at_once(tmp_path: Path) -> None:
    with pytest.raises(PolicyError) as info:
        Policy.build(chunk_size=-1, l1={"size_gb": 0}, l2=[{"type": "fs", "base_path": "/nope/x"}, {"type": "zz"}])
    assert set(_problems(info.value)) == {"chunk_size", "l1.size_gb", "l2[0].base_path", "l2[1].type"}


def test_yaml_syntax_and_shape_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("chunk_size: [1,\n")
    with pytest.raises(PolicyError, match=r"not valid YAML at line \d+"):
        Policy.from_yaml(str(bad))
    bad.write_text("- just\n- a list\n")
    with pytest.raises(PolicyError, match="must be a mapping"):
        Policy.from_yaml(str(bad))
    with pytest.raises(PolicyError, match="does not exist"):
        Policy.from_yaml(str(tmp_path / "missing.yaml"))
    with pytest.raises(PolicyError, match="did you mean 'single-node'"):
        Policy.from_preset("single-nod")


# --- tier registry -------------------------------------------------------------------------------------


def test_registry_is_lazy_and_extensible(tmp_path: Path) -> None:
    import sys

    assert set(known_tiers()) >= {"fs", "resp", "valkey", "s3", "mooncake_store", "nixl_store"}
    from prefixshare.tiers._fs import FsTier

    class LocalMirror(FsTier):
        pass

    register_tier("mirror_test", LocalMirror)
    try:
        with pytest.raises(ValueError, match="already registered"):
            register_tier("mirror_test", LocalMirror)
        assert tier_class("mirror_test") is LocalMirror
    finally:
        from prefixshare import tiers

        tiers._REGISTRY.pop("mirror_test")
        tiers._LOADED.pop("mirror_test")
    with pytest.raises(KeyError, match="did you mean 'valkey'"):
        tier_class("valky")
    assert "prefixshare.tiers._fs" in sys.modules


def test_missing_client_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = tier_class("nixl_store").model_validate(_tier_examples(tmp_path)["nixl_store"])
    monkeypatch.setattr(type(tier), "requires_module", "prefixshare_no_such_module")
    with pytest.raises(MissingExtraError, match=r"pip install 'prefixshare\[nixl\]'"):
        require_client(tier)


def test_shared_memory_is_on_by_default_and_named_after_the_port(tmp_path: Path) -> None:
    policy = Policy.build(server={"port": 7001, "http_port": 7002})
    parsed = parse_server_argv(server_argv(policy)[4:])
    assert parsed["mp"].shm_name == "prefixshare-7001"  # one segment per server: several servers per node
    off = Policy.build(server={"port": 7001, "http_port": 7002, "shm_name": None})
    assert "--shm-name" not in server_argv(off)
    with pytest.raises(PolicyError, match=r"server.shm_name: 'a/b' is not a usable shared-memory name"):
        Policy.build(server={"shm_name": "a/b"})


def test_manifests_go_where_the_policy_says_else_beside_the_fs_tier(tmp_path: Path) -> None:
    """Stores without a directory tier (Redis, Valkey, Mooncake, S3) record fingerprints at fingerprint.manifests,
    so an incompatible replica can still say why it loads nothing."""
    from prefixshare.fingerprint import EngineSettings, Fingerprint, compute_fingerprint, explain, write_manifest
    from prefixshare.model import create_model

    redis = {"type": "resp", "host": "127.0.0.1", "port": 6379}
    assert Policy.build(l2=[redis]).manifest_url is None
    assert Policy.build(l2=[{"type": "fs", "base_path": str(tmp_path), "create": True}]).manifest_url == str(tmp_path)
    policy = Policy.build(l2=[redis], fingerprint={"manifests": "memory://ps-manifests"})
    url = policy.manifest_url
    assert url == "memory://ps-manifests"
    model = create_model(tmp_path / "m", shape="tiny", seed=0)
    written: Fingerprint = compute_fingerprint(model, EngineSettings(engine="vllm", kv_dtype="float32"))
    write_manifest(url, written)
    reader = compute_fingerprint(model, EngineSettings(engine="vllm", kv_dtype="bfloat16"))
    [(manifest, diffs)] = explain(url, reader)
    assert manifest.digest == written.digest and any("kv_dtype" in d.field for d in diffs)


def test_io_threads_and_fsync_belong_to_the_checked_adapter(tmp_path: Path) -> None:
    policy = Policy.build(l2=[{"type": "fs", "base_path": str(tmp_path), "io_threads": 8, "fsync": True}])
    params = policy.l2[0].server_config()["adapter_params"]
    assert params["io_threads"] == 8 and params["fsync"] is True
    with pytest.raises(PolicyError) as info:
        Policy.build(l2=[{"type": "fs", "base_path": str(tmp_path), "integrity": "none", "fsync": True}])
    assert "l2[0]" in str(info.value) and "set integrity: xxh3 (the default), or drop io_threads / fsync" in str(info.value)
    with pytest.raises(PolicyError, match="io_threads"):
        Policy.build(l2=[{"type": "fs", "base_path": str(tmp_path), "io_threads": 0}])
