"""Warm with the real CLI and a real vLLM engine, then a fresh replica (another process) hits every document.

`prefixshare warm DOCS --json` prefills three documents into an fs store through a running LMCache MP
server; a fresh replica (tests/helpers/warm_replica.py) re-warms them (a no-op: the engine gets no request),
is refused an over-long document, and asks questions built by prompt_for: each document's prefix is loaded
from the store on its first question, and the greedy answers equal a cold model's (HF transformers).
`inspect` and `doctor` then describe the store the warm wrote.

On a Redis store (the resp tier: no directory to read) warm asks the MP server which chunks it holds: a real
vLLM engine warms a document there (verified), re-warms it (skipped, by the server's answer), and, as the
negative control, warms another whose chunks are deleted from Redis and the server's memory between the
prefill and the check (not verified: failed).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from conftest import TESTS, free_port
from e2e.common import (
    cli_json,
    corpus_past_l1,
    entry_script,
    hf_greedy,
    run_helper,
    write_documents,
    write_policy_file,
)
from e2e.test_tiers import redis, tier_policy  # noqa: F401 - redis: a real redis-server on loopback (a fixture)
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


# --- a Redis (resp) store: the MP server answers ---------------------------------------------------------------


def _resp(port: int, *args: str) -> str:
    """One RESP command to the test's Redis; its reply's first line (``+OK``, ``:12``)."""
    payload = f"*{len(args)}\r\n" + "".join(f"${len(a)}\r\n{a}\r\n" for a in args)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(payload.encode())
        return conn.recv(4096).decode().split("\r\n", 1)[0]


def _wait_for_redis_keys(port: int, http_url: str, expected: int, timeout_s: float = 30.0) -> int:
    """Until the server's writes to Redis are done (its store queue empty) and Redis holds ``expected`` keys."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        store = httpx.get(http_url + "/status", timeout=5).json()["storage_manager"]["store_controller"]
        keys = int(_resp(port, "DBSIZE")[1:])
        idle = store["pending_keys_count"] == 0 and store["in_flight_task_count"] == 0
        if (idle and keys >= expected) or time.monotonic() > deadline:
            return keys
        time.sleep(0.05)


def _resp_warm_main(spec_path: str) -> None:
    """The replica of test_warm_on_redis_is_checked_by_the_server, in its own process (run by the test)."""
    for key, value in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}.items():
        os.environ.setdefault(key, value)
    import httpx

    from prefixshare import PrefixShare
    from prefixshare.warm import warm

    spec = json.loads(Path(spec_path).read_text())
    port, http_url, docs = spec["redis_port"], spec["http_url"], spec["docs"]
    ps = PrefixShare(spec["policy_file"], server=False, instance=spec["instance"])
    llm = ps.attach({"model": spec["model"], "dtype": "float32", "enforce_eager": True, "block_size": 32,
                     "distributed_executor_backend": "uni", "max_model_len": 2048, "seed": 0})
    out: dict[str, Any] = {}
    first = warm(ps, {"alpha": docs["alpha"]}, llm, strict=False)
    out["first"] = first.to_dict()
    requests = ps.stats()["requests"]
    out["again"] = warm(ps, {"alpha": docs["alpha"]}, llm, strict=False).to_dict()
    out["requests_by_again"] = ps.stats()["requests"] - requests

    def lose_them(progress: Any) -> None:
        """Between the prefill and the check: the chunks reach Redis, then Redis and the server's memory lose
        them (the server answers for both)."""
        if progress.phase != "verify":
            return
        expected = sum(d["chunks"] for d in out["first"]["documents"]) + lost_chunks
        out["redis_keys_stored"] = _wait_for_redis_keys(port, http_url, expected)
        out["redis_keys_expected"] = expected
        out["flush"] = _resp(port, "FLUSHALL")
        out["clear_l1"] = httpx.post(http_url + "/cache/clear", json={"tier": "l1"}, timeout=10).json()
        out["redis_keys_left"] = int(_resp(port, "DBSIZE")[1:])

    from prefixshare.warm import as_template, prefix_ids

    tokenizer = llm.get_tokenizer()
    lost_chunks = len(prefix_ids(tokenizer, as_template(None).resolve(tokenizer), docs["beta"])) // spec["chunk"]
    out["lost"] = warm(ps, {"beta": docs["beta"]}, llm, strict=False, verify_timeout_s=3.0, retries=0,
                       progress=lose_them).to_dict()
    # warmed again: the server, asked first, no longer holds it
    out["back"] = warm(ps, {"beta": docs["beta"]}, llm, strict=False).to_dict()
    sys.stdout.write("RESULT " + json.dumps(out) + "\n")
    sys.stdout.flush()
    os._exit(0)


def test_warm_on_redis_is_checked_by_the_server_and_the_check_can_fail(
    work: Path, model: Path, redis: dict[str, Any]  # noqa: F811 - the fixture imported above
) -> None:
    from prefixshare.model import document_text

    policy = tier_policy("resp", redis["port"], chunk_size=CHUNK)
    with LMCacheServer(policy) as srv:
        policy_file = write_policy_file(work / "policy-redis.yaml", srv.policy)
        script = entry_script(work / "resp_warm.py", "e2e.test_warm_e2e", "_resp_warm_main")
        spec = {"model": str(model), "policy_file": str(policy_file), "instance": f"warm-redis-{os.getpid()}",
                "redis_port": redis["port"], "http_url": srv.http_url, "chunk": CHUNK,
                "docs": {"alpha": document_text(600, seed=41), "beta": document_text(400, seed=42)}}
        out, _ = run_helper(work, "warm-redis", script, spec)
    (work / "warm-redis.result.json").write_text(json.dumps(out, indent=1))
    first = out["first"]["documents"][0]
    assert out["first"]["verification"] == "server" and out["first"]["store"] is None
    assert first["status"] == "warmed" and first["verified"] is True and first["verified_by"] == "server", first
    assert first["chunks"] == first["tokens"] // CHUNK >= 8
    assert (out["first"]["totals"]["verified"], out["first"]["totals"]["unverified"]) == (1, 0)
    again = out["again"]["documents"][0]
    assert again["status"] == "skipped" and again["verified"] is True and again["verified_by"] == "server", again
    assert out["requests_by_again"] == 0  # the server's answer, not a prefill
    # the negative control: the chunks did reach Redis, then Redis and the server's memory lost them
    assert out["redis_keys_stored"] >= out["redis_keys_expected"] > first["chunks"], out
    assert out["flush"] == "+OK" and out["clear_l1"]["status"] == "ok" and out["redis_keys_left"] == 0
    lost = out["lost"]["documents"][0]
    assert lost["status"] == "failed" and lost["verified"] is False and lost["verified_by"] == "server", lost
    assert f"holds 0 of the {lost['chunks']} objects" in lost["reason"] and out["lost"]["ok"] is False
    back = out["back"]["documents"][0]
    assert back["status"] == "warmed" and back["verified"] is True, back


# --- a corpus larger than the server's memory -----------------------------------------------------------------

def test_a_corpus_larger_than_the_servers_memory_is_warmed_whole(work: Path, model: Path) -> None:
    """The server drops a store it has no memory for, and only chunks its store has written can be evicted. With
    a store slower to write than the engine computes, unpaced and without retries (the negative control), a
    corpus sent in one engine call loses documents; warm as it runs by default sends each engine call what the
    server's memory has room for (waiting for the writes and the eviction), prefills again what verification
    still finds missing, and every document reaches the store; questions about three of them, this replica's
    prefix cache emptied, load their prefix from the store and answer like a cold model."""
    corpus_past_l1(work, model, "vllm")
