"""A shared-document load against a fleet of OpenAI-compatible replicas (``prefixshare bench-load``).

The workload prefixshare is for: ``documents`` long, stable documents (``doc_tokens`` each: a manual, a codebase),
each asked many questions (``questions`` distinct ones), popularity Zipf(``zipf``), requests arriving open-loop
(Poisson, ``rate`` per second, for ``duration_s``) and spread over the replicas by ``routing``:

* ``random`` — what a plain load balancer does: a document's requests land on every replica;
* ``affinity`` — each document always to the same replica (a stable hash of its id): what users run instead
  of a shared store, at the price of hot spots and of a replica's own cache capacity;
* ``round_robin``.

``unique=True`` is the zero-reuse control: every request brings a document never seen before, so nothing can
be shared and every cost of sharing shows. Each request is a streamed chat completion (the document in the
system message, the question as the user's), greedy, with the sampled tokens' logprobs, so that a run's answers
can be compared with a cold reference. With ``prefixshare_params`` each request carries its tenant and document
id in ``kv_transfer_params``, as a gateway in front of prefixshare replicas would set them.

Reported per run, as ``vllm bench serve`` reports them: completed requests, request throughput, goodput at the
TTFT SLO, TTFT and ITL percentiles, plus errors, the prompt tokens the replicas served from a cache
(``usage.prompt_tokens_details.cached_tokens``) and the hit rate. Everything is on the client's clock; a request
not answered within ``request_timeout_s`` is an error.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

QUESTIONS = (
    "What is this document about?", "Who is named first?", "What happens at the end?",
    "Summarise the second paragraph.", "Which place is mentioned most?", "What is the main warning?",
    "List three facts from the text.", "What should a new reader do first?",
)
SYSTEM = "Answer from the document.\n\n"
#: about how many tokens one word of :func:`prefixshare.model.document_text` becomes (the tokenizers this
#: package builds; real tokenizers are near it for English prose)
TOKENS_PER_WORD = 1.3
ROUTINGS = ("random", "affinity", "round_robin")


@dataclass(frozen=True)
class Workload:
    documents: int = 16
    doc_tokens: tuple[int, int] = (1500, 2500)
    questions: int = 8
    zipf: float = 0.8
    rate: float = 1.0
    duration_s: float = 60.0
    seed: int = 0
    routing: str = "random"
    unique: bool = False
    tenants: tuple[str, ...] = ("acme", "globex")
    max_tokens: int = 16
    ttft_slo_s: float = 2.0
    request_timeout_s: float = 180.0
    prefixshare_params: bool = True

    def __post_init__(self) -> None:
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing {self.routing!r}: use one of {', '.join(ROUTINGS)}")
        if not 0 < self.doc_tokens[0] <= self.doc_tokens[1]:
            raise ValueError(f"doc_tokens {self.doc_tokens}: give MIN-MAX with 0 < MIN <= MAX")
        if self.documents < 1 or not 1 <= self.questions <= len(QUESTIONS):
            raise ValueError(f"documents >= 1 and 1 <= questions <= {len(QUESTIONS)}")
        if self.rate <= 0 or self.duration_s <= 0:
            raise ValueError("rate and duration must be positive")


@dataclass(frozen=True)
class Request:
    index: int
    at_s: float  #: when it is sent, from the run's start
    doc: str
    question: int
    tenant: str
    replica: int


@dataclass
class Answer:
    index: int
    doc: str
    question: int
    tenant: str
    replica: int
    sent_s: float = 0.0
    ttft_s: float | None = None
    latency_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    error: str | None = None


def document_texts(workload: Workload) -> dict[str, str]:
    """The workload's documents: id -> text, deterministic in the seed."""
    from prefixshare.model import document_text

    rng = random.Random(f"docs:{workload.seed}")
    low, high = (round(t / TOKENS_PER_WORD) for t in workload.doc_tokens)
    return {f"doc{i:03d}": document_text(rng.randint(low, high), seed=10_000 * workload.seed + i)
            for i in range(workload.documents)}


