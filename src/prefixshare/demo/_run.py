"""The one-command demo: a second replica loads a manual another replica prefilled, instead of recomputing it.

Steps (each replica is a fresh process; they share nothing but the store):

1. build the local model if missing (``prefixshare.model.ensure_model`` under the user cache dir);
2. start an LMCache MP server on a fresh directory store under the user cache dir;
3. replica A warms ``examples/manual.md`` (chat template, system prompt) and verifies the store;
4. a cold replica (vLLM without prefixshare) answers three questions whose prompts start with the manual:
   the reference TTFT and first tokens;
5. replica B answers the same questions through prefixshare: the manual is loaded from the store;
6. print the table, write ``demo.json`` and ``demo.png``; stop the server and every replica.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefixshare._paths import cache_dir
from prefixshare.errors import ServerError

if TYPE_CHECKING:
    from prefixshare.policies import Policy

SYSTEM = "You are the prefixshare support assistant. Answer from the operator's manual below."
QUESTIONS = (
    "How do I check that a node is ready before serving?",
    "What happens to requests when the store is down?",
    "Which files does garbage collection delete?",
)


@dataclass(frozen=True)
class DemoConfig:
    """What differs between the full demo and ``--quick`` (CI)."""

    shape: str
    chunk_size: int
    block_size: int
    max_model_len: int
    l1_gb: float
    #: keep the manual's first N sections (None: all of it)
    sections: int | None

    @classmethod
    def full(cls) -> DemoConfig:
        # "demo" shape (hidden 512, 8 layers, 2 KV heads x 64): on a 2-core CPU a 4k-token prefill takes
        # seconds, its load from the store a fraction of one
        return cls("demo", 256, 128, 8192, 0.5, None)

    @classmethod
    def quick(cls) -> DemoConfig:
        return cls("tiny", 64, 32, 4096, 0.2, 4)


class DemoError(ServerError):
    """A demo step failed (the message names the step and its log); the CLI exits 3."""


@dataclass
class DemoResult:
    rows: list[dict[str, Any]]
    warm: dict[str, Any]
    timings: dict[str, float]
    model: str
    store: str
    plot: str | None
    table: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"rows": self.rows, "warm": self.warm, "timings": self.timings, "model": self.model,
                "store": self.store, "plot": self.plot, **self.extra}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def find_manual() -> Path:
    """``examples/manual.md`` of a source checkout, or a copy installed beside this module."""
    here = Path(__file__).resolve()
    for candidate in (here.parent / "manual.md", *(p / "examples" / "manual.md" for p in here.parents)):
        if candidate.is_file():
            return candidate
    raise DemoError("cannot find examples/manual.md; pass --manual PATH")


def manual_text(path: Path, sections: int | None) -> str:
    text = path.read_text(encoding="utf-8")
    if sections is None:
        return text
    parts = text.split("\n## ")
    return "\n## ".join(parts[: sections + 1]).rstrip() + "\n"


class _Replicas:
    """Runs replica processes; kills any that is still running when the demo stops."""

    def __init__(self, workdir: Path, env: dict[str, str]) -> None:
        self.workdir = workdir
        self.env = env
        self.procs: list[subprocess.Popen[str]] = []

    def run(self, name: str, spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        spec_path = self.workdir / f"{name}.json"
        spec_path.write_text(json.dumps(spec))
        log_path = self.workdir / f"{name}.log"
        with open(log_path, "w", encoding="utf-8") as log:
            proc = subprocess.Popen([sys.executable, "-m", "prefixshare.demo._replica", str(spec_path)],
                                    stdout=subprocess.PIPE, stderr=log, text=True, env=self.env,
                                    start_new_session=True)
            self.procs.append(proc)
            try:
                stdout, _ = proc.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._kill(proc)
                raise DemoError(f"replica {name} did not finish within {timeout_s:.0f} s; see {log_path}") from None
        line = next((ln for ln in stdout.splitlines() if ln.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
            raise DemoError(f"replica {name} failed (exit {proc.returncode}); last lines of {log_path}:\n{tail}")
        return json.loads(line[len("RESULT "):])

    @staticmethod
    def _kill(proc: subprocess.Popen[str]) -> None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def close(self) -> None:
        for proc in self.procs:
            self._kill(proc)


def run_demo(*, quick: bool = False, out_dir: Path | None = None, manual: Path | None = None,
             log: Any = print) -> DemoResult:
    """Run the demo end to end; ``log(str)`` receives one line per step."""
    from prefixshare.model import ensure_model
    from prefixshare.warm import vllm_engine_kwargs

    cfg = DemoConfig.quick() if quick else DemoConfig.full()
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    root = (out_dir or cache_dir() / ("demo-quick" if quick else "demo")).expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    store = root / "store"
    shutil.rmtree(store, ignore_errors=True)  # the demo shows a first warm: start from an empty store
    manual_copy = _copy_manual(root, manual, cfg)

    t0 = time.perf_counter()
    model_dir = cache_dir() / "models" / f"{cfg.shape}-seed0"
    log(f"[1/5] model: {cfg.shape} shape at {model_dir}")
    model = ensure_model(model_dir, shape=cfg.shape, seed=0)
    timings["model_s"] = time.perf_counter() - t0

    policy, policy_file = _write_policy(root, store, cfg)
    engine = vllm_engine_kwargs(policy, str(model), dtype="float32", block_size=cfg.block_size,
                                max_model_len=cfg.max_model_len)
    common = {"manual": str(manual_copy), "system": SYSTEM, "questions": list(QUESTIONS),
              "policy_file": str(policy_file)}
    warm, cold, served = _run_replicas(root, policy, store, common, engine, timings, log)

    doc = warm["report"]["documents"][0]
    rows = _compare_rows(cold, served)
    timings["total_s"] = time.perf_counter() - t_start
    plot = _plot(rows, root / "demo.png", cfg)
    result = DemoResult(rows, doc, timings, str(model), str(store), plot,
                        extra={"quick": quick, "shape": cfg.shape, "chunk_size": cfg.chunk_size,
                               "server": {"port": policy.server.port, "http_port": policy.server.http_port},
                               "engine_start_s": {"a": warm["engine_s"], "cold": cold["engine_s"],
                                                  "b": served["engine_s"]}})
    (root / "demo.json").write_text(json.dumps(result.to_dict(), indent=2))
    return result


def _copy_manual(root: Path, manual: Path | None, cfg: DemoConfig) -> Path:
    """Write the part of the manual this demo uses to ``root/manual.md`` (what the replicas read)."""
    manual_path = manual or find_manual()
    text = manual_text(manual_path, cfg.sections)
    manual_copy = root / "manual.md"
    manual_copy.write_text(text, encoding="utf-8")
    return manual_copy


def _write_policy(root: Path, store: Path, cfg: DemoConfig) -> tuple[Policy, Path]:
    """The demo's policy (a directory store on fresh ports), written to ``root/policy.yaml`` for the replicas."""
    from prefixshare.policies import Policy

    policy = Policy.build(
        name="demo", chunk_size=cfg.chunk_size, l1={"size_gb": cfg.l1_gb},
        l2=[{"type": "fs", "base_path": str(store), "create": True}],
        server={"port": _free_port(), "http_port": _free_port(), "start_timeout_s": 120},
        load={"timeout_s": 10.0},
    )
    policy_file = root / "policy.yaml"
    import yaml

    policy_file.write_text(yaml.safe_dump(policy.to_dict(), sort_keys=False))
    return policy, policy_file


