"""Warm with the real CLI and a real vLLM engine, then a fresh replica (another process) hits every document.

`prefixshare warm DOCS --json` prefills three documents into an fs store through a running LMCache MP
server; a fresh replica (tests/helpers/warm_replica.py) re-warms them (a no-op: the engine gets no request),
is refused an over-long document, and asks questions built by prompt_for: each document's prefix is loaded
from the store on its first question, and the greedy answers equal a cold model's (HF transformers).
`inspect` and `doctor` then describe the store the warm wrote.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from conftest import TESTS, free_port
from e2e.common import cli_json, hf_greedy, run_helper, write_documents, write_policy_file
from prefixshare.policies import Policy
from prefixshare.server import LMCacheServer

pytestmark = [pytest.mark.engine, pytest.mark.server, pytest.mark.usefixtures("module_cache_dir")]

CHUNK = 64
SYSTEM = "Answer from the document."
QUESTIONS = ["What is the harbor called?", "Who builds the bridge?"]
DOC_TOKENS = {"alpha.md": 300, "beta.md": 600, "gamma.md": 900}


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("warm-e2e")


@pytest.fixture(scope="module")
def model(work: Path) -> Path:
    from prefixshare.model import create_model

    return create_model(work / "model", shape="tiny", seed=0)


@pytest.fixture(scope="module")
def docs(work: Path) -> Path:
    return write_documents(work / "docs", DOC_TOKENS)


@pytest.fixture(scope="module")
def server(work: Path) -> Iterator[LMCacheServer]:
    policy = Policy.build(chunk_size=CHUNK, l1={"size_gb": 0.2},
                          l2=[{"type": "fs", "base_path": str(work / "store"), "create": True}],
                          server={"port": free_port(), "http_port": free_port(), "start_timeout_s": 120},
                          admission={"any": [{"min_tokens": 256}, {"pinned": ["*.md"]}]})
    with LMCacheServer(policy) as srv:
        yield srv


@pytest.fixture(scope="module")
def policy_file(work: Path, server: LMCacheServer) -> Path:
    return write_policy_file(work / "policy.yaml", server.policy)


@pytest.fixture(scope="module")
def cli_warm(work: Path, model: Path, docs: Path, policy_file: Path) -> dict[str, Any]:
    return cli_json(work, "cli-warm", ["warm", str(docs), "--policy", str(policy_file), "--model", str(model),
                                       "--system", SYSTEM, "--block-size", "32", "--max-model-len", "2048"],
                    env={"VLLM_CPU_KVCACHE_SPACE": "1"})


@pytest.fixture(scope="module")
def replica(work: Path, model: Path, docs: Path, policy_file: Path, cli_warm: dict[str, Any]) -> dict[str, Any]:
    from prefixshare.model import document_text

    spec = {"model": str(model), "policy_file": str(policy_file), "instance": f"warm-replica-{os.getpid()}",
            "system": SYSTEM, "docs": [str(docs / name) for name in DOC_TOKENS], "questions": QUESTIONS,
            "long_doc": document_text(2500, seed=9), "max_tokens": 6}
    return run_helper(work, "replica", TESTS / "helpers" / "warm_replica.py", spec)[0]


def test_cli_warm_prefills_verifies_and_records_every_document(cli_warm: dict[str, Any], work: Path) -> None:
    docs = {d["id"]: d for d in cli_warm["documents"]}
    assert set(docs) == set(DOC_TOKENS) and cli_warm["ok"] is True
    for doc in docs.values():
        assert doc["status"] == "warmed" and doc["verified"] is True, doc
        assert doc["chunks"] == doc["tokens"] // CHUNK and doc["bytes"] > 0
    files = list((work / "store").glob(f"{cli_warm['namespace']}@*.data"))
    assert len(files) == sum(d["chunks"] for d in docs.values())  # exactly the documents' prefixes
    assert sum(f.stat().st_size for f in files) == cli_warm["totals"]["warmed_bytes"]
    records = list((work / "store" / ".prefixshare" / "documents" / cli_warm["fingerprint"]).glob("*.json"))
    assert sorted(r.name for r in records) == sorted(f"{name}.json" for name in DOC_TOKENS)


def test_rewarm_is_a_no_op(replica: dict[str, Any]) -> None:
    assert [d["status"] for d in replica["rewarm"]["documents"]] == ["skipped"] * len(DOC_TOKENS)
    assert replica["requests_after_rewarm"] == 0  # nothing was sent to the engine


def test_an_over_long_document_is_refused(replica: dict[str, Any]) -> None:
    long = replica["long"]
    assert long is not None and long["error"] == "DocumentTooLongError", long
    assert long["too_long"][0][0] == "manual-long" and long["too_long"][0][1] > 2048
    assert "max_model_len" in long["message"]


def test_a_fresh_replica_hits_every_warmed_document_and_answers_like_a_cold_model(
    replica: dict[str, Any], model: Path, cli_warm: dict[str, Any]
) -> None:
    warmed = {d["id"]: d for d in cli_warm["documents"]}
    first = {}
    for answer in replica["answers"]:
        name = Path(answer["doc"]).name
        assert answer["prefix_tokens"] == warmed[name]["tokens"]  # prompt_for rebuilt the warmed prefix exactly
        first.setdefault(name, answer)
    for name, answer in first.items():
        # the first question on a document: its prefix comes from the store, not this replica
        assert answer["cached"] >= warmed[name]["chunks"] * CHUNK, (name, answer["cached"])
    stats = replica["stats"]
    assert stats["tokens_loaded"] >= sum(d["chunks"] * CHUNK for d in warmed.values())
    assert stats["hits"] >= len(DOC_TOKENS)
    cold = hf_greedy(model, [a["prompt"] for a in replica["answers"]], 6)
    assert [a["token_ids"] for a in replica["answers"]] == cold


def test_inspect_and_doctor_describe_the_warmed_store(
    cli: typer.Typer, policy_file: Path, model: Path, cli_warm: dict[str, Any], replica: dict[str, Any]
) -> None:
    runner = CliRunner()
    result = runner.invoke(cli, ["inspect", "--policy", str(policy_file), "--json"])
    assert result.exit_code == 0, result.output
    ns = {n["namespace"]: n for n in json.loads(result.stdout)["namespaces"]}[cli_warm["namespace"]]
    assert {d["id"] for d in ns["documents"]} == set(DOC_TOKENS) and all(d["complete"] for d in ns["documents"])
    assert ns["hits"] is not None and ns["hits"]["tokens_loaded"] >= replica["stats"]["tokens_loaded"]
    result = runner.invoke(cli, ["doctor", "--policy", str(policy_file), "--model", str(model), "--json"])
    data = json.loads(result.stdout)
    checks = {c["name"]: c for c in data["checks"]}
    assert checks["server"]["status"] == "ok" and checks["fingerprint"]["status"] == "ok", checks
    assert result.exit_code == 0 and data["verdict"].startswith("verdict: READY")
