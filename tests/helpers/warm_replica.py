"""Test-only: a fresh vLLM (or SGLang) replica that re-warms documents, tries an over-long one, and asks questions whose
prompts start with each warmed document. Prints one ``RESULT {json}`` line.

Spec: {"model": DIR, "policy_file": PATH, "instance": STR, "engine_type": "vllm"|"sglang",
       "engine": {engine kwargs}, "system": STR,
       "docs": [PATH...], "long_doc": TEXT, "questions": [STR...], "max_tokens": N, "foreign_tenant": STR?}
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
    from prefixshare.warm import DocumentTooLongError, Template, prompt_for, warm

    engine = engine_kwargs(kind, spec["model"], **spec.get("engine", {}))
    ps = PrefixShare(spec["policy_file"], server=False, instance=spec["instance"])
    llm = ps.attach(engine, engine_type=kind)
    template = Template.chat(system=spec["system"])
    result: dict = {}

    rewarm = warm(ps, spec["docs"], llm, prefix=template)
    result["rewarm"] = rewarm.to_dict()
    result["requests_after_rewarm"] = ps.stats()["requests"]  # a no-op re-warm sends the engine nothing

    try:
        warm(ps, [("manual-long", spec["long_doc"])], llm, prefix=template)
        result["long"] = None
    except DocumentTooLongError as exc:
        result["long"] = {"error": type(exc).__name__, "message": str(exc), "too_long": exc.too_long}

    answers = []
    for doc in spec["docs"]:
        for question in spec["questions"]:
            prompt = prompt_for(ps, doc, question, prefix=template)
            answer = {"doc": doc, "question": question, "prompt": prompt.token_ids,
                      "prefix_tokens": prompt.prefix_tokens}
            answer.update(_sglang(llm, prompt, spec) if kind == "sglang" else _vllm(llm, prompt, spec))
            answers.append(answer)
    result["answers"] = answers
    if spec.get("foreign_tenant"):  # negative control: the first question under another tenant loads nothing
        prompt = prompt_for(ps, spec["docs"][0], spec["questions"][0], prefix=template, tenant=spec["foreign_tenant"])
        result["foreign"] = _sglang(llm, prompt, spec) if kind == "sglang" else _vllm(llm, prompt, spec)
    result["stats"] = ps.stats()
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()
    if kind == "sglang":
        llm.shutdown()
    os._exit(0)


def _vllm(llm, prompt, spec: dict) -> dict:  # noqa: ANN001
    import vllm

    params = vllm.SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 6), ignore_eos=True,
                                 extra_args={"kv_transfer_params": prompt.kv_transfer_params})
    out = llm.generate([prompt.engine_input()], params, use_tqdm=False)[0]
    return {"cached": int(out.num_cached_tokens or 0), "token_ids": list(out.outputs[0].token_ids)}


def _sglang(engine, prompt, spec: dict) -> dict:  # noqa: ANN001
    out = engine.generate(**prompt.sglang_kwargs(), return_logprob=True,
                          sampling_params={"temperature": 0.0, "max_new_tokens": spec.get("max_tokens", 6),
                                           "ignore_eos": True})
    meta = out["meta_info"]
    details = meta.get("cached_tokens_details") or {}
    return {"cached": int(meta.get("cached_tokens") or 0), "storage_tokens": int(details.get("storage") or 0),
            "token_ids": list(out["output_ids"]), "logprobs": [x[0] for x in meta["output_token_logprobs"]]}


if __name__ == "__main__":
    main()
