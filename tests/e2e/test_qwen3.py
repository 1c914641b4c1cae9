"""Cross-replica sharing on the architecture our users serve: a Qwen3 model with Qwen3-8B's head geometry
(8 KV heads x head dim 128, per-head q/k norms) and bf16 KV, prompted through its own chat template.

The document sits in the system message, as a manual or a codebase does in practice; replica A asks one
question about it. A fresh replica B asks the same question: it loads A's KV and answers bit for bit like a
cold engine without prefixshare answering after its own prefix-cache hit (the prompt is sized so that both
reuse the same number of tokens and compute the same rest: the loaded KV is the computed KV, to the last bit).
A fresh replica C asks another question: it loads the shared system prompt and answers like the cold engine
(greedy ids exactly, logprobs within the bf16 tolerance). Negative controls:
other weights, another tokenizer and fp32 KV load nothing and say which field differs; noise in the stored
bf16 values changes the answer on a tier without integrity checks. The store's bytes per token are the ones
``prefixshare plan`` computes for the model.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from e2e.common import CHUNK, build_models, corrupt_copy, policy_for, run_replica
from prefixshare.model import document_text
from prefixshare.plan import kv_bytes_per_token, shape_from_config
from prefixshare.server import LMCacheServer
from prefixshare.server.plugins.integrity import payload_size

pytestmark = [pytest.mark.engine, pytest.mark.server, pytest.mark.usefixtures("module_cache_dir")]

DOC_WORDS = 700
#: Where B computes a different number of tokens than the reference (a 64-token chunk boundary against a
#: 32-token block), bf16 rounding moves logprobs by up to ~0.09 (measured); the ids must not move at all.
BF16_LOGPROB_TOL = 0.15
KV_DTYPE = "bfloat16"


def _bf16_kv() -> tuple[bool, str]:
    """Whether this CPU runs vLLM with bf16 KV: vLLM's own platform answer, asked in a fresh process."""
    code = ("import torch; from vllm.platforms import current_platform as p; "
            "print(torch.bfloat16 in p.supported_dtypes, torch.cpu._is_avx512_bf16_supported())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        return False, f"vLLM's platform could not be asked: {proc.stderr[-300:]}"
    supported, native = proc.stdout.split()[-2:]
    if supported != "True":
        return False, "vLLM's CPU platform lists no bfloat16 here: the bf16 KV path cannot run on this CPU"
    return True, "native avx512_bf16" if native == "True" else "bf16 without avx512_bf16 (emulated, slower)"


@pytest.fixture(scope="module", autouse=True)
def bf16() -> str:
    ok, why = _bf16_kv()
    if not ok:
        pytest.skip(why)
    return why


@pytest.fixture(scope="module")
def qwen(work: Path) -> dict[str, Path]:
    return build_models(work, arch="qwen3")


BLOCK = 32  # the replicas' vLLM block size (tests/helpers/vllm_replica.py)


def _chat(question: str, pad: int = 0) -> dict[str, Any]:
    system = "Answer from this manual only." + " Note." * pad + "\n\n" + document_text(DOC_WORDS, seed=31)
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "chat_template_kwargs": {"enable_thinking": False}, "max_tokens": 12}


def _prompt_len(tok: Any, request: dict[str, Any]) -> int:
    text = tok.apply_chat_template(request["messages"], tokenize=False, add_generation_prompt=True,
                                   **request["chat_template_kwargs"])
    return len(tok(text, add_special_tokens=False).input_ids)


def _prompt_ids(tok: Any, request: dict[str, Any]) -> list[int]:
    text = tok.apply_chat_template(request["messages"], tokenize=False, add_generation_prompt=True,
                                   **request["chat_template_kwargs"])
    return list(tok(text, add_special_tokens=False).input_ids)