def _replica_env() -> dict[str, str]:
    """The replicas' environment: ours, plus the engine and quiet settings we do not set already."""
    from prefixshare.warm import ENGINE_ENV, QUIET_ENV

    return {**os.environ, **{k: os.environ.get(k, v) for k, v in {**ENGINE_ENV, **QUIET_ENV}.items()},
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}


def _run_replicas(root: Path, policy: Policy, store: Path, common: dict[str, Any], engine: dict[str, Any],
                  timings: dict[str, float], log: Any) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Steps 2-5: start the server, run replica A, the cold replica and replica B; stop them all, even on failure.

    Returns the results of replica A (warm), the cold replica and replica B (served)."""
    from prefixshare.server import LMCacheServer

    replicas = _Replicas(root, _replica_env())
    server = LMCacheServer(policy, log_path=root / "server.log")
    try:
        t0 = time.perf_counter()
        log(f"[2/5] LMCache MP server on {policy.server.url}, store {store}")
        server.start(reuse=False)
        timings["server_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        log("[3/5] replica A (process 1) warms the manual")
        warm = replicas.run("replica-a", {**common, "role": "warm", "instance": "demo-a", "engine": engine}, 600)
        timings["replica_a_s"] = time.perf_counter() - t0
        _check_warm(warm, log)

        t0 = time.perf_counter()
        log("[4/5] cold replica (process 2, no prefixshare) answers the questions")
        cold = replicas.run("replica-cold", {**common, "role": "cold", "engine": engine}, 600)
        timings["replica_cold_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        log("[5/5] replica B (process 3, fresh) answers the same questions through prefixshare")
        served = replicas.run("replica-b", {**common, "role": "serve", "instance": "demo-b", "engine": engine}, 600)
        timings["replica_b_s"] = time.perf_counter() - t0
    finally:
        replicas.close()
        server.stop()
    return warm, cold, served


def _check_warm(warm: dict[str, Any], log: Any) -> None:
    """Fail unless replica A warmed (or had already stored) the manual; log what it stored."""
    doc = warm["report"]["documents"][0]
    if doc["status"] not in ("warmed", "skipped"):
        raise DemoError(f"replica A could not warm the manual: {doc['status']}: {doc['reason']}")
    log(f"      {doc['tokens']:,} prefix tokens, {doc['chunks']} chunks, {doc['bytes'] / 2**20:.1f} MiB "
        f"in {warm['warm_s']:.2f} s (verified: {doc['verified']})")


def _compare_rows(cold: dict[str, Any], served: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per question: the cold and the prefixshare replica's TTFT, what B loaded, and whether they agree."""
    rows = []
    for c, b in zip(cold["questions"], served["questions"], strict=True):
        if c["prompt"] != b["prompt"]:
            raise DemoError("the cold and the prefixshare replica built different prompts for one question")
        same = c["first_token"] == b["first_token"] and (
            c["first_logprob"] is None or abs(c["first_logprob"] - b["first_logprob"]) < 1e-3)
        rows.append({"question": c["question"], "prompt_tokens": b["prompt_tokens"],
                     "prefix_tokens": b["prefix_tokens"],
                     "cold_ttft_s": c["ttft_s"], "warm_ttft_s": b["ttft_s"], "tokens_loaded": b["tokens_loaded"],
                     "bytes_loaded": b["bytes_loaded"], "cold_cached_tokens": c["cached_tokens"],
                     "speedup": c["ttft_s"] / b["ttft_s"] if b["ttft_s"] else None,
                     "same_first_token": same})
    return rows


