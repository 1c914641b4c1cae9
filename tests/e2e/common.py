"""Shared pieces of the end-to-end tests: fresh-process replicas, output comparison, test policies."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from conftest import TESTS, free_port
from prefixshare.bench._procs import parse_events
from prefixshare.policies import Policy
from prefixshare.server import LMCacheServer

CHUNK = 64
LOGPROB_TOL = 1e-4
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
SCRIPTS = {"vllm": TESTS / "helpers" / "vllm_replica.py", "sglang": TESTS / "helpers" / "sglang_replica.py"}


#: the test-only sgl_kernel stand-in (see tests/shims/sgl_kernel) first on the path: SGLang's CPU engine needs it
SHIM_ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS / "shims"), os.environ.get("PYTHONPATH")]))}


def run_helper(tmp: Path, name: str, script: Path, spec: dict[str, Any], *, env: dict[str, str] | None = None,
               timeout: float = 600) -> tuple[dict[str, Any], subprocess.CompletedProcess[str]]:
    """Run a tests/helpers script on a JSON spec in a fresh process; returns its ``RESULT`` line and the process
    (its stderr is kept as ``<name>.stderr``)."""
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, str(script), str(path)], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    (tmp / f"{name}.stderr").write_text(proc.stderr)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line, f"{name} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(line[len("RESULT "):]), proc


def run_replica(tmp: Path, name: str, model: Path, policy: Policy | None, requests: list[dict[str, Any]],
                *, engine_type: str = "vllm", timeout: float = 600, **extra: Any) -> dict[str, Any]:
    """Run one replica in a fresh process; returns its results, stats and structured log events."""
    spec = {"model": str(model), "policy": policy.to_dict() if policy else None, "instance": f"{name}-{os.getpid()}",
            "requests": requests, **extra}
    env = {"PREFIXSHARE_LOG_JSON": "1", "PREFIXSHARE_LOG_LEVEL": "INFO"}
    if engine_type == "sglang" and extra.get("engine", {}).get("device", "cpu") == "cpu":
        env.update(SHIM_ENV)  # a GPU run uses the real kernels
    result, proc = run_helper(tmp, name, SCRIPTS[engine_type], spec, env=env, timeout=timeout)
    (tmp / f"{name}.result.json").write_text(json.dumps(result, indent=1))
    result["events"] = parse_events(proc.stderr + proc.stdout)
    return result


def entry_script(path: Path, module: str, function: str) -> Path:
    """A script that runs ``module.function(sys.argv[1])`` with tests/ on the path, under a main guard (SGLang's
    scheduler and spawned children import the script again)."""
    path.write_text(f"import sys\nsys.path.insert(0, {str(TESTS)!r})\nfrom {module} import {function}\n"
                    f"if __name__ == '__main__':\n    {function}(sys.argv[1])\n")
    return path


def write_documents(folder: Path, sizes: dict[str, int], first_seed: int = 20) -> Path:
    """One generated text file per ``{name: tokens}``, seeds counting up from ``first_seed``."""
    from prefixshare.model import document_text

    folder.mkdir()
    for i, (name, n) in enumerate(sizes.items()):
        (folder / name).write_text(document_text(n, seed=first_seed + i))
    return folder


def write_policy_file(path: Path, policy: Policy) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(policy.to_dict()))
    return path


def cli_json(work: Path, name: str, args: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run the installed ``prefixshare`` command with ``--json``; returns what it printed (stdout holds only the
    JSON document: engine logs go to stderr, kept as ``<name>.stderr``)."""
    exe = Path(sys.executable).parent / "prefixshare"
    proc = subprocess.run([str(exe), *args, "--json"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})
    (work / f"{name}.stderr").write_text(proc.stderr)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


@contextlib.contextmanager
def http_server(argv: list[str], env: dict[str, str], log_path: Path, port: int) -> Iterator[str]:
    """An engine's HTTP server in its own session: yields its base URL once /health answers; stopped after."""
    import urllib.request

    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                start_new_session=True)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 300
            while True:
                assert proc.poll() is None, log_path.read_text()[-3000:]
                assert time.monotonic() < deadline, f"no answer on {url}/health: " + log_path.read_text()[-3000:]
                try:
                    urllib.request.urlopen(f"{url}/health", timeout=2)
                    break
                except OSError:
                    time.sleep(1)
            yield url
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 15)
            proc.wait(timeout=60)


