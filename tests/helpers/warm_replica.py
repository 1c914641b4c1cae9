"""Test-only: a fresh vLLM replica that re-warms documents, tries an over-long one, and asks questions whose
prompts start with each warmed document. Prints one ``RESULT {json}`` line.

Spec: {"model": DIR, "policy_file": PATH, "instance": STR, "engine": {LLM kwargs}, "system": STR,
       "docs": [PATH...], "long_doc": TEXT, "questions": [STR...], "max_tokens": N}
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: ~3 s engine start
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    import vllm

    from prefixshare import PrefixShare
    from prefixshare.warm import DocumentTooLongError, Template, prompt_for, warm

    engine = {"model": spec["model"], "dtype": "float32", "enforce_eager": True, "distributed_executor_backend": "uni",
              "block_size": 32, "max_model_len": 2048, "seed": 0, **spec.get("engine", {})}
    ps = PrefixShare(spec["policy_file"], server=False, instance=spec["instance"])
    llm = ps.attach(engine)
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
            params = vllm.SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 6), ignore_eos=True,
                                         extra_args={"kv_transfer_params": prompt.kv_transfer_params})
            out = llm.generate([prompt.engine_input()], params, use_tqdm=False)[0]
            answers.append({"doc": doc, "question": question, "prompt": prompt.token_ids,
                            "prefix_tokens": prompt.prefix_tokens, "cached": int(out.num_cached_tokens or 0),
                            "token_ids": list(out.outputs[0].token_ids)})
    result["answers"] = answers
    result["stats"] = ps.stats()
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
