"""Test-only: one vLLM replica in its own process that runs a list of steps; prints ``RESULT {json}``.

Like tests/helpers/vllm_replica.py (a fresh process per replica: nothing shared but the store), plus what the
fault tests need while ONE engine keeps running: pauses during which the test breaks or repairs the store
(kill the server, restart it, move its directory), pre-warming documents, per-step stats, and clearing the
engine's own prefix cache so that a hit can only come from the store.

Spec: {"model": DIR, "policy": {...}|null, "instance": STR, "engine": {LLM kwargs}, "control": DIR,
       "steps": [
         {"op": "generate", "name": STR, "ids": [...], "max_tokens": N, "params": {...}, "cache_salt": STR,
          "reset": BOOL},                          # reset: clear the engine's own prefix cache first
         {"op": "pause", "name": STR},             # write CONTROL/NAME.ready, wait for CONTROL/NAME.go
         {"op": "warm", "name": STR, "docs": [[ID, TEXT], ...], "tenant": STR|null, "force": BOOL},
         {"op": "prompt", "name": STR, "doc": [ID, TEXT], "question": STR, "tenant": STR|null, "reset": BOOL},
         {"op": "verify", "name": STR, "limit": N},  # PrefixShare.verify(): check the hits set aside
         {"op": "sleep", "seconds": S}]}
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
from _probes import settle_probes  # noqa: E402

from _engine_env import set_engine_env  # noqa: E402

set_engine_env()

PAUSE_LIMIT_S = 300.0


def _pause(control: Path, name: str) -> float:
    (control / f"{name}.ready").write_text(str(time.time()))
    go = control / f"{name}.go"
    t0 = time.monotonic()
    while not go.exists():
        if time.monotonic() - t0 > PAUSE_LIMIT_S:
            raise TimeoutError(f"nobody released pause {name!r}")
        time.sleep(0.05)
    return time.monotonic() - t0


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    from prefixshare._log import configure

    configure(level="INFO", json=True)
    import vllm

    engine = {"model": spec["model"], "dtype": "float32", "enforce_eager": True,
              "distributed_executor_backend": "uni", "block_size": 32, "max_model_len": 4096,
              "enable_prefix_caching": True, "seed": 0, **spec.get("engine", {})}
    ps = None
    if spec.get("policy") is None:
        from prefixshare.adapters.vllm import _compat

        _compat.apply()
        llm = vllm.LLM(**engine)
    else:
        from prefixshare import Policy, PrefixShare

        ps = PrefixShare(Policy.build(**spec["policy"]), server=False, instance=spec["instance"])
        llm = ps.attach(engine)
    control = Path(spec.get("control") or ".")

    def stats() -> dict[str, Any] | None:
        if ps is None:
            return None
        time.sleep(0.12)  # the connector publishes its counters at most every 50 ms
        return ps.stats()

    def reset_prefix_cache() -> bool:
        """Clear the engine's own prefix cache. A finished request's blocks stay held until the connector
        reports its store done, which happens in the next engine step after the store ends: run (empty) steps
        until it is. A store into a hung server ends when its RPC times out (the policy's load timeout, twice:
        two RPCs), not at the heartbeat's first late ping: wait that long, plus a second."""
        policy_timeout = float((spec.get("policy") or {}).get("load", {}).get("timeout_s") or 2.0)
        deadline = time.monotonic() + 2 * policy_timeout + 1.0
        while True:
            if llm.reset_prefix_cache():
                return True
            if time.monotonic() > deadline:
                return False
            llm.llm_engine.step()
            time.sleep(0.01)

    def generate(ids: list[int], step: dict[str, Any], params: dict[str, Any] | None,
                 salt: str | None) -> dict[str, Any]:
        reset_ok = None
        if step.get("reset"):
            reset_ok = reset_prefix_cache()
        sampling = vllm.SamplingParams(
            temperature=0.0, max_tokens=step.get("max_tokens", 8), logprobs=1, ignore_eos=True,
            extra_args={"kv_transfer_params": params} if params else None)
        prompt: dict[str, Any] = {"prompt_token_ids": list(ids)}
        if salt:
            prompt["cache_salt"] = salt
        t0 = time.monotonic()
        out = llm.generate([prompt], sampling, use_tqdm=False)[0]
        seconds = time.monotonic() - t0
        comp = out.outputs[0]
        return {"token_ids": list(comp.token_ids),
                "logprobs": [lp[t].logprob for lp, t in zip(comp.logprobs, comp.token_ids)],
                "num_cached_tokens": int(out.num_cached_tokens or 0), "seconds": seconds,
                "prompt_tokens": len(ids), "reset_ok": reset_ok, "stats": stats()}

    results: list[dict[str, Any]] = []
    for i, step in enumerate(spec["steps"]):
        op, name = step["op"], step.get("name", str(i))
        started_at = time.time()  # wall clock: steps of two replicas are compared (did they overlap?)
        if op == "generate":
            res = generate(step["ids"], step, step.get("params"), step.get("cache_salt"))
        elif op == "pause":
            res = {"waited_s": _pause(control, name)}
        elif op == "verify":
            assert ps is not None
            res = {"report": ps.verify(llm, limit=step.get("limit")).to_dict(), "stats": stats()}
        elif op == "sleep":
            time.sleep(float(step["seconds"]))
            res = {}
        elif op == "warm":
            from prefixshare.warm import warm

            assert ps is not None
            try:
                report = warm(ps, [tuple(d) for d in step["docs"]], llm, tenant=step.get("tenant"),
                              force=bool(step.get("force")))
                res = {"report": report.to_dict(), "stats": stats()}
            except Exception as exc:  # noqa: BLE001 - the test asserts on the error
                res = {"error": type(exc).__name__, "message": str(exc), "stats": stats()}
        elif op == "prompt":
            from prefixshare.warm import prompt_for

            assert ps is not None
            p = prompt_for(ps, tuple(step["doc"]), step["question"], tenant=step.get("tenant"))
            res = generate(p.token_ids, step, p.kv_transfer_params, p.cache_salt)
            res["prompt"] = p.token_ids
            res["prefix_tokens"] = p.prefix_tokens
        else:
            raise ValueError(f"unknown step {op!r}")
        res.update(op=op, name=name, started_at=started_at, ended_at=time.time())
        results.append(res)
    settle_probes()  # a store.down verdict in flight reaches the log the tests read
    result = {"results": results, "stats": stats()}
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()
    os._exit(0)  # skip engine teardown (a killed store must not delay the exit)


if __name__ == "__main__":
    main()
