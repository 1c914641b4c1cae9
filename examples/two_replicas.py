"""Two replicas, two processes, one store: B loads the document A prefilled.

    python examples/two_replicas.py [--model DIR] [--quick]

The parent starts the node's LMCache MP server from a policy file and runs each replica as a fresh
process (``--replica NAME``) that attaches with ``PrefixShare(policy_file, server=False)``: replicas share
nothing but the store. On several nodes, give each node's server the same shared directory (NFS).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # CPU test mode: in-process engine
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replica(name: str, policy_file: str, model: str, tokens: int) -> None:
    """One replica: attach, answer one prompt that starts with the shared document, report the hits."""
    import vllm

    from prefixshare import PrefixShare
    from prefixshare.model import document_text

    ps = PrefixShare(policy_file, server=False, instance=f"example-{name}")
    llm = ps.attach({"model": model, "dtype": "float32", "block_size": 32, "max_model_len": 4096,
                     "enforce_eager": True, "distributed_executor_backend": "uni"})
    ids = llm.get_tokenizer().encode(document_text(tokens, seed=11))
    params = vllm.SamplingParams(max_tokens=8, temperature=0.0, extra_args={"kv_transfer_params": {
        "prefixshare.document_id": "handbook"}})
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    print(json.dumps({"replica": name, "prompt_tokens": len(ids), "cached": out.num_cached_tokens,
                      "answer": list(out.outputs[0].token_ids)}), flush=True)
    os._exit(0)  # skip the in-process engine's teardown


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory (default: build a tiny local one)")
    parser.add_argument("--quick", action="store_true", help="smallest settings (the test suite runs this)")
    parser.add_argument("--replica", help=argparse.SUPPRESS)
    parser.add_argument("--policy-file", help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.replica:
        replica(args.replica, args.policy_file, args.model, args.tokens)

    import yaml

    from prefixshare import Policy
    from prefixshare._paths import cache_dir
    from prefixshare.model import ensure_model
    from prefixshare.server import LMCacheServer

    model = args.model or str(ensure_model(cache_dir() / "models" / "tiny-seed0", shape="tiny"))
    work = cache_dir() / "examples" / "two-replicas"
    work.mkdir(parents=True, exist_ok=True)
    policy = Policy.build(chunk_size=64, l1={"size_gb": 0.2},
                          l2=[{"type": "fs", "base_path": str(work / "store"), "create": True}],
                          server={"port": free_port(), "http_port": free_port()})
    policy_file = work / "policy.yaml"
    policy_file.write_text(yaml.safe_dump(policy.to_dict()))
    tokens = 400 if args.quick else 1500
    results = []
    with LMCacheServer(policy):                       # the node's server; each replica connects to it
        for name in ("a", "b"):
            proc = subprocess.run([sys.executable, __file__, "--replica", name, "--policy-file", str(policy_file),
                                   "--model", model, "--tokens", str(tokens)],
                                  capture_output=True, text=True, timeout=600)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("{")), None)
            if proc.returncode != 0 or line is None:
                print(proc.stderr[-3000:], file=sys.stderr)
                return 1
            results.append(json.loads(line))
            print(f"replica {name}: {results[-1]['prompt_tokens']} prompt tokens, {results[-1]['cached']} loaded")
    a, b = results
    same = a["answer"] == b["answer"]
    print(f"same answer: {same}")
    return 0 if b["cached"] > 0 and same else 1


if __name__ == "__main__":
    sys.exit(main())