class Schedule:
    """The run's requests, in order: Poisson arrivals, Zipf documents (or new ones), uniform questions and
    tenants, a replica by the routing rule. The same workload and replica count give the same requests."""

    def __init__(self, workload: Workload, replicas: int, texts: dict[str, str]) -> None:
        self.workload, self.replicas, self.texts = workload, replicas, texts
        self.docs = sorted(texts)
        self.weights = [1.0 / (rank + 1) ** workload.zipf for rank in range(len(self.docs))]
        self.rng = random.Random(f"schedule:{workload.seed}")
        #: routing draws from its own stream: every routing rule sees the same requests at the same times
        self.route_rng = random.Random(f"route:{workload.seed}")
        self.low, self.high = (round(t / TOKENS_PER_WORD) for t in workload.doc_tokens)

    def replica_for(self, doc: str, index: int) -> int:
        w = self.workload
        if w.routing == "affinity":
            return int.from_bytes(hashlib.blake2b(doc.encode(), digest_size=8).digest(), "big") % self.replicas
        if w.routing == "round_robin":
            return index % self.replicas
        return self.route_rng.randrange(self.replicas)

    def requests(self) -> list[Request]:
        from prefixshare.model import document_text

        w, rng, out, t = self.workload, self.rng, [], 0.0
        while True:
            t += rng.expovariate(w.rate)
            if t >= w.duration_s:
                return out
            i = len(out)
            if w.unique:
                doc = f"u{w.seed}-{i:05d}"
                words = rng.randint(self.low, self.high)
                self.texts[doc] = document_text(words, seed=1_000_000 + 10_000 * w.seed + i)
            else:
                doc = rng.choices(self.docs, self.weights)[0]
            question, tenant = rng.randrange(w.questions), rng.choice(w.tenants)
            out.append(Request(i, t, doc, question, tenant, self.replica_for(doc, i)))


def body(workload: Workload, model: str, req: Request, text: str) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": model, "stream": True, "stream_options": {"include_usage": True}, "temperature": 0,
        "max_tokens": workload.max_tokens, "logprobs": True,
        "messages": [{"role": "system", "content": SYSTEM + text},
                     {"role": "user", "content": QUESTIONS[req.question]}],
        # the tenant as the engine's own cache salt: tenants never share a prefix, with or without prefixshare
        "cache_salt": f"t-{req.tenant}",
    }
    if workload.prefixshare_params:
        out["kv_transfer_params"] = {"prefixshare.tenant": req.tenant, "prefixshare.document_id": req.doc}
    return out


async def _ask(client: Any, url: str, payload: dict[str, Any], req: Request, t0: float, timeout_s: float) -> Answer:
    ans = Answer(req.index, req.doc, req.question, req.tenant, req.replica, sent_s=time.monotonic() - t0)
    begin = time.monotonic()
    try:
        await asyncio.wait_for(_stream(client, url, payload, ans, begin), timeout_s)
    except Exception as exc:  # noqa: BLE001 - every failure is a result: counted as an error
        ans.error = f"{type(exc).__name__}: {exc}"[:400]
    ans.latency_s = time.monotonic() - begin
    return ans


async def _stream(client: Any, url: str, payload: dict[str, Any], ans: Answer, begin: float) -> None:
    """One streamed chat completion into ``ans``: first-token time, inter-token gaps, text, logprobs, usage."""
    last = begin
    async with client.stream("POST", f"{url}/v1/chat/completions", json=payload) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or ():
                content = ((choice.get("logprobs") or {}).get("content")) or []
                if content:
                    now = time.monotonic()
                    if ans.ttft_s is None:
                        ans.ttft_s = now - begin
                    else:
                        ans.itl_s.append((now - last) / len(content))
                    last = now
                    ans.logprobs += [float(t["logprob"]) for t in content]
                ans.text += (choice.get("delta") or {}).get("content") or ""
            usage = chunk.get("usage")
            if usage:
                ans.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                details = usage.get("prompt_tokens_details") or {}
                ans.cached_tokens = int(details.get("cached_tokens") or 0)


