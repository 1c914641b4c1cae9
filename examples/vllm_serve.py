"""Run ``vllm serve`` replicas with prefixshare: print the flags, optionally start one and query it.

    python examples/vllm_serve.py POLICY.yaml [--model DIR] [--run] [--quick]

Without --run it prints the command and environment (what ``prefixshare vllm-args`` prints) and checks
that the ``--kv-transfer-config`` is valid JSON naming prefixshare's connector. With --run it starts the
node's server and one ``vllm serve`` replica (35-60 s on CPU), sends a completion whose
``kv_transfer_params`` carry the per-request keys, prints the cache hits, and stops both.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("policy", nargs="?", help="policy YAML (default: write one under the user cache dir)")
    parser.add_argument("--model", help="model directory (default: build a tiny local one)")
    parser.add_argument("--run", action="store_true", help="start the server and one replica, send a request")
    parser.add_argument("--quick", action="store_true", help="smallest settings (the test suite runs this)")
    args = parser.parse_args()

    import yaml

    from prefixshare import Policy, PrefixShare
    from prefixshare._paths import cache_dir
    from prefixshare.model import ensure_model

    model = args.model or str(ensure_model(cache_dir() / "models" / "tiny-seed0", shape="tiny"))
    policy_file = Path(args.policy) if args.policy else cache_dir() / "examples" / "serve-policy.yaml"
    if not args.policy:
        policy_file.parent.mkdir(parents=True, exist_ok=True)
        policy = Policy.build(chunk_size=64, l1={"size_gb": 0.2},
                              l2=[{"type": "fs", "base_path": str(policy_file.parent / "serve-store"), "create": True}],
                              server={"port": free_port(), "http_port": free_port()})
        policy_file.write_text(yaml.safe_dump(policy.to_dict()))

    ps = PrefixShare(str(policy_file))
    argv, env = ps.serve_args(model)                   # = `prefixshare vllm-args --policy P --model M`
    port = free_port()
    argv += ["--port", str(port), "--dtype", "float32", "--block-size", "32", "--max-model-len", "2048",
             "--enforce-eager"]
    print(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " \\")
    print(" ".join(shlex.quote(a) for a in argv))
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "PrefixShareConnector", config
    if not args.run:
        return 0

    if argv[0] == "python":
        argv[0] = sys.executable
    with ps:                                          # the node's server, started from the policy
        proc = subprocess.Popen(argv, env={**os.environ, **env, "VLLM_CPU_KVCACHE_SPACE": "1"},
                                start_new_session=True)
        try:
            deadline = time.monotonic() + 300
            while True:
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                    break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        return 1
                    time.sleep(1)
            from prefixshare.model import document_text

            body = {"model": model, "prompt": document_text(300 if args.quick else 600, seed=5), "max_tokens": 8,
                    "temperature": 0,
                    "kv_transfer_params": {"prefixshare.document_id": "handbook", "cached_token_stats": True}}
            for attempt in (1, 2):
                request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                                 data=json.dumps(body).encode(),
                                                 headers={"Content-Type": "application/json"})
                answer = json.loads(urllib.request.urlopen(request, timeout=120).read())
                print(f"request {attempt}: {answer.get('kv_transfer_params')}")
        finally:
            os.killpg(proc.pid, 15)
            proc.wait(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
