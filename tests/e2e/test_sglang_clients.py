"""Replicas behind SGLang's HTTP server, driven through its documented routes: ``/generate`` with text, and the
OpenAI routes (``/v1/completions``, ``/v1/chat/completions``) through the ``openai`` package.

Two replicas are started from ``prefixshare sglang-args``' printed output, pasted as a user would (plus the CPU
engine's flags). Replica A answers every request first, computing it from scratch (asserted: nothing cached)
-- the cold answer -- and its KV goes to the store; replica B, a fresh server, then answers the same requests
and must load each document from the store (SGLang's own ``cached_tokens_details.storage`` count, read from the
response) and answer exactly as the cold computation did. The document id and tenant travel as
``request_kwargs`` builds them (``rid``, ``cache_salt``), in the body or in ``extra_body``. Negative control:
another tenant loads nothing and still gives the cold answer.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.common import CHUNK, SHIM_ENV, post_json, served_by_openai

pytestmark = [pytest.mark.engine, pytest.mark.server, pytest.mark.usefixtures("module_cache_dir")]

DOC_TOKENS = 600
MAX_TOKENS = 8
LOGPROB_TOL = 1e-3
#: SGLang's CPU engine (tests/helpers/sglang_replica.py runs it with the same settings), and the hit counts
CPU_FLAGS = ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph", "--page-size", "16",
             "--dtype", "float32", "--mem-fraction-static", "0.3", "--max-total-tokens", "16384",
             "--random-seed", "0", "--enable-cache-report"]
CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1", **SHIM_ENV}


@pytest.fixture(scope="module")
def served(work: Path) -> Iterator[dict[str, Any]]:
    docs = {f"doc{i}": (DOC_TOKENS, 60 + i) for i in range(5)}
    with served_by_openai("sglang", work, CPU_FLAGS, CPU_ENV, docs) as served:
        yield served


def tagged(doc_id: str, tenant: str) -> dict[str, Any]:
    """The request fields prefixshare reads (``rid``, ``cache_salt``); tenants other than acme are not stored,
    so that neither replica can load another's copy of a control prompt."""
    from prefixshare.adapters.sglang import request_kwargs

    return request_kwargs(document_id=doc_id, tenant=tenant, store=None if tenant == "acme" else False)


def generate(served: dict[str, Any], name: str, doc: str, *, tenant: str = "acme") -> dict[str, Any]:
    prompt = served["docs"][doc] + "\n\nQuestion: what is this about?\nAnswer:"
    body = {"text": prompt, "return_logprob": True, **tagged(doc, tenant),
            "sampling_params": {"temperature": 0.0, "max_new_tokens": MAX_TOKENS, "ignore_eos": True}}
    out = post_json(f"{served['urls'][name]}/generate", body)
    meta = out["meta_info"]
    return {"text": out["text"], "logprobs": [x[0] for x in meta["output_token_logprobs"]],
            "prompt_tokens": meta["prompt_tokens"], "cached": meta["cached_tokens"],
            "storage": int((meta.get("cached_tokens_details") or {}).get("storage") or 0)}


def _storage(resp: Any) -> int | None:
    details = ((resp.model_extra or {}).get("sglext") or {}).get("cached_tokens_details") or {}
    return None if details.get("storage") is None else int(details["storage"])


def _usage(usage: Any) -> tuple[int, int]:
    details = usage.prompt_tokens_details
    return usage.prompt_tokens, int(details.cached_tokens or 0) if details is not None else 0