def pasted_command(engine: str, policy_file: Path, model: Path, instance: str) -> tuple[list[str], dict[str, str]]:
    """What `prefixshare vllm-args` / `sglang-args` prints, split as a shell would run it (``K=V ... \\`` then
    the command); its ``python`` is the one prefixshare and the engine are installed with."""
    import re
    import shlex

    exe = Path(sys.executable).parent / "prefixshare"
    printed = subprocess.run([str(exe), f"{engine}-args", "--policy", str(policy_file), "--model", str(model),
                              "--instance", instance], capture_output=True, text=True, check=True, timeout=120).stdout
    words = shlex.split(printed.replace("\\\n", " "))
    n = next(i for i, w in enumerate(words) if not re.match(r"[A-Z_][A-Z0-9_]*=", w))
    env, argv = dict(w.split("=", 1) for w in words[:n]), words[n:]
    if argv[0] == "python":
        argv[0] = sys.executable
    return argv, env


@contextlib.contextmanager
def pasted_replicas(engine: str, work: Path, model: Path, policy_file: Path, flags: list[str],
                    env: dict[str, str]) -> Iterator[dict[str, str]]:
    """HTTP replicas A and B, each started from the printed command plus ``flags``; yields their base URLs."""
    with contextlib.ExitStack() as stack:
        urls: dict[str, str] = {}
        for name in ("a", "b"):
            port = free_port()
            argv, printed_env = pasted_command(engine, policy_file, model, f"{engine}-clients-{name}")
            argv += ["--host", "127.0.0.1", "--port", str(port), *flags]
            urls[name] = stack.enter_context(
                http_server(argv, {**printed_env, **env}, work / f"{engine}-{name}.log", port))
        yield urls


@contextlib.contextmanager
def served_by_openai(engine: str, work: Path, flags: list[str], env: dict[str, str],
                     docs: dict[str, tuple[int, int]]) -> Iterator[dict[str, Any]]:
    """A tiny model behind two pasted HTTP replicas sharing one LMCache server: ``{"model", "urls", "clients"
    (an ``openai.OpenAI`` per replica), "docs"}``; ``docs`` maps a name to (words, seed) of a generated text."""
    from openai import OpenAI

    from prefixshare.model import create_model, document_text

    model = create_model(work / "model", shape="tiny", seed=0)
    with LMCacheServer(policy_for(work / "store")) as server:
        policy_file = write_policy_file(work / "policy.yaml", server.policy)
        with pasted_replicas(engine, work, model, policy_file, flags, env) as urls:
            clients = {name: OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=180, max_retries=0)
                       for name, url in urls.items()}
            texts = {name: document_text(n, seed=seed) for name, (n, seed) in docs.items()}
            yield {"model": str(model), "urls": urls, "clients": clients, "docs": texts}


def post_json(url: str, body: dict[str, Any]) -> dict[str, Any]:
    import urllib.request

    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(request, timeout=120).read())


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


def build_models(work: Path, arch: str = "llama") -> dict[str, Path]:
    """The main tiny model, the same weights with another tokenizer, and other weights with the same one."""
    from prefixshare.model import create_model

    main = create_model(work / "main", shape="tiny", seed=0, arch=arch)
    other = create_model(work / "seed1", shape="tiny", seed=1, arch=arch)
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


