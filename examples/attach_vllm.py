"""Attach a vLLM engine to prefixshare in application code.

    python examples/attach_vllm.py [--model DIR] [--quick]

Without --model a small local model is built under the user cache dir (no download). The store is a
directory under the user cache dir; in production the policy would come from a YAML file
(``PrefixShare("policy.yaml")``) naming a shared directory, Valkey, S3...
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

# CPU test mode: an in-process engine starts in seconds (drop these on a GPU host).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory (default: build a tiny local one)")
    parser.add_argument("--quick", action="store_true", help="smallest settings (the test suite runs this)")
    args = parser.parse_args()

    import vllm

    from prefixshare import Policy, PrefixShare
    from prefixshare._paths import cache_dir
    from prefixshare.model import document_text, ensure_model

    model = args.model or str(ensure_model(cache_dir() / "models" / "tiny-seed0", shape="tiny"))
    policy = Policy.build(
        chunk_size=64,                                      # tokens per stored chunk
        l1={"size_gb": 0.2},                                # the server's memory tier
        l2=[{"type": "fs", "base_path": str(cache_dir() / "examples" / "attach-store"), "create": True}],
        server={"port": free_port(), "http_port": free_port()},
        admission={"any": [{"min_tokens": 256}, {"pinned": ["manual-*"]}]},
    )

    # PrefixShare starts (or reuses) the node's LMCache MP server; attach() starts vLLM wired to it.
    with PrefixShare(policy) as ps:
        llm = ps.attach({"model": model, "dtype": "float32", "block_size": 32, "max_model_len": 2048,
                         "enforce_eager": True, "distributed_executor_backend": "uni"})
        tokenizer = llm.get_tokenizer()
        document = document_text(300 if args.quick else 1500, seed=7)   # stands in for a long manual
        ids = tokenizer.encode(document + "\n\nQuestion: what is the river called?")

        # Per-request keys: the document id (admission rules match it) and how many leading tokens are the
        # shared document (only those are stored, not the question).
        doc_tokens = len(tokenizer.encode(document))
        params = vllm.SamplingParams(max_tokens=8, temperature=0.0, extra_args={"kv_transfer_params": {
            "prefixshare.document_id": "manual-v1", "prefixshare.prefix_tokens": doc_tokens}})
        for attempt in (1, 2):
            out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
            print(f"request {attempt}: {len(ids)} prompt tokens, {out.num_cached_tokens} cached, "
                  f"answer ids {list(out.outputs[0].token_ids)}")
        stats = ps.stats()
        print(f"stored {stats['tokens_stored']} tokens ({stats['bytes_stored']:,} bytes) under {stats['namespace']}")
        sys.stdout.flush()
        ok = stats["tokens_stored"] > 0
    # vLLM's in-process engine is torn down with the process
    os._exit(0 if ok else 1)


if __name__ == "__main__":
    sys.exit(main())
