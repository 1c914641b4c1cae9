"""Shared pieces of the end-to-end tests: fresh-process replicas, output comparison, test policies."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from conftest import TESTS, free_port
from prefixshare.bench._procs import parse_events
from prefixshare.policy import Policy

CHUNK = 64
LOGPROB_TOL = 1e-4
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
SCRIPTS = {"vllm": TESTS / "helpers" / "vllm_replica.py", "sglang": TESTS / "helpers" / "sglang_replica.py"}


def run_replica(tmp: Path, name: str, model: Path, policy: Policy | None, requests: list[dict[str, Any]],
                *, engine_type: str = "vllm", timeout: float = 600, **extra: Any) -> dict[str, Any]:
    """Run one replica in a fresh process; returns its results, stats and structured log events."""
    spec = {"model": str(model), "policy": policy.to_dict() if policy else None, "instance": f"{name}-{os.getpid()}",
            "requests": requests, **extra}
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(spec))
    env = {**os.environ, "PREFIXSHARE_LOG_JSON": "1", "PREFIXSHARE_LOG_LEVEL": "INFO"}
    if engine_type == "sglang" and extra.get("engine", {}).get("device", "cpu") == "cpu":
        # the test-only sgl_kernel stand-in (see tests/shims/sgl_kernel); a GPU run uses the real kernels
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS / "shims"), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, str(SCRIPTS[engine_type]), str(path)], capture_output=True, text=True,
                          timeout=timeout, env=env)
    (tmp / f"{name}.stderr").write_text(proc.stderr)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line, f"replica {name} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    result = json.loads(line[len("RESULT "):])
    (tmp / f"{name}.result.json").write_text(json.dumps(result, indent=1))
    result["events"] = parse_events(proc.stderr + proc.stdout)
    return result


def hf_greedy(model: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    """A cold model's greedy continuation of each prompt (HF transformers: no engine, no store)."""
    import torch
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    outs = []
    with torch.no_grad():
        for ids in prompts:
            tokens = torch.tensor([ids])
            past = None
            out: list[int] = []
            for _ in range(n):
                step = lm(tokens if past is None else tokens[:, -1:], past_key_values=past, use_cache=True)
                past = step.past_key_values
                nxt = int(step.logits[0, -1].argmax())
                out.append(nxt)
                tokens = torch.cat([tokens, torch.tensor([[nxt]])], dim=1)
            outs.append(out)
    return outs


def same_output(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["token_ids"] == b["token_ids"] and all(
        abs(x - y) <= LOGPROB_TOL for x, y in zip(a["logprobs"], b["logprobs"], strict=True))


def policy_for(store: Path, **overrides: Any) -> Policy:
    fields: dict[str, Any] = {
        "chunk_size": CHUNK,
        "l1": {"size_gb": 0.2},
        "l2": [{"type": "fs", "base_path": str(store), "create": True}],
        "server": {"port": free_port(), "http_port": free_port(), "start_timeout_s": 120},
        "load": {"timeout_s": 2.0},
        "admission": {"any": [{"min_tokens": 256}, {"pinned": ["manual-*"]}]},
    }
    fields.update(overrides)
    return Policy.build(**fields)


def build_models(work: Path) -> dict[str, Path]:
    """The main tiny model, the same weights with another tokenizer, and other weights with the same one."""
    from prefixshare.model import create_model

    main = create_model(work / "main", shape="tiny", seed=0)
    other = create_model(work / "seed1", shape="tiny", seed=1)
    other_tok = work / "other-tokenizer"
    shutil.copytree(main, other_tok)
    for name in TOKENIZER_FILES:
        if (other / name).exists():
            shutil.copy(other / name, other_tok / name)
    other_weights = work / "other-weights"
    shutil.copytree(other, other_weights)
    for name in TOKENIZER_FILES:
        if (main / name).exists():
            shutil.copy(main / name, other_weights / name)
    return {"main": main, "other_tok": other_tok, "other_weights": other_weights}


def document_ids(model: Path, seed: int, n: int) -> list[int]:
    from transformers import AutoTokenizer

    from prefixshare.model import document_text

    tok = AutoTokenizer.from_pretrained(str(model))
    ids = tok(document_text(n, seed=seed))["input_ids"][:n]
    assert len(ids) == n
    return ids


def corrupt_copy(store: Path, target: Path, sigma: float = 2.0) -> Path:
    """A copy of a store with Gaussian noise added to every chunk's float32 values."""
    import numpy as np

    shutil.copytree(store, target)
    rng = np.random.default_rng(0)
    for path in target.glob("*.data"):
        data = np.frombuffer(path.read_bytes(), dtype=np.float32).copy()
        data += rng.normal(0, sigma, size=data.shape).astype(np.float32)
        path.write_bytes(data.tobytes())
    return target
