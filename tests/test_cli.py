"""CLI: policy init/validate/render and server start/status/stop, through the real app."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from conftest import free_port
from helpers.lmcache_parsers import parse_server_argv
from prefixshare.policies import Policy

runner = CliRunner()


def invoke(cli: typer.Typer, *args: str) -> object:
    return runner.invoke(cli, list(args), env={"COLUMNS": "200"})


def test_init_writes_a_valid_commented_policy(cli: typer.Typer, tmp_path: Path) -> None:
    for preset in ("single-node", "shared-nfs", "valkey", "mooncake"):
        store = tmp_path / preset
        store.mkdir()
        result = invoke(cli, "policy", "init", "--preset", preset, "--store", str(store))
        assert result.exit_code == 0, result.output
        assert result.output.startswith("# prefixshare policy")
        path = tmp_path / f"{preset}.yaml"
        path.write_text(result.output)
        policy = Policy.from_yaml(str(path))
        if preset in ("single-node", "shared-nfs"):
            assert policy.l2[0].base_path == str(store)
        # every commented example is itself valid when uncommented
        optional = "\n".join(
            ln[2:] for ln in result.output.split("optional settings")[1].splitlines()[1:] if ln.startswith("# ")
            and not ln.startswith("# Other")
        )
        Policy.build(**yaml.safe_load(optional))


def test_init_json_lists_presets_and_carries_the_starter_yaml(cli: typer.Typer, tmp_path: Path) -> None:
    listed = invoke(cli, "policy", "init", "--list", "--json")
    assert listed.exit_code == 0, listed.output
    presets = {p["name"]: p["description"] for p in json.loads(listed.output)}
    assert {"single-node", "shared-nfs", "valkey", "mooncake"} <= set(presets)
    assert presets["single-node"].startswith("One node") and all(presets.values())
    assert invoke(cli, "policy", "init", "--list").output.split() == sorted(presets)  # human output unchanged

    result = invoke(cli, "policy", "init", "--preset", "shared-nfs", "--store", str(tmp_path), "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["preset"] == "shared-nfs" and data["store"] == str(tmp_path)
    assert data["yaml"] == invoke(cli, "policy", "init", "--preset", "shared-nfs", "--store", str(tmp_path)).output
    assert data["settings"] == yaml.safe_load(data["yaml"]) and data["settings"]["preset"] == "shared-nfs"
    path = tmp_path / "p.yaml"
    path.write_text(data["yaml"])
    assert Policy.from_yaml(str(path)).l2[0].base_path == str(tmp_path)
    unknown = invoke(cli, "policy", "init", "--preset", "nope", "--json")
    assert unknown.exit_code == 2 and "Traceback" not in unknown.output and "not a shipped preset" in unknown.output


def test_validate_exit_codes_and_json(cli: typer.Typer, tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(f"chunk_size: 64\nl2:\n  - type: fs\n    base_path: {tmp_path}\n")
    ok = invoke(cli, "policy", "validate", str(good), "--json")
    assert ok.exit_code == 0 and json.loads(ok.output)["valid"] is True
    bad = tmp_path / "bad.yaml"
    bad.write_text("chunk_size: 0\nl2:\n  - type: fs\n    base_path: /nfs/kv\n")
    result = invoke(cli, "policy", "validate", str(bad), "--json")
    assert result.exit_code == 2
    problems = {p["loc"]: p for p in json.loads(result.output)["problems"]}
    assert problems["l2[0].base_path"]["fix"] == "create it or set create: true"
    assert problems["chunk_size"]["value"] == 0
    text = invoke(cli, "policy", "validate", str(bad))
    assert text.exit_code == 2 and "Traceback" not in text.output
    assert "l2[0].base_path: '/nfs/kv' does not exist; create it or set create: true" in text.output
    missing = invoke(cli, "policy", "validate", str(tmp_path / "nope.yaml"))
    assert missing.exit_code == 2 and "Traceback" not in missing.output


def test_render_json_is_what_lmcache_parses(cli: typer.Typer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VK_PW", "s3cret")
    path = tmp_path / "p.yaml"
    path.write_text(
        f"l2:\n  - type: fs\n    base_path: {tmp_path}\n"
        "  - type: valkey\n    startup_nodes: [127.0.0.1:6379]\n    password_env: VK_PW\n"
    )
    result = invoke(cli, "policy", "render", str(path), "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    # LMCache's server with prefixshare's guards (an abandoned store is discarded, not admitted)
    assert data["server_argv"][:4] == ["python", "-m", "prefixshare.server.plugins.main", "server"]
    assert "s3cret" not in result.output  # masked unless --show-secrets
    assert data["server_env"]["PREFIXSHARE_L2_1_PASSWORD"] == "***"  # the command line refers to it
    from prefixshare.policies import resolve_secrets

    parse_server_argv(resolve_secrets(data["server_argv"], {"PREFIXSHARE_L2_1_PASSWORD": "s3cret"})[4:])
    assert data["legacy_config"]["remote_url"] == f"fs://localhost:0{tmp_path}"
    shown = invoke(cli, "policy", "render", str(path))
    assert shown.exit_code == 0 and "--l2-adapter" in shown.output and "chunk_size: 256" in shown.output


@pytest.mark.server
def test_server_start_status_stop(cli: typer.Typer, tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(
        f"chunk_size: 32\nl1: {{size_gb: 0.1}}\nl2:\n  - type: fs\n    base_path: {tmp_path / 'kv'}\n    create: true\n"
        f"server: {{port: {free_port()}, http_port: {free_port()}, start_timeout_s: 90}}\n"
    )
    down = invoke(cli, "server", "status", "--policy", str(path), "--json")
    assert down.exit_code == 1 and json.loads(down.output)["healthy"] is False
    try:
        started = invoke(cli, "server", "start", "--policy", str(path), "--json")
        assert started.exit_code == 0, started.output
        assert json.loads(started.output)["started"] is True
        again = invoke(cli, "server", "start", "--policy", str(path), "--json")
        assert json.loads(again.output)["started"] is False  # reused
        up = invoke(cli, "server", "status", "--policy", str(path), "--json")
        info = json.loads(up.output)
        assert up.exit_code == 0 and info["healthy"] and info["chunk_size"] == 32
    finally:
        stopped = invoke(cli, "server", "stop", "--policy", str(path), "--json")
    assert json.loads(stopped.output) == {"stopped": True}
    assert invoke(cli, "server", "status", "--policy", str(path)).exit_code == 1
