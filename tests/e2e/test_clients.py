"""Replicas behind `vllm serve`, driven by the client users use: the `openai` package.

Two replicas are started from `prefixshare vllm-args`' printed output, pasted as a user would. Replica A
answers every request first, computing it from scratch (asserted: nothing cached) — the cold answer — and its
KV goes to the store; replica B, a fresh server, then answers the same requests — completions and chat
completions, streamed and not, with the document id and tenant in ``extra_body`` — and must load each
document from the store on its first request and answer exactly as the cold computation did. Negative
control: another tenant (another cache salt) loads nothing and still gives the cold answer.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.common import CHUNK, served_by_openai

pytestmark = [pytest.mark.engine, pytest.mark.server, pytest.mark.usefixtures("module_cache_dir")]

DOC_TOKENS = 600
MAX_TOKENS = 8
#: logprobs of the same greedy tokens, computed with and without a loaded prefix (different batch shapes)
LOGPROB_TOL = 1e-3
SERVE_FLAGS = ["--dtype", "float32", "--enforce-eager", "--block-size", "32", "--max-model-len", "2048",
               "--enable-prompt-tokens-details"]
SERVE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}


@pytest.fixture(scope="module")
def served(work: Path) -> Iterator[dict[str, Any]]:
    docs = {f"doc{i}": (DOC_TOKENS, 40 + i) for i in range(4)}
    with served_by_openai("vllm", work, SERVE_FLAGS, SERVE_ENV, docs) as served:
        yield served


def extra(doc_id: str, tenant: str) -> dict[str, Any]:
    """What a user puts in ``extra_body``: the document, the tenant (also as the engine's cache salt). The acme
    tenant's requests are stored; the others' are not (``prefixshare.store: false``), so that neither replica
    can load another's copy of a control prompt."""
    params: dict[str, Any] = {"prefixshare.document_id": doc_id, "prefixshare.tenant": tenant,
                              "cached_token_stats": True}
    if tenant != "acme":
        params["prefixshare.store"] = False
    return {"kv_transfer_params": params, "cache_salt": f"t-{tenant}"}


def complete(served: dict[str, Any], name: str, doc: str, *, stream: bool, tenant: str = "acme") -> dict[str, Any]:
    client = served["clients"][name]
    prompt = served["docs"][doc] + "\n\nQuestion: what is this about?\nAnswer:"
    kw: dict[str, Any] = {"model": served["model"], "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                          "logprobs": 1, "extra_body": extra(doc, tenant)}
    if not stream:
        resp = client.completions.create(**kw)
        choice = resp.choices[0]
        return {"text": choice.text, "logprobs": list(choice.logprobs.token_logprobs), "usage": resp.usage,
                "kv": (resp.model_extra or {}).get("kv_transfer_params")}
    text, logprobs, usage = "", [], None
    for chunk in client.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if chunk.choices:
            text += chunk.choices[0].text
            logprobs += list(chunk.choices[0].logprobs.token_logprobs or [])
        usage = chunk.usage or usage
    return {"text": text, "logprobs": logprobs, "usage": usage, "kv": None}


def chat(served: dict[str, Any], name: str, doc: str, *, stream: bool, tenant: str = "acme") -> dict[str, Any]:
    client = served["clients"][name]
    messages = [{"role": "system", "content": "Answer from the manual.\n\n" + served["docs"][doc]},
                {"role": "user", "content": "What is this about?"}]
    kw: dict[str, Any] = {"model": served["model"], "messages": messages, "max_tokens": MAX_TOKENS,
                          "temperature": 0, "logprobs": True, "extra_body": extra(doc, tenant)}
    if not stream:
        resp = client.chat.completions.create(**kw)
        choice = resp.choices[0]
        return {"text": choice.message.content, "logprobs": [t.logprob for t in choice.logprobs.content],
                "usage": resp.usage, "kv": (resp.model_extra or {}).get("kv_transfer_params")}
    text, logprobs, usage = "", [], None
    for chunk in client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            logprobs += [t.logprob for t in (chunk.choices[0].logprobs.content or [])] if chunk.choices[0].logprobs else []
        usage = chunk.usage or usage
    return {"text": text, "logprobs": logprobs, "usage": usage, "kv": None}


def cached(answer: dict[str, Any]) -> int:
    details = answer["usage"].prompt_tokens_details
    return int(details.cached_tokens or 0) if details is not None else 0


def assert_same(answer: dict[str, Any], cold: dict[str, Any]) -> None:
    assert answer["text"] == cold["text"]
    assert len(answer["logprobs"]) == len(cold["logprobs"]) == MAX_TOKENS
    assert all(abs(x - y) <= LOGPROB_TOL for x, y in zip(answer["logprobs"], cold["logprobs"], strict=True))


@pytest.mark.parametrize(("api", "stream", "doc"), [
    ("completions", False, "doc0"), ("completions", True, "doc1"), ("chat", False, "doc2"), ("chat", True, "doc3"),
])
def test_a_fresh_replica_loads_the_document_through_the_openai_client(
    served: dict[str, Any], api: str, stream: bool, doc: str,
) -> None:
    ask = complete if api == "completions" else chat
    cold = ask(served, "a", doc, stream=stream)  # replica A computes the prompt; its KV goes to the store
    assert cached(cold) == 0
    answer = ask(served, "b", doc, stream=stream)  # replica B has never seen it: what it has, it loaded
    prompt_tokens = answer["usage"].prompt_tokens
    assert cached(answer) >= (prompt_tokens - CHUNK) // CHUNK * CHUNK * 0.9, (cached(answer), prompt_tokens)
    if answer["kv"] is not None:  # the connector's own count: these tokens came from the store
        assert answer["kv"]["cached_token_stats"]["num_lmcache_cached_tokens"] == cached(answer), answer["kv"]
    assert_same(answer, cold)


def test_another_tenant_loads_nothing_and_answers_the_same(served: dict[str, Any]) -> None:
    """The negative control: the documents above are in the store under tenant acme's salt; another tenant's
    request for the same prompt loads none of it (from the store or the replica's own cache)."""
    answer = chat(served, "b", "doc2", stream=False, tenant="guest")
    assert cached(answer) == 0
    assert answer["kv"] is None or answer["kv"]["cached_token_stats"]["num_lmcache_cached_tokens"] == 0
    cold = chat(served, "a", "doc2", stream=False, tenant="guest")  # A has not seen guest's prompt either
    assert cached(cold) == 0
    assert_same(answer, cold)
