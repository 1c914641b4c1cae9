"""Isolation and exposure: tenants never read each other's KV (warmed documents included), the store's files
are not world-readable, nothing read from shared storage is unpickled, and no document id reaches outside the
store.

One vLLM replica (tests/faults/_replica.py) warms a shared document (no tenant) and a tenant's document, then
asks about both as several tenants, clearing its own prefix cache before each question so a hit can only
come from the store. Answers are compared with a cold vLLM engine's (no prefixshare) on the same token ids:
greedy ids and logprobs, as every other engine row.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from e2e.common import policy_for
from faults._common import WARMUP, counters, gen, identical, row_counters, run_steps
from faults._matrix import Row, record
from prefixshare.server import LMCacheServer

QUESTION = "What is the harbor called?"
TENANTS = ["acme", "globex", None]


# --- engine part: tenants and warmed documents -----------------------------------------------------------------


@pytest.fixture(scope="module")
def server(work: Path) -> Iterator[LMCacheServer]:
    with LMCacheServer(policy_for(work / "store", admission={"any": [{"min_tokens": 256}]})) as srv:
        yield srv


@pytest.fixture(scope="module")
def texts() -> dict[str, str]:
    from prefixshare.model import document_text

    return {"shared.md": document_text(500, seed=61), "acme-plan.md": document_text(500, seed=62),
            "raw": document_text(600, seed=63)}


@pytest.fixture(scope="module")
def run(work: Path, model: Path, docs: dict[str, list[int]], server: LMCacheServer,
        texts: dict[str, str]) -> dict[str, Any]:
    shared, plan = ["shared.md", texts["shared.md"]], ["acme-plan.md", texts["acme-plan.md"]]
    steps: list[dict[str, Any]] = [
        gen(WARMUP, docs[WARMUP], reset=False),
        {"op": "warm", "name": "warm-shared", "docs": [shared]},
        {"op": "warm", "name": "warm-acme", "docs": [plan], "tenant": "acme"},
    ]
    for tenant in TENANTS:
        steps.append({"op": "prompt", "name": f"plan-as-{tenant}", "doc": plan, "question": QUESTION,
                      "tenant": tenant, "reset": True})
        steps.append({"op": "prompt", "name": f"shared-as-{tenant}", "doc": shared, "question": QUESTION,
                      "tenant": tenant, "reset": True})
    # plain requests (no warm): a tenant's request stores under its salt; the others must not find it
    steps.append(gen("raw-acme", docs["k"], params={"prefixshare.tenant": "acme"}))
    steps.append(gen("raw-globex", docs["k"], params={"prefixshare.tenant": "globex"}))
    steps.append(gen("raw-none", docs["k"]))
    steps.append(gen("raw-acme-again", docs["k"], params={"prefixshare.tenant": "acme"}))
    # the timing side channel: the ENGINE's own prefix cache (not the store) across tenants on one engine
    steps.append(gen("local-acme", docs["l"], params={"prefixshare.tenant": "acme"}))
    steps.append(gen("local-globex", docs["l"], params={"prefixshare.tenant": "globex"}, reset=False))
    # ...closed by the tenant's salt as the engine's cache_salt: what prompt_for's engine_input() sends
    steps.append(gen("local-acme-2", docs["j"], params={"prefixshare.tenant": "acme"}, cache_salt="t-acme"))
    steps.append(gen("local-globex-salted", docs["j"], params={"prefixshare.tenant": "globex"},
                     cache_salt="t-globex", reset=False))
    # salts that a joined rule ("-".join of tenant, LoRA, request salt) made equal: a tenant named with the
    # separator vs another tenant plus a request salt; a request with no tenant whose own salt is a tenant's
    steps.append(gen("collide-a-b", docs["a"], params={"prefixshare.tenant": "a-b"}))
    steps.append(gen("collide-a+b", docs["a"], params={"prefixshare.tenant": "a"}, cache_salt="b"))
    steps.append(gen("collide-a-b-again", docs["a"], params={"prefixshare.tenant": "a-b"}))
    steps.append(gen("spoof-acme", docs["b"], params={"prefixshare.tenant": "acme"}))
    steps.append(gen("spoof-untenanted", docs["b"], cache_salt="t-acme"))
    steps.append(gen("spoof-acme-again", docs["b"], params={"prefixshare.tenant": "acme"}))
    return run_steps(work, "isolation", model, server.policy, steps)


@pytest.fixture(scope="module")
def cold_prompts(work: Path, model: Path, docs: dict[str, list[int]], run: dict[str, Any]) -> dict[str, Any]:
    """A cold engine (no prefixshare) answering every prompt the replica built with prompt_for."""
    prompts = [gen(r["name"], r["prompt"]) for r in run["results"] if r["op"] == "prompt"]
    return run_steps(work, "isolation-cold", model, None, [gen(WARMUP, docs[WARMUP], reset=False), *prompts])["by_name"]


def _cold_for(name: str, cold: dict[str, Any], cold_prompts: dict[str, Any]) -> dict[str, Any]:
    """The cold answer to a step: prompt_for's prompts from cold_prompts, the raw requests (document k) from the
    suite's cold engine."""
    return cold_prompts[name] if name in cold_prompts else cold["k" if name.startswith("raw-") else name]


