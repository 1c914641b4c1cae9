"""One demo replica in its own process: ``python -m prefixshare.demo._replica SPEC.json``.

Roles: ``warm`` (replica A: attach through prefixshare, warm the manual), ``serve`` (replica B: a fresh
process that answers the questions with prompts built by ``prompt_for``) and ``cold`` (vLLM without
prefixshare, the same model and prompts: the reference TTFT and first token). Prints one ``RESULT {json}``
line on stdout; logs go to stderr.

TTFT is the wall time of a ``max_tokens=1`` generation: the prefill (or the load) plus one token. Before
each question the replica's local prefix cache is reset, so every question reaches the store (B) or is
computed in full (cold), as on a replica that has never seen the manual.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

from prefixshare.warm import apply_engine_env

apply_engine_env()
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def _params(vllm: Any, kv: dict[str, Any] | None, *, logprobs: bool = True) -> Any:
    return vllm.SamplingParams(max_tokens=1, temperature=0.0, logprobs=1 if logprobs else None, detokenize=False,
                               extra_args={"kv_transfer_params": kv} if kv else None)


def _first(out: Any) -> tuple[int, float | None]:
    comp = out.outputs[0]
    token = int(comp.token_ids[0])
    logprob = comp.logprobs[0][token].logprob if comp.logprobs else None
    return token, logprob


def _prime_ids(n: int) -> list[int]:
    """A random prefix as long as the manual's: every replica's first request of a given shape pays one-off
    costs (seconds on CPU), so each replica first runs a request shaped like its measured ones on these ids."""
    rng = random.Random(1234)
    return [rng.randrange(16, 4000) for _ in range(n)]


def _reset(llm: Any) -> None:
    from prefixshare.adapters.vllm import reset_vllm_prefix_cache

    reset_vllm_prefix_cache(llm)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))
    role = spec["role"]
    started = time.perf_counter()
    import vllm

    from prefixshare.warm import Template

    template = Template.chat(system=spec["system"])
    result: dict[str, Any] = {"role": role}
    if role == "cold":
        result.update(_run_cold(vllm, spec, template, started))
    else:
        from prefixshare.share import PrefixShare

        ps = PrefixShare(spec["policy_file"], server=False, instance=spec["instance"])
        llm = ps.attach(spec["engine"])
        result["engine_s"] = time.perf_counter() - started
        if role == "warm":
            result.update(_run_warm(vllm, ps, llm, spec, template))
        else:
            result.update(_run_serve(vllm, ps, llm, spec, template))
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()
    os._exit(0)  # the process is done; an in-process engine's teardown only costs time


def _run_cold(vllm: Any, spec: dict[str, Any], template: Any, started: float) -> dict[str, Any]:
    """The cold replica: vLLM without prefixshare answers every question, prefilling the manual each time."""
    from prefixshare.adapters.vllm import fix_in_process_engine

    fix_in_process_engine()
    llm = vllm.LLM(**spec["engine"])
    result: dict[str, Any] = {"engine_s": time.perf_counter() - started}
    from prefixshare.warm import prefix_ids, question_ids

    tok = llm.get_tokenizer()
    resolved = template.resolve(tok)
    manual = Path(spec["manual"]).read_text(encoding="utf-8")
    head = prefix_ids(tok, resolved, manual)
    first_q = question_ids(tok, resolved, spec["questions"][0])
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": _prime_ids(len(head)) + first_q}], _params(vllm, None), use_tqdm=False)
    result["warmup_s"] = time.perf_counter() - t0
    rows = []
    for question in spec["questions"]:
        ids = head + question_ids(tok, resolved, question)
        _reset(llm)
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], _params(vllm, None), use_tqdm=False)[0]
        ttft = time.perf_counter() - t0
        token, logprob = _first(out)
        rows.append({"question": question, "prompt_tokens": len(ids), "prefix_tokens": len(head),
                     "ttft_s": ttft, "cached_tokens": int(out.num_cached_tokens or 0), "first_token": token,
                     "first_logprob": logprob, "prompt": ids})
    result["questions"] = rows
    return result


def _run_warm(vllm: Any, ps: Any, llm: Any, spec: dict[str, Any], template: Any) -> dict[str, Any]:
    """Replica A: warm the manual into the store, then run replica B's warm-up prefix once."""
    from prefixshare.warm import warm

    t0 = time.perf_counter()
    report = warm(ps, [spec["manual"]], llm, prefix=template, strict=False)
    result: dict[str, Any] = {"warm_s": time.perf_counter() - t0, "report": report.to_dict()}
    # the warm-up prefix replica B loads before its measured questions (see _prime_ids)
    n = report.documents[0].tokens
    llm.generate([{"prompt_token_ids": _prime_ids(n)}],
                 _params(vllm, {"prefixshare.document_id": "demo-warmup", "prefixshare.prefix_tokens": n}),
                 use_tqdm=False)
    return result


def _run_serve(vllm: Any, ps: Any, llm: Any, spec: dict[str, Any], template: Any) -> dict[str, Any]:
    """Replica B: answer every question through prefixshare, the manual loaded from the store."""
    from prefixshare.warm import prompt_for

    first = prompt_for(ps, spec["manual"], spec["questions"][0], prefix=template)
    prime = _prime_ids(first.prefix_tokens) + first.token_ids[first.prefix_tokens:]
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": prime}],
                 _params(vllm, {"prefixshare.prefix_tokens": first.prefix_tokens}), use_tqdm=False)
    result: dict[str, Any] = {"warmup_s": time.perf_counter() - t0}
    result["questions"] = [_serve_question(vllm, ps, llm, spec, template, question) for question in spec["questions"]]
    result["stats"] = ps.stats()
    return result


def _serve_question(vllm: Any, ps: Any, llm: Any, spec: dict[str, Any], template: Any, question: str) -> dict[str, Any]:
    """Replica B answers one question: its TTFT, first token and what it loaded from the store."""
    from prefixshare.warm import prompt_for

    prompt = prompt_for(ps, spec["manual"], question, prefix=template)
    _reset(llm)  # the manual must come from the store, not this replica's own cache
    before = ps.stats()
    t0 = time.perf_counter()
    out = llm.generate([prompt.engine_input()], _params(vllm, prompt.kv_transfer_params),
                       use_tqdm=False)[0]
    ttft = time.perf_counter() - t0
    after = _settled_stats(ps, before)
    token, logprob = _first(out)
    return {"question": question, "prompt_tokens": len(prompt), "prefix_tokens": prompt.prefix_tokens,
            "ttft_s": ttft, "cached_tokens": int(out.num_cached_tokens or 0),
            "tokens_loaded": after["tokens_loaded"] - before["tokens_loaded"],
            "bytes_loaded": after["bytes_loaded"] - before["bytes_loaded"],
            "first_token": token, "first_logprob": logprob, "prompt": prompt.token_ids}


def _settled_stats(ps: Any, before: dict[str, Any]) -> dict[str, Any]:
    """Stats after one more finished request (snapshots are published at most every 50 ms)."""
    deadline = time.monotonic() + 1.0
    while True:
        after = ps.stats()
        if after.get("requests", 0) > before.get("requests", 0) or time.monotonic() > deadline:
            return after
        time.sleep(0.06)


if __name__ == "__main__":
    main()
