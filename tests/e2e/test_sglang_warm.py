"""Warm with the real CLI and a real SGLang engine, then a fresh SGLang replica (another process) hits every document.

`prefixshare warm DOCS --engine sglang --json` prefills three documents into an fs store through a running LMCache
MP server. A fresh SGLang replica (tests/helpers/warm_replica.py) re-warms them (a no-op: the engine gets no
request), is refused an over-long document, and asks questions built by prompt_for. Each document's prefix
is loaded from the store on its first question (SGLang reports storage hits), and the greedy ids and logprobs
equal a cold SGLang engine's. Negative control: the same question under another tenant loads nothing.
SGLang runs with the test-only ``sgl_kernel`` stand-in from tests/shims.

The MP server's lookup (what warm asks on stores without a directory) checks an SGLang warm too: keys under
SGLang's registration; negative control: the chunk files deleted and the server's memory cleared between
the prefill and the check fail it.

A corpus 3x the server's memory, behind a store slower than the engine computes, is warmed whole by SGLang as by
vLLM (warm paces its engine calls to the server's room), and lost in part unpaced (the negative control).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import TESTS
from e2e.common import (
    CHUNK,
    SHIM_ENV,
    cli_json,
    corpus_past_l1,
    entry_script,
    policy_for,
    run_helper,
    run_replica,
    same_output,
    write_documents,
    write_policy_file,
)
from prefixshare.server import LMCacheServer

pytestmark = [pytest.mark.engine, pytest.mark.server, pytest.mark.usefixtures("module_cache_dir")]

SYSTEM = "Answer from the document."
QUESTIONS = ["What is the harbor called?", "Who builds the bridge?"]
DOC_TOKENS = {"alpha.md": 300, "beta.md": 600, "gamma.md": 900}


@pytest.fixture(scope="module")
def model(work: Path) -> Path:
    from prefixshare.model import create_model

    return create_model(work / "model", shape="tiny", seed=0)


@pytest.fixture(scope="module")
def docs(work: Path) -> Path:
    return write_documents(work / "docs", DOC_TOKENS)


@pytest.fixture(scope="module")
def server(work: Path) -> Iterator[LMCacheServer]:
    with LMCacheServer(policy_for(work / "store", admission={"any": [{"min_tokens": 256}, {"pinned": ["*.md"]}]})) as srv:
        yield srv


@pytest.fixture(scope="module")
def policy_file(work: Path, server: LMCacheServer) -> Path:
    return write_policy_file(work / "policy.yaml", server.policy)


@pytest.fixture(scope="module")
def cli_warm(work: Path, model: Path, docs: Path, policy_file: Path) -> dict[str, Any]:
    return cli_json(work, "cli-warm", ["warm", str(docs), "--engine", "sglang", "--policy", str(policy_file),
                                       "--model", str(model), "--system", SYSTEM, "--max-model-len", "2048"],
                    env=SHIM_ENV)


@pytest.fixture(scope="module")
def replica(work: Path, model: Path, docs: Path, policy_file: Path, cli_warm: dict[str, Any]) -> dict[str, Any]:
    from prefixshare.model import document_text

    spec = {"model": str(model), "policy_file": str(policy_file), "instance": f"sgl-warm-replica-{os.getpid()}",
            "engine_type": "sglang", "system": SYSTEM, "docs": [str(docs / name) for name in DOC_TOKENS],
            "questions": QUESTIONS, "long_doc": document_text(2500, seed=9), "max_tokens": 6,
            "foreign_tenant": "globex"}
    return run_helper(work, "replica", TESTS / "helpers" / "warm_replica.py", spec, env=SHIM_ENV)[0]


@pytest.fixture(scope="module")
def cold(work: Path, model: Path, replica: dict[str, Any]) -> list[dict[str, Any]]:
    """A cold SGLang engine (no prefixshare) answering the same prompts."""
    prompts = [a["prompt"] for a in replica["answers"]]
    result = run_replica(work, "sgl-warm-cold", model, None,
                         [{"prompt_token_ids": p, "max_tokens": 6} for p in prompts], engine_type="sglang", timeout=300)
    return result["results"]


def test_cli_warm_with_sglang_prefills_verifies_and_records_every_document(cli_warm: dict[str, Any], work: Path) -> None:
    assert cli_warm["engine"] == "sglang" and cli_warm["ok"] is True
    docs = {d["id"]: d for d in cli_warm["documents"]}
    assert set(docs) == set(DOC_TOKENS)
    for doc in docs.values():
        assert doc["status"] == "warmed" and doc["verified"] is True, doc
        assert doc["chunks"] == doc["tokens"] // CHUNK and doc["bytes"] > 0
    files = list((work / "store").glob(f"{cli_warm['namespace']}@*.data"))
    assert len(files) == sum(d["chunks"] for d in docs.values())  # exactly the documents' prefixes
    records = list((work / "store" / ".prefixshare" / "documents" / cli_warm["fingerprint"]).glob("*.json"))
    assert sorted(r.name for r in records) == sorted(f"{name}.json" for name in DOC_TOKENS)
    assert {json.loads(r.read_text())["engine"] for r in records} == {"sglang"}


def test_sglang_rewarm_is_a_no_op_and_an_over_long_document_is_refused(replica: dict[str, Any]) -> None:
    assert [d["status"] for d in replica["rewarm"]["documents"]] == ["skipped"] * len(DOC_TOKENS)
    assert replica["requests_after_rewarm"] == 0  # nothing was sent to the engine
    long = replica["long"]
    assert long is not None and long["error"] == "DocumentTooLongError", long
    assert long["too_long"][0][0] == "manual-long" and long["too_long"][0][1] > 2048


def test_a_fresh_sglang_replica_loads_every_warmed_document_and_answers_like_a_cold_engine(
    replica: dict[str, Any], cli_warm: dict[str, Any], cold: list[dict[str, Any]]
) -> None:
    warmed = {d["id"]: d for d in cli_warm["documents"]}
    first: dict[str, dict[str, Any]] = {}
    for answer in replica["answers"]:
        name = Path(answer["doc"]).name
        assert answer["prefix_tokens"] == warmed[name]["tokens"]  # prompt_for rebuilt the warmed prefix exactly
        first.setdefault(name, answer)
    for name, answer in first.items():
        # the first question on a document: its whole stored prefix comes from the store, not this replica
        assert answer["storage_tokens"] >= warmed[name]["chunks"] * CHUNK, (name, answer)
    assert replica["stats"]["tokens_loaded"] >= sum(d["chunks"] * CHUNK for d in warmed.values())
    # nothing is sent to the store twice: later questions find the prefix in the replica's own radix tree, and
    # the only new KV is the foreign tenant's copy of the first document (its own salt)
    assert replica["stats"]["tokens_stored"] == warmed["alpha.md"]["chunks"] * CHUNK, replica["stats"]
    for answer, ref in zip(replica["answers"], cold, strict=True):
        assert same_output(answer, ref), (answer["doc"], answer["question"])


def test_another_tenant_does_not_load_the_warmed_document(replica: dict[str, Any], cold: list[dict[str, Any]]) -> None:
    foreign = replica["foreign"]
    assert foreign["storage_tokens"] == 0 and foreign["cached"] == 0, foreign  # other salt: no store, no local hit
    assert foreign["token_ids"] == cold[0]["token_ids"]


def _server_check_main(spec_path: str) -> None:
    """The SGLang replica of test_the_servers_lookup_checks_an_sglang_warm, in its own process."""
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    import httpx

    from prefixshare import PrefixShare
    from prefixshare.warm import warm

    spec = json.loads(Path(spec_path).read_text())
    store, http_url = Path(spec["store"]), spec["http_url"]
    ps = PrefixShare(spec["policy_file"], server=False, instance=spec["instance"])
    engine = ps.attach({"model_path": spec["model"], "device": "cpu", "attention_backend": "torch_native",
                        "disable_cuda_graph": True, "page_size": 16, "dtype": "float32", "mem_fraction_static": 0.3,
                        "max_total_tokens": 16384, "context_length": 2048, "log_level": "warning", "random_seed": 0},
                       engine_type="sglang")
    out: dict[str, Any] = {"held": warm(ps, {"delta": spec["docs"]["delta"]}, engine, verify="server",
                                        strict=False).to_dict()}
    before = {f.name for f in store.glob("*.data")}

    def lose_them(progress: Any) -> None:
        if progress.phase != "verify":
            return
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the server's writes of the prefill are done
            sc = httpx.get(http_url + "/status", timeout=5).json()["storage_manager"]["store_controller"]
            if sc["pending_keys_count"] == 0 and sc["in_flight_task_count"] == 0:
                break
            time.sleep(0.05)
        new = [f for f in store.glob("*.data") if f.name not in before]
        out["deleted_files"] = len(new)
        for f in new:
            f.unlink()
        out["clear_l1"] = httpx.post(http_url + "/cache/clear", json={"tier": "l1"}, timeout=10).json()

    out["lost"] = warm(ps, {"epsilon": spec["docs"]["epsilon"]}, engine, verify="server", verify_timeout_s=3.0,
                       retries=0, strict=False, progress=lose_them).to_dict()
    sys.stdout.write("RESULT " + json.dumps(out) + "\n")
    sys.stdout.flush()
    engine.shutdown()
    os._exit(0)


def test_the_servers_lookup_checks_an_sglang_warm(work: Path, model: Path, server: LMCacheServer,
                                                   policy_file: Path) -> None:
    from prefixshare.model import document_text

    script = entry_script(work / "server_check.py", "e2e.test_sglang_warm", "_server_check_main")
    spec = {"model": str(model), "policy_file": str(policy_file), "instance": f"sgl-server-check-{os.getpid()}",
            "store": str(work / "store"), "http_url": server.http_url,
            "docs": {"delta": document_text(500, seed=51), "epsilon": document_text(400, seed=52)}}
    out, _ = run_helper(work, "sgl-server-check", script, spec, env=SHIM_ENV)
    (work / "sgl-server-check.result.json").write_text(json.dumps(out, indent=1))
    held = out["held"]["documents"][0]
    assert out["held"]["verification"] == "server" and out["held"]["engine"] == "sglang"
    assert held["status"] == "warmed" and held["verified"] is True and held["verified_by"] == "server", held
    lost = out["lost"]["documents"][0]
    assert out["deleted_files"] == lost["chunks"] > 0 and out["clear_l1"]["status"] == "ok", out
    assert lost["status"] == "failed" and lost["verified"] is False and lost["verified_by"] == "server", lost
    assert f"holds 0 of the {lost['chunks']} objects" in lost["reason"]


def test_a_corpus_larger_than_the_servers_memory_is_warmed_whole_by_sglang(work: Path, model: Path) -> None:
    """As tests/e2e/test_warm_e2e.py's corpus test, with SGLang: unpaced and without retries the corpus loses
    documents (the server logs the stores it dropped); warm as it runs by default stores and verifies all 48, and
    three of them, SGLang's radix tree flushed, load from the store and answer like a cold model."""
    corpus_past_l1(work, model, "sglang", env=SHIM_ENV)