def _plot(rows: list[dict[str, Any]], path: Path, cfg: DemoConfig) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    labels = [f"Q{i}" for i in range(1, len(rows) + 1)]
    cold = [r["cold_ttft_s"] for r in rows]
    warm = [r["warm_ttft_s"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    xs = range(len(rows))
    width = 0.38
    ax.bar([x - width / 2 for x in xs], cold, width, label="cold replica (prefill)", color="#c0504d")
    ax.bar([x + width / 2 for x in xs], warm, width, label="replica B (loaded via prefixshare)", color="#4f81bd")
    for x, r in zip(xs, rows, strict=True):
        if r["speedup"]:
            ax.annotate(f"{r['speedup']:.1f}x", (x + width / 2, r["warm_ttft_s"]), ha="center", va="bottom",
                        fontsize=9)
    ax.set_ylim(0, max([*cold, *warm, 1e-3]) * 1.35)  # room for the legend above the bars
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("time to first token (s)")
    tokens = rows[0]["prompt_tokens"] if rows else 0
    ax.set_title(f"prefixshare demo: {tokens:,}-token prompts, '{cfg.shape}' model, CPU")
    ax.legend(loc="upper center", ncol=2, frameon=False, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return str(path)


def render_table(result: DemoResult, console: Any) -> None:
    from rich import box
    from rich.table import Table

    table = Table(title="TTFT: cold replica vs fresh replica B loading the manual", header_style="bold",
                  box=box.SIMPLE_HEAD)
    for name, justify in (("", "left"), ("prompt\ntokens", "right"), ("cold\nTTFT", "right"), ("warm\nTTFT", "right"),
                          ("tokens\nloaded", "right"), ("MiB\nloaded", "right"), ("speedup", "right"),
                          ("same\nanswer", "center")):
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for i, r in enumerate(result.rows, 1):
        table.add_row(f"Q{i}", f"{r['prompt_tokens']:,}", f"{r['cold_ttft_s']:.3f} s", f"{r['warm_ttft_s']:.3f} s",
                      f"{r['tokens_loaded']:,}", f"{r['bytes_loaded'] / 2**20:.1f}",
                      f"{r['speedup']:.1f}x" if r["speedup"] else "-", "yes" if r["same_first_token"] else "NO")
    console.print(table)
    for i, r in enumerate(result.rows, 1):
        console.print(f"Q{i}: {r['question']}", markup=False)
