"""Sampled verification of store hits, against the real collision it exists for.

Under ``fingerprint.weights: headers`` two checkpoints of one shape (here: the suite's model, and other weights
with the same tokenizer, config and tensor layout: a fine-tune) share one namespace. Replica B then loads A's
KV with a valid digest and answers wrongly, and no fingerprint field can tell. With ``verify: {sample: 1.0}``
the hit is set aside; ``PrefixShare.verify()`` runs the prompt loaded and recomputed, finds the first-token
log-probabilities apart, and quarantines the chunks; B's next answer is its own cold one. The control: a
replica of A's own weights verifies A's hits as good (no false alarm).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.common import CHUNK, TOKENIZER_FILES, policy_for
from faults._common import WARMUP, counters, gen, identical, row_counters, run_steps
from faults._matrix import Row, record
from prefixshare.policies import Policy
from prefixshare.server import LMCacheServer

pytestmark = [pytest.mark.engine, pytest.mark.server]

DOC = "a"
VERIFY = {"op": "verify", "name": "verify"}


@pytest.fixture(scope="module")
def other(work: Path, model: Path) -> Path:
    """Other weights of the same shape, with the suite model's tokenizer: a checkpoint headers mode cannot tell."""
    from prefixshare.model import create_model

    seed1 = create_model(work / "seed1", shape="tiny", seed=1)
    out = work / "other-weights"
    shutil.copytree(seed1, out)
    for name in TOKENIZER_FILES:
        if (model / name).exists():
            shutil.copy(model / name, out / name)
    return out


@pytest.fixture(scope="module")
def policy(work: Path) -> Policy:
    return policy_for(work / "store", fingerprint={"weights": "headers"},
                      verify={"sample": 1.0, "max_per_minute": 600})


@pytest.fixture(scope="module")
def server(policy: Policy) -> Iterator[LMCacheServer]:
    with LMCacheServer(policy) as s:
        yield s


@pytest.fixture(scope="module")
def written(work: Path, model: Path, docs: dict[str, list[int]], server: LMCacheServer) -> dict[str, Any]:
    """Replica A computes the document once: its KV is in the store."""
    run = run_steps(work, "writer", model, server.policy, [gen(WARMUP, docs[WARMUP]), gen(DOC, docs[DOC])])
    assert run["by_name"][DOC]["num_cached_tokens"] == 0
    assert counters(run, DOC)["tokens_stored"] == len(docs[DOC]) // CHUNK * CHUNK
    return run


def _report(run: dict[str, Any]) -> dict[str, Any]:
    return run["by_name"]["verify"]["report"]


def test_good_hits_pass_verification(work: Path, model: Path, docs: dict[str, list[int]], cold: dict[str, Any],
                                     server: LMCacheServer, written: dict[str, Any]) -> None:
    run = run_steps(work, "same-weights", model, server.policy,
                    [gen(WARMUP, docs[WARMUP]), gen(DOC, docs[DOC]), VERIFY])
    hit = run["by_name"][DOC]
    # every token but the last, which an engine always computes
    assert hit["num_cached_tokens"] == len(docs[DOC]) - 1, "the replica must have loaded A's KV"
    assert identical(hit, cold[DOC])
    report = _report(run)
    assert (report["checked"], report["ok"], report["mismatch"], report["unverifiable"]) == (1, 1, 0, 0), report
    check = report["checks"][0]
    assert check["reloaded_tokens"] == len(docs[DOC]) - 1  # the verification's own load came from the store
    assert check["comparison"]["max_diff"] <= check["comparison"]["tolerance"]
    stats = run["by_name"]["verify"]["stats"]["verify"]
    assert stats["sampled"] == 1 and stats["ok"] == 1 and stats["mismatch"] == 0, stats
    c = counters(run, DOC)
    record(Row(area="corruption", fault="sampled verification of good hits, same weights (control)",
               behaviour="the hit's answer equals a recompute: verified ok, nothing quarantined (no false alarm)",
               **row_counters(c), identical_to_cold=identical(hit, cold[DOC]),
               extra={"verified": report["checked"], "ok": report["ok"], "mismatches": report["mismatch"],
                      "max_logprob_diff": check["comparison"]["max_diff"],
                      "tolerance": check["comparison"]["tolerance"], "verify_s": check["seconds"]}))


