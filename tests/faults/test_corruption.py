"""Corruption: damaged chunks and manifests are detected from the integrity data prefixshare writes, never loaded.

One writer replica (real vLLM, real LMCache MP server, fs tier with its default ``integrity: blake3``) stores
five documents. A copy of the store is then damaged, one way per document, always at the same chunk (the
4th of 10): truncated, one bit flipped, another model's chunk copied in under the right name, the file
rewritten without integrity data (as a plain LMCache fs tier writes it), the digest itself altered. A fresh
replica behind a fresh server on the damaged copy must load exactly the 3 chunks before the damage, recompute
the rest, and answer like a cold engine; the server logs one line per damaged chunk and sets it aside.
The recompute stores a good copy in its place (the store heals). ``prefixshare doctor --verify`` then lists
every damaged object (the set-aside chunks, chunks damaged since, a hand-edited manifest), ``gc --verify``
removes them, and doctor is clean afterwards.

The negative control is the same bit flip on a tier with ``integrity: none``: LMCache's plain adapter loads
the chunk and the answer changes — so the identical answers above are the checks' doing, not luck.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from e2e.common import CHUNK, policy_for
from faults._common import WARMUP, added_latency, counters, gen, identical, row_counters, run_steps
from faults._matrix import Row, record
from prefixshare.server import LMCacheServer
from prefixshare.server.plugins.integrity import verify_file
from prefixshare.keys import blake3_chunk_hashes

pytestmark = [pytest.mark.engine, pytest.mark.server]

DAMAGED_AT = 3  #: index of the damaged chunk in every document: chunks 0..2 stay loadable
#: document -> how its chunk DAMAGED_AT is damaged
DAMAGE = {"a": "truncated", "b": "with one bit flipped", "c": "replaced by another model's chunk (same file name)",
          "d": "rewritten without integrity data", "e": "whose stored digest was altered"}


def chunk_file(store: Path, ids: list[int], index: int) -> Path:
    digest = blake3_chunk_hashes(ids, CHUNK)[index]
    [path] = store.glob(f"prefixshare-*@{digest}.data")
    return path


def flip_bit(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def store(work: Path, model: Path, docs: dict[str, list[int]]) -> Path:
    store = work / "store"
    with LMCacheServer(policy_for(store)) as server:
        out = run_steps(work, "writer", model, server.policy, [gen(n, docs[n]) for n in DAMAGE])
    assert all(out["by_name"][n]["num_cached_tokens"] == 0 for n in DAMAGE)  # written, not read
    return store


@pytest.fixture(scope="module")
def foreign_store(work: Path, suite_dir: Path, docs: dict[str, list[int]]) -> Path:
    """Another model (other weights) computing document c: its chunk files have the same chunk hashes."""
    from prefixshare.model import create_model

    other = create_model(suite_dir / "model-seed1", shape="tiny", seed=1)
    store = work / "foreign"
    with LMCacheServer(policy_for(store)) as server:
        run_steps(work, "foreign-writer", other, server.policy, [gen("c", docs["c"])])
    return store


@pytest.fixture(scope="module")
def damaged(work: Path, store: Path, foreign_store: Path, docs: dict[str, list[int]]) -> dict[str, Any]:
    """A damaged copy of the store, one kind of damage per document, and a hand-edited manifest."""
    copy = work / "damaged"
    shutil.copytree(store, copy)
    files = {n: chunk_file(copy, docs[n], DAMAGED_AT) for n in DAMAGE}
    original = {n: p.read_bytes() for n, p in files.items()}
    a = files["a"]
    a.write_bytes(a.read_bytes()[: a.stat().st_size // 2])
    flip_bit(files["b"], 1000)
    shutil.copyfile(chunk_file(foreign_store, docs["c"], DAMAGED_AT), files["c"])
    d = files["d"]
    d.write_bytes(d.read_bytes()[:-48])  # the payload alone: what LMCache's plain fs adapter writes
    flip_bit(files["e"], files["e"].stat().st_size - 1)  # the last byte of the stored digest
    # the damage happened: every file differs from what the writer stored, and its own check says so
    changed = {n: files[n].read_bytes() != original[n] for n in DAMAGE}
    verdicts = {n: verify_file(files[n]).verdict for n in DAMAGE}
    assert all(changed.values()) and all(v != "ok" for v in verdicts.values()), (changed, verdicts)
    return {"store": copy, "files": files, "verdicts_before_load": verdicts}


@pytest.fixture(scope="module")
def reader(work: Path, model: Path, docs: dict[str, list[int]], damaged: dict[str, Any]) -> dict[str, Any]:
    with LMCacheServer(policy_for(damaged["store"])) as server:  # (a warm-up first: one-off costs are not timed)
        out = run_steps(work, "reader", model, server.policy,
                        [gen(WARMUP, docs[WARMUP]), *[gen(n, docs[n]) for n in DAMAGE]])
        log = server.log_path.read_text(errors="replace")
    out["server_log"] = log
    return out


def test_damaged_chunks_are_never_loaded_and_the_answer_is_the_cold_one(
    reader: dict[str, Any], cold: dict[str, Any], damaged: dict[str, Any]
) -> None:
    for name, how in DAMAGE.items():
        got = reader["by_name"][name]
        assert got["num_cached_tokens"] == DAMAGED_AT * CHUNK, (how, got["num_cached_tokens"])
        assert identical(got, cold[name]), how
        path: Path = damaged["files"][name]
        assert path.with_name(path.name + ".corrupt").exists(), how  # set aside...
        assert verify_file(path).verdict == "ok", how  # ...and the recompute stored a good copy in its place
    lines = [ln for ln in reader["server_log"].splitlines() if "store.damaged_chunk" in ln]
    assert len(lines) == len(DAMAGE), lines  # one clear line per damaged chunk
    verdicts = {"truncated", "digest-mismatch", "unverified"}
    assert all(any(v in ln for v in verdicts) for ln in lines), lines
    for name, how in DAMAGE.items():
        got = reader["by_name"][name]
        path = damaged["files"][name]
        detected = sum(1 for ln in lines if path.name in ln)  # the server's line naming this chunk file
        assert detected == 1, (how, path.name, lines)
        c = counters(reader, name)
        assert c["requests"] == 1, c
        record(Row(area="corruption", fault=f"one chunk {how}",
                   behaviour=f"the {DAMAGED_AT} chunks before it loaded, the damaged one and the rest recomputed; "
                   "chunk set aside (one log line) and a good copy stored by the recompute",
                   **row_counters(c), identical_to_cold=identical(got, cold[name]),
                   max_added_latency_s=added_latency(got, cold[name], cold), corrupt_detected=detected,
                   extra={"engine_cached_tokens": got["num_cached_tokens"],
                          "verdict_before_load": damaged["verdicts_before_load"][name],
                          "fallback_reasons": c["fallback_reasons"]}))


def _json(cli: Any, *args: str) -> dict[str, Any]:
    from typer.testing import CliRunner

    result = CliRunner().invoke(cli, [*args, "--json"], env={"COLUMNS": "200"})
    assert result.exit_code in (0, 1), result.output  # 1: doctor's verdict, not an error
    return json.loads(result.stdout)


def test_doctor_lists_every_damaged_object_and_gc_removes_them(
    cli: Any, reader: dict[str, Any], damaged: dict[str, Any], store: Path
) -> None:
    import yaml

    policy_file = damaged["store"].parent / "damaged-policy.yaml"
    policy_file.write_text(yaml.safe_dump(policy_for(damaged["store"]).to_dict()))
    for path in sorted(damaged["store"].glob("prefixshare-*.data"))[:2]:  # damaged in place, never read by a
        flip_bit(path, 2000)  # server since: only --verify finds them
    [manifest] = (damaged["store"] / ".prefixshare" / "manifests").glob("*.json")
    body = json.loads(manifest.read_text())
    body["fingerprint"]["engine"]["kv_dtype"] = "bfloat16"  # someone "fixes" the dtype by hand
    manifest.write_text(json.dumps(body, indent=2))
    report = _json(cli, "doctor", "--policy", str(policy_file), "--verify")
    check = next(c for c in report["checks"] if c["name"] == "integrity")
    kinds = sorted((o["kind"], o["reason"]) for o in check["data"]["damaged"])
    assert check["status"] == "warn"
    assert kinds.count(("chunk", "quarantined")) == len(DAMAGE)
    assert kinds.count(("chunk", "digest-mismatch")) == 2
    assert [k for k in kinds if k[0] == "manifest"] and "checksum" in json.dumps(check["data"]["damaged"])
    quick = _json(cli, "doctor", "--policy", str(policy_file))
    quick_check = next(c for c in quick["checks"] if c["name"] == "integrity")
    assert len(quick_check["data"]["damaged"]) == len(DAMAGE) + 1  # without --verify: quarantined + manifest

    gc = _json(cli, "gc", "--policy", str(policy_file), "--verify")
    assert len(gc["deleted"]) == len(DAMAGE) + 2 + 1, gc["deleted"]
    after = _json(cli, "doctor", "--policy", str(policy_file), "--verify")
    clean = next(c for c in after["checks"] if c["name"] == "integrity")
    assert clean["status"] == "ok" and clean["data"]["damaged"] == []
    manifests = [k for k in kinds if k[0] == "manifest"]
    chunks = [k for k in kinds if k[0] == "chunk"]
    record(Row(area="corruption", fault="a manifest edited by hand (kv dtype changed)", engine="none",
               behaviour="its checksum fails: never trusted, listed by doctor, removed by gc --verify; the next "
               "replica of that fingerprint writes it again", corrupt_detected=len(manifests),
               extra={"checksum_failures": sum("checksum" in r for _, r in manifests)}))
    record(Row(area="corruption", fault="chunks damaged on disk, never read since", engine="none",
               behaviour="doctor --verify reads every chunk and lists them (digest-mismatch); gc --verify "
               "removes them with the quarantined ones; doctor clean afterwards",
               corrupt_detected=len(chunks),
               extra={"digest_mismatch": kinds.count(("chunk", "digest-mismatch")),
                      "quarantined": kinds.count(("chunk", "quarantined")), "deleted_by_gc": len(gc["deleted"]),
                      "damaged_after_gc": len(clean["data"]["damaged"])}))


def test_negative_control_without_integrity_checks_the_flip_is_loaded(
    work: Path, model: Path, docs: dict[str, list[int]], store: Path, cold: dict[str, Any]
) -> None:
    copy = work / "unchecked"
    shutil.copytree(store, copy)
    target = chunk_file(copy, docs["b"], DAMAGED_AT)
    data = bytearray(target.read_bytes())
    for i in range(0, len(data) - 48, 4):  # noise on every value of the chunk: the KV is visibly different
        data[i + 3] ^= 0x08
    target.write_bytes(bytes(data))
    policy = policy_for(copy, l2=[{"type": "fs", "base_path": str(copy), "integrity": "none"}])
    started = time.monotonic()
    with LMCacheServer(policy) as server:
        out = run_steps(work, "unchecked-reader", model, server.policy, [gen("b", docs["b"])])
    got = out["by_name"]["b"]
    assert got["num_cached_tokens"] >= 9 * CHUNK  # the damaged chunk was loaded as it is...
    same = identical(got, cold["b"])
    assert not same  # ...and the answer changed
    c = counters(out, "b")
    record(Row(area="corruption", fault="one chunk's values perturbed, tier with integrity: none (control)",
               behaviour="loaded as it is and the answer changed: what the checks prevent", **row_counters(c),
               identical_to_cold=same,  # (no latency: the replica's first request, untimed by design)
               extra={"engine_cached_tokens": got["num_cached_tokens"], "wall_s": round(time.monotonic() - started, 1)}))


# --- keyed integrity: only a key holder can write chunks the store's servers load ------------------------------
KEY_ENV, STORE_KEY, WRONG_KEY = "PREFIXSHARE_TEST_STORE_KEY", bytes(range(32)), bytes(range(5, 37))


def forge(path: Path, keyring: Any = None) -> None:
    """What a writer without the store's key can do: other KV values under the chunk's own name, with a valid
    digest it computes itself — unkeyed, or keyed under a key of its own."""
    from prefixshare.server.plugins.integrity import TRAILER_BYTES, trailer

    data = bytearray(path.read_bytes()[:-TRAILER_BYTES])
    for i in range(0, len(data), 4):  # noise on every value: KV an engine would answer differently from
        data[i + 3] ^= 0x08
    path.write_bytes(bytes(data) + trailer(path.name, data, keyring))


def test_a_keyed_store_refuses_forged_chunks_that_an_unkeyed_one_loads(
    work: Path, model: Path, docs: dict[str, list[int]], store: Path, cold: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A chunk forged with a recomputed unkeyed digest, and one keyed under another key: a keyed store's server
    loads neither (the chunks before them load, the answer is the cold one) and sets both aside. The control:
    the same unkeyed forgery on an unkeyed store is loaded and changes the answer."""
    from prefixshare.server.plugins.integrity import Keyring

    monkeypatch.setenv(KEY_ENV, STORE_KEY.hex())  # the servers inherit it; the policy names the variable only
    keyed = work / "keyed"
    policy = policy_for(keyed, l2=[{"type": "fs", "base_path": str(keyed), "create": True, "key_env": KEY_ENV}])
    ring = Keyring(STORE_KEY, (STORE_KEY,))
    with LMCacheServer(policy) as server:
        run_steps(work, "keyed-writer", model, server.policy, [gen(n, docs[n]) for n in ("a", "b")])
    written = chunk_file(keyed, docs["a"], DAMAGED_AT)
    assert verify_file(written, ring).verdict == "ok" and verify_file(written).verdict == "keyed"  # keyed on disk
    forgeries = {"a": (chunk_file(keyed, docs["a"], DAMAGED_AT), None, "unkeyed"),
                 "b": (chunk_file(keyed, docs["b"], DAMAGED_AT), Keyring(WRONG_KEY, (WRONG_KEY,)), "other-key")}
    for path, forger, verdict in forgeries.values():
        forge(path, forger)
        assert verify_file(path, ring).verdict == verdict  # the forgery happened, and is what it claims to be
    with LMCacheServer(policy_for(keyed, l2=policy.to_dict()["l2"])) as server:
        steps = [gen(WARMUP, docs[WARMUP]), gen("a", docs["a"]), gen("b", docs["b"])]
        out = run_steps(work, "keyed-reader", model, server.policy, steps)
        log = server.log_path.read_text(errors="replace")
    control_store = work / "unkeyed-forged"
    shutil.copytree(store, control_store)
    forge(chunk_file(control_store, docs["a"], DAMAGED_AT))
    assert verify_file(chunk_file(control_store, docs["a"], DAMAGED_AT)).verdict == "ok"  # valid, unkeyed
    with LMCacheServer(policy_for(control_store)) as server:
        control = run_steps(work, "unkeyed-forged-reader", model, server.policy, [gen("a", docs["a"])])

    lines = [ln for ln in log.splitlines() if "store.damaged_chunk" in ln]
    for name, (path, _, verdict) in forgeries.items():
        got = out["by_name"][name]
        assert got["num_cached_tokens"] == DAMAGED_AT * CHUNK, (verdict, got["num_cached_tokens"])
        assert identical(got, cold[name]), verdict
        assert path.with_name(path.name + ".corrupt").exists(), verdict
        detected = sum(1 for ln in lines if path.name in ln and verdict in ln)  # the server's line for it
        assert detected == 1, (verdict, lines)
        c = counters(out, name)
        how = "unkeyed digest" if verdict == "unkeyed" else "digest under another key"
        record(Row(area="corruption", fault=f"a chunk forged with a valid {how}, keyed store",
                   behaviour=f"refused ({verdict}) and set aside; the {DAMAGED_AT} chunks before it loaded, the rest "
                   "recomputed", **row_counters(c), identical_to_cold=identical(got, cold[name]),
                   max_added_latency_s=added_latency(got, cold[name], cold), corrupt_detected=detected,
                   extra={"engine_cached_tokens": got["num_cached_tokens"], "verdict": verdict}))
    forged = control["by_name"]["a"]
    assert forged["num_cached_tokens"] >= 9 * CHUNK  # the unkeyed store loaded the forgery...
    changed = not identical(forged, cold["a"])
    assert changed  # ...and it changed the answer: the threat the key removes
    c = counters(control, "a")
    record(Row(area="corruption", fault="a chunk forged with a valid unkeyed digest, unkeyed store (control)",
               behaviour="loaded and the answer changed: what a store key prevents", **row_counters(c),
               identical_to_cold=not changed, extra={"engine_cached_tokens": forged["num_cached_tokens"]}))
