"""Concurrency: two vLLM replicas behind two MP servers on one shared fs directory (two "nodes" on one NFS
share) warm the same documents at the same moment, then ask about them at the same moment.

No torn reads (every answer equals a cold vLLM engine's, greedy ids and logprobs: a half-written chunk would
change it), no corruption from duplicate writes (every chunk file has the one right size, no temporary file is
left), and the registry is consistent afterwards: ``prefixshare inspect`` lists every document complete and
``doctor`` finds nothing wrong with the store. The test checks that the race really happened: both warms ran
at the same time (wall clock) and both servers wrote the chunks.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from typer.testing import CliRunner

from e2e.common import policy_for
from faults._common import WARMUP, counters, gen, identical, pause, row_counters, run_steps
from faults._matrix import Row, record
from prefixshare.server import LMCacheServer

pytestmark = [pytest.mark.engine, pytest.mark.server]

QUESTIONS = ["What is the harbor called?", "Who builds the bridge?"]
NAMES = ["one.md", "two.md", "three.md"]


@pytest.fixture(scope="module")
def texts() -> dict[str, str]:
    from prefixshare.model import document_text

    return {name: document_text(450 + 150 * i, seed=70 + i) for i, name in enumerate(NAMES)}


@pytest.fixture(scope="module")
def servers(work: Path) -> Iterator[list[LMCacheServer]]:
    store = work / "store"
    started = [LMCacheServer(policy_for(store)).start(), LMCacheServer(policy_for(store)).start()]
    yield started
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def runs(work: Path, model: Path, docs: dict[str, list[int]], servers: list[LMCacheServer],
         texts: dict[str, str]) -> list[dict[str, Any]]:
    pairs = [[name, texts[name]] for name in NAMES]
    steps: list[dict[str, Any]] = [gen(WARMUP, docs[WARMUP], reset=False), pause("go-warm"),
                                   {"op": "warm", "name": "warm", "docs": pairs}, pause("go-ask")]
    for name in NAMES:
        for q, question in enumerate(QUESTIONS):
            steps.append({"op": "prompt", "name": f"{name}-{q}", "doc": [name, texts[name]], "question": question,
                          "reset": True})
    handles = [run_steps(work, f"node{i}", model, server.policy, steps, wait=False)
               for i, server in enumerate(servers)]
    for barrier in ("go-warm", "go-ask"):  # both replicas start each phase together
        deadline = time.monotonic() + 600
        while not all((h.control / f"{barrier}.ready").exists() for h in handles):
            assert time.monotonic() < deadline and all(h.proc.poll() is None for h in handles), barrier
            time.sleep(0.05)
        for h in handles:
            h.done[barrier] = time.monotonic()
            (h.control / f"{barrier}.go").write_text("go")
    return [h.result() for h in handles]


def _overlap_s(runs: list[dict[str, Any]], step: str) -> float:
    """How long the two replicas ran ``step`` at the same time (wall clock; <= 0: one after the other)."""
    spans = [(r["by_name"][step]["started_at"], r["by_name"][step]["ended_at"]) for r in runs]
    return round(min(e for _, e in spans) - max(s for s, _ in spans), 3)


@pytest.fixture(scope="module")
def cold_prompts(work: Path, model: Path, docs: dict[str, list[int]], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A cold engine (no prefixshare) answering every prompt the replicas built (the same on both nodes)."""
    prompts = [gen(r["name"], r["prompt"]) for r in runs[0]["results"] if r["op"] == "prompt"]
    assert [p["ids"] for p in prompts] == [r["prompt"] for r in runs[1]["results"] if r["op"] == "prompt"]
    return run_steps(work, "cold-prompts", model, None, [gen(WARMUP, docs[WARMUP], reset=False), *prompts])["by_name"]


