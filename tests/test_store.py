"""inspect, gc and doctor over real files in a directory store (chunk files named as LMCache's fs tier names
them, registry records, manifests), through the API and the CLI's --json output."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from conftest import free_port
from prefixshare.keys import namespace
from prefixshare.fingerprint import EngineSettings, compute_fingerprint, write_manifest
from prefixshare.policies import Policy
from prefixshare.store import doctor, plan_gc, run_gc
from prefixshare.warm import DocumentRecord, Registry, chunk_file_name

runner = CliRunner()
DAY = 86400.0
CHUNK_BYTES = 1000
SETTINGS = EngineSettings(engine="vllm", kv_layout="vllm-0.32/cpu/default", kv_dtype="float32", block_size=32,
                          chunk_size=64)


def invoke(cli: typer.Typer, *args: str) -> Any:
    return runner.invoke(cli, list(args), env={"COLUMNS": "200"})


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from prefixshare.model import create_model

    root = tmp_path_factory.mktemp("store-models")
    return {"a": create_model(root / "a", shape="tiny", seed=0), "b": create_model(root / "b", shape="tiny", seed=1)}


def _policy_file(tmp_path: Path, store: Path) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(f"chunk_size: 64\nl2:\n  - type: fs\n    base_path: {store}\n"
                    f"server:\n  port: {free_port()}\n  http_port: {free_port()}\n")
    return path


def _chunk(store: Path, ns: str, i: int, age_days: float, now: float, salt: str = "") -> Path:
    path = store / chunk_file_name(ns, 0x01000100, 0, f"{i:064x}", salt)
    path.write_bytes(b"\0" * CHUNK_BYTES)
    os.utime(path, (now - age_days * DAY, now - age_days * DAY))
    return path


def _record(store: Path, fp: str, ns: str, doc_id: str, hashes: list[int]) -> Path:
    record = DocumentRecord(id=doc_id, text_hash="t", template_digest="x", prefix_digest="p", tokens=64 * len(hashes),
                            chunk_tokens=64 * len(hashes), chunk_size=64, chunks=len(hashes),
                            chunk_hashes=[f"{i:064x}" for i in hashes], objects=[(0x01000100, 0)], bytes=0,
                            fingerprint=fp, namespace=ns, warmed_at="2026-01-01T00:00:00+00:00", host="h")
    return Registry(store).put(record)


@pytest.fixture
def populated(tmp_path: Path, models: dict[str, Path]) -> dict[str, Any]:
    """Two namespaces of aged chunks, a foreign namespace, registry records, a corrupt manifest and record."""
    store = tmp_path / "store"
    store.mkdir(mode=0o750)
    now = time.time()
    fp = compute_fingerprint(models["a"], SETTINGS)
    ns = namespace(fp)
    write_manifest(str(store), fp)
    other = "prefixshare-" + "e" * 20
    files = {
        "old": [_chunk(store, ns, i, 10, now) for i in range(3)],          # beyond a 7d TTL
        "mid": [_chunk(store, ns, i, 3.7 - i * 0.1, now) for i in range(3, 8)],  # 3.4 .. 3.0 days old
        "new": [_chunk(store, other, i, 0.5, now, salt="t-acme") for i in range(8, 10)],
        "foreign": [_chunk(store, "plain-lmcache-model", i, 30, now) for i in range(10, 12)],
    }
    stale_tmp = store / (chunk_file_name(ns, 0x01000100, 0, "f" * 64)[: -len(".data")] + ".tmp")
    stale_tmp.write_bytes(b"x" * 10)
    os.utime(stale_tmp, (now - 9 * DAY, now - 9 * DAY))
    records = {
        "gone": _record(store, fp.digest, ns, "manual-old", [0, 1, 3]),    # loses chunks 0, 1 to the TTL
        "kept": _record(store, fp.digest, ns, "guide/intro.md", [6, 7]),   # newest chunks of ns
        "partial": _record(store, fp.digest, ns, "manual-partial", [6, 99]),  # chunk 99 is not there
    }
    corrupt_record = Registry(store).base / fp.digest / "broken.json"
    corrupt_record.write_text("{not json")
    corrupt_manifest = store / ".prefixshare" / "manifests" / ("0" * 32 + ".json")
    corrupt_manifest.write_text('{"format": "prefixshare-manifest/1"}')
    return {"store": store, "now": now, "fp": fp, "ns": ns, "other": other, "files": files, "records": records,
            "tmp": stale_tmp, "corrupt_record": corrupt_record, "corrupt_manifest": corrupt_manifest,
            "policy_file": _policy_file(tmp_path, store)}


def _all_files(store: Path) -> set[str]:
    return {str(p) for p in store.rglob("*") if p.is_file()}


def test_inspect_reports_namespaces_documents_and_corruption(populated: dict[str, Any], cli: typer.Typer) -> None:
    result = invoke(cli, "inspect", "--policy", str(populated["policy_file"]), "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    by_ns = {n["namespace"]: n for n in data["namespaces"]}
    ns = by_ns[populated["ns"]]
    assert ns["chunk_files"] == 8 and ns["bytes"] == 8 * CHUNK_BYTES and ns["fingerprint"] == populated["fp"].digest
    assert ns["manifest"]["kv_dtype"] == "float32" and 9.9 * DAY < ns["age_s"]["oldest"] < 10.1 * DAY
    assert {d["id"]: d["complete"] for d in ns["documents"]} == {"manual-old": True, "guide/intro.md": True,
                                                                      "manual-partial": False}
    assert by_ns[populated["other"]]["salts"] == {"t-acme": 2}
    assert by_ns["plain-lmcache-model"]["prefixshare"] is False
    assert data["totals"]["chunk_files"] == 12 and data["totals"]["tmp_files"] == 1
    assert len(data["corrupt_manifests"]) == 1 and len(data["corrupt_records"]) == 1
    text = invoke(cli, "inspect", "--policy", str(populated["policy_file"]))
    assert text.exit_code == 0 and populated["ns"] in text.output and "INCOMPLETE" in text.output


def test_gc_deletes_exactly_what_the_dry_run_reports(populated: dict[str, Any], cli: typer.Typer) -> None:
    store, policy = populated["store"], str(populated["policy_file"])
    before = _all_files(store)
    # budget: everything left after the TTL is 7 chunk files (5 mid + 2 new); keep 4 of them
    budget = str(4 * CHUNK_BYTES)
    dry = invoke(cli, "gc", "--policy", policy, "--ttl", "7d", "--max-bytes", budget, "--dry-run", "--json")
    assert dry.exit_code == 0, dry.output
    plan = json.loads(dry.stdout)
    assert _all_files(store) == before  # a dry run touches nothing
    planned = {d["path"]: d for d in plan["deletions"]}
    ttl = {str(p) for p in populated["files"]["old"]}
    oldest_mid = {str(p) for p in populated["files"]["mid"][:3]}  # oldest first until under the budget
    assert {p for p, d in planned.items() if d["reason"] == "ttl"} == ttl
    assert {p for p, d in planned.items() if d["reason"] == "max_bytes"} == oldest_mid
    assert {p for p, d in planned.items() if d["reason"] == "stale_tmp"} == {str(populated["tmp"])}
    assert {p for p, d in planned.items() if d["reason"] == "chunks_gone"} == {
        str(populated["records"]["gone"]), str(populated["records"]["partial"])}
    assert {p for p, d in planned.items() if d["reason"] == "corrupt"} == {
        str(populated["corrupt_record"]), str(populated["corrupt_manifest"])}
    assert not any("plain-lmcache-model" in p for p in planned)  # other namespaces are never touched
    assert plan["bytes_before"] == 10 * CHUNK_BYTES and plan["bytes_after"] == 4 * CHUNK_BYTES

    real = invoke(cli, "gc", "--policy", policy, "--ttl", "7d", "--max-bytes", str(4 * CHUNK_BYTES), "--json")
    assert real.exit_code == 0, real.output
    done = json.loads(real.stdout)
    assert set(done["deleted"]) == set(planned) and done["skipped"] == []
    assert _all_files(store) == before - set(planned)
    # the store now fits; a second gc has nothing to do
    again = json.loads(invoke(cli, "gc", "--policy", policy, "--ttl", "7d", "--max-bytes", str(4 * CHUNK_BYTES),
                              "--json").stdout)
    assert again["deletions"] == []


def test_gc_evicts_whole_documents_and_keeps_shared_chunks(tmp_path: Path, models: dict[str, Path]) -> None:
    """Over the byte budget, the oldest document goes as a whole (its first chunk alone would strand the rest
    of its chain), except chunks a kept document shares (a common system prompt)."""
    store = tmp_path / "store"
    store.mkdir()
    now = time.time()
    ns = "prefixshare-" + "a" * 20
    fp = "a" * 32
    old = [_chunk(store, ns, i, 2 - i * 0.01, now) for i in range(4)]  # chunk 0 is the shared prompt
    new = [_chunk(store, ns, i, 1, now) for i in range(10, 12)]
    _record(store, fp, ns, "old-doc", [0, 1, 2, 3])
    _record(store, fp, ns, "new-doc", [0, 10, 11])
    policy = Policy.from_yaml(str(_policy_file(tmp_path, store)))
    plan = plan_gc(policy, max_bytes=5 * CHUNK_BYTES)  # 6 files: one must go
    chunks = {d.path for d in plan.deletions if d.kind == "chunk"}
    assert chunks == {str(p) for p in old[1:]}  # the old document's own chunks, not the shared one
    records = {d.document for d in plan.deletions if d.kind == "record"}
    assert records == {"old-doc"} and all(p.exists() for p in old + new)
    assert {str(p) for p in old[:1] + new}.isdisjoint(chunks)


def test_gc_leaves_files_that_changed_since_the_plan(populated: dict[str, Any]) -> None:
    policy = Policy.from_yaml(str(populated["policy_file"]))
    plan = plan_gc(policy, ttl_s=7 * DAY)
    rewritten = populated["files"]["old"][0]
    os.utime(rewritten, None)  # the server wrote it again after the plan
    result = run_gc(plan)
    assert rewritten.exists() and {"path": str(rewritten), "reason": "changed since the plan"} in result.skipped
    assert all(not Path(d.path).exists() for d in result.deleted)


def test_gc_and_inspect_input_errors(populated: dict[str, Any], cli: typer.Typer, tmp_path: Path) -> None:
    policy = str(populated["policy_file"])
    assert invoke(cli, "gc", "--policy", policy).exit_code == 2  # neither --ttl nor --max-bytes
    bad = invoke(cli, "gc", "--policy", policy, "--ttl", "seven days")
    assert bad.exit_code == 2 and "Traceback" not in bad.output
    assert invoke(cli, "gc", "--policy", policy, "--max-bytes", "50G", "--dry-run", "--json").exit_code == 0
    no_fs = tmp_path / "mem.yaml"
    no_fs.write_text("chunk_size: 64\n")
    result = invoke(cli, "inspect", "--policy", str(no_fs))
    assert result.exit_code == 2 and "directory" in result.output
    assert invoke(cli, "inspect", "--policy", str(tmp_path / "missing.yaml")).exit_code == 2


def test_size_arguments_accept_short_binary_units() -> None:
    from prefixshare.cli._store import parse_size_arg

    assert parse_size_arg("50G") == 50 * 2**30 and parse_size_arg("50GB") == 50 * 10**9
    assert parse_size_arg("512MiB") == 512 * 2**20 and parse_size_arg("1024") == 1024


# --- doctor --------------------------------------------------------------------------------------------------------


def test_doctor_detects_a_store_written_by_another_model(tmp_path: Path, models: dict[str, Path],
                                                         cli: typer.Typer) -> None:
    store = tmp_path / "store"
    store.mkdir(mode=0o750)
    write_manifest(str(store), compute_fingerprint(models["b"], SETTINGS))  # written by replicas of model b
    policy = str(_policy_file(tmp_path, store))
    result = invoke(cli, "doctor", "--policy", policy, "--model", str(models["a"]), "--json")
    assert result.exit_code == 1, result.output
    data = json.loads(result.stdout)
    check = next(c for c in data["checks"] if c["name"] == "fingerprint")
    assert check["status"] == "fail" and data["verdict"].startswith("verdict: NOT READY")
    differences = check["data"]["comparisons"][0]["differences"]
    assert any("weights differ" in d for d in differences) and any("tokenizer" in d for d in differences)
    text = invoke(cli, "doctor", "--policy", policy, "--model", str(models["a"]))
    assert text.exit_code == 1 and text.output.strip().splitlines()[-1].startswith("verdict: NOT READY")
    assert "weights differ" in text.output
    # the model that wrote the store matches it
    same = json.loads(invoke(cli, "doctor", "--policy", policy, "--model", str(models["b"]), "--json").stdout)
    assert next(c for c in same["checks"] if c["name"] == "fingerprint")["status"] == "ok"
    assert same["ok"] is True and same["verdict"].startswith("verdict: READY")


def test_doctor_store_permissions_server_and_versions(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    policy = Policy.build(chunk_size=64, l2=[{"type": "fs", "base_path": str(store)}],
                          server={"port": free_port(), "http_port": free_port()})
    os.chmod(store, 0o777)
    report = doctor(policy)
    by_name = {c.name: c for c in report.checks}
    assert by_name["store"].status == "fail" and "world-writable" in by_name["store"].message
    assert by_name["server"].status == "warn"  # not running: engines start it through PrefixShare
    assert by_name["versions"].data["lmcache"] and by_name["hashing"].status == "ok"
    os.chmod(store, 0o755)
    assert {c.name: c for c in doctor(policy).checks}["store"].status == "warn"  # world-readable KV
    os.chmod(store, 0o750)
    report = doctor(policy)
    assert {c.name: c for c in report.checks}["store"].status == "ok" and report.ok


def test_doctor_bad_input_exits_2(tmp_path: Path, cli: typer.Typer) -> None:
    policy = _policy_file(tmp_path, tmp_path)
    result = invoke(cli, "doctor", "--policy", str(policy), "--model", str(tmp_path / "nope"))
    assert result.exit_code == 2 and "Traceback" not in result.output
    bad = tmp_path / "bad.yaml"
    bad.write_text("chunk_size: 0\n")
    assert invoke(cli, "doctor", "--policy", str(bad)).exit_code == 2


@pytest.mark.server
def test_doctor_against_a_running_server(tmp_path: Path) -> None:
    """With the policy's server up: reachable, same hash algorithm, telemetry off in its environment."""
    from prefixshare.server import LMCacheServer

    store = tmp_path / "store"
    policy = Policy.build(chunk_size=64, l1={"size_gb": 0.1},
                          l2=[{"type": "fs", "base_path": str(store), "create": True}],
                          server={"port": free_port(), "http_port": free_port(), "start_timeout_s": 120})
    with LMCacheServer(policy):
        report = doctor(policy)
    by_name = {c.name: c for c in report.checks}
    assert by_name["server"].status == "ok", by_name["server"]
    assert by_name["hashing"].data == {"policy": "blake3", "server": "blake3"}
    telemetry = by_name["telemetry"]
    assert telemetry.status in ("ok", "warn") and "running server reports" not in telemetry.message


