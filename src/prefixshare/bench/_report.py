"""Plots (PNG) and the generated ``docs/benchmarks.md`` of a benchmark run."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any


def _ms(x: float) -> str:
    if abs(x) < 1:
        return f"{x * 1e3:.0f} ms"
    return f"{x:.2f} s" if abs(x) < 10 else f"{x:.1f} s"


def _span(d: dict[str, float]) -> str:
    """median (min-max)"""
    return f"{_ms(d['median'])} ({_ms(d['min'])}–{_ms(d['max'])})"


def _gb(d: dict[str, float]) -> str:
    return f"{d['median']:.2f} ({d['min']:.2f}–{d['max']:.2f})"


def _mark(ok: bool) -> str:
    return "**pass**" if ok else "**MISS**"


def _x_ticks(lengths: list[int]) -> list[str]:
    return [f"{n // 1024}k" if n >= 1024 else str(n) for n in lengths]


def plots(results: dict[str, Any], out: Path) -> list[str]:
    """ttft.png (P1/P2/P6/P7 per length, log scale), store.png (P3 throughput) and sweep.png (P4: TTFT of forced
    load, forced recompute and auto, and auto's regret, against the load/recompute factor); [] without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    label = f"{results['model']['shape']} shape; {results['machine']['cpu']}, {results['machine']['cores']} cores"
    paths = []
    for draw, name in ((_plot_ttft, "ttft.png"), (_plot_store, "store.png"), (_plot_sweep, "sweep.png")):
        fig = draw(plt, results, label)
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        paths.append(str(out / name))
    return paths


def _plot_ttft(plt: Any, results: dict[str, Any], label: str) -> Any:
    rows = results["per_length"]
    lengths = sorted(int(n) for n in rows)
    fig, ax = plt.subplots(figsize=(8, 5))
    series = [
        ("cold, raw engine (no prefixshare)", "raw_cold_ttft_s", "o-"),
        ("cold, prefixshare attached (a miss)", "cold_ttft_s", "o--"),
        ("cross-replica warm (page cache warm)", "warm_ttft_s", "s-"),
        ("cross-replica warm (evicted)", "warm_evicted_ttft_s", "s--"),
        ("one token with the prefix cached (same replica)", "one_token_ttft_s", "^-"),
        ("pre-warm wall time", "prewarm_s", "v:"),
        ("raw engine prefill (P6 documents)", "raw_prefill_s", "x:"),
    ]
    for name, key, style in series:
        xs = [n for n in lengths if key in rows[str(n)]]
        if not xs:
            continue
        med = [rows[str(n)][key]["median"] for n in xs]
        lo = [m - rows[str(n)][key]["min"] for m, n in zip(med, xs, strict=True)]
        hi = [rows[str(n)][key]["max"] - m for m, n in zip(med, xs, strict=True)]
        ax.errorbar(xs, med, yerr=[lo, hi], fmt=style, capsize=3, label=name)
    ax.plot(lengths, [rows[str(n)]["floor_s"]["total_s"] for n in lengths], "k--", lw=1,
            label="floor (one token + KV bytes through the copy path at its best, page cache)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(lengths, _x_ticks(lengths))
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT / wall time (s), median with min-max")
    ax.set_title(f"prefixshare: TTFT per prompt length\n{label}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def _digest(results: dict[str, Any]) -> str:
    """The fs tier's digest in a run's results (runs before it was recorded hashed with blake3)."""
    return str(results.get("integrity") or "blake3")


def _plot_store(plt: Any, results: dict[str, Any], label: str) -> Any:
    rows = results["per_length"]
    lengths = sorted(int(n) for n in rows)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    kinds = [("write", "write_gbps"), ("read, cache", "read_warm_gbps"), ("read, evicted", "read_evicted_gbps")]
    sources = [("raw", "tab:gray", "raw sequential"), ("fs_l2_plain", "tab:orange", "LMCache fs adapter"),
               ("fs_l2_native", "tab:green", "LMCache fs_native adapter"),
               ("fs_l2", "tab:blue", f"prefixshare fs tier ({_digest(results)})")]
    sources = [src for src in sources if src[0] in rows[str(lengths[0])]["io"]]
    width = 0.9 / (3 * len(sources))
    for j, (name, key) in enumerate(kinds):
        for k, (src, color, what) in enumerate(sources):
            xs = [i + (len(sources) * j + k - (3 * len(sources) - 1) / 2) * width for i in range(len(lengths))]
            ys = [rows[str(n)]["io"][src][key]["median"] for n in lengths]
            ax.bar(xs, ys, width, color=color, alpha=0.35 + 0.2 * j, label=f"{what}: {name}")
    ax.set_xticks(range(len(lengths)), [f"{n} tok\n{rows[str(n)]['kv_bytes'] / 1e6:.0f} MB" for n in lengths])
    ax.set_ylabel("GB/s (median)")
    ax.set_title(f"store medium: fs tier adapters vs raw sequential I/O\n{label}", fontsize=10)
    ax.legend(fontsize=6, ncol=3)
    ax.grid(True, axis="y", alpha=0.3)
    return fig


def _plot_sweep(plt: Any, results: dict[str, Any], label: str) -> Any:
    sweep = results["sweep"]["per_length"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    for n_key, d in sorted(sweep.items(), key=lambda kv: int(kv[0])):
        pts = d["points"]
        xs = [p["achieved_load_over_recompute"] for p in pts]
        for key, style, what in (("load_s", "s-", "forced load"), ("recompute_s", "o-", "forced recompute"),
                                 ("auto_s", "D--", "auto")):
            ax1.plot(xs, [p[key]["median"] for p in pts], style, label=f"{n_key} tok: {what}")
        ax2.plot(xs, [p["regret"] for p in pts], "D-", label=f"{n_key} tok")
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log")
    ax1.set_xlabel("measured forced load / forced recompute")
    ax1.set_ylabel("TTFT (s), median")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=7)
    ax2.axhline(GOAL_REGRET, color="k", lw=1, ls="--", label="goal")
    ax2.axvline(1.0, color="gray", lw=1, ls=":")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("measured forced load / forced recompute")
    ax2.set_ylabel("regret: auto / the better forced option")
    ax2.grid(True, which="both", alpha=0.3)
    ax2.legend(fontsize=7)
    fig.suptitle(f"P4: load or recompute around break-even (throttled store)\n{label}", fontsize=10)
    return fig


#: P4's goal, drawn in the sweep plot
GOAL_REGRET = 1.1


def render_markdown(results: dict[str, Any], docs_path: Path) -> str:
    """The ``docs/benchmarks.md`` page: command, machine, goals table, per-measure tables, notes."""
    rows = results["per_length"]
    lengths = sorted(int(n) for n in rows)
    slow = [n for n in lengths if "prewarm_over_raw" in rows[str(n)]]
    lines = _md_header(results)
    lines += _md_goals(results["goals"])
    lines += _md_ttft(results, rows, lengths)
    lines += _md_miss(rows, lengths)
    lines += _md_miss_cpu(_lab_results(results, "miss-path.json"), _lab_results(results, "store-copy.json"))
    lines += _md_miss_sglang([_lab_results(results, f"sglang-miss-path{s}.json") for s in ("-alone", "")])
    lines += _md_store(rows, lengths, _digest(results))
    lines += _md_sweep(results)
    lines += _md_overhead(rows, lengths)
    lines += _md_prewarm(rows, slow)
    lines += _md_corpus(results.get("corpus"))
    lines += _md_lab(_lab_results(results))
    lines += _md_lab_choice(_lab_results(results, "lab-choice.json"), _results_folder(results))
    lines += _md_kv_bytes(results)
    lines += _md_plots(results, docs_path)
    lines += _where_time_goes(results)
    lines += _md_notes(results)
    return "\n".join(lines) + "\n"


def _md_header(results: dict[str, Any]) -> list[str]:
    """Title, the command that reproduces the page, the run, the machine and the model."""
    m, s = results["machine"], results["settings"]
    v = m["versions"]
    return [
        "# Benchmarks",
        "",
        "Generated by `prefixshare bench` — do not edit by hand. Reproduce with:",
        "",
        "```bash",
        results["command"].strip(),
        "```",
        "",
        f"**Run:** `{results.get('run_id')}` at commit `{results.get('commit')}`, {results.get('recorded_at')}; "
        "every figure on this page comes from this one run.",
        "",
        f"**Machine:** {m['cpu']} ({', '.join(m['isa']) or 'no AVX2/AVX512 flags'}), {m['cores']} cores "
        f"({m['cores_usable']} usable), {m['memory_gb']} GB memory, {'GPU ' + m['gpu'] if m['gpu'] else 'no GPU'}; "
        f"{m['os']}; Python {m['python']}; "
        + ", ".join(f"{k} {val}" for k, val in v.items())
        + f". Load average at start {m['load_average']}, at end {results['load_average_end']}"
        " (other jobs share this machine: a load above the core count inflates every time).",
        "",
        f"**Model:** random-weight Llama, shape `{results['model']['shape']}`, fp32, "
        f"{results['model']['kv_bytes_per_token']:,} KV bytes per token; vLLM CPU backend (in-process engine, eager), "
        f"block size {s['block_size']}; LMCache MP server, chunk size {s['chunk_size']}, fs L2 tier on local disk "
        f"(integrity {'on: ' + _digest(results) if results.get('integrity_hashing') else 'off'}). Prompts are *n* + 1 tokens "
        "(*n* below), so a load and a prefix-cache hit both leave exactly one token to compute. "
        f"Medians of {s['runs']} runs (min–max in parentheses; every value in results.json) "
        f"(total {results['timings'].get('total_s', 0):.0f} s).",
        "",
        "These are single requests, one at a time. A fleet under concurrent load, with the arms a user compares "
        "(raw vLLM with random and with document-affinity routing, prefixshare, the zero-reuse control), is "
        "measured by its own run: [benchmarks/load-mission.md](benchmarks/load-mission.md); vLLM's own load client "
        "(`vllm bench serve`) beside ours, behind a real router: "
        "[benchmarks/load-standard.md](benchmarks/load-standard.md).",
    ]


def _md_goals(goals: dict[str, Any]) -> list[str]:
    """The goals table: one row per goal, measured value, target, pass/miss."""
    g = goals
    fc = g["P2"]["floor_check"]
    lines = [
        "",
        "## Goals",
        "",
        "| goal | what | measured | target | result |",
        "|---|---|---|---|---|",
    ]
    lines.append(f"| P1 | {g['P1']['what']} | {g['P1']['value']:.1f}× at {g['P1']['at_tokens']} tokens | ≥ 20× | "
                 f"{_mark(g['P1']['pass'])} |")
    lines.append(f"| P2 | {g['P2']['what']} | worst {g['P2']['value']:.2f}× (floor never beaten by more than "
                 f"{1 - fc['tolerance']:.0%}: {'yes' if fc['ok'] else 'NO'}) | ≤ 1.5× | {_mark(g['P2']['pass'])} |")
    lines.append(f"| P3 | {g['P3']['what']} | worst {g['P3']['value']:.2f}× | ≥ 0.8× | {_mark(g['P3']['pass'])} |")
    lines.append(f"| P4 | {g['P4']['what']} | worst {g['P4']['value']:.2f}× | ≤ 1.1× | {_mark(g['P4']['pass'])} |")
    lines.append(_p5_goal_row(g))
    lines.append(f"| P6 | {g['P6']['what']} | worst {g['P6']['value']:.2f}× | ≤ 1.1× | {_mark(g['P6']['pass'])} |")
    twins = list((g["P7"].get("raw_twin") or {}).values())
    spread = (f" (two raw engines: {min(twins):.2f}–{max(twins):.2f}×)" if twins else "")
    lines.append(f"| P7 | {g['P7']['what']} | worst {g['P7']['value']:.2f}×{spread} | ≤ 1.03× | "
                 f"{_mark(g['P7']['pass'])} |")
    lines.append(f"| KV | {g['KV']['what']} | {g['KV']['value']} vs plan {g['KV']['plan']} | equal | "
                 f"{_mark(g['KV']['pass'])} |")
    return lines


def _p5_goal_row(g: dict[str, Any]) -> str:
    p5, calls = g["P5"], g.get("P5_calls")
    if "per_length" not in p5:  # results from before P5 went through LMCache's connector: its in-process figure
        return (f"| P5 | {p5['what']} | {p5['value_us']:.1f} µs, {p5['value_pct']:.3f} % of warm TTFT | ≤ 50 µs and "
                f"≤ 1 % | {_mark(p5['pass'])} |")
    if p5.get("value_pct") is None:
        measured = p5.get("note", "not measured")
    else:
        worst = max(p5["per_length"], key=lambda n: p5["per_length"][n])
        lo, hi = p5["ci95"][worst]
        measured = (f"worst {p5['value_pct']:+.2f} % at {worst} tokens (95 % interval {lo:+.2f} to {hi:+.2f} %"
                    + ("" if p5.get("resolved") else "; the run cannot tell pass from miss") + ")")
    row = f"| P5 | {p5['what']} | {measured} | ≤ 1 % | {_mark(p5['pass'])} |"
    if calls is not None:
        row += (f"\n| P5 calls | {calls['what']} | {calls['value_us']:.1f} µs, {calls['value_pct']:.3f} % of warm "
                f"TTFT | ≤ 50 µs | {_mark(calls['pass'])} |")
    return row


def _md_ttft(results: dict[str, Any], rows: dict[str, Any], lengths: list[int]) -> list[str]:
    """P1, P2: TTFT per prompt length against the raw engine and the floor."""
    evicted = "warm_evicted_ttft_s" in rows[str(lengths[0])]
    lines = [
        "",
        "## P1, P2: time to first token per prompt length",
        "",
        "TTFT is the wall time of a `max_tokens=1` request. *Raw cold*: vLLM without prefixshare (a fresh process, "
        "after one warm-up request) computing the prompt. *Warm*: a fresh replica behind a second MP server on the "
        "same directory (another node) loading the prompt another replica stored. *One token*: the warm replica "
        "asked the same prompt again at once — the whole prefix is in its own KV cache, one token is computed; "
        "measured right after each warm request, in the same process. *Floor*: one token + the KV bytes through "
        "each stage of the copy path at that stage's best measured bandwidth in this run (the medium's raw "
        f"sequential read, the {_digest(results)} digest when the tier checks integrity, one copy into the engine's memory; breakdown "
        "below). A warm request more than 5 % under its floor fails the run: the floor would not be a bound.",
        "",
        "| n | KV MB | raw cold | warm | raw cold/warm | one token | floor | warm/floor |"
        + (" warm, evicted | floor, evicted | evicted/floor |" if evicted else ""),
        "|---|---|---|---|---|---|---|---|" + ("---|---|---|" if evicted else ""),
    ]
    for n in lengths:
        r = rows[str(n)]
        line = (f"| {n} | {r['kv_bytes'] / 1e6:.1f} | {_span(r['raw_cold_ttft_s'])} | {_span(r['warm_ttft_s'])} | "
                f"{r['speedup_raw_cold_over_warm']:.1f}× | {_span(r['one_token_ttft_s'])} | "
                f"{_ms(r['floor_s']['total_s'])} | {r['warm_over_floor']:.2f}× |")
        if evicted:
            line += (f" {_span(r['warm_evicted_ttft_s'])} | {_ms(r['floor_evicted_s']['total_s'])} | "
                     f"{r['warm_evicted_over_floor']:.2f}× |")
        lines.append(line)
    lines += [
        "",
        "The floor's terms (ms) and the bandwidths they use (GB/s, the best of the run's repetitions):",
        "",
        f"| n | one token | read (page cache) | read (evicted) | {_digest(results)} | copy | read GB/s cache / evicted "
        f"| {_digest(results)} GB/s | copy GB/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for n in lengths:
        r = rows[str(n)]
        f, fe = r["floor_s"], r.get("floor_evicted_s")
        ev_read, ev_bw = (f"{fe['read_s'] * 1e3:.1f}", f"{fe['read_gbps']:.2f}") if fe else ("–", "–")
        lines.append(f"| {n} | {f['one_token_s'] * 1e3:.1f} | {f['read_s'] * 1e3:.1f} | {ev_read} | "
                     f"{f['hash_s'] * 1e3:.1f} | {f['copy_s'] * 1e3:.1f} | {f['read_gbps']:.2f} / {ev_bw} | "
                     f"{f['hash_gbps']:.2f} | {f['copy_gbps']:.2f} |")
    lines += [
        "",
        "Which bandwidth applies: the warm replica reads files another replica wrote seconds before, so they are in "
        "the page cache; the *evicted* replica evicts every store file (posix_fadvise DONTNEED) before each "
        "request, so its reads come from the disk.",
    ]
    return lines


def _md_miss(rows: dict[str, Any], lengths: list[int]) -> list[str]:
    """P7: what attaching prefixshare costs a miss, with its breakdown."""
    lines = [
        "",
        "## P7: the miss overhead",
        "",
        "The same prompts computed cold by the raw engine (R, vLLM without prefixshare: the goal's ratio) and by a "
        "replica with prefixshare attached (A, whose store is empty, so every lookup misses and every prompt is then "
        "stored), and, in A, prompts of the same length that prefixshare was told to leave alone "
        "(`prefixshare.load: never`, `prefixshare.store: false`: no lookup, no store; *bypassed*): the in-process "
        "ratio and the added time (median of the per-pair differences) come from those. A and R are up side by "
        "side and their requests alternate (in runs before that, R ran after A, and the drift between the two "
        "processes showed in the ratio). A miss's KV is copied into the server after its first token; the run "
        "waits until its chunks are on the store's medium (*landed*, from the first token) before the next request, "
        "so P7 is what a miss's first token waits for. On a GPU host that copy runs beside the prefill; on this "
        "CPU-only box it takes the prefill's cores, and what it costs them is measured apart "
        "(`benchmarks/miss_path.py`, in docs/benchmarks/miss-path.json). The added time is split into the lookup "
        "(the connector's own timing of it), prefixshare's per-request calls (P5, timed in-process) and the rest, by "
        "difference. *Two raw engines* is a second raw engine (R′, the same as R in every way, up beside them, its "
        "requests in the same rotation) over R on the same prompts: what two processes differ by with nothing "
        "between them, the resolution the goal's ratio is read against.",
        "",
    ]
    landed = all(rows[str(n)]["miss_overhead"].get("landed_s") is not None for n in lengths)
    twin = all(rows[str(n)]["miss_overhead"].get("raw_twin_ratio") is not None for n in lengths)
    lines += [
        "| n | raw cold (R) | cold, prefixshare (A) | ratio (goal) |" + (" two raw engines (R′/R) |" if twin else "")
        + " bypassed (A) | ratio in-process | added | lookup (miss) | prefixshare's calls | rest |"
        + (" landed |" if landed else ""),
        "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if twin else "") + ("---|" if landed else ""),
    ]
    for n in lengths:
        r = rows[str(n)]
        m = r["miss_overhead"]
        lines.append(f"| {n} | {_span(r['raw_cold_ttft_s'])} | {_span(r['cold_ttft_s'])} | {m['ratio']:.2f}× | "
                     + (f"{m['raw_twin_ratio']:.2f}× | " if twin else "") +
                     f"{_span(r['bypassed_cold_ttft_s'])} | {m['in_process_ratio']:.2f}× | {_ms(m['added_s'])} | "
                     f"{_ms(m['lookup_s']) if m['lookup_s'] is not None else '–'} | "
                     f"{m['ours_s'] * 1e6:.0f} µs | {_ms(m['rest_s'])} |" + (f" {_ms(m['landed_s'])} |" if landed else ""))
    return lines


def _md_miss_cpu(mp: dict[str, Any] | None, copy: dict[str, Any] | None) -> list[str]:
    """What a miss's store costs a CPU-only box's cores after its first token (benchmarks/miss_path.py, and the
    engine side's copy taken apart by benchmarks/store_copy.py), when their results sit beside this run's."""
    if not mp or "q" not in mp:
        return []
    lines = [
        "",
        "### P7 on a CPU-only box: what a miss's store costs the cores after its first token",
        "",
        f"`python benchmarks/miss_path.py` (run `{mp['run_id']}`, commit `{mp['commit'][:12]}`, medians of "
        f"{mp['rounds']} rounds): fresh replicas computing fresh prompts back to back — R the raw engine, S the raw "
        "engine with the node's MP server idle beside it, B prefixshare attached with every request bypassed, P "
        "prefixshare attached with every request a stored miss — and Q, prefixshare attached, stored misses and "
        "bypassed requests alternating with each store landed and a pause before the next request; per request, "
        "the engine's and the server's CPU seconds (stored minus bypassed: the store's).",
        "",
        "| n | S/R | B/R | P/R (back to back) | Q: first token, stored / bypassed | landed after the first token "
        "| store CPU: engine | store CPU: server | store CPU / the prefill's CPU |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for n, q in sorted(mp["q"].items(), key=lambda kv: int(kv[0])):
        r = mp["rows"][n]
        landed = q.get("landed_after_first_token_s")
        lines.append(f"| {n} | {r['S']['over_raw']:.3f}× | {r['B']['over_raw']:.3f}× | {r['P']['over_raw']:.3f}× | "
                     f"{q['first_token_ratio']:.3f}× | {_ms(landed) if landed is not None else '–'} | "
                     f"{q['store_cpu_s']['engine'] * 1e3:.0f} ms | {q['store_cpu_s']['server'] * 1e3:.0f} ms | "
                     f"{q['store_cpu_over_prefill_cpu'] * 100:.1f} % |")
    idle = mp.get("idle_server_cpu_cores") or []
    lines += ["", "A miss's first token does not wait for its store (Q). Its store then takes CPU from whatever "
              "runs next: on this 2-core box that is the next prefill, whose threads wait for each other, so a "
              "store costs it about its wall time, not only its CPU time (P). An idle MP server takes "
              f"{', '.join(f'{c * 100:.1f} %' for c in idle)} of a core (S): most of it LMCache's "
              "`DeviceHostFuncDispatcher`, a thread that wakes every 5 ms to drain completions of LMCache's "
              "accelerator transfer path, idle with a CPU engine (2.1 % of a core measured alone). On a GPU host "
              "the prefill runs on the GPU and all of this on host cores beside it."]
    if copy and copy.get("rows"):
        ours = all("prefixshare" in c["gbps"] for c in copy["rows"].values())
        parts = [f"{n} tokens: LMCache's {c['gbps']['lmcache']:.2f} GB/s, one pass {c['gbps']['one_pass']:.2f} GB/s, "
                 + (f"prefixshare's {c['gbps']['prefixshare']:.2f} GB/s, " if ours else "")
                 + f"memcpy {c['gbps']['memcpy']:.2f} GB/s" for n, c in sorted(copy["rows"].items(),
                                                                             key=lambda kv: int(kv[0]))]
        lines += ["", "The engine's share is the copy of the KV out of vLLM's blocks into the server's chunk buffers. "
                  "LMCache has no native kernel for it on a CPU engine, and its Python fallback writes every byte "
                  "three times (a staging tensor, a gather per layer, the permuted copy, then the copy into the chunk "
                  "object)" + ("; prefixshare's connector makes this copy itself for vLLM's CPU layout (one strided "
                               "copy per chunk, layer and run of blocks, straight into the chunk buffer, no OpenMP: "
                               "`prefixshare.adapters.vllm._store_copy`)" if ours else "") + ". "
                  f"`python benchmarks/store_copy.py` (run `{copy['run_id']}`, {copy['threads']} thread) times "
                  "them against a copy of the same bytes straight into the chunk object: " + "; ".join(parts) + "."]
    return lines


def _md_store(rows: dict[str, Any], lengths: list[int], digest: str) -> list[str]:
    """P3: the fs tier's adapters vs raw sequential I/O, per length."""
    native = all("fs_l2_native" in rows[str(n)]["io"] for n in lengths)
    sources = ["raw", "fs_l2_plain", *(["fs_l2_native"] if native else []), "fs_l2"]
    names = {"raw": "raw", "fs_l2_plain": "LMCache fs", "fs_l2_native": "LMCache fs_native", "fs_l2": "prefixshare"}
    head = ["n", "MB"]
    for what in ("write", "read (cache)", "read (evicted)"):
        head += [f"{names[src]} {what}" for src in sources]
    head += [f"{names[src]}/raw w, r, r ev" for src in sources[1:]]
    lines = [
        "",
        "## P3: the store medium — fs tier adapters vs raw sequential I/O (GB/s)",
        "",
        "The MP server's fs L2 adapters driven directly (no engine), one file per chunk, written without fsync like "
        "the server does: *LMCache fs*: LMCache's plain Python fs adapter; *LMCache fs_native*: LMCache's native "
        "(C++) fs adapter, 4 worker threads, no integrity check; *prefixshare*: the fs tier's adapter (LMCache's "
        f"file layout, a pool of 4 I/O threads, and the integrity digest: {digest} over every chunk, on store and on "
        "load; `integrity: none` drops it). *Raw*: one file of the same total size, sequential `write`/`readinto`. "
        "*Read (cache)*: raw and adapters alike timed right after an untimed read of the same bytes (on this box "
        "memory left alone for milliseconds can read slower, 2-3x in one run, so both start from the same state); "
        "*read (evicted)*: "
        "after the files were dropped from the page cache. Raw I/O and the adapters run in one loop, a round of each "
        "per repetition in an order that rotates, so the medium's drift moves both sides of a ratio alike; medians "
        f"of {_reps(rows, lengths)} repetitions (min–max in parentheses). The goal is judged on prefixshare's "
        "adapter, the one users get.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for n in lengths:
        r = rows[str(n)]
        io = r["io"]
        cells = [f"{_gb(io[src][key])}" for key in ("write_gbps", "read_warm_gbps", "read_evicted_gbps")
                 for src in sources]
        for src in sources[1:]:
            ratio = _over(io, src)
            cells.append(f"{ratio['write']:.2f} / {ratio['read_warm']:.2f} / {ratio['read_evicted']:.2f}")
        lines.append(f"| {n} | {r['kv_bytes'] / 1e6:.0f} | " + " | ".join(cells) + " |")
    return lines


def _reps(rows: dict[str, Any], lengths: list[int]) -> str:
    """P3's repetitions per length, as the run recorded them (one number when every length had as many)."""
    reps = sorted({rows[str(n)]["io"]["raw"]["read_warm_gbps"]["n"] for n in lengths})
    return str(reps[0]) if len(reps) == 1 else f"{reps[0]}–{reps[-1]}"


def _over(io: dict[str, Any], src: str) -> dict[str, float]:
    fs, rw = io[src], io["raw"]
    return {k: fs[f"{k}_gbps"]["median"] / rw[f"{k}_gbps"]["median"] for k in ("write", "read_warm", "read_evicted")}


def _md_sweep(results: dict[str, Any]) -> list[str]:
    """P4: the break-even sweep, per length and point."""
    sw = results["sweep"]
    lines = [
        "",
        "## P4: load or recompute, around break-even",
        "",
        "One replica (policy `load.mode: auto`) behind an MP server whose fs adapter sleeps per chunk it reads; a "
        "control file sets the delay while the server runs (`prefixshare.bench._throttle`). Per length and "
        "point, the delay is set so that a load is predicted to take *factor* × the recompute (from the replica's "
        "own unthrottled forced loads and recomputes of the same prompts, measured first; a factor below their "
        "ratio cannot be reached and runs unthrottled); then, per run, the same prompt is forced to load (`prefixshare.load: always`), "
        "forced to recompute (`never`) and left to the cost model (`auto`), interleaved, the engine's prefix "
        "cache and the server's L1 emptied before each so a load reads the throttled medium. *Regret* = auto's "
        "median ÷ the better forced median; *right* = auto's choices that match the better forced option. The "
        "model learns the store's new speed from the requests themselves (a store whose speed changes).",
        "",
        "| n | factor | delay/chunk | forced load | forced recompute | load/recompute | auto | auto chose | right "
        "| regret |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n_key, d in sorted(sw["per_length"].items(), key=lambda kv: int(kv[0])):
        cal = d["calibration"]
        lines.append(f"| {n_key} | unthrottled | 0 | {_span(cal['load_s'])} | {_span(cal['recompute_s'])} | "
                     f"{cal['load_s']['median'] / cal['recompute_s']['median']:.2f} | – | – | – | – |")
        for p in d["points"]:
            chose = ", ".join(f"{c} {p['auto_choices'].count(c)}" for c in ("load", "recompute")
                              if p["auto_choices"].count(c))
            lines.append(f"| {n_key} | {p['factor']:g} | {_ms(p['chunk_delay_s'])} | {_span(p['load_s'])} | "
                         f"{_span(p['recompute_s'])} | {p['achieved_load_over_recompute']:.2f} | {_span(p['auto_s'])} | "
                         f"{chose} | {p['right_choices']}/{len(p['auto_choices'])} | "
                         f"{'**' if p['regret'] > GOAL_REGRET else ''}{p['regret']:.2f}"
                         f"{'**' if p['regret'] > GOAL_REGRET else ''} |")
    lines += ["", f"The replica's decisions: `{sw.get('decisions')}`; its final estimates: `{sw.get('estimates')}`."]
    return lines


def _md_overhead(rows: dict[str, Any], lengths: list[int]) -> list[str]:
    """P5: prefixshare's own per-request overhead, per length, without and with admission rules."""
    lines = _md_connectors(rows, lengths)
    lines += [
        "",
        "**Its breakdown, in-process.** Scheduler-side work per request, timed in a loop outside the engine: "
        "admission, identity, namespace and salt, stats, the cost model's decisions and observations, plus handing "
        "the stats snapshot to the writer thread (which writes it at most every 50 ms, off the request path).",
        "",
        "| n | calls µs (median, min–max) | hand-off µs | total µs | % of warm TTFT | % of cold TTFT "
        "| total µs with admission rules |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in lengths:
        r = rows[str(n)]
        o = r["overhead_us"]
        wr = r.get("overhead_with_rules_us", {}).get("total_us")
        lines.append(f"| {n} | {o['calls_us']['median']:.1f} ({o['calls_us']['min']:.1f}–{o['calls_us']['max']:.1f}) "
                     f"| {o['publish_us']['median']:.1f} | {o['total_us']:.1f} | {r['overhead_pct_of_warm_ttft']:.3f} | "
                     f"{r['overhead_pct_of_cold_ttft']:.4f} | {wr:.1f} |" if wr is not None else "")
    lines += [
        "",
        "The goal is judged on the default policy (no admission rules). With rules (`min_tokens` & (`pinned` | "
        "`frequency`), last column) the connector also digests the prompt for the rules, which grows with its length.",
    ]
    return lines


def _md_connectors(rows: dict[str, Any], lengths: list[int]) -> list[str]:
    """P5 as the engine sees it: warm TTFT through prefixshare's connector vs LMCache's, and the hooks' µs."""
    lines = [
        "",
        "## P5: what prefixshare's connector adds to a warm request",
        "",
        "Two replicas up side by side on one MP server and one store, requests alternating (which one goes first "
        "alternates too): **O**, prefixshare's connector, and **L**, LMCache's own `LMCacheMPConnector` with the "
        "same server settings (LMCache keys by the model's name, so L computes and stores its own copies first). "
        "Every request empties the engine's prefix cache first, so each is a load from the server's memory (L1): "
        "the shortest warm request, where a fixed overhead weighs most. *Added*: the median of the pairs' "
        "differences (O − L), with its 95 % interval (order statistics); a pair in which either replica did not "
        "load the prompt is left out and counted.",
        "",
        "| n | pairs | O: prefixshare | L: LMCache | added (95 % interval) | added % of warm TTFT | O/L (median of pairs) "
        "| O's hooks µs per request |",
        "|---|---|---|---|---|---|---|---|",
    ]
    hooks: dict[str, dict[int, dict[str, float]]] = {}
    if not any("connectors" in rows[str(n)] for n in lengths):
        return lines[:4] + ["Not measured in this run (its results predate the comparison)."]
    for n in lengths:
        c = rows[str(n)].get("connectors") or {}
        if not c.get("pairs"):
            lines.append(f"| {n} | 0 ({c.get('pairs_not_loaded', 0)} not loaded) | – | – | – | – | – | – |")
            continue
        lo, hi = c["added_ci95_s"]
        plo, phi = c["added_pct_ci95"]
        skipped = f" ({c['pairs_not_loaded']} not loaded)" if c["pairs_not_loaded"] else ""
        lines.append(f"| {n} | {c['pairs']}{skipped} | {_span(c['ours_ttft_s'])} | {_span(c['lmcache_ttft_s'])} "
                     f"| {c['added_s'] * 1e3:+.2f} ms ({lo * 1e3:+.2f} to {hi * 1e3:+.2f}) "
                     f"| {c['added_pct_of_warm_ttft']:+.2f} % ({plo:+.2f} to {phi:+.2f}) | {c['ratio_median']:.3f} "
                     f"| {c['hooks_us_total']:.0f} |")
        for hook, v in c["hooks_us_per_request"].items():
            hooks.setdefault(hook, {})[n] = v
    if hooks:
        lines += [
            "",
            "Where O's hook time goes, per request (median µs, with the median number of calls): prefixshare's work "
            "in each hook of its connector, around LMCache's (the scheduler side's and the worker side's methods; "
            "`WorkerSide.gate` is the worker's port check before a step's transfers, `SchedulerSide.before_lookup` "
            "holds the scheduler's):",
            "",
            "| hook | " + " | ".join(str(n) for n in lengths) + " |",
            "|---|" + "---|" * len(lengths),
        ]
        for hook, per in sorted(hooks.items(), key=lambda kv: -max(v["us_median"] for v in kv[1].values())):
            cells = [f"{per[n]['us_median']:.1f} ({per[n]['calls_median']:g})" if n in per else "–" for n in lengths]
            lines.append(f"| `{hook}` | " + " | ".join(cells) + " |")
    return lines


def _md_prewarm(rows: dict[str, Any], slow: list[int]) -> list[str]:
    """P6: pre-warm wall time vs the engine's raw prefill, per P6 length."""
    lines = [
        "",
        "## P6: pre-warm vs the engine's raw prefill",
        "",
        "`prefixshare.warm.warm()` on one document (prefill with store, then verification that every chunk is in "
        "the store, registry entry) vs vLLM without prefixshare prefilling the same tokens.",
        "",
        "| tokens | pre-warm wall time | raw prefill | ratio |",
        "|---|---|---|---|",
    ]
    for n in slow:
        r = rows[str(n)]
        lines.append(f"| {r['prewarm_tokens']} | {_span(r['prewarm_s'])} | {_span(r['raw_prefill_s'])} | "
                     f"{r['prewarm_over_raw']:.2f}× |")
    return lines


def _md_corpus(c: dict[str, Any] | None) -> list[str]:
    """P6's corpus: one warm() call over many documents vs the raw engine prefilling them."""
    if not c:
        return []
    store = c.get("store_write_gbps_during_prefill")
    return [
        "",
        f"**A corpus.** One `warm()` call over {c['documents']} documents of about {c['tokens'] // max(c['documents'], 1)} "
        f"tokens ({c['tokens']:,} tokens, {c['kv_bytes'] / 1e6:.0f} MB of KV; the same as `prefixshare warm DIR`), "
        f"against vLLM without prefixshare prefilling the same token ids in the same {c['raw_batches']} batches:",
        "",
        "| | wall time | documents/s | KV GB/s | ratio |",
        "|---|---|---|---|---|",
        f"| raw prefill | {c['raw_s']:.1f} s | {c['raw_documents_per_s']:.2f} | {c['raw_kv_gbps']:.3f} | 1.00× |",
        f"| `warm()` | {c['warm_s']:.1f} s | {c['warm_documents_per_s']:.2f} | {c['warm_kv_gbps']:.3f} | "
        f"{c['warm_over_raw']:.2f}× |",
        "",
        f"{c['warmed']} warmed, {c['failed']} not, {c.get('verified')} verified in the store; "
        + (f"the store's write rate while prefilling (KV of the call's chunks found in the fs tier over time, as "
           f"warm's progress bar shows it): {store:.3f} GB/s." if store is not None else "no fs tier to watch."),
        *_corpus_pacing(c),
    ]


def _corpus_pacing(c: dict[str, Any]) -> list[str]:
    """What warm spent on the server's memory in the corpus: pacing, documents prefilled again, its steps."""
    if c.get("paced_s") is None:
        return []
    phases = c.get("phases") or {}
    steps = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in phases.items())
    return ["", f"warm() waited {c['paced_s']:.2f} s in all for room in the server's memory (it sends each engine "
            "call only the documents whose KV the server's free memory holds: the server drops a store it cannot "
            f"reserve memory for) and prefilled {c.get('retried') or 0} documents more than once (what "
            f"verification found missing is prefilled again); its steps: {steps}."]


def _md_lab(lab: dict[str, Any] | None) -> list[str]:
    """The network lab's link table (docs/benchmarks/lab.json, written by tests/lab/links.py): one request's KV
    from node A through a store node to node B over shaped links, against the plan's arithmetic."""
    if not lab or not lab.get("rows"):
        return []
    lines = [
        "",
        "## Across a real link: the rated link table, measured (network lab)",
        "",
        f"Three network namespaces (node A, node B, a store node) behind a bridge; both nodes' links shaped with "
        f"`tbf` to the class's rate. Node A stores one request's KV ({lab['chunk_tokens']}-token chunks) through "
        "a tier's adapter — `resp`: Redis on the store node; `sshfs`: the `fs` tier (blake3-checked) on the store "
        "node's directory mounted over sshfs on each node; `mooncake`: `mooncake_store`, master and the "
        "segment-holding client on the store node (TCP); `s3`: the `s3` tier against an S3 stand-in (moto's "
        "server, plain HTTP) on the store node — and node B, another process with no memory of the "
        "store, looks it up, loads it and compares every byte. *Rated*: `prefixshare plan`'s time for the same "
        "bytes on the class's line rate (a lower bound: no row may beat it). Medians of "
        f"{lab['reps']}; {_lab_runs(lab)} (`python tests/lab/links.py --full`).",
        "",
        "| link | via | payload | tokens | MB | rated | store A→S | load S→B | load / rated | store / rated | lookup | "
        "wire / payload |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in lab["rows"]:
        if "error" in r:
            lines.append(f"| {r['link_gbit']:g} Gbit/s | {r['transport']} | {r['shape']} | {r['tokens']} | "
                         f"**FAILED**: {r['error'][:200]} ||||||||")
            continue
        lines.append(
            f"| {r['link_gbit']:g} Gbit/s | {r.get('transport', 'resp')} | {r['shape']} | {r['tokens']} | {r['bytes'] / 1e6:.0f} | "
            f"{r['rated_s']:.3f} s | {r['store_s']:.3f} s | {r['load_s']:.3f} s | {r['load_over_rated']:.2f}× | "
            f"{r['store_over_rated']:.2f}× | {r['lookup_s'] * 1e3:.1f} ms | {r['wire_over_payload']:.3f}× |")
    return lines


def _lab_runs(lab: dict[str, Any]) -> str:
    """Which run (and commit) measured the rows: one, or one per transport when a run added a transport."""
    runs: dict[tuple[str, str], list[str]] = {}
    for r in lab["rows"]:
        key = (str(r.get("run_id", lab.get("run_id"))), str(r.get("commit", lab.get("commit", ""))))
        via = r.get("transport", "resp")
        if via not in runs.setdefault(key, []):
            runs[key].append(via)
    if len(runs) == 1:
        (run_id, commit), = runs
        return f"run `{run_id}`, commit `{commit[:12]}`"
    return "; ".join(f"{', '.join(vias)}: run `{run_id}`, commit `{commit[:12]}`"
                     for (run_id, commit), vias in runs.items())


def _md_lab_choice(choice: dict[str, Any] | None, out: Path | None) -> list[str]:
    """The network lab's load-or-recompute sweep (docs/benchmarks/lab-choice.json, written by
    tests/lab/engines.py), with its plot drawn beside it."""
    if not choice or not choice.get("sweeps"):
        return []
    plot = _plot_lab_choice(choice, out) if out is not None else None
    lines = [
        "",
        "## Across a real link: load or recompute (network lab, engines)",
        "",
        "vLLM replicas on node A and node B, each beside its own MP server, the `resp` tier (Redis) on the store "
        "node. Node A computes each document cold (the reference every answer is compared with); node B first "
        "measures its own forced load over the unshaped link (L0) and forced recompute (R), then per point its link "
        "is shaped (`tbf`) to the rate at which the plan's arithmetic puts a load at *f* x R (rate = KV bytes / "
        "(f x R - L0)), and per run the same document is forced to load, forced to recompute and left to "
        "`load.mode: auto`, interleaved (B's prefix cache and server L1 emptied before each). *Plan*: L0 + KV bytes "
        "/ rate, the prediction the rate was chosen by. *GPU link*: the link that puts "
        f"{choice.get('gpu_assumption', 'a GPU')} at the same ratio of link bytes/s to the KV bytes/s prefill "
        "produces — the GPU + link pairing the point stands for. Medians; every answer equal to the cold one "
        f"unless marked. Run `{choice.get('run_id')}`, commit `{str(choice.get('commit', ''))[:12]}` "
        "(`python tests/lab/engines.py --full`).",
        "",
        "| tokens | f | link | GPU link | plan load | load | recompute | auto | auto chose | regret | first auto "
        "| answers |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for sw in choice["sweeps"]:
        for p in sw["points"]:
            if "skipped" in p:
                lines.append(f"| {sw['tokens']} | {p['factor']:g} | skipped: {p['skipped']} ||||||||||")
                continue
            lines.append(
                f"| {sw['tokens']} | {p['factor']:g} | {p['rate_mbit']:.0f} Mbit/s | "
                f"{p['gpu_equivalent_link_gbit']:.1f} Gbit/s | {p['predicted_load_s']:.2f} s | {p['load_s']:.2f} s | "
                f"{p['recompute_s']:.2f} s | {p['auto_s']:.2f} s | {'/'.join(p['auto_choices'])} "
                f"(better: {p['better']}) | {p['regret']:.3f} | {_first_auto(p)} | "
                f"{'equal' if p['all_same_as_cold'] else '**DIFFER**'} |")
    points = [p for sw in choice["sweeps"] for p in sw["points"] if "regret" in p]
    away = [p["regret"] for p in points if not 0.7 <= p["achieved_load_over_recompute"] <= 1.3]
    if points:
        worst = max(p["regret"] for p in points)
        lines += ["", f"Worst regret {worst:.3f} (goal ≤ 1.1 everywhere: {'met' if worst <= 1.1 else '**MISS**'})"
                  + (f"; away from break-even (measured load/recompute outside 0.7–1.3) {max(away):.3f} (goal ≤ "
                     f"1.05: {'met' if max(away) <= 1.05 else '**MISS**'})." if away else ".")]
    if points and "first_auto_regret" in points[0]:
        lines += ["", "*First auto*: the first auto request after the link was reshaped, on its own (its choice and "
                  "its time / the better option's median): the cost model had measured the new link once, by the "
                  "forced load just before it. The regret column includes it."]
    if plot:
        lines += ["", f"![lab sweep](benchmarks/{Path(plot).name})"]
    return lines


def _first_auto(p: dict[str, Any]) -> str:
    if "first_auto_regret" not in p:
        return "–"
    return f"{p['first_auto_choice']} {p['first_auto_regret']:.2f}"


def _plot_lab_choice(choice: dict[str, Any], out: Path) -> str | None:
    """lab-choice.png: TTFT of forced load, forced recompute and auto against the link rate, the plan's predicted
    load drawn in, and auto's regret."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    for sw in choice["sweeps"]:
        pts = sorted((p for p in sw["points"] if "regret" in p), key=lambda p: p["rate_mbit"])
        if not pts:
            continue
        xs = [p["rate_mbit"] for p in pts]
        n = sw["tokens"]
        for key, style, what in (("load_s", "s-", "forced load"), ("recompute_s", "o-", "forced recompute"),
                                 ("auto_s", "D--", "auto"), ("predicted_load_s", "k:", "plan: load")):
            ax1.plot(xs, [p[key] for p in pts], style, label=f"{n} tok: {what}")
        ax2.plot(xs, [p["regret"] for p in pts], "D-", label=f"{n} tok")
    for ax in (ax1, ax2):
        ax.set_xscale("log")
        ax.set_xlabel("node B's link (Mbit/s, tbf)")
        ax.grid(True, which="both", alpha=0.3)
    ax1.set_yscale("log")
    ax1.set_ylabel("TTFT (s), median")
    ax1.legend(fontsize=7)
    ax2.axhline(GOAL_REGRET, color="k", lw=1, ls="--", label="goal")
    ax2.set_ylabel("regret: auto / the better forced option")
    ax2.legend(fontsize=7)
    fig.suptitle("Load or recompute across a shaped link (network lab, vLLM CPU replicas)", fontsize=10)
    fig.tight_layout()
    path = out / "lab-choice.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def _results_folder(results: dict[str, Any]) -> Path:
    return (Path(results["results_path"]).parent if results.get("results_path")
            else Path(str((results.get("settings") or {}).get("out", ""))))


def _md_miss_sglang(runs: list[dict[str, Any] | None]) -> list[str]:
    """P7 on SGLang (benchmarks/sglang_miss_path.py), when its results sit beside this run's."""
    runs = [r for r in runs if r and r.get("per_length")]
    if not runs:
        return []
    lines = [
        "",
        "### P7 on SGLang",
        "",
        "`python benchmarks/sglang_miss_path.py` (the bench drives vLLM only): SGLang's CPU engine computing fresh "
        "prompts cold, one token each, a pause before every request so nothing a previous request left running "
        "overlaps it. R: SGLang without prefixshare; L: SGLang with LMCache's own integration, every request a "
        "stored miss; Q: prefixshare attached, a stored miss (Qs) and a bypassed request (Qb: no lookup, no "
        "store) per step. *One at a time*: each replica alone on the machine with SGLang's defaults, the order "
        "rotating between rounds; *side by side*: all three up at once (with `sleep_on_idle`, else an idle "
        "scheduler polls and takes a core), the calls of each step in rotating order.",
        "",
        "| run | mode | n | R | L | Qs | Qb | L/R | Qs/R (goal) | Qb/R | Qs/Qb (pairs) | stores landed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        for n, r in sorted(run["per_length"].items(), key=lambda kv: int(kv[0])):
            m = r["median_s"]
            lines.append(f"| `{run['run_id']}` | {run.get('mode', 'side by side')} | {n} | {_ms(m['R'])} | "
                         f"{_ms(m['L'])} | {_ms(m['Qs'])} | {_ms(m['Qb'])} | {r['lmcache_over_raw']:.3f}× | "
                         f"{r['stored_over_raw']:.3f}× | {r['bypassed_over_raw']:.3f}× | "
                         f"{r['stored_over_bypassed_pairs']:.3f}× | {'yes' if run['stores_landed'] else 'NO'} |")
    lines += ["", "LMCache's SGLang connector copies a store's KV on a thread pool that lives as long as the engine; "
              "prefixshare runs each such copy on a thread that ends with it (`prefixshare.adapters._threads`: a "
              "long-lived thread keeps an OpenMP pool, which slows the engine's later parallel regions). With "
              "the pool, the first version of this script (one at a time, 2 rounds) measured Qb/R 1.127× at 1k "
              "tokens and 1.061× at 4k. Differences under about 5 % are within what these runs reproduce: L/R "
              "moved between 0.98× and 1.13× from run to run."]
    return lines


def _lab_results(results: dict[str, Any], name: str = "lab.json") -> dict[str, Any] | None:
    """The network lab's results beside this run's (``name`` in the results folder), if there are any."""
    path = _results_folder(results) / name
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return None


def _md_kv_bytes(results: dict[str, Any]) -> list[str]:
    """KV bytes per token measured from the store's files vs ``prefixshare plan``."""
    s, kv = results["settings"], results["kv_bytes_per_token"]
    return [
        "",
        "## KV bytes per token",
        "",
        f"Measured from the store: {kv['measured']['files']} chunk files, median {kv['measured']['median_file_bytes']} "
        f"bytes per {s['chunk_size']}-token chunk = **{kv['measured']['bytes_per_token']}** bytes per token "
        f"(all files equal: {kv['measured']['all_files_equal']}); `prefixshare plan {results['model']['shape']}` "
        f"predicts **{kv['plan']}**: {'they agree' if kv['agree'] else 'THEY DISAGREE'}.",
    ]


def _md_plots(results: dict[str, Any], docs_path: Path) -> list[str]:
    """The plots and a link to results.json, as paths relative to the page."""
    rel = lambda p: os.path.relpath(p, docs_path.parent)  # noqa: E731
    lines = [
        "",
        "## Plots and raw results",
        "",
    ]
    for p in results.get("plots", []):
        lines.append(f"![{Path(p).stem}]({rel(p)})")
        lines.append("")
    lines.append(f"Every number above, with the settings and per-run values: [`{rel(results['results_path'])}`]"
                 f"({rel(results['results_path'])}).")
    return lines


def _md_notes(results: dict[str, Any]) -> list[str]:
    """The run's free-text notes, if it has any."""
    notes = results.get("notes")
    if notes:
        return ["", "## Notes", "", notes]
    return []


#: profile rows worth showing (the generic call chain of vLLM's engine loop is left out)
_INTERESTING = re.compile(r"lmcache|prefixshare|pickle|serialization|acquire|_model_forward|scheduler.py.*schedule")


def _where_time_goes(results: dict[str, Any]) -> list[str]:
    """Decompositions measured in this run, for the goals it missed."""
    rows, goals = results["per_length"], results["goals"]
    lengths = sorted(int(n) for n in rows)
    out = ["", "## Where the time goes", ""]
    prof = results.get("profile_warm_request") or {}
    cost = prof.get("cost") or {}
    est = results["sweep"].get("estimates") or {}
    if not goals["P1"]["pass"] or not goals["P2"]["pass"]:
        out += [
            "**Warm loads (P1, P2).** A cross-replica load is: the lookup, during which LMCache's server also reads "
            "the chunks from the fs tier into its memory; then the transfer from the server into vLLM's KV cache; "
            "then one token of prefill. Measured on one more warm request of "
            f"{prof.get('tokens')} tokens (under cProfile, {_ms(prof['seconds']) if prof.get('seconds') else '?'}): "
            f"lookup {_ms(cost['observed_lookup_s']) if cost.get('observed_lookup_s') else '?'}, transfer "
            f"{_ms(cost['observed_transfer_s']) if cost.get('observed_transfer_s') else '?'}. Over the whole run the "
            f"sweep replica's fit of the transfer is {est.get('transfer_gbps')} GB/s — against "
            f"{rows[str(lengths[-1])]['io']['raw']['read_warm_gbps']['median']:.1f} GB/s for reading the same bytes "
            "from the page cache. "
            + ("The transfer is LMCache's engine-driven *shared-memory* transport (`server.shm_name`): the server's "
               "L1 pool is mapped in the engine, which copies each chunk into its KV blocks "
               "(`lmcache/v1/multiprocess/transfer_context/shm.py`); what remains is per-chunk RPCs and copies. "
               if results.get("transport") == "shared memory" else
               "The transfer is LMCache's engine-driven *pickle* transport (no shared-memory segment configured): "
               "the server copies each chunk (`tensor.cpu().clone()`), pickles the list, msgpack-encodes the reply "
               "and sends it over a ZMQ TCP socket; the engine unpickles it and copies it into its KV blocks "
               "(`lmcache/v1/multiprocess/modules/server_transfer.py`, `PickleTransferStrategy.prepare_retrieve`). ")
            + "The engine-side profile of that request (its LMCache, waiting and model rows), by cumulative time; "
            "`acquire` is the engine waiting for the server's reply:",
            "",
            "| function | calls | own s | cumulative s |",
            "|---|---|---|---|",
        ]
        for row in [r for r in (prof.get("top") or []) if _INTERESTING.search(r["function"])][:16]:
            out.append(f"| `{row['function']}` | {row['calls']} | {row['own_s']} | {row['cumulative_s']} |")
        out.append("")
    if not goals["P3"]["pass"]:
        out += [
            "**The fs L2 path (P3).** The fs tier writes and reads one file per chunk (LMCache's file layout: "
            "`lmcache/v1/distributed/l2_adapters/fs_l2_adapter.py`) through a pool of 4 I/O threads, and hashes "
            f"every chunk with {_digest(results)} in the thread that writes or reads it (its rate in this run is in the "
            "floor's table above); the raw reference is one sequential "
            "stream over one file (larger kernel read-ahead, no per-file work); the ratios per length are in the "
            "P3 table, LMCache's plain and native (C++, worker threads, no integrity check) adapters beside ours.",
            "",
        ]
    if not goals.get("P5_calls", goals["P5"]).get("pass", True):
        worst = max(lengths, key=lambda n: rows[str(n)]["overhead_us"]["total_us"])
        o = rows[str(worst)]["overhead_us"]
        out += [
            f"**prefixshare's own overhead (P5).** Of {o['total_us']:.0f} µs per request at {worst} tokens, "
            f"{o['calls_us']['median']:.0f} µs are the per-request calls (admission, namespace and salt, stats, the "
            f"cost model) and {o['publish_us']['median']:.1f} µs handing the stats snapshot to the writer thread "
            "(`ConnectorRuntime.publish`; the write itself is off the request path).",
            "",
        ]
    if not goals["P6"]["pass"]:
        out += _p6_breakdown(results, rows, lengths)
        out += _p6_phases(rows, lengths)
    if not goals["P3"]["pass"] or not goals["P6"]["pass"]:
        out += _idle_memory(results.get("idle_memory"))
    return out


_IDLE_KINDS = {"anon_4k": "anonymous, 4 KiB pages", "anon_thp": "anonymous, huge pages",
               "shm": "shared memory (as the server's chunk buffers)", "page_cache_read": "page cache, read"}


def _idle_memory(idle: dict[str, Any] | None) -> list[str]:
    """The run's probe of what memory that sat idle costs (:mod:`prefixshare.bench._memory`), when P3 or P6 missed."""
    if not idle:
        return []
    keys = [f"{i:g}" for i in idle["idle_s"]]
    out = ["**Memory that sat idle.** A store's path writes into memory that waits between requests: the engine "
           "copies a request's KV into the server's chunk buffers (shared memory, allocated when the server "
           "started) and the fs tier writes and reads through the page cache. Measured in this run "
           f"(`prefixshare.bench._memory`, {idle['bytes'] >> 20} MiB per access, medians of {idle['rounds']}): the "
           "first access after the memory sat idle, against the same access right after it was touched:", "",
           "| memory | " + " | ".join("touched just before" if k == "0" else f"idle {k} s" for k in keys) + " |",
           "|---|" + "---|" * len(keys)]
    for kind, label in _IDLE_KINDS.items():
        gbps, ratio = idle["gbps"][kind], idle["ratio_to_first"][kind]
        out.append(f"| {label} | " + " | ".join(
            f"{gbps[k]:.2f} GB/s" + ("" if k == keys[0] else f" ({ratio[k]:.2f}×)") for k in keys) + " |")
    out += ["", "Ratios well below 1 mean this machine charges for memory left alone: the cost starts within "
            "milliseconds (idle spells under a second are timed right after an access of the same memory) and grows "
            "over seconds, while the guest's own page-fault counters do not move, so the time goes to the host, and "
            "4 KiB pages pay it per page. A pre-warm or a stored miss writes its KV into chunk buffers and files that "
            "may have sat idle since the last request; the raw prefill writes only its own KV blocks. Two timings "
            "compared on this page start from the same state for the same reason (P3's warm reads: both right after "
            "an untimed read). `python benchmarks/idle_memory.py` runs the probe over other idle spells.", ""]
    return out


def _p6_phases(rows: dict[str, Any], lengths: list[int]) -> list[str]:
    """warm()'s own timing of its steps (the report's ``phases``), beside the raw prefill of the same tokens."""
    timed = [n for n in lengths if rows[str(n)].get("prewarm_phases_s")]
    if not timed:
        return []
    names = list(rows[str(timed[0])]["prewarm_phases_s"])
    out = ["warm()'s own timing of its steps (`WarmReport.phases`, medians over the runs): *prefill* is the engine's "
           "call with the copy of its KV into the server, *verify* the wait until the store holds every chunk; "
           "the other steps are warm()'s bookkeeping:", "",
           "| tokens | raw prefill | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for n in timed:
        r = rows[str(n)]
        phases = r["prewarm_phases_s"]
        out.append(f"| {n} | {_ms(r['raw_prefill_s']['median'])} | "
                   + " | ".join(_ms(phases[name]) if name in phases else "–" for name in names) + " |")
    out.append("")
    return out


def _p6_breakdown(results: dict[str, Any], rows: dict[str, Any], lengths: list[int]) -> list[str]:
    """Where pre-warm's time over the raw prefill goes (shown when P6 is missed)."""
    out: list[str] = []
    if results.get("interleaved_a_r"):
        out += ["**Pre-warm (P6).** `warm()` = a prefill with prefixshare attached (a lookup that misses, the engine "
                "step, the copy of the KV into the server after it), then waiting until every chunk is on the store's "
                "medium, then the registry entry. Its time over the raw prefill (R, the document's exact tokens, "
                "right after), split with what P7 measured in the same replicas at the same length: a miss's added "
                "time (cold − bypassed, paired) and when its chunks landed after its first token; the rest is what "
                "neither explains: warm()'s own steps (timed in the next table) and any difference between the two "
                "replicas' prefills of the same tokens:",
                "",
                "| tokens | raw prefill | pre-warm | over raw | a miss's added time (P7) | landed (P7) | rest |",
                "|---|---|---|---|---|---|---|"]
        for n in lengths:
            r = rows[str(n)]
            if "prewarm_s" not in r:
                continue
            m = r["miss_overhead"]
            raw, pw = r["raw_prefill_s"]["median"], r["prewarm_s"]["median"]
            landed = m.get("landed_s") or 0.0
            out.append(f"| {n} | {_ms(raw)} | {_ms(pw)} | {_ms(pw - raw)} | {_ms(m['added_s'])} | {_ms(landed)} | "
                       f"{_ms(pw - raw - m['added_s'] - landed)} |")
        out.append("")
    else:
        out += ["**Pre-warm (P6).** Raw prefill → the same prefill with prefixshare attached (cold TTFT: a lookup "
                "that misses, then the engine-side copy of the KV into the server through the same "
                f"{results.get('transport', 'pickle')} transport) → `warm()` (that, then waiting until every chunk is "
                "on the store's medium, and the registry entry). Replicas A and R ran one after the other, so a "
                "drifting machine load shows in the differences too:", "",
                "| tokens | raw prefill | with prefixshare (cold TTFT) | pre-warm | lookup + store copy | warm()'s own |",
                "|---|---|---|---|---|---|"]
        for n in lengths:
            r = rows[str(n)]
            if "prewarm_s" not in r:
                continue
            raw, cold, pw = r["raw_prefill_s"]["median"], r["cold_ttft_s"]["median"], r["prewarm_s"]["median"]
            out.append(f"| {n} | {_ms(raw)} | {_ms(cold)} | {_ms(pw)} | {_ms(cold - raw)} | {_ms(pw - cold)} |")
        out.append("")
    return out