def _sum(parts: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {k: sum(p[k] for p in parts) for k in ("requests", "hits", "fallbacks", "tokens_loaded")}
    return out


@pytest.mark.engine
@pytest.mark.server
def test_tenants_never_hit_each_other_including_warmed_documents(
    run: dict[str, Any], cold: dict[str, Any], cold_prompts: dict[str, Any]
) -> None:
    by = run["by_name"]
    for step in ("warm-shared", "warm-acme"):
        report = by[step]["report"]
        assert [d["status"] for d in report["documents"]] == ["warmed"], report
    hits = {name: by[name]["num_cached_tokens"] for name in by if name.startswith(("plan-as", "shared-as", "raw-"))}
    prefix = {name: by[name]["prefix_tokens"] for name in by if name.startswith(("plan-as", "shared-as"))}
    own = {"plan-as-acme": True, "shared-as-None": True}
    for name, cached in hits.items():
        if name in own:
            assert cached >= prefix[name] // 64 * 64, (name, cached, prefix[name])
        elif name == "raw-acme-again":
            assert cached >= 576, cached
        else:
            assert cached == 0, (name, cached)  # another tenant's KV, or the first writer
    same = {name: identical(by[name], _cold_for(name, cold, cold_prompts)) for name in hits}
    assert all(same.values()), same
    cross = [n for n in hits if n not in own and n not in ("raw-acme", "raw-acme-again")]
    c = counters(run, "plan-as-acme", "raw-acme-again")
    assert c["requests"] == len(hits) and c["hits"] == len(own) + 1, c  # own documents and acme's raw request
    # the fault is real: acme's KV is in the store (acme hits it), and the others asked for exactly that
    present = {"acme_plan_hit": hits["plan-as-acme"] > 0, "acme_raw_hit": hits["raw-acme-again"] > 0}
    assert all(present.values()), present
    record(Row("isolation and exposure", "two tenants (and untenanted requests) ask about each other's documents, "
               "warmed (prefixshare.warm tenant=...) or stored by requests",
               "0 cross-tenant hits; each tenant hits its own documents; answers identical to a cold engine",
               **row_counters(c), identical_to_cold=all(same.values()),
               extra={"cross_tenant_requests": len(cross),
                      "cross_tenant_hits": sum(1 for n in cross if hits[n] > 0), **present}))


@pytest.mark.engine
@pytest.mark.server
def test_salts_that_a_joined_rule_made_equal_load_nothing_from_each_other(run: dict[str, Any],
                                                                          cold: dict[str, Any]) -> None:
    by = run["by_name"]
    cached = {n: by[n]["num_cached_tokens"] for n in by if n.startswith(("collide-", "spoof-"))}
    # the fault is real: the first writer's KV is in the store (its own tenant's repeat loads it) ...
    assert cached["collide-a-b-again"] >= 576 and cached["spoof-acme-again"] >= 576, cached
    # ... and the colliding salt and the spoofing salt asked for exactly those chunks, and got none
    assert cached["collide-a+b"] == 0 and cached["spoof-untenanted"] == 0, cached
    same = {n: identical(by[n], cold["a" if n.startswith("collide") else "b"]) for n in cached}
    assert all(same.values()), same
    record(Row("isolation and exposure", "salts a joined rule made equal: tenant 'a-b' vs tenant 'a' with "
               "cache_salt 'b'; an untenanted request with cache_salt 't-acme' (tenant acme's salt)",
               "0 tokens loaded across; each first writer's own tenant loads its KV (576+ tokens); answers "
               "identical to a cold engine", **row_counters(counters(run, "collide-a-b", "spoof-acme-again")),
               identical_to_cold=all(same.values()), extra={"cached_tokens": cached}))


@pytest.mark.engine
@pytest.mark.server
def test_a_shared_document_is_shared_only_with_untenanted_requests(
    run: dict[str, Any], cold: dict[str, Any], cold_prompts: dict[str, Any]
) -> None:
    """There is no per-document 'share with tenants' switch: a document warmed without a tenant lives in the
    untenanted namespace; a tenant's request salts its keys and never reads it (recorded as a known limit)."""
    by = run["by_name"]
    names = [f"shared-as-{t}" for t in TENANTS]
    assert by["shared-as-None"]["num_cached_tokens"] > 0
    assert by["shared-as-acme"]["num_cached_tokens"] == 0 and by["shared-as-globex"]["num_cached_tokens"] == 0
    same = all(identical(by[n], _cold_for(n, cold, cold_prompts)) for n in names)
    assert same
    c = _sum([counters(run, n) for n in names])
    assert c["requests"] == len(names) and c["hits"] == 1, c
    record(Row("isolation and exposure", "a document warmed without a tenant (shared), asked by tenants",
               "served to untenanted requests only; tenant requests recompute it (explicit sharing of one document "
               "with tenants is not supported: no cross-tenant read is possible)",
               **row_counters(c), identical_to_cold=same,
               extra={"cached_tokens": {n: by[n]["num_cached_tokens"] for n in names}}))


def _modes(root: Path) -> list[tuple[str, str]]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            out.append((str(path.relative_to(root)), oct(stat.S_IMODE(path.lstat().st_mode))))
    return out


@pytest.mark.engine
@pytest.mark.server
def test_store_files_and_manifests_are_not_world_readable(run: dict[str, Any], server: LMCacheServer,
                                                         work: Path) -> None:
    root = work / "store"
    modes = _modes(root)
    kinds = {"chunks": [m for p, m in modes if p.endswith(".data")],
             "manifests": [m for p, m in modes if "manifest" in p],
             "registry": [m for p, m in modes if p.startswith(".prefixshare/documents") and p.endswith(".json")]}
    assert kinds["chunks"] and kinds["registry"], modes
    exposed = [(p, m) for p, m in modes if int(m, 8) & 0o007]
    assert not exposed, exposed  # nothing for "others": no read, no write, no listing
    assert not int(oct(stat.S_IMODE(root.stat().st_mode)), 8) & 0o007
    c = counters(run, run["results"][0]["name"], run["results"][-1]["name"])  # the requests that wrote the store
    record(Row("isolation and exposure", "local users other than the store's owner and group read the store",
               "every chunk file, manifest and registry record is 0640 (directories 0750): the MP server runs "
               "under umask 027, our own files are written 0640",
               **row_counters(c), extra={"files": len(modes), "exposed": len(exposed), "chunk_modes": sorted(set(kinds["chunks"])),
                                     "manifest_modes": sorted(set(kinds["manifests"])),
                                     "registry_modes": sorted(set(kinds["registry"]))}))


# --- no pickle from shared storage -------------------------------------------------------------------------------


class _Boom:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_nothing_read_from_shared_storage_is_unpickled(tmp_path: Path, cli: typer.Typer) -> None:
    """Plant pickles that run a command when unpickled wherever prefixshare reads the shared store (registry
    records, manifests, chunk files), then run every reader: inspect, doctor, gc --dry-run, the registry, the
    manifest reader. The command never runs; the planted files are reported as unreadable."""
    import yaml

    from prefixshare.fingerprint import read_manifests
    from prefixshare.warm import Registry

    store = tmp_path / "store"
    marker = tmp_path / "PWNED"
    payload = pickle.dumps(_Boom(marker))
    fp = "ab" * 32
    planted = [
        store / ".prefixshare" / "documents" / fp / "doc.json",
        store / ".prefixshare" / "documents" / fp / "evil.pkl",
        store / "prefixshare-0123456789abcdef0123@0@0@deadbeef.data",
    ]
    for manifest_dir in (".prefixshare", ".prefixshare/manifests"):
        planted.append(store / manifest_dir / f"{fp}.json")
    for path in planted:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(payload)
    # the planted payload is really hostile: unpickled (in a throwaway process) it runs its command
    subprocess.run([sys.executable, "-c", "import pickle, sys; pickle.loads(open(sys.argv[1], 'rb').read())",
                    str(planted[0])], check=False, capture_output=True, timeout=60)
    ran_when_unpickled = marker.exists()
    assert ran_when_unpickled, "the control unpickling did not run the payload"
    marker.unlink()
    policy = policy_for(store)
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(yaml.safe_dump(policy.to_dict()))

    records = Registry(store).records()
    assert not records.records and records.corrupt
    manifests = read_manifests(str(store))
    assert list(manifests) == [] or all(hasattr(m, "fingerprint") for m in manifests)
    runner = CliRunner()
    outputs = {}
    for argv in (["inspect", "--policy", str(policy_file), "--json"], ["doctor", "--policy", str(policy_file), "--json"],
                 ["gc", "--policy", str(policy_file), "--max-bytes", "0", "--dry-run"]):
        result = runner.invoke(cli, argv)
        outputs[argv[0]] = result.exit_code
        assert "Traceback" not in result.output, result.output
    assert not marker.exists()

    # and statically: no module of prefixshare can unpickle (or yaml-load unsafely) anything
    src = Path(__file__).resolve().parents[2] / "src" / "prefixshare"
    bad = re.compile(r"\bpickle\.loads?\(|\bcloudpickle\b|\bdill\b|torch\.load\(|yaml\.load\(|yaml\.unsafe_load|"
                     r"\bmarshal\.loads?\(|\beval\(|\bexec\(")
    found = [f"{p.relative_to(src)}:{i}" for p in src.rglob("*.py")
             for i, line in enumerate(p.read_text().splitlines(), 1) if bad.search(line)]
    assert not found, found
    record(Row("isolation and exposure", "pickles that run a command when loaded, planted in the registry, the "
               "manifest directory and as a chunk file",
               "never unpickled: registry and manifest readers parse JSON only (the planted files are reported as "
               "unreadable), chunk files are never opened by inspect/gc; no pickle/eval/yaml.load in the package",
               engine="none", extra={"planted": len(planted), "payload_runs_when_unpickled": ran_when_unpickled,
                                     "command_ran": marker.exists(), "exit_codes": outputs,
                                     "corrupt_records": len(records.corrupt)}))


# --- document ids cannot escape the store root ----------------------------------------------------------------


EVIL_IDS = ["../../etc/x", "/etc/passwd", "a\x00b", "..", ".", "", "guide/../../../x", "C:\\windows\\x",
            "ok/..", "~root/.ssh/id_rsa", "x" * 5000, "%2e%2e%2fx", "\u202e.json"]


def test_document_ids_cannot_escape_the_store(tmp_path: Path) -> None:
    from prefixshare.warm import DocumentRecord, Registry, safe_name

    store = tmp_path / "store"
    registry = Registry(store)
    fp = "cd" * 32
    outcomes: dict[str, str] = {}
    for doc_id in EVIL_IDS:
        name = safe_name(doc_id)
        try:
            path = registry.path(fp, doc_id)
        except Exception as exc:  # noqa: BLE001 - a clear error is an acceptable answer
            assert "Traceback" not in str(exc)
            outcomes[repr(doc_id)[:40]] = f"refused: {type(exc).__name__}"
            continue
        assert path.resolve().parent == (store / ".prefixshare" / "documents" / fp).resolve(), (doc_id, path)
        assert "/" not in name and "\x00" not in name and name not in (".", "..")
        record_ = DocumentRecord(id=doc_id, text_hash="t", template_digest="d", prefix_digest="p", tokens=64,
                                 chunk_tokens=64, chunk_size=64, chunks=1, chunk_hashes=["00"], bytes=1,
                                 fingerprint=fp, namespace="prefixshare-x", warmed_at="now", host="h")
        written = registry.put(record_)
        assert written == path and written.exists()
        got = registry.get(fp, doc_id)
        assert got is not None and got.id == doc_id  # the id round-trips verbatim inside the JSON
        outcomes[repr(doc_id)[:40]] = name[:24]
    inside = {p.resolve() for p in store.rglob("*")}
    assert all(str(p).startswith(str(store.resolve())) for p in inside)
    assert not any(tmp_path.joinpath(x).exists() for x in ("etc", "x", "windows"))
    assert not any(p.name == "x" for p in tmp_path.rglob("x") if store not in p.parents)
    record(Row("isolation and exposure", "document ids with path traversal, absolute paths, NUL bytes, empty, "
               "over-long and bidi names (registry put/get, as warm and prompt_for use it)",
               "plain names are kept, every other id is stored under a digest name inside the registry; "
               "the id round-trips verbatim inside the JSON; nothing is written outside the store",
               engine="none", extra={"cases": len(EVIL_IDS), "ids": outcomes}))


def test_warm_cli_and_prompt_for_with_hostile_ids(tmp_path: Path, cli: typer.Typer) -> None:
    """The warm front ends: documents named by hostile ids never leave the store, and a document id that is
    not registered is not opened as a path outside what the caller gave."""
    from prefixshare.warm import DocumentError, resolve_documents

    outcomes: dict[str, str] = {}
    for doc_id in EVIL_IDS:
        try:
            (doc,) = resolve_documents([(doc_id, "some text")])
        except DocumentError as exc:
            outcomes[repr(doc_id)[:40]] = f"refused: {str(exc)[:60]}"
            assert "document id" in str(exc)
            continue
        assert doc.id == doc_id and doc.source is None  # ids are data, never paths
        outcomes[repr(doc_id)[:40]] = "kept as data"
    assert outcomes[repr("a\x00b")].startswith("refused") and outcomes[repr("")].startswith("refused")
    outside = tmp_path / "outside.txt"
    outside.write_text("secret")
    runner = CliRunner()
    result = runner.invoke(cli, ["warm", str(tmp_path / "nope" / ".." / ".." / "missing-dir"),
                                 "--policy", str(tmp_path / "missing.yaml"), "--model", "/nonexistent"])
    assert result.exit_code != 0 and "Traceback" not in result.output, result.output
    record(Row("isolation and exposure", "hostile document ids and paths given to warm (API and CLI)",
               "ids are kept as data (never joined to a path); a missing policy/document path fails with a "
               "clear message, no traceback; NUL/control characters, empty and over-long ids are refused by name",
               engine="none", extra={"cases": len(EVIL_IDS) + 1, "cli_exit": result.exit_code, "ids": outcomes}))


@pytest.mark.engine
@pytest.mark.server
def test_the_engines_own_prefix_cache_is_a_timing_side_channel_unless_salted(
    run: dict[str, Any], cold: dict[str, Any]
) -> None:
    """prefixshare's tenant salts the STORE's keys. vLLM's own prefix cache is keyed by the prompt (and vLLM's
    per-request ``cache_salt``) only: on one engine, tenant B's request reuses blocks tenant A's request left,
    which shows in B's time to first token. Setting vLLM's ``cache_salt`` to the tenant's salt closes it; prompts
    from ``prompt_for(..., tenant=...)`` carry it (the store key counts it once)."""
    by = run["by_name"]
    leak, salted = by["local-globex"], by["local-globex-salted"]
    assert leak["num_cached_tokens"] >= 576, leak["num_cached_tokens"]  # blocks of acme's request, reused
    assert salted["num_cached_tokens"] == 0
    same = identical(leak, cold["l"]) and identical(salted, cold["j"])
    assert same
    c = counters(run, "local-acme", "local-globex-salted")
    assert c["requests"] == 4, c
    record(Row("isolation and exposure", "tenant B sends tenant A's prompt to the same engine right after A "
               "(engine prefix cache not cleared)",
               "the store is not read (tenant salt) but vLLM's own prefix cache serves B from A's blocks: a "
               "timing side channel (TTFT); closed by the tenant's salt as vLLM's cache_salt, which prompt_for "
               "sends (raw requests: cache_salt 't-<tenant>'); then 0 cached tokens",
               **row_counters(c), identical_to_cold=same,
               extra={"prompt_tokens": leak["prompt_tokens"], "unsalted_cached_tokens": leak["num_cached_tokens"],
                      "unsalted_s": round(leak["seconds"], 3), "salted_cached_tokens": salted["num_cached_tokens"],
                      "salted_s": round(salted["seconds"], 3)}))