@pytest.fixture(scope="module")
def questions(qwen: dict[str, Path]) -> dict[str, dict[str, Any]]:
    """Both questions are aligned so that a store load and the engine's own prefix-cache hit (whole blocks,
    never the last token) reuse the same tokens and compute the same rest: Q1 is padded until its hit ends on a
    chunk boundary; the system prompt is padded until the part Q2 shares with Q1 ends in the first half of a
    chunk (the cold engine's hit for Q2, in whole blocks, then equals the store's, in whole chunks). Otherwise
    the two compute the rest from different points, and in bf16 a near-tie token may differ (it did on an AVX2
    machine)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(qwen["main"]))
    for pad in range(16):
        q2 = _chat("Summarise the warranty terms, please.", pad)
        shared = _shared_prefix(_prompt_ids(tok, _chat("What does the first chapter say?", pad)), _prompt_ids(tok, q2))
        if shared // BLOCK * BLOCK != shared // CHUNK * CHUNK:
            continue
        for extra in range(64):
            q1 = _chat("What does the first chapter say?" + " Please." * extra, pad)
            n = _prompt_len(tok, q1)
            if (n - 1) // BLOCK * BLOCK % CHUNK == 0:
                return {"q1": q1, "q2": q2, "q1_len": n, "shared": shared}  # type: ignore[dict-item]
    raise AssertionError("no padding aligns the prefix-cache hits with chunk boundaries")


BF16 = {"dtype": KV_DTYPE}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["token_ids"] == b["token_ids"] and all(
        abs(x - y) <= BF16_LOGPROB_TOL for x, y in zip(a["logprobs"], b["logprobs"], strict=True))


def _shared_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.fixture(scope="module")
def store(work: Path) -> Path:
    return work / "store"


@pytest.fixture(scope="module")
def server(store: Path):  # type: ignore[no-untyped-def]
    with LMCacheServer(policy_for(store)) as srv:
        yield srv


@pytest.fixture(scope="module")
def cold(work: Path, qwen: dict[str, Path], questions: dict[str, Any]) -> dict[str, Any]:
    # the second Q1 hits the engine's own prefix cache: it computes exactly the tokens a replica that loaded Q1's
    # blocks computes, so their answers must agree to the bit
    q1, q2 = questions["q1"], questions["q2"]
    result = run_replica(work, "q-cold", qwen["main"], None, [q1, q1, q2], engine=BF16)
    return dict(zip(("q1", "q1_cached", "q2"), result["results"], strict=True))


@pytest.fixture(scope="module")
def replica_a(work: Path, qwen: dict[str, Path], server: LMCacheServer, questions: dict[str, Any]) -> dict[str, Any]:
    return run_replica(work, "q-replica-a", qwen["main"], server.policy, [questions["q1"]], engine=BF16)


@pytest.fixture(scope="module")
def replica_b(work: Path, qwen: dict[str, Path], server: LMCacheServer, questions: dict[str, Any],
              replica_a: dict[str, Any]) -> dict[str, Any]:
    return run_replica(work, "q-replica-b", qwen["main"], server.policy, [questions["q1"]], engine=BF16)


@pytest.fixture(scope="module")
def replica_c(work: Path, qwen: dict[str, Path], server: LMCacheServer, questions: dict[str, Any],
              replica_a: dict[str, Any]) -> dict[str, Any]:
    return run_replica(work, "q-replica-c", qwen["main"], server.policy, [questions["q2"]], engine=BF16)


def test_same_question_on_a_fresh_replica_is_bit_identical_to_a_local_cache_hit(
    replica_a: dict[str, Any], replica_b: dict[str, Any], cold: dict[str, Any], questions: dict[str, Any],
    bf16: str,
) -> None:
    a, b = replica_a["results"][0], replica_b["results"][0]
    assert len(a["prompt_token_ids"]) == questions["q1_len"]  # vLLM rendered the template as transformers does
    assert a["num_cached_tokens"] == 0 and _same(a, cold["q1"])
    local = cold["q1_cached"]  # the cold engine's second Q1: its own prefix cache, no store
    assert b["num_cached_tokens"] == local["num_cached_tokens"] == (questions["q1_len"] - 1) // BLOCK * BLOCK
    assert (b["token_ids"], b["logprobs"]) == (local["token_ids"], local["logprobs"])
    assert replica_b["stats"]["tokens_loaded"] >= b["num_cached_tokens"]


def test_another_question_loads_the_shared_system_prompt_and_answers_like_cold(
    replica_a: dict[str, Any], replica_c: dict[str, Any], cold: dict[str, Any]
) -> None:
    a, c = replica_a["results"][0], replica_c["results"][0]
    shared = _shared_prefix(a["prompt_token_ids"], c["prompt_token_ids"])
    assert shared > 800, shared  # the rendered system message: the document, through the model's own template
    # C's first request loads every full chunk of the system prompt A stored: exactly the tokens the cold
    # engine's own prefix cache gave its Q2 (see the questions fixture), so both compute the same rest
    assert c["num_cached_tokens"] == shared // CHUNK * CHUNK == cold["q2"]["num_cached_tokens"], (
        c["num_cached_tokens"], shared, cold["q2"]["num_cached_tokens"])
    assert _same(c, cold["q2"]), (c, cold["q2"])


def test_bytes_per_token_are_what_plan_says(
    qwen: dict[str, Path], replica_a: dict[str, Any], replica_b: dict[str, Any], store: Path
) -> None:
    planned = kv_bytes_per_token(shape_from_config(qwen["main"]))
    assert planned == 3 * 8 * 128 * 2 * 2  # layers x KV heads x head dim x (K, V) x bf16
    stats = replica_b["stats"]
    assert stats["kv_bytes_per_token"] == planned
    assert stats["bytes_loaded"] == stats["tokens_loaded"] * planned
    namespace = replica_a["stats"]["namespace"]
    sizes = {payload_size(p) for p in store.glob(f"{namespace}@*.data")}  # KV bytes, without the integrity trailer
    assert sizes == {CHUNK * planned}, sizes  # every stored object: one full chunk of bf16 K and V, nothing else


@pytest.mark.parametrize(("variant", "engine", "field"), [
    ("other_weights", BF16, "weights"), ("other_tok", BF16, "tokenizer"), ("main", {"dtype": "float32"}, "kv_dtype"),
])
def test_incompatible_replicas_load_nothing_and_say_why(
    work: Path, qwen: dict[str, Path], server: LMCacheServer, replica_a: dict[str, Any], questions: dict[str, Any],
    variant: str, engine: dict[str, Any], field: str,
) -> None:
    out = run_replica(work, f"q-incompatible-{field}", qwen[variant], server.policy, [questions["q1"]], engine=engine)
    result = out["results"][0]
    assert result["num_cached_tokens"] == 0 and out["stats"]["tokens_loaded"] == 0
    warnings = [e for e in out["events"] if e.get("event") == "store.incompatible"]
    assert len(warnings) == 1 and any(field in d for d in warnings[0]["differences"]), out["events"]
    if variant == "other_tok":  # same weights; the prompt is tokenized differently, so compare only the ids' fate
        assert result["prompt_token_ids"] != replica_a["results"][0]["prompt_token_ids"]


def test_noise_in_stored_bf16_values_changes_the_answer(
    work: Path, qwen: dict[str, Path], store: Path, replica_a: dict[str, Any], cold: dict[str, Any],
    questions: dict[str, Any],
) -> None:
    """The loaded KV is really used: the same hits from a store whose bf16 values carry noise give another
    answer (on a tier without integrity checks; with them, the damage is refused)."""
    bad = corrupt_copy(store, work / "q-corrupt", dtype=KV_DTYPE)
    unchecked = policy_for(bad, l2=[{"type": "fs", "base_path": str(bad), "integrity": "none"}])
    with LMCacheServer(unchecked) as srv:
        result = run_replica(work, "q-corrupt", qwen["main"], srv.policy, [questions["q1"]], engine=BF16)["results"][0]
    assert result["num_cached_tokens"] > 800
    assert result["token_ids"] != cold["q1"]["token_ids"], json.dumps(result)
