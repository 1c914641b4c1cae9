"""The mission's workload under load, with the arms a user compares (``make bench``; ``python tests/load/mission.py``).

Two ``vllm serve`` replicas of the ``demo`` model (8 layers, 8,192 KV bytes per token; a 2k-token document
takes seconds to prefill on one core), each on a core of its own, each KV cache cut to
``--num-gpu-blocks-override`` blocks (about five documents), facing a corpus of ``--documents`` documents of
``--doc-tokens`` tokens (three times that): no replica can keep the corpus in its own cache, and a document's
questions arrive at both replicas. Requests are ``prefixshare bench-load``'s (:mod:`prefixshare.bench._load`):
open-loop Poisson arrivals at each ``--rate``, Zipf popularity, eight questions per document, two tenants.

Arms, on the same replicas and cores, interleaved (each repetition runs every arm once, in a rotated order):

* ``raw-random`` — vLLM without prefixshare behind a random load balancer;
* ``raw-affinity`` — vLLM without prefixshare, each document always to one replica (what users run instead
  of a shared store);
* ``prefixshare-random`` — prefixshare replicas (a node's MP server each, one shared fs store) behind a random
  balancer;
* the zero-reuse control: every request a new document, raw vs prefixshare, random routing.

Before the clients start every arm gets the same head start: every document once per tenant, sent to the raw
replicas each (their own caches keep what fits) and once across the prefixshare fleet (stored, so every replica
loads it). Every answer is compared with the raw replicas' answer to the same prompt (text, and the sampled
tokens' logprobs within ``LOGPROB_TOL``); stores lost are read from each prefixshare replica's counters.

Each run also records the CPU seconds every process of the fleet used (``cpu_s``; ``--profile DIR`` adds py-spy's
stacks of each process, whose thread ids ``<run>-threads.json`` gives CPU seconds). ``tests/load/standard.py`` puts
the replicas behind ``vllm-router`` and drives them with ``vllm bench serve``. Not here yet: LMCache's own
connector as an arm, a replica joining mid-run; see docs/benchmarks/load-mission.md for what a run measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/: load.fleet, e2e.common, faults._matrix

from load.fleet import SERVE_ENV, Fleet, _meta, cpu_delta, cpu_seconds, node_stats, thread_cpu_seconds  # noqa: E402

#: about five 2k-token documents per replica (block size 32)
BLOCKS = 320
FLAGS = ["--dtype", "float32", "--enforce-eager", "--block-size", "32", "--max-model-len", "4096",
         "--enable-prompt-tokens-details", "--max-num-seqs", "4", "--seed", "0",
         "--num-gpu-blocks-override", str(BLOCKS)]
#: logprobs of the same greedy tokens computed in different batches (fp32 on the CPU)
LOGPROB_TOL = 1e-3
ARMS = (("raw-random", False, "random"), ("raw-affinity", False, "affinity"), ("prefixshare-random", True, "random"))


def prime(urls: list[str], texts: dict[str, str], workload: Any, *, each_replica: bool) -> float:
    """Every document once per tenant (question 0, one token): to every replica (``each_replica``) or once across
    them (round robin). Replicas are primed in parallel, one request at a time each. Returns the seconds taken."""
    import httpx

    from prefixshare.bench._load import Request, body

    jobs: dict[int, list[Request]] = {i: [] for i in range(len(urls))}
    k = 0
    for doc in sorted(texts):
        for tenant in workload.tenants:
            targets = range(len(urls)) if each_replica else [k % len(urls)]
            for r in targets:
                jobs[r].append(Request(-1, 0.0, doc, 0, tenant, r))
            k += 1
    model = httpx.get(f"{urls[0]}/v1/models", timeout=10).json()["data"][0]["id"]
    w = replace(workload, max_tokens=1)

    async def one_replica(r: int) -> None:
        async with httpx.AsyncClient(timeout=600) as client:
            for req in jobs[r]:
                payload = {**body(w, model, req, texts[req.doc]), "stream": False}
                payload.pop("stream_options", None)
                resp = await client.post(f"{urls[r]}/v1/chat/completions", json=payload)
                resp.raise_for_status()

    async def all_of() -> None:
        await asyncio.gather(*(one_replica(r) for r in jobs))

    began = time.monotonic()
    asyncio.run(all_of())
    return time.monotonic() - began


def same(a: dict[str, Any], ref: dict[str, Any]) -> bool:
    return (a["text"] == ref["text"] and len(a["logprobs"]) == len(ref["logprobs"])
            and all(abs(x - y) <= LOGPROB_TOL for x, y in zip(a["logprobs"], ref["logprobs"], strict=True)))


def check_answers(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Every answer against the raw replicas' first answer to the same (document, question): counts per arm."""
    refs: dict[tuple[str, int], dict[str, Any]] = {}
    for run in runs:
        if run["arm"].startswith("raw"):
            for a in run["answers"]:
                if a["error"] is None:
                    refs.setdefault((a["doc"], a["question"]), a)
    out: dict[str, Any] = {}
    for run in runs:
        ok = [a for a in run["answers"] if a["error"] is None]
        # a raw answer that is itself the reference is not a comparison
        compared = [a for a in ok if (a["doc"], a["question"]) in refs and refs[(a["doc"], a["question"])] is not a]
        wrong = [a for a in compared if not same(a, refs[(a["doc"], a["question"])])]
        entry = out.setdefault(run["arm"], {"compared": 0, "wrong": 0, "samples": []})
        entry["compared"] += len(compared)
        entry["wrong"] += len(wrong)
        entry["samples"] += [{"doc": a["doc"], "question": a["question"], "text": a["text"],
                              "expected": refs[(a["doc"], a["question"])]["text"]} for a in wrong[:3]]
    return out