def test_concurrent_warm_and_reads_answer_like_a_cold_model(runs: list[dict[str, Any]],
                                                            cold_prompts: dict[str, Any]) -> None:
    reports = [r["by_name"]["warm"] for r in runs]
    assert all("error" not in rep for rep in reports), reports
    statuses = [[d["status"] for d in rep["report"]["documents"]] for rep in reports]
    assert all(s in ("warmed", "skipped") for ss in statuses for s in ss), statuses
    # the fault happened: both warms (and both rounds of questions) ran at the same time
    overlap = {"warm": _overlap_s(runs, "warm"), "ask": _overlap_s(runs, f"{NAMES[0]}-0")}
    assert overlap["warm"] > 0 and overlap["ask"] > 0, overlap
    answers = [(name, r["by_name"][name]) for r in runs for name in r["by_name"] if name.endswith(("-0", "-1"))]
    same = [identical(a, cold_prompts[name]) for name, a in answers]
    assert all(same), [n for (n, _), ok in zip(answers, same) if not ok]
    loaded = [a["num_cached_tokens"] >= a["prefix_tokens"] // 64 * 64 for _, a in answers]
    assert all(loaded), [(n, a["num_cached_tokens"], a["prefix_tokens"]) for n, a in answers]
    first, last = f"{NAMES[0]}-0", f"{NAMES[-1]}-{len(QUESTIONS) - 1}"
    per_node = [counters(r, first, last) for r in runs]
    c = {k: sum(n[k] for n in per_node) for k in ("requests", "hits", "fallbacks", "tokens_loaded")}
    assert c["requests"] == len(answers), c
    record(Row("concurrency", "two replicas behind two MP servers on one fs directory warm the same 3 documents "
               "at the same moment, then ask 2 questions each about them at the same moment",
               "every question loads its document's prefix; no torn read (answers identical to a cold engine)",
               **row_counters(c), identical_to_cold=all(same),
               extra={"warm_statuses": statuses, "overlap_s": overlap,
                      "warm_tokens_stored": [counters(r, "warm")["tokens_stored"] for r in runs]}))


def test_the_store_is_consistent_afterwards(runs: list[dict[str, Any]], servers: list[LMCacheServer], work: Path,
                                            model: Path, cli: typer.Typer) -> None:
    store = work / "store"
    data = sorted(store.glob("prefixshare-*.data"))
    sizes = {p.stat().st_size for p in data}
    assert len(sizes) == 1, sizes  # every chunk object is the same size: no short (torn) file
    leftovers = [p for p in store.rglob("*") if p.is_file() and (p.suffix == ".tmp" or ".tmp" in p.name)]
    assert not leftovers, leftovers
    policy_file = work / "policy.yaml"
    policy_file.write_text(yaml.safe_dump(servers[0].policy.to_dict()))
    runner = CliRunner()
    result = runner.invoke(cli, ["inspect", "--policy", str(policy_file), "--json"])
    assert result.exit_code == 0, result.output
    namespaces = json.loads(result.stdout)["namespaces"]
    docs = [d for n in namespaces for d in n.get("documents", [])]
    assert sorted(d["id"] for d in docs) == sorted(NAMES) and all(d["complete"] for d in docs), docs
    result = runner.invoke(cli, ["doctor", "--policy", str(policy_file), "--model", str(model), "--json"])
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    # the store's checks (the environment's, e.g. telemetry of this test process, are not the store's business)
    store_checks = {n: c for n, c in checks.items() if n not in ("telemetry", "versions")}
    bad = {n: c for n, c in store_checks.items() if c["status"] not in ("ok", "info", "skip", "skipped")}
    assert store_checks and not bad, bad
    per_node = [counters(r, "warm") for r in runs]
    # the fault happened: both servers wrote the documents' chunks (duplicate writes to the same files)
    assert all(w["tokens_stored"] > 0 for w in per_node), per_node
    warm = {k: sum(w[k] for w in per_node) for k in ("requests", "hits", "fallbacks", "tokens_loaded")}
    record(Row("concurrency", "the registry and chunk files after the concurrent warm (duplicate writes of "
               "every chunk by two servers)",
               "one record per document, all complete (inspect); doctor clean; every chunk file whole, no "
               "temporary file left",
               **row_counters(warm),  # the two engines' warm requests that wrote what is checked here
               extra={"chunk_files": len(data), "chunk_sizes": len(sizes), "leftover_tmp": len(leftovers),
                      "documents": len(docs), "warm_tokens_stored": [w["tokens_stored"] for w in per_node],
                      "doctor": {n: c["status"] for n, c in checks.items()}}))