def test_damaged_chunks_are_reported_by_doctor_and_removed_by_gc(populated: dict[str, Any]) -> None:
    """A chunk the server set aside on load (``*.data.corrupt``) is always garbage; with verify, every chunk
    of a checked fs tier that fails its digest (these test chunks carry no integrity data) is listed too."""
    from prefixshare.policies import Policy

    store = populated["store"]
    policy = Policy.from_yaml(str(populated["policy_file"]))
    victim = populated["files"]["mid"][0]
    set_aside = victim.with_name(victim.name + ".corrupt")
    victim.rename(set_aside)
    quick = next(c for c in doctor(policy).checks if c.name == "integrity")
    assert quick.status == "warn"
    assert sorted((d["kind"], d["reason"] if d["kind"] == "chunk" else "") for d in quick.data["damaged"]) == [
        ("chunk", "quarantined"), ("manifest", ""), ("record", "")]  # the fixture's corrupt manifest and record
    plan = plan_gc(policy, verify=False)
    assert [d.path for d in plan.deletions if d.reason == "damaged:quarantined"] == [str(set_aside)]
    verified = plan_gc(policy, verify=True)
    unverified = {d.path for d in verified.deletions if d.reason == "damaged:unverified"}
    ours = {str(p) for k in ("old", "mid", "new") for p in populated["files"][k] if p != victim}
    assert unverified == ours  # foreign namespaces (plain LMCache users) are never judged or touched
    run_gc(plan)
    assert not set_aside.exists() and populated["files"]["foreign"][0].exists()
    after = next(c for c in doctor(policy).checks if c.name == "integrity")
    assert after.status == "ok" and after.data["damaged"] == []


def test_doctor_probes_network_tiers_and_names_the_dead_one(tmp_path: Path) -> None:
    import socket

    from prefixshare.policies import Policy

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        tiers = [{"type": "s3", "endpoint": f"127.0.0.1:{port}", "region": "us-east-1", "disable_tls": True},
                 {"type": "resp", "host": "127.0.0.1", "port": port}]
        policy = Policy.build(l2=tiers)
        checks = [c for c in doctor(policy).checks if c.name == "store"]
    assert [c.status for c in checks] == ["ok", "fail"]  # s3: the port answers; resp: no PING reply
    assert checks[1].data["tier"] == f"resp:127.0.0.1:{port}" and "does not answer" in checks[1].message
    after = [c for c in doctor(policy).checks if c.name == "store"]  # the listener is closed now
    assert [c.status for c in after] == ["fail", "fail"] and "unreachable" in after[0].message
