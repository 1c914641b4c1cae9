"""Pre-warm a folder of documents, then ask a question whose prompt starts with one of them.

    python examples/prewarm_folder.py [FOLDER] [--model DIR] [--quick]

FOLDER defaults to examples/docs. Each file is placed in the model's chat template after a system prompt,
prefilled once (one output token), verified in the store and recorded in its registry. Running the script
again skips every document (already warm). The CLI does the same: ``prefixshare warm FOLDER --policy P
--model M --chat --system "..."``.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # CPU test mode: in-process engine
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SYSTEM = "Answer from the document."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", nargs="?", default=str(Path(__file__).parent / "docs"))
    parser.add_argument("--model", help="model directory (default: build a tiny local one)")
    parser.add_argument("--quick", action="store_true", help="smallest settings (the test suite runs this)")
    args = parser.parse_args()

    import vllm

    from prefixshare import Policy, PrefixShare
    from prefixshare._paths import cache_dir
    from prefixshare.model import ensure_model
    from prefixshare.warm import Template, prompt_for, warm

    model = args.model or str(ensure_model(cache_dir() / "models" / "tiny-seed0", shape="tiny"))
    store = cache_dir() / "examples" / "prewarm-store"
    policy = Policy.build(chunk_size=64, l1={"size_gb": 0.2},
                          l2=[{"type": "fs", "base_path": str(store), "create": True}],
                          server={"port": free_port(), "http_port": free_port()})
    template = Template.chat(system=SYSTEM)    # where documents sit in later prompts

    with PrefixShare(policy) as ps:
        llm = ps.attach({"model": model, "dtype": "float32", "block_size": 32, "max_model_len": 4096,
                         "enforce_eager": True, "distributed_executor_backend": "uni"})
        report = warm(ps, [args.folder], llm, prefix=template)        # raises WarmError if one fails
        for doc in report.documents:
            print(f"{doc.id:20} {doc.status:8} {doc.tokens:6,} tokens {doc.chunks:3} chunks {doc.bytes:>11,} bytes")
        again = warm(ps, [args.folder], llm, prefix=template)          # everything is already there
        print(f"second run: {len(again.skipped)} of {len(again.documents)} skipped")

        # A prompt whose first tokens are exactly the warmed ones; the question is not stored.
        first = report.documents[0].id
        prompt = prompt_for(ps, Path(args.folder) / first, "What happens when the store is slow?", prefix=template)
        params = vllm.SamplingParams(max_tokens=8, temperature=0.0,
                                     extra_args={"kv_transfer_params": prompt.kv_transfer_params})
        out = llm.generate([prompt.engine_input()], params, use_tqdm=False)[0]
        print(f"question on {first}: {len(prompt)} prompt tokens, {out.num_cached_tokens} cached")
        sys.stdout.flush()
        ok = len(again.skipped) == len(again.documents) and out.num_cached_tokens >= prompt.prefix_tokens // 64 * 64
    os._exit(0 if ok else 1)


if __name__ == "__main__":
    sys.exit(main())
