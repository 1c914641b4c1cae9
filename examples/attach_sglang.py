"""Attach an SGLang engine to prefixshare in application code, warm a document, and ask about it.

    python examples/attach_sglang.py [--model DIR] [--quick]

Without --model a small local model is built under the user cache dir (no download). The store is a
directory under the user cache dir; in production the policy would come from a YAML file
(``PrefixShare("policy.yaml")``) naming a shared directory, Valkey, S3...

On a CPU host SGLang runs its CPU engine, which needs SGLang's CPU kernel package (``sgl_kernel``) for the
host's CPU.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_settings(model: str) -> dict:
    """sglang.Engine keyword arguments: SGLang's defaults on a GPU, its CPU engine elsewhere."""
    import torch

    settings = {"model_path": model, "context_length": 2048, "random_seed": 0, "log_level": "warning"}
    if not torch.cuda.is_available():
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
        settings.update(device="cpu", attention_backend="torch_native", disable_cuda_graph=True, page_size=16,
                        dtype="float32", mem_fraction_static=0.3, max_total_tokens=16384)
    return settings


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory (default: build a tiny local one)")
    parser.add_argument("--quick", action="store_true", help="smallest settings (the test suite runs this)")
    args = parser.parse_args()

    from prefixshare import Policy, PrefixShare
    from prefixshare._paths import cache_dir
    from prefixshare.model import document_text, ensure_model
    from prefixshare.warm import Template

    model = args.model or str(ensure_model(cache_dir() / "models" / "tiny-seed0", shape="tiny"))
    policy = Policy.build(
        chunk_size=64,                                      # tokens per stored chunk
        l1={"size_gb": 0.2},                                # the server's memory tier
        l2=[{"type": "fs", "base_path": str(cache_dir() / "examples" / "attach-sglang-store"), "create": True}],
        server={"port": free_port(), "http_port": free_port()},
        admission={"any": [{"min_tokens": 256}, {"pinned": ["manual-*"]}]},
    )
    manual = ("manual-v1", document_text(300 if args.quick else 1500, seed=7))  # stands in for a long manual
    template = Template.chat(system="Answer from the manual.")

    # PrefixShare starts (or reuses) the node's LMCache MP server; attach() starts SGLang wired to it.
    with PrefixShare(policy) as ps:
        engine = ps.attach(engine_settings(model), engine_type="sglang")
        try:
            # Prefill the manual once (one generated token, discarded); the store now holds its KV.
            report = ps.warm([manual], engine, prefix=template)
            print(f"warm: {report.totals()['warmed']} warmed, {report.totals()['skipped']} already warm")

            # prompt_for builds prompts whose first tokens are exactly the warmed prefix; sglang_kwargs() carries
            # the document id and prefix length (in the request id) and the tenant's cache salt.
            for question in ("What is the river called?", "Who built the bridge?"):
                prompt = ps.prompt_for(manual, question, prefix=template)
                out = engine.generate(**prompt.sglang_kwargs(),
                                      sampling_params={"temperature": 0.0, "max_new_tokens": 8})
                meta = out["meta_info"]
                print(f"{question!r}: {len(prompt)} prompt tokens, {meta['cached_tokens']} cached, "
                      f"answer ids {out['output_ids']}")
            stats = ps.stats()
            print(f"stored {stats['tokens_stored']} tokens ({stats['bytes_stored']:,} bytes) under {stats['namespace']}")
            ok = stats["tokens_stored"] > 0
        finally:
            engine.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":  # SGLang starts its scheduler in child processes
    sys.exit(main())
