"""Test-only: one vLLM replica in its own process, driven by a JSON spec; prints a JSON result.

A fresh process per replica is the point: nothing is shared with another replica but the store.
``policy: null`` runs a cold engine without prefixshare (the reference output).

Spec: {"model": DIR, "policy": {...}|null, "instance": STR, "engine": {LLM kwargs},
       "requests": [{"prompt_token_ids": [...], "max_tokens": N, "params": {...}, "cache_salt": STR}
                    | {"messages": [...], "chat_template_kwargs": {...}, ...}],   # LLM.chat: the model's template
       "kill_before": {"INDEX": PID}}      # SIGKILL a process (the store) before request INDEX
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from _probes import settle_probes  # tests/helpers: this script's directory

from _engine_env import set_engine_env  # tests/helpers: this script's directory

set_engine_env()


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    from prefixshare._log import configure

    configure(level="INFO", json=True)  # structured events on stderr, for the tests to read
    import vllm

    engine = {"model": spec["model"], "dtype": "float32", "enforce_eager": True,
              "distributed_executor_backend": "uni", "block_size": 32, "max_model_len": 4096,
              "enable_prefix_caching": True, "seed": 0, **spec.get("engine", {})}
    ps = None
    started = time.monotonic()
    if spec.get("policy") is None:
        from prefixshare.adapters.vllm import _compat

        _compat.apply()
        llm = vllm.LLM(**engine)
    else:
        from prefixshare import Policy, PrefixShare

        ps = PrefixShare(Policy.build(**spec["policy"]), server=False, instance=spec["instance"])
        # "engine_args": attach the documented vllm.EngineArgs form instead of a dict of LLM kwargs
        llm = ps.attach(vllm.EngineArgs(**engine) if spec.get("engine_args") else engine)
    engine_s = time.monotonic() - started
    results = []
    kill = {int(k): v for k, v in spec.get("kill_before", {}).items()}
    for i, req in enumerate(spec["requests"]):
        if i in kill:
            os.kill(kill[i], signal.SIGKILL)
            time.sleep(0.2)
        params = vllm.SamplingParams(
            temperature=0.0, max_tokens=req.get("max_tokens", 12), logprobs=1, ignore_eos=True,
            extra_args={"kv_transfer_params": req["params"]} if req.get("params") else None,
        )
        t0 = time.monotonic()
        if "messages" in req:  # rendered by vLLM with the model's own chat template
            out = llm.chat(req["messages"], params, use_tqdm=False,
                           chat_template_kwargs=req.get("chat_template_kwargs"))[0]
        else:
            prompt = {"prompt_token_ids": req["prompt_token_ids"]}
            if req.get("cache_salt"):
                prompt["cache_salt"] = req["cache_salt"]
            out = llm.generate([prompt], params, use_tqdm=False)[0]
        seconds = time.monotonic() - t0
        comp = out.outputs[0]
        results.append({
            "token_ids": list(comp.token_ids),
            "logprobs": [lp[t].logprob for lp, t in zip(comp.logprobs, comp.token_ids)],
            "num_cached_tokens": out.num_cached_tokens or 0,
            "prompt_token_ids": list(out.prompt_token_ids or []),
            "seconds": seconds,
        })
    settle_probes()  # a store.down verdict in flight reaches the log the tests read
    result = {"engine_s": engine_s, "results": results, "stats": ps.stats() if ps else None}
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()
    os._exit(0)  # skip engine teardown: the process is done (and a killed store must not delay exit)


if __name__ == "__main__":
    main()