async def _run(urls: list[str], model: str, workload: Workload, requests: list[Request],
               text_of: Callable[[str], str]) -> tuple[list[Answer], float]:
    import httpx

    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=64, keepalive_expiry=2.0)
    timeout = httpx.Timeout(workload.request_timeout_s, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        t0 = time.monotonic()

        async def one(req: Request) -> Answer:
            await asyncio.sleep(max(0.0, t0 + req.at_s - time.monotonic()))
            return await _ask(client, urls[req.replica], body(workload, model, req, text_of(req.doc)), req, t0,
                              workload.request_timeout_s)

        answers = await asyncio.gather(*(one(r) for r in requests))
        return sorted(answers, key=lambda a: a.index), time.monotonic() - t0


def served_model(url: str) -> str:
    import httpx

    return str(httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"])


def run_load(urls: list[str], workload: Workload, *, model: str | None = None,
             texts: dict[str, str] | None = None) -> dict[str, Any]:
    """Drive ``workload`` against the replicas at ``urls``; the run's summary plus every answer."""
    texts = dict(texts) if texts is not None else document_texts(workload)
    schedule = Schedule(workload, len(urls), texts)
    requests = schedule.requests()
    model = model or served_model(urls[0])
    answers, elapsed = asyncio.run(_run(urls, model, workload, requests, texts.__getitem__))
    return {"workload": asdict(workload), "replicas": urls, "model": model,
            "summary": summarize(answers, workload, elapsed), "answers": [asdict(a) for a in answers]}


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile by linear interpolation (numpy's default), or None without values."""
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summarize(answers: list[Answer], workload: Workload, elapsed_s: float) -> dict[str, Any]:
    ok = [a for a in answers if a.error is None and a.ttft_s is not None]
    ttft = [a.ttft_s for a in ok if a.ttft_s is not None]
    itl = [x for a in ok for x in a.itl_s]
    good = [a for a in ok if a.ttft_s is not None and a.ttft_s <= workload.ttft_slo_s]
    prompt = sum(a.prompt_tokens for a in ok)
    cached = sum(a.cached_tokens for a in ok)

    def ms(v: float | None) -> float | None:
        return None if v is None else round(v * 1e3, 1)

    return {
        "requests": len(answers), "completed": len(ok), "errors": len(answers) - len(ok),
        "error_samples": [a.error for a in answers if a.error][:5],
        "duration_s": round(elapsed_s, 2),
        "request_throughput": round(len(ok) / elapsed_s, 4) if elapsed_s > 0 else None,
        "goodput": round(len(good) / elapsed_s, 4) if elapsed_s > 0 else None,
        "ttft_slo_s": workload.ttft_slo_s,
        "mean_ttft_ms": ms(sum(ttft) / len(ttft)) if ttft else None,
        "p50_ttft_ms": ms(percentile(ttft, 50)), "p90_ttft_ms": ms(percentile(ttft, 90)),
        "p99_ttft_ms": ms(percentile(ttft, 99)),
        "mean_itl_ms": ms(sum(itl) / len(itl)) if itl else None,
        "p50_itl_ms": ms(percentile(itl, 50)), "p99_itl_ms": ms(percentile(itl, 99)),
        "prompt_tokens": prompt, "cached_prompt_tokens": cached,
        "cached_fraction": round(cached / prompt, 4) if prompt else None,
        # a hit: at least half the prompt served from a cache (the replica's own or the shared store)
        "hit_rate": round(sum(1 for a in ok if a.cached_tokens * 2 >= a.prompt_tokens) / len(ok), 4) if ok else None,
    }
