"""Test-only: a vLLM (or SGLang) replica warms a corpus larger than the server's memory (L1), twice: first
unpaced and without retries (the negative control: the server drops stores it has no memory for), then as warm
does by default; then, its own prefix cache emptied and the server's memory back under its eviction watermark (a
load needs room there too: over the watermark LMCache's lookup misses until its next eviction, up to a second),
it asks one question about a few documents of the second corpus (loaded from the store). Prints one
``RESULT {json}`` line.

Spec: {"model": DIR, "policy_file": PATH, "instance": STR, "engine_type": "vllm"|"sglang", "control": {ID: TEXT},
       "corpus": {ID: TEXT}, "batch_tokens": N, "ask": [ID...], "question": STR, "max_tokens": N}
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from _engine_env import engine_kwargs, set_engine_env  # tests/helpers: this script's directory

set_engine_env()


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    kind = spec.get("engine_type", "vllm")
    if kind == "sglang":
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

    from prefixshare import PrefixShare
    from prefixshare.warm import prompt_for, warm
    from prefixshare.warm._engines import engine_for

    engine = engine_kwargs(kind, spec["model"])
    ps = PrefixShare(spec["policy_file"], server=False, instance=spec["instance"])
    llm = ps.attach(engine, engine_type=kind)
    batch = int(spec["batch_tokens"])
    control = warm(ps, spec["control"], llm, pace=False, retries=0, strict=False, batch_tokens=batch)
    paced = warm(ps, spec["corpus"], llm, strict=False, batch_tokens=batch)
    engine_for(ps, llm).reset_prefix_cache()
    waited = _until_under_watermark(ps.policy.server.http_url)
    before = ps.stats()["tokens_loaded"]
    answers = []
    for doc_id in spec["ask"]:
        prompt = prompt_for(ps, (doc_id, spec["corpus"][doc_id]), spec["question"])
        answer = {"doc": doc_id, "prompt": prompt.token_ids, "prefix_tokens": prompt.prefix_tokens}
        answer.update(_sglang(llm, prompt, spec) if kind == "sglang" else _vllm(llm, prompt, spec))
        answers.append(answer)
    result = {"control": control.to_dict(), "paced": paced.to_dict(), "answers": answers, "waited_s": waited,
              "tokens_loaded": ps.stats()["tokens_loaded"] - before}
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()
    if kind == "sglang":
        llm.shutdown()
    os._exit(0)


def _vllm(llm, prompt, spec: dict) -> dict:  # noqa: ANN001
    import vllm

    params = vllm.SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True,
                                 extra_args={"kv_transfer_params": prompt.kv_transfer_params})
    out = llm.generate([prompt.engine_input()], params, use_tqdm=False)[0]
    return {"cached": int(out.num_cached_tokens or 0), "token_ids": list(out.outputs[0].token_ids)}


def _sglang(engine, prompt, spec: dict) -> dict:  # noqa: ANN001
    out = engine.generate(**prompt.sglang_kwargs(), sampling_params={"temperature": 0.0, "ignore_eos": True,
                                                                     "max_new_tokens": spec["max_tokens"]})
    meta = out["meta_info"]
    details = meta.get("cached_tokens_details") or {}
    return {"cached": int(meta.get("cached_tokens") or 0), "storage_tokens": int(details.get("storage") or 0),
            "token_ids": list(out["output_ids"])}


def _until_under_watermark(url: str, timeout_s: float = 5.0) -> float:
    """Wait until the server's memory is under its eviction watermark; returns the seconds waited."""
    import time

    import httpx

    from prefixshare.warm._room import parse_room

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        room = parse_room(httpx.get(url + "/status", timeout=5).json())
        if room is None or not room.evicting:
            break
        time.sleep(0.05)
    return time.monotonic() - t0


if __name__ == "__main__":
    main()
