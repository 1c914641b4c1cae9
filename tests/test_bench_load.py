"""``prefixshare bench-load``'s client against stub OpenAI-compatible replicas (no engine): the request stream is
deterministic, routing does what it says, a streamed answer's TTFT, inter-token gaps, text, logprobs and cached
tokens are read as sent, and a replica that fails or stalls is counted as errors, not dropped."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from prefixshare.bench._load import Schedule, Workload, document_texts, percentile, run_load

TOKENS = ["Alpha", " beta", " gamma"]
GAP_S = 0.05


class _Stub(BaseHTTPRequestHandler):
    seen: list[dict[str, Any]]
    mode = "ok"

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802
        data = json.dumps({"data": [{"id": "stub-model"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:  # noqa: N802
        payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append(payload)
        if self.mode == "fail":
            self.send_response(503)
            self.send_header("Content-Length", "4")
            self.end_headers()
            self.wfile.write(b"busy")
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        if self.mode == "stall":
            time.sleep(3)
            return
        for i, tok in enumerate(TOKENS):
            chunk = {"choices": [{"delta": {"content": tok}, "logprobs": {"content": [{"logprob": -0.5 * i}]}}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
            time.sleep(GAP_S)
        usage = {"choices": [], "usage": {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 64}}}
        self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())


@pytest.fixture
def replicas() -> Iterator[tuple[list[str], list[type[_Stub]]]]:
    servers, handlers = [], []
    for _ in range(2):
        handler = type("Stub", (_Stub,), {"seen": []})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        handlers.append(handler)
    yield [f"http://127.0.0.1:{s.server_address[1]}" for s in servers], handlers
    for s in servers:
        s.shutdown()
        s.server_close()


def test_the_stream_is_deterministic_and_affinity_keeps_a_document_on_one_replica() -> None:
    w = Workload(documents=6, doc_tokens=(100, 200), rate=20, duration_s=5, routing="affinity", seed=3)
    texts = document_texts(w)
    first, second = Schedule(w, 2, dict(texts)).requests(), Schedule(w, 2, dict(texts)).requests()
    assert first == second and 60 <= len(first) <= 140  # Poisson at 20/s for 5 s
    owner: dict[str, int] = {}
    for r in first:
        assert owner.setdefault(r.doc, r.replica) == r.replica
    assert len(set(owner.values())) == 2  # both replicas own documents
    spread = Schedule(Workload(documents=6, doc_tokens=(100, 200), rate=20, duration_s=5, seed=3), 2,
                      dict(texts)).requests()
    assert any(len({r.replica for r in spread if r.doc == d}) == 2 for d in texts)  # random spreads a document
    # every routing rule sees the same requests at the same times (arms compare on the same stream)
    assert [(r.at_s, r.doc, r.question, r.tenant) for r in spread] == [(r.at_s, r.doc, r.question, r.tenant)
                                                                         for r in first]
    unique = Schedule(Workload(documents=6, doc_tokens=(100, 200), rate=20, duration_s=2, unique=True), 2,
                      dict(texts)).requests()
    assert len({r.doc for r in unique}) == len(unique)  # the control: never the same document twice


def test_answers_are_read_as_streamed_and_failures_counted(replicas: tuple[list[str], list[type[_Stub]]]) -> None:
    urls, handlers = replicas
    w = Workload(documents=3, doc_tokens=(50, 80), rate=10, duration_s=1.5, routing="round_robin",
                 ttft_slo_s=1.0, request_timeout_s=1.0)
    result = run_load(urls, w)
    s, answers = result["summary"], result["answers"]
    assert result["model"] == "stub-model" and s["errors"] == 0 and s["completed"] == len(answers) > 5
    a = answers[0]
    assert a["text"] == "".join(TOKENS) and a["logprobs"] == [0.0, -0.5, -1.0]
    assert a["cached_tokens"] == 64 and a["prompt_tokens"] == 100 and len(a["itl_s"]) == 2
    assert all(GAP_S * 0.8 <= x < GAP_S * 4 for x in a["itl_s"])
    assert s["cached_fraction"] == 0.64 and s["hit_rate"] == 1.0 and s["goodput"] == s["request_throughput"]
    sent = handlers[0].seen[0]
    assert sent["kv_transfer_params"]["prefixshare.document_id"] == a["doc"] and sent["cache_salt"].startswith("t-")
    assert {len(h.seen) for h in handlers} <= {len(answers) // 2, len(answers) - len(answers) // 2}

    handlers[0].mode, handlers[1].mode = "fail", "stall"
    bad = run_load(urls, w)["summary"]
    assert bad["completed"] == 0 and bad["errors"] == bad["requests"] > 0
    assert any("HTTP 503" in e for e in bad["error_samples"]) and any("Timeout" in e for e in bad["error_samples"])


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([], 50) is None
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
