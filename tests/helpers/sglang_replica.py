"""Test-only: one SGLang replica in its own process, driven by a JSON spec; prints a JSON result.

Same contract as vllm_replica.py. SGLang's CPU engine needs the test-only ``sgl_kernel`` stand-in from
tests/shims on PYTHONPATH (the test harness puts it there). ``policy: null`` runs a cold engine.
Request specs may carry "document_id", "tenant", "prefix_tokens", "store", "load" (prefixshare settings) and
"pause_before_s" (a sleep before the request, so that what the previous one left running has ended).
``"interactive": true``: after start-up it prints ``READY``, then answers one JSON request per stdin line with
one ``ONE <json>`` line, until an empty line (benchmarks/sglang_miss_path.py keeps several up side by side).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

from _probes import settle_probes  # tests/helpers: this script's directory

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _generate(eng: Any, req: dict[str, Any]) -> dict[str, Any]:
    from prefixshare.adapters.sglang import request_kwargs

    if req.get("pause_before_s"):
        time.sleep(float(req["pause_before_s"]))
    extra = request_kwargs(document_id=req.get("document_id"), tenant=req.get("tenant"),
                           prefix_tokens=req.get("prefix_tokens"), store=req.get("store"), load=req.get("load"))
    t0 = time.monotonic()
    out = eng.generate(input_ids=req["prompt_token_ids"], return_logprob=True,
                       sampling_params={"temperature": 0.0, "max_new_tokens": req.get("max_tokens", 12),
                                        "ignore_eos": True}, **extra)
    seconds = time.monotonic() - t0
    meta = out["meta_info"]
    details = meta.get("cached_tokens_details") or {}
    return {
        "token_ids": list(out["output_ids"]),
        "logprobs": [x[0] for x in meta["output_token_logprobs"]],
        "num_cached_tokens": int(meta.get("cached_tokens") or 0),
        "storage_tokens": int(details.get("storage") or 0),
        "seconds": seconds,
    }


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    if spec.get("engine", {}).get("device", "cpu") == "cpu":
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")  # before SGLang is imported
    from prefixshare._log import configure

    configure(level="INFO", json=True)
    import sglang

    engine = {"model_path": spec["model"], "device": "cpu", "attention_backend": "torch_native",
              "disable_cuda_graph": True, "page_size": 16, "dtype": "float32", "mem_fraction_static": 0.3,
              "max_total_tokens": 16384, "log_level": "warning", "random_seed": 0, **spec.get("engine", {})}
    ps = None
    started = time.monotonic()
    if spec.get("policy") is None:
        eng = sglang.Engine(**engine)
    else:
        from prefixshare import Policy, PrefixShare

        ps = PrefixShare(Policy.build(**spec["policy"]), server=False, instance=spec["instance"])
        if spec.get("server_args"):  # attach the documented ServerArgs form instead of a dict of Engine kwargs
            from sglang.srt.server_args import ServerArgs

            eng = ps.attach(ServerArgs(**engine))
        else:
            eng = ps.attach(engine, engine_type="sglang")
    engine_s = time.monotonic() - started

    if spec.get("interactive"):  # one request per line on stdin, one result line each (benchmarks)
        sys.stdout.write("READY\n")
        sys.stdout.flush()
        for line in sys.stdin:
            if not line.strip():
                break
            sys.stdout.write("ONE " + json.dumps(_generate(eng, json.loads(line))) + "\n")
            sys.stdout.flush()
        spec["requests"] = []
    kill = {int(k): v for k, v in spec.get("kill_before", {}).items()}
    results = []
    for i, req in enumerate(spec["requests"]):
        if i in kill:
            os.kill(kill[i], signal.SIGKILL)
            time.sleep(0.2)
        results.append(_generate(eng, req))
    settle_probes()  # a store.down verdict in flight reaches the log the tests read
    result = {"engine_s": engine_s, "results": results, "stats": ps.stats() if ps else None}
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()
    try:
        eng.shutdown()
    finally:
        os._exit(0)


if __name__ == "__main__":
    main()