def complete(served: dict[str, Any], name: str, doc: str, *, stream: bool, tenant: str = "acme") -> dict[str, Any]:
    client = served["clients"][name]
    prompt = served["docs"][doc] + "\n\nQuestion: what is this about?\nAnswer:"
    kw: dict[str, Any] = {"model": served["model"], "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                          "logprobs": 1, "extra_body": {**tagged(doc, tenant), "return_cached_tokens_details": True}}
    if not stream:
        resp = client.completions.create(**kw)
        choice = resp.choices[0]
        prompt_tokens, cached = _usage(resp.usage)
        return {"text": choice.text, "logprobs": list(choice.logprobs.token_logprobs), "prompt_tokens": prompt_tokens,
                "cached": cached, "storage": _storage(resp)}
    text, logprobs, usage = "", [], None
    for chunk in client.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if chunk.choices:
            text += chunk.choices[0].text
            logprobs += list(chunk.choices[0].logprobs.token_logprobs or []) if chunk.choices[0].logprobs else []
        usage = chunk.usage or usage
    prompt_tokens, cached = _usage(usage)
    return {"text": text, "logprobs": logprobs, "prompt_tokens": prompt_tokens, "cached": cached, "storage": None}


def chat(served: dict[str, Any], name: str, doc: str, *, stream: bool, tenant: str = "acme") -> dict[str, Any]:
    client = served["clients"][name]
    messages = [{"role": "system", "content": "Answer from the manual.\n\n" + served["docs"][doc]},
                {"role": "user", "content": "What is this about?"}]
    kw: dict[str, Any] = {"model": served["model"], "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0,
                          "logprobs": True, "extra_body": {**tagged(doc, tenant), "return_cached_tokens_details": True}}
    if not stream:
        resp = client.chat.completions.create(**kw)
        choice = resp.choices[0]
        prompt_tokens, cached = _usage(resp.usage)
        return {"text": choice.message.content, "logprobs": [t.logprob for t in choice.logprobs.content],
                "prompt_tokens": prompt_tokens, "cached": cached, "storage": _storage(resp)}
    text, logprobs, usage = "", [], None
    for chunk in client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            if chunk.choices[0].logprobs:
                logprobs += [t.logprob for t in (chunk.choices[0].logprobs.content or [])]
        usage = chunk.usage or usage
    prompt_tokens, cached = _usage(usage)
    return {"text": text, "logprobs": logprobs, "prompt_tokens": prompt_tokens, "cached": cached, "storage": None}


def assert_same(answer: dict[str, Any], cold: dict[str, Any]) -> None:
    assert answer["text"] == cold["text"]
    assert len(answer["logprobs"]) == len(cold["logprobs"]) == MAX_TOKENS
    assert all(abs(x - y) <= LOGPROB_TOL for x, y in zip(answer["logprobs"], cold["logprobs"], strict=True))


ROUTES = {"generate": lambda s, n, d, stream: generate(s, n, d), "completions": complete, "chat": chat}


@pytest.mark.parametrize(("route", "stream", "doc"), [
    ("generate", False, "doc0"), ("completions", False, "doc1"), ("completions", True, "doc2"),
    ("chat", False, "doc3"), ("chat", True, "doc4"),
])
def test_a_fresh_sglang_replica_loads_the_document_through_its_routes(
    served: dict[str, Any], route: str, stream: bool, doc: str,
) -> None:
    ask = ROUTES[route]
    cold = ask(served, "a", doc, stream=stream)  # replica A computes the prompt; its KV goes to the store
    assert cold["cached"] == 0 and not cold["storage"]
    answer = ask(served, "b", doc, stream=stream)  # replica B has never seen it: what it has, it loaded
    full_chunks = (answer["prompt_tokens"] - 1) // CHUNK * CHUNK
    assert answer["cached"] >= full_chunks - CHUNK, (answer["cached"], answer["prompt_tokens"])
    if not stream:  # SGLang's own count of the tokens that came from the store (streams carry only usage)
        assert answer["storage"] == answer["cached"], answer
    assert_same(answer, cold)


def test_another_tenant_loads_nothing_and_answers_the_same(served: dict[str, Any]) -> None:
    """The negative control: the documents above are in the store under tenant acme's salt; another tenant's
    request for the same prompt loads none of it (from the store or the replica's own radix tree)."""
    answer = chat(served, "b", "doc3", stream=False, tenant="guest")
    assert answer["cached"] == 0 and not answer["storage"]
    cold = chat(served, "a", "doc3", stream=False, tenant="guest")  # A has not seen guest's prompt either
    assert cold["cached"] == 0
    assert_same(answer, cold)