def _spread(values: list[float | None]) -> dict[str, Any]:
    vals = [v for v in values if v is not None]
    if not vals:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": round(statistics.median(vals), 4), "min": round(min(vals), 4), "max": round(max(vals), 4),
            "n": len(vals)}


METRICS = ("request_throughput", "goodput", "p50_ttft_ms", "p99_ttft_ms", "p50_itl_ms", "hit_rate",
           "cached_fraction", "errors")


def table(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per (arm, rate): each metric's median, min and max over the repetitions."""
    out: dict[str, Any] = {}
    for run in runs:
        key = f"{run['arm']}@{run['rate']:g}"
        entry = out.setdefault(key, {m: [] for m in METRICS})
        for m in METRICS:
            entry[m].append(run["summary"][m])
    return {k: {m: _spread(v) for m, v in entry.items()} for k, entry in out.items()}


def ratios(runs: list[dict[str, Any]], arm: str, base: str) -> dict[str, Any]:
    """``arm`` over ``base`` per rate: the ratio of each repetition's figures (same stream, same repetition)."""
    by = {(r["arm"], r["rate"], r["rep"]): r["summary"] for r in runs}
    out: dict[str, Any] = {}
    for (a, rate, rep), s in sorted(by.items()):
        if a != arm or (base, rate, rep) not in by:
            continue
        b = by[(base, rate, rep)]
        entry = out.setdefault(f"{rate:g}", {"goodput": [], "request_throughput": [], "p50_ttft": []})
        entry["goodput"].append(s["goodput"] / b["goodput"] if b["goodput"] else None)
        entry["request_throughput"].append(
            s["request_throughput"] / b["request_throughput"] if b["request_throughput"] else None)
        entry["p50_ttft"].append(s["p50_ttft_ms"] / b["p50_ttft_ms"] if b["p50_ttft_ms"] else None)
    return {rate: {k: _spread(v) for k, v in e.items()} for rate, e in out.items()}


class _Profile:
    """py-spy sampling every process of a fleet for one run (``--profile``): collapsed stacks per process."""

    def __init__(self, fleet: Fleet, out: Path | None, name: str, seconds: float) -> None:
        self.procs: list[Any] = []
        self.fleet, self.out, self.name = fleet, out, name
        if out is None:
            return
        self.threads = thread_cpu_seconds(fleet)
        import shutil
        import subprocess

        out.mkdir(parents=True, exist_ok=True)
        exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        for label, pid in fleet.processes().items():
            self.procs.append(subprocess.Popen(
                [exe, "record", "--pid", str(pid), "--rate", "20", "--duration", str(int(seconds)), "--format",
                 "raw", "--nonblocking", "--threads", "--output", str(out / f"{name}-{label}.txt")],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    def stop(self) -> None:
        """The CPU seconds each thread used since the start (``<name>-threads.json``)."""
        if self.out is None:
            return
        after = thread_cpu_seconds(self.fleet)
        (self.out / f"{self.name}-threads.json").write_text(json.dumps({
            label: {tid: round(s - self.threads.get(label, {}).get(tid, 0.0), 2) for tid, s in threads.items()}
            for label, threads in after.items()}, indent=1))

    def wait(self) -> None:
        for p in self.procs:
            try:
                p.wait(timeout=120)
            except Exception:  # noqa: BLE001 - a profiler that hangs is killed; the run's figures stand
                p.kill()


def measured(fleet: Fleet, urls: list[str], w: Any, texts: dict[str, str], profile: Path | None,
             name: str) -> dict[str, Any]:
    """One load run, with the CPU seconds each of the fleet's processes used during it (and, with ``profile``,
    py-spy's stacks of each)."""
    from prefixshare.bench._load import run_load

    before = cpu_seconds(fleet)
    prof = _Profile(fleet, profile, name, w.duration_s + 10)
    result = run_load(urls, w, texts=texts)
    result["cpu_s"] = cpu_delta(before, cpu_seconds(fleet))
    prof.stop()
    prof.wait()
    return result


def mission(work: Path, *, rates: list[float], zero_rates: list[float], duration_s: float, reps: int, documents: int,
            doc_tokens: tuple[int, int], slo_s: float, log: Any, blocks: int = BLOCKS,
            zero_only: bool = False, server_workers: int | None = None,
            profile: Path | None = None) -> dict[str, Any]:
    from prefixshare.bench._load import Workload, document_texts
    from prefixshare.model import create_model

    model = create_model(work / "model-demo", shape="demo", seed=0)
    base = Workload(documents=documents, doc_tokens=doc_tokens, duration_s=duration_s, ttft_slo_s=slo_s,
                    max_tokens=16, request_timeout_s=300)
    texts = document_texts(base)
    runs: list[dict[str, Any]] = []
    flags = [*FLAGS[:-1], str(blocks)]
    with Fleet(work, model, prefixshare=False, tag="raw", flags=flags) as raw, \
            Fleet(work, model, prefixshare=True, tag="ps", flags=flags,
                  server={"max_workers": server_workers} if server_workers else None) as ps:
        fleets = {False: raw, True: ps}
        urls = {k: [n.url for n in f.nodes.values()] for k, f in fleets.items()}
        head = {} if zero_only else {"raw_s": prime(urls[False], texts, base, each_replica=True),
                                     "prefixshare_s": prime(urls[True], texts, base, each_replica=False)}
        log(f"head start: {head}")
        time.sleep(2.0)  # the last stores land
        arms = list(ARMS)
        for rep in range(reps):
            order = arms[rep % len(arms):] + arms[:rep % len(arms)]
            for rate in [] if zero_only else rates:
                for name, with_ps, routing in order:
                    w = replace(base, rate=rate, routing=routing, seed=rep, prefixshare_params=with_ps)
                    result = measured(fleets[with_ps], urls[with_ps], w, texts, profile, f"{name}-{rate:g}-{rep}")
                    runs.append({"arm": name, "rate": rate, "rep": rep, **result})
                    log(f"rep {rep} rate {rate:g} {name}: {json.dumps(result['summary'])[:400]}")
            for zi, zero_rate in enumerate(zero_rates):
                for name, with_ps in (("raw-zero-reuse", False), ("prefixshare-zero-reuse", True))[::1 - 2 * (rep % 2)]:
                    # a seed of its own per rate and repetition: a seed's documents are stored once they are sent
                    w = replace(base, rate=zero_rate, routing="random", seed=1000 + 100 * zi + rep, unique=True,
                                prefixshare_params=with_ps)
                    result = measured(fleets[with_ps], urls[with_ps], w, dict(texts), profile,
                                      f"{name}-{zero_rate:g}-{rep}")
                    runs.append({"arm": name, "rate": zero_rate, "rep": rep, **result})
                    log(f"rep {rep} zero-reuse {name} @ {zero_rate:g}: {json.dumps(result['summary'])[:400]}")
        stats = node_stats(ps)
        server_status = {name: n.server.status() for name, n in ps.nodes.items() if n.server is not None}
    correctness = check_answers(runs)
    lost = {name: s.get("stores_lost", {}) for name, s in stats.items()}
    summary = table(runs)
    result = {
        **_meta(), "kind": "load-mission", "model": "demo (8 layers, 8,192 KV bytes/token)",
        "blocks_per_replica": blocks, "serve_flags": flags, "serve_env": SERVE_ENV,
        "workload": {**base.__dict__, "rates": rates, "zero_rates": zero_rates, "reps": reps},
        "server_workers": server_workers,
        "head_start": head, "table": summary, "correctness": correctness, "stores_lost": lost,
        "connector": {name: {k: s.get(k) for k in ("requests", "hits", "tokens_loaded", "tokens_stored", "fallbacks",
                                                    "stores_lost", "lookup_ms", "load_ms")}
                      for name, s in stats.items()},
        "server_status": {name: _losses(s) for name, s in server_status.items()},
        "ratios": {"prefixshare_over_raw_random": ratios(runs, "prefixshare-random", "raw-random"),
                   "prefixshare_over_raw_affinity": ratios(runs, "prefixshare-random", "raw-affinity"),
                   "zero_reuse": ratios(runs, "prefixshare-zero-reuse", "raw-zero-reuse")},
        "runs": [{k: v for k, v in r.items() if k != "answers"} for r in runs],
    }
    result["goals"] = goals(result, rates, zero_rates)
    return drop_reused_controls(result)


def drop_reused_controls(result: dict[str, Any]) -> dict[str, Any]:
    """A zero-reuse control whose prefixshare run hit the store reused documents (an earlier run sent the same
    ones): it is not a control. Such (rate, repetition) pairs, raw and prefixshare, leave the table, the ratios
    and the goals, and are listed under ``excluded`` with why; the rest is recomputed from the runs."""
    bad = {(r["rate"], r["rep"]) for r in result["runs"]
           if r["arm"] == "prefixshare-zero-reuse" and (r["summary"].get("hit_rate") or 0) > 0}
    if not bad:
        return result
    kept = [r for r in result["runs"] if not (r["arm"].endswith("zero-reuse") and (r["rate"], r["rep"]) in bad)]
    result = {**result, "runs": kept, "table": table(kept)}
    result["excluded"] = result.get("excluded", []) + [
        {"arm": "zero-reuse", "rate": rate, "rep": rep, "why": "the prefixshare run hit the store: its documents "
         "were sent before (one seed for every zero-reuse rate of a repetition, fixed since)"}
        for rate, rep in sorted(bad)]
    result["ratios"] = {**result["ratios"], "zero_reuse": ratios(kept, "prefixshare-zero-reuse", "raw-zero-reuse")}
    w = result["workload"]
    result["goals"] = goals(result, w["rates"], w.get("zero_rates", [w.get("zero_rate")]))
    return result


def _losses(status: dict[str, Any]) -> Any:
    """The server's own count of chunks it lost before its L2 tier stored them (prefixshare's losses plugin)."""
    found: dict[str, Any] = {}

    def walk(obj: Any, path: str) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                if k == "prefixshare_chunks_not_stored":
                    found[path or "server"] = v
                else:
                    walk(v, f"{path}.{k}" if path else k)

    walk(status, "")
    return found


def goals(result: dict[str, Any], rates: list[float], zero_rates: list[float]) -> dict[str, Any]:
    """Each goal's measured value; the zero-reuse control's are the worst over its rates."""
    r = result["ratios"]
    top = f"{max(rates):g}"
    zero = [r["zero_reuse"].get(f"{z:g}", {}) for z in zero_rates]
    zero_tput = [e["request_throughput"]["median"] for e in zero if e.get("request_throughput", {}).get("median")]
    zero_ttft = [e["p50_ttft"]["median"] for e in zero if e.get("p50_ttft", {}).get("median")]
    g = {
        "goodput_vs_random": {"goal": ">= 2x at the top rate", "value": r["prefixshare_over_raw_random"].get(top, {})
                              .get("goodput", {}).get("median")},
        "goodput_vs_affinity": {"goal": ">= 1.2x at the top rate", "value": r["prefixshare_over_raw_affinity"]
                                .get(top, {}).get("goodput", {}).get("median")},
        "p50_ttft_vs_random": {"goal": "<= 0.5x at every rate", "value": max(
            (e["p50_ttft"]["median"] for e in r["prefixshare_over_raw_random"].values()
             if e["p50_ttft"]["median"] is not None), default=None)},
        "zero_reuse_throughput": {"goal": ">= 0.95x at every rate", "value": min(zero_tput, default=None)},
        "zero_reuse_p50_ttft": {"goal": "<= 1.10x at every rate", "value": max(zero_ttft, default=None)},
        "errors": {"goal": 0, "value": sum(run["summary"]["errors"] for run in result["runs"])},
        "wrong_answers": {"goal": 0, "value": sum(e["wrong"] for e in result["correctness"].values())},
        "stores_lost": {"goal": 0, "value": sum(sum(v.values()) for v in result["stores_lost"].values())},
    }
    checks = {"goodput_vs_random": lambda v: v >= 2.0, "goodput_vs_affinity": lambda v: v >= 1.2,
              "p50_ttft_vs_random": lambda v: v <= 0.5, "zero_reuse_throughput": lambda v: v >= 0.95,
              "zero_reuse_p50_ttft": lambda v: v <= 1.10, "errors": lambda v: v == 0,
              "wrong_answers": lambda v: v == 0, "stores_lost": lambda v: v == 0}
    for k, entry in g.items():
        entry["pass"] = entry["value"] is not None and checks[k](entry["value"])
    return g


def _fmt(entry: dict[str, Any], digits: int = 2, scale: float = 1.0) -> str:
    if entry.get("median") is None:
        return "-"
    m, lo, hi = (entry[k] * scale for k in ("median", "min", "max"))
    return f"{m:.{digits}f} ({lo:.{digits}f}–{hi:.{digits}f})"


def _count(found: dict[str, Any]) -> int:
    """Chunks lost, over every store controller's per-reason counts."""
    return sum(int(n) for counts in found.values() if isinstance(counts, dict) for n in counts.values())


def _cpu_role(key: str) -> str:
    if key.startswith("server-"):
        return "MP servers"
    if key.startswith("VLLM::EngineCor"):
        return "engine cores (scheduler)"
    if key.startswith("VLLM::Worker"):
        return "workers (forward pass, store copy)"
    return "API servers"


CPU_ROLES = ("MP servers", "engine cores (scheduler)", "workers (forward pass, store copy)", "API servers")


def cpu_table(runs: list[dict[str, Any]]) -> list[str]:
    """CPU seconds per run by process role (both nodes added), median over the repetitions."""
    per: dict[str, dict[str, list[float]]] = {}
    for run in runs:
        if "cpu_s" not in run:
            continue
        roles = dict.fromkeys(CPU_ROLES, 0.0)
        for key, seconds in run["cpu_s"].items():
            roles[_cpu_role(key)] += seconds
        entry = per.setdefault(f"{run['arm']}@{run['rate']:g}", {r: [] for r in (*CPU_ROLES, "total")})
        for role, seconds in roles.items():
            entry[role].append(seconds)
        entry["total"].append(sum(roles.values()))
    if not per:
        return []
    lines = ["", "## Where the CPU went", "",
             "CPU seconds each run's processes used (user + system, every thread, both nodes added; read from "
             "/proc before and after the run), median over the repetitions. Two cores give about "
             f"{2 * runs[0]['summary']['duration_s']:.0f} CPU seconds per run. An engine core waiting for its "
             "worker spins (vLLM's shared-memory queue), so its figure grows with the time its worker is "
             "kept from the CPU.", "",
             "| arm @ rate | " + " | ".join(CPU_ROLES) + " | total |", "|---" * (len(CPU_ROLES) + 2) + "|"]
    for key, entry in per.items():
        lines.append(f"| {key} | " + " | ".join(f"{statistics.median(v):.1f}" for v in entry.values()) + " |")
    return lines


def render(result: dict[str, Any]) -> str:
    """The run as a markdown page (docs/benchmarks/load-mission.md)."""
    w = result["workload"]
    lines = [
        "# Load: the shared-document workload, arm by arm",
        "",
        f"Run `{result['run_id']}` on commit `{str(result['commit'])[:12]}` ({result['recorded_at']}), "
        f"{result['cpus']} CPUs ({', '.join(result['cpu_flags'])}). Generated by `python tests/load/mission.py "
        "--render` from `load-mission.json`; how the run is made: `tests/load/mission.py`'s docstring.",
        "",
        f"Two `vllm serve` replicas of the {result['model']} model, one core each, each KV cache cut to "
        f"{result['blocks_per_replica']} blocks of 32 tokens; {w['documents']} documents of "
        f"{w['doc_tokens'][0]}–{w['doc_tokens'][1]} tokens, Zipf {w['zipf']}, {w['questions']} questions each, "
        f"tenants {', '.join(w['tenants'])}; open-loop Poisson arrivals for {w['duration_s']:g} s per run at "
        f"{', '.join(f'{r:g}' for r in w['rates'])} requests/s (the zero-reuse control at "
        f"{', '.join(f'{r:g}' for r in w.get('zero_rates', [w.get('zero_rate')]))}); {w['max_tokens']} tokens out; "
        "goodput counts "
        f"requests whose TTFT is at most {w['ttft_slo_s']:g} s. {w['reps']} repetitions, arms interleaved; each "
        "cell is the median (min–max) over them.",
        "",
        "## Goals",
        "",
        "| goal | target | measured | result |",
        "|---|---|---|---|",
    ]
    for name, g in result["goals"].items():
        verdict = "pass" if g["pass"] else "not measured in this run" if g["value"] is None else "**miss**"
        lines.append(f"| {name} | {g['goal']} | {g['value']} | {verdict} |")
    lines += ["", "## Every arm", "",
              "| arm @ rate | req/s | goodput/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | hit rate | cached "
              "prompt | errors |", "|---|---|---|---|---|---|---|---|---|"]
    for key, t in result["table"].items():
        lines.append(f"| {key} | {_fmt(t['request_throughput'])} | {_fmt(t['goodput'])} | "
                     f"{_fmt(t['p50_ttft_ms'], 0)} | {_fmt(t['p99_ttft_ms'], 0)} | {_fmt(t['p50_itl_ms'], 1)} | "
                     f"{_fmt(t['hit_rate'])} | {_fmt(t['cached_fraction'])} | {_fmt(t['errors'], 0)} |")
    lines += cpu_table(result["runs"])
    lines += ["", "## Ratios (same repetition, same request stream)", "",
              "| prefixshare over | rate | goodput | req/s | TTFT p50 |", "|---|---|---|---|---|"]
    for label, key in (("raw, random routing", "prefixshare_over_raw_random"),
                       ("raw, document affinity", "prefixshare_over_raw_affinity"),
                       ("raw, zero reuse (control)", "zero_reuse")):
        for rate, e in result["ratios"][key].items():
            lines.append(f"| {label} | {rate} | {_fmt(e['goodput'])} | {_fmt(e['request_throughput'])} | "
                         f"{_fmt(e['p50_ttft'])} |")
    for ex in result.get("excluded", []):
        lines.append(f"\nExcluded: {ex['arm']} at {ex['rate']:g} requests/s, repetition {ex['rep']}: {ex['why']}.")
    if result.get("zero_page"):
        lines += ["", f"The zero-reuse control measured again on its own: [{result['zero_page']}]"
                      f"({result['zero_page']})."]
    lines += ["", "## Correctness and losses", "",
              "Answers compared with the raw replicas' answer to the same prompt (greedy text; logprobs within "
              f"{LOGPROB_TOL:g}):", ""]
    for arm, c in result["correctness"].items():
        lines.append(f"- {arm}: {c['compared']} compared, {c['wrong']} different")
    lines += ["", "Stores lost (engine side, per prefixshare replica): "
              + ", ".join(f"{k}: {v or 0}" for k, v in result["stores_lost"].items())
              + "; chunks the servers lost before their store wrote them: "
              + ", ".join(f"{k}: {_count(v)}" for k, v in result["server_status"].items()) + ".", ""]
    lines += ["Connector counters of the prefixshare replicas over the whole run:", "", "```",
              json.dumps(result["connector"], indent=1), "```", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="0.3,0.8", help="arrival rates (requests/s), comma-separated")
    parser.add_argument("--zero-rate", default="0.3", help="the zero-reuse control's rates, comma-separated")
    parser.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals per run")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--documents", type=int, default=16)
    parser.add_argument("--doc-tokens", default="1500-2500")
    parser.add_argument("--slo", type=float, default=2.0, help="goodput's TTFT bound (s)")
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=HERE.parents[1] / "docs" / "benchmarks" / "load-mission.json")
    parser.add_argument("--render", action="store_true", help="measure nothing: write --out's page (.md) from it")
    parser.add_argument("--blocks", type=int, default=BLOCKS, help="KV cache blocks per replica (32 tokens each)")
    parser.add_argument("--zero-only", action="store_true", help="only the zero-reuse control (an experiment)")
    parser.add_argument("--server-workers", type=int, default=None, help="the MP servers' --max-workers")
    parser.add_argument("--profile", type=Path, default=None, help="py-spy every process per run into this folder")
    args = parser.parse_args(argv)
    if args.render:
        result = drop_reused_controls(json.loads(args.out.read_text()))
        args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
        args.out.with_suffix(".md").write_text(render(result))
        return 0
    from faults._matrix import commit, run_id

    commit(), run_id()  # fixed now: the row names what ran
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import tempfile

    work = args.work or Path(tempfile.mkdtemp(prefix="prefixshare-mission-"))
    work.mkdir(parents=True, exist_ok=True)
    low, high = (int(x) for x in args.doc_tokens.split("-"))

    def log(line: str) -> None:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()

    result = mission(work, rates=[float(r) for r in args.rates.split(",")],
                     zero_rates=[float(r) for r in args.zero_rate.split(",")],
                     duration_s=args.duration, reps=args.reps, documents=args.documents, doc_tokens=(low, high),
                     slo_s=args.slo, log=log, blocks=args.blocks, zero_only=args.zero_only,
                     server_workers=args.server_workers, profile=args.profile)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    sys.stdout.write(f"load-mission {result['run_id']}: " + ", ".join(
        f"{k} {g['value']} ({'pass' if g['pass'] else 'MISS'})" for k, g in result["goals"].items())
        + f" -> {args.out}\n")
    return 1 if any(not result["goals"][k]["pass"] for k in ("errors", "wrong_answers")) else 0


if __name__ == "__main__":
    sys.exit(main())