def test_a_same_shape_checkpoint_is_caught_and_quarantined(
    work: Path, other: Path, docs: dict[str, list[int]], policy: Policy, server: LMCacheServer,
    written: dict[str, Any],
) -> None:
    from prefixshare.store import doctor

    cold_b = run_steps(work, "cold-other", other, None, [gen(WARMUP, docs[WARMUP]), gen(DOC, docs[DOC])])
    run = run_steps(work, "other-weights", other, server.policy,
                    [gen(WARMUP, docs[WARMUP]), gen(DOC, docs[DOC]), VERIFY, gen("after", docs[DOC])])
    hit, after, cold = run["by_name"][DOC], run["by_name"]["after"], cold_b["by_name"][DOC]
    # the fault happened: B loaded A's KV under the shared namespace and answered with it
    assert hit["num_cached_tokens"] == len(docs[DOC]) - 1
    assert not identical(hit, cold), "the foreign KV did not change B's answer: this test proves nothing"
    report = _report(run)
    assert (report["checked"], report["mismatch"], report["ok"]) == (1, 1, 0), report
    check = report["checks"][0]
    quarantined = check["quarantined"]
    chunks = len(docs[DOC]) // CHUNK
    assert quarantined["chunks"] == chunks and quarantined["files"] >= chunks, quarantined
    assert quarantined["server_deleted"] >= chunks and quarantined["server_error"] is None, quarantined
    set_aside = sorted((work / "store").glob("*.data.corrupt"))
    assert len(set_aside) == quarantined["files"]
    events = [e for e in run["events"] if e.get("event") == "store.verify_mismatch"]
    assert len(events) == 1 and events[0]["namespace"], events
    # the next request finds nothing to load (memory and disk), recomputes, and answers as B's cold engine
    assert after["num_cached_tokens"] == 0
    assert identical(after, cold)
    stats = run["by_name"]["verify"]["stats"]["verify"]
    assert stats["sampled"] == 1 and stats["mismatch"] == 1, stats
    found = [c for c in doctor(policy).checks if c.name == "verification"]
    assert found and found[0].status == "warn" and found[0].data["mismatches"] == 1, found
    c = counters(run, DOC)
    record(Row(area="corruption", fault="a same-shape checkpoint's KV under fingerprint.weights: headers",
               behaviour="the hit loaded with a valid digest and answered wrongly; sampled verification found the "
               "first token's log-probabilities apart, quarantined the chunks (disk and server memory), and the "
               "next answer was the replica's own cold one", **row_counters(c),
               identical_to_cold=identical(after, cold), corrupt_detected=len(events),
               extra={"wrong_answer_served": not identical(hit, cold), "mismatches": report["mismatch"],
                      "max_logprob_diff": check["comparison"]["max_diff"],
                      "files_quarantined": quarantined["files"], "server_deleted": quarantined["server_deleted"],
                      "next_loaded_tokens": after["num_cached_tokens"], "doctor": found[0].status,
                      "verify_s": check["seconds"]}))


def _cli(work: Path, name: str, args: list[str], code: int) -> dict[str, Any]:
    """The installed command with --json; its exit code must be ``code``."""
    import json
    import subprocess
    import sys

    exe = Path(sys.executable).parent / "prefixshare"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run([str(exe), *args, "--json"], capture_output=True, text=True, timeout=600, env=env)
    (work / f"{name}.stderr").write_text(proc.stderr)
    assert proc.returncode == code, proc.stderr[-4000:]
    return json.loads(proc.stdout)


def test_the_stores_documents_verify_offline_and_a_same_shape_checkpoint_is_caught(
    work: Path, model: Path, other: Path,
) -> None:
    """``prefixshare verify --model``: the warmed documents replayed on a fresh engine. The suite's weights
    verify every document ok (no false alarm); the same-shape checkpoint, which shares the namespace under
    headers, finds its document's KV foreign and quarantines it; the suite's weights then find that document
    gone from the store (unverifiable), the other one still ok."""
    from e2e.common import write_documents, write_policy_file

    store = work / "doc-store"
    with LMCacheServer(policy_for(store, fingerprint={"weights": "headers"})) as server:
        pfile = str(write_policy_file(work / "doc-policy.yaml", server.policy))
        docs = write_documents(work / "documents", {"manual.md": 600, "faq.md": 700}, first_seed=70)
        common = ["--policy", pfile, "--block-size", "32"]
        warmed = _cli(work, "doc-warm", ["warm", str(docs), *common, "--model", str(model)], 0)
        assert [d["status"] for d in warmed["documents"]] == ["warmed", "warmed"], warmed
        chunks = {d["id"]: d["chunks"] for d in warmed["documents"]}

        good = _cli(work, "doc-verify-good", ["verify", *common, "--model", str(model)], 0)
        assert (good["verdict"], good["checked"], good["ok"]) == ("ok", 2, 2), good
        for check in good["checks"]:
            assert check["reloaded_tokens"] >= check["loaded_tokens"] == chunks[check["document_id"]] * CHUNK
            assert check["comparison"]["max_diff"] <= check["comparison"]["tolerance"]

        bad = _cli(work, "doc-verify-other", ["verify", *common, "--model", str(other), "--document", "manual.md"], 1)
        assert (bad["verdict"], bad["checked"], bad["mismatch"]) == ("mismatch", 1, 1), bad
        [check] = bad["checks"]
        assert check["reloaded_tokens"] >= check["loaded_tokens"] > 0  # the foreign KV was really loaded
        assert check["quarantined"]["files"] == chunks["manual.md"] and check["quarantined"]["server_error"] is None
        assert len(list(store.glob("*.data.corrupt"))) == chunks["manual.md"]

        after = _cli(work, "doc-verify-after", ["verify", *common, "--model", str(model)], 0)
        assert (after["verdict"], after["ok"], after["unverifiable"]) == ("ok", 1, 1), after
        verdicts = {c["document_id"]: (c["verdict"], c["reason"]) for c in after["checks"]}
        assert verdicts["faq.md"] == ("ok", "") and verdicts["manual.md"][0] == "unverifiable", verdicts
        assert "no longer holds" in verdicts["manual.md"][1]