def corrupt_copy(store: Path, target: Path, sigma: float = 2.0, dtype: str = "float32") -> Path:
    """A copy of a store with Gaussian noise added to every chunk's values (``float32`` or ``bfloat16``)."""
    import numpy as np

    shutil.copytree(store, target)
    rng = np.random.default_rng(0)
    for path in target.glob("*.data"):
        raw = path.read_bytes()
        if dtype == "bfloat16":  # a bf16 is the high half of a float32: widen, add noise, truncate back
            values = (np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
            values = values + rng.normal(0, sigma, size=values.shape).astype(np.float32)
            path.write_bytes((values.view(np.uint32) >> 16).astype(np.uint16).tobytes())
        else:
            data = np.frombuffer(raw, dtype=np.float32).copy()
            data += rng.normal(0, sigma, size=data.shape).astype(np.float32)
            path.write_bytes(data.tobytes())
    return target


#: the corpus past the server's memory: 48 documents of 4 chunks (1 MiB of the tiny model's KV each) through a
#: 16 MiB server memory that evicts half of itself above 80 %, to a store that writes a chunk (256 KiB) in
#: STORE_CHUNK_DELAY_S, 4 at a time (8 MiB/s): slower than the engine computes
CORPUS_DOCS, CORPUS_WORDS, L1_MIB, STORE_CHUNK_DELAY_S = 48, 215, 16, 0.125


def corpus_past_l1(work: Path, model: Path, engine_type: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """One replica of ``engine_type`` (tests/helpers/warm_corpus.py) warms two corpora 3x the server's memory, the
    first unpaced and without retries (the negative control: it must lose documents, and the server must log the
    stores it dropped), the second as warm runs by default (every document stored and verified); then three of
    the second's documents answer questions loaded from the store, like a cold model. Returns the helper's result."""
    from prefixshare.bench._procs import throttled_store_spec
    from prefixshare.model import document_text

    store = work / f"store-corpus-{engine_type}"
    store.mkdir(exist_ok=True)
    slow = throttled_store_spec(str(store), store_chunk_delay_s=STORE_CHUNK_DELAY_S)
    policy = Policy.build(chunk_size=CHUNK, l1={"size_gb": L1_MIB / 1024, "eviction_ratio": 0.5},
                          server={"port": free_port(), "http_port": free_port(), "start_timeout_s": 120,
                                  "extra_args": ["--l2-adapter", json.dumps(slow)]})

    def corpus(name: str, seed: int) -> dict[str, str]:
        return {f"{name}-{i}": document_text(CORPUS_WORDS, seed=seed + i) for i in range(CORPUS_DOCS)}

    ask = ["paced-0", f"paced-{CORPUS_DOCS // 2}", f"paced-{CORPUS_DOCS - 1}"]
    name = f"warm-corpus-{engine_type}"
    with LMCacheServer(policy) as srv:
        spec = {"model": str(model), "policy_file": str(write_policy_file(work / f"policy-{name}.yaml", srv.policy)),
                "instance": f"{name}-{os.getpid()}", "engine_type": engine_type, "control": corpus("control", 500),
                "corpus": corpus("paced", 700), "batch_tokens": 16384, "ask": ask,
                "question": "What is the harbor called?", "max_tokens": 6}
        out, _ = run_helper(work, name, TESTS / "helpers" / "warm_corpus.py", spec, env=env)
        dropped = srv.log_path.read_text().count("Failed to batched allocate")
    (work / f"{name}.result.json").write_text(json.dumps(out, indent=1))
    control, paced = out["control"], out["paced"]
    chunks = {d["chunks"] for d in control["documents"] + paced["documents"]}
    assert chunks == {4}, chunks  # every document 1 MiB of KV: the corpus is 3x the server's memory
    # the fault happened: the server dropped stores, and the control lost documents to it
    assert dropped > 0 and control["totals"]["failed"] >= CORPUS_DOCS // 4, (dropped, control["totals"])
    assert all(d["attempts"] == 1 for d in control["documents"]) and control["paced_seconds"] == 0
    # warm as it runs by default: every document in the store
    assert paced["ok"] and paced["totals"]["warmed"] == paced["totals"]["verified"] == CORPUS_DOCS, paced["totals"]
    assert paced["paced_seconds"] > 0
    # loaded from the store (SGLang counts storage hits apart), answered like a cold model
    for answer in out["answers"]:
        assert answer.get("storage_tokens", answer["cached"]) >= 4 * CHUNK, answer
    assert out["tokens_loaded"] >= len(ask) * 4 * CHUNK
    assert [a["token_ids"] for a in out["answers"]] == hf_greedy(model, [a["prompt"] for a in out["answers"]], 6)
    return out
