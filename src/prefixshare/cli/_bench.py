"""``prefixshare bench [--quick]``: the prefill cost cut across replicas against the raw engine and a measured floor,
the miss overhead, and load-or-recompute regret around break-even."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from prefixshare.cli._common import EXIT_CHECK_FAILED, EXIT_RUNTIME, JSON_OPTION, emit_json, err, handles_errors, out


def _lengths(value: str | None) -> list[int] | None:
    if not value:
        return None
    from prefixshare.plan import parse_prompt_lengths

    return list(parse_prompt_lengths(value))


def register(app: typer.Typer) -> None:
    register_load(app)

    @app.command("bench")
    @handles_errors
    def bench_cmd(
        quick: bool = typer.Option(False, "--quick", help="Tiny model, short prompts, no docs page (CI; ~2 min)."),
        out_dir: Path | None = typer.Option(None, "--out", help="Where results.json and the plots go (default: "
                                            "docs/benchmarks; with --quick, the user cache dir)."),
        docs: Path | None = typer.Option(None, "--docs", help="The markdown page to generate (default: "
                                         "docs/benchmarks.md; none with --quick)."),
        no_docs: bool = typer.Option(False, "--no-docs", help="Do not write the markdown page."),
        lengths: str | None = typer.Option(None, "--lengths", help="Prompt lengths, e.g. 1k,2k,4k,8k."),
        slow_lengths: str | None = typer.Option(None, "--slow-lengths", help="Lengths of P6 (default: "
                                                "all of --lengths)."),
        sweep_lengths: str | None = typer.Option(None, "--sweep-lengths", help="Lengths of P4's break-even sweep "
                                                 "(default: 1k,4k; with --quick 512)."),
        runs: int | None = typer.Option(None, "--runs", min=5, help="Repetitions per measure (medians; >= 5)."),
        shape: str | None = typer.Option(None, "--shape", help="Model shape (prefixshare model shapes)."),
        check: bool = typer.Option(False, "--check", help="Exit 1 when a goal is missed."),
        render: Path | None = typer.Option(None, "--render", help="Measure nothing: render the plots and the page "
                                           "again from a results.json (e.g. after changing the page's layout)."),
        tiers: Path | None = typer.Option(None, "--tiers", help="Measure only the L2 tiers of this policy file: "
                                          "store / lookup / load throughput of each tier's adapter (and the raw "
                                          "medium), into tiers.json and docs/tiers.md (no engine, no server)."),
        tier_chunks: int = typer.Option(16, "--tier-chunks", min=1, help="--tiers: chunks per store/load task."),
        tier_chunk_tokens: int = typer.Option(256, "--tier-chunk-tokens", min=1, help="--tiers: tokens per chunk "
                                              "(bytes: tokens x the --shape model's KV bytes per token)."),
        json: bool = JSON_OPTION,
    ) -> None:
        """Measure the raw engine's cold TTFT vs cross-replica warm TTFT, warm against a measured floor, the miss
        overhead, the store path, load-or-recompute regret around break-even, prefixshare's own overhead and
        pre-warm; report pass/fail per goal."""
        import sys

        if tiers is not None:
            _bench_tiers(tiers, quick=quick, chunks=tier_chunks, chunk_tokens=tier_chunk_tokens, shape=shape,
                         runs=runs, out_dir=out_dir, docs=docs, no_docs=no_docs, json=json)
            return

        from prefixshare.bench import Settings, render_results, run_bench

        if render is not None:
            results = render_results(render, docs or Path("docs/benchmarks.md"))
            if json:
                emit_json(results)
            else:
                _render(results)
            return

        settings = Settings.for_run(
            quick, lengths=_lengths(lengths), slow_lengths=_lengths(slow_lengths),
            sweep_lengths=_lengths(sweep_lengths), runs=runs, shape=shape, out=out_dir, docs=docs,
        )
        if no_docs:
            settings.docs = None
        settings.command = " ".join(["prefixshare", "bench", *sys.argv[2:]]) if len(sys.argv) > 1 and \
            sys.argv[1] == "bench" else "prefixshare bench" + (" --quick" if quick else "")

        def log(line: str) -> None:
            (err if json else out).print(escape(line))

        results = run_bench(settings, log=log)
        if json:
            emit_json(results)
        else:
            _render(results)
        if check and not all(g["pass"] for g in results["goals"].values()):
            raise typer.Exit(EXIT_CHECK_FAILED)


def _bench_tiers(policy_file: Path, *, quick: bool, chunks: int, chunk_tokens: int, shape: str | None,
                 runs: int | None, out_dir: Path | None, docs: Path | None, no_docs: bool, json: bool) -> None:
    import sys

    from prefixshare._paths import cache_dir
    from prefixshare.bench import TierBenchSettings, measure_tiers, write_docs, write_results
    from prefixshare.policies import Policy

    policy = Policy.from_yaml(str(policy_file))
    settings = TierBenchSettings(chunks=4 if quick else chunks, chunk_tokens=64 if quick else chunk_tokens,
                                 shape=shape or ("tiny" if quick else "bench"), reps=runs or 5)
    if out_dir is None:
        out_dir = cache_dir() / "bench" / "quick-results" if quick else Path("docs/benchmarks")
    if no_docs:
        docs = None
    elif docs is None and not quick:
        docs = Path("docs/tiers.md")
    command = " ".join(["prefixshare", *sys.argv[1:]])

    def log(line: str) -> None:
        (err if json else out).print(escape(line))

    results = measure_tiers(policy, settings, log_line=log, command=command)
    results["results_path"] = str(write_results(results, out_dir / "tiers.json"))
    failed = [t["tier"] for t in results["tiers"] if "error" in t]
    if docs is not None and not failed:
        results["docs_path"] = str(write_docs(results, docs))
    if json:
        emit_json(results)
    else:
        _render_tiers(results)
    if failed:
        err.print(f"[bold red]error:[/] tier(s) failed: {escape(', '.join(failed))}" +
                  (" (docs not updated)" if docs is not None else ""))
        raise typer.Exit(EXIT_RUNTIME)


def _render_tiers(results: dict) -> None:
    st = results["settings"]
    table = Table(title=f"L2 tiers: {st['chunks']} x {st['chunk_bytes'] / 2**20:.2f} MiB per task, MB/s, medians "
                        f"of {st['reps']} (min/max: {results['results_path']})")
    for col in ("tier", "store", "lookup ms", "load", "evicted", "raw store", "raw load", "/raw store", "/raw load"):
        table.add_column(col, justify="right")

    def med(s: dict | None, digits: int = 0) -> str:
        return f"{s['median']:.{digits}f}" if s else "-"

    for t in results["tiers"]:
        if "error" in t:
            table.add_row(escape(t["tier"]), f"[red]{escape(t['error'])}[/]", *["" for _ in range(7)])
            continue
        raw, ratio = t.get("raw") or {}, t.get("adapter_over_raw") or {}
        table.add_row(escape(t["tier"]), med(t["store_mbps"]), med(t["lookup_ms"], 1), med(t["load_mbps"]),
                      med(t.get("load_evicted_mbps")), med(raw.get("store_mbps")), med(raw.get("load_mbps")),
                      f"{ratio['store_mbps']:.2f}" if "store_mbps" in ratio else "-",
                      f"{ratio['load_mbps']:.2f}" if "load_mbps" in ratio else "-")
    out.print(table)
    out.print(f"load average: {results['machine'].get('load_average')} -> {results.get('load_average_end')}")
    out.print(f"results: {results['results_path']}")
    if results.get("docs_path"):
        out.print(f"docs: {results['docs_path']}")


def _render(results: dict) -> None:
    table = Table(title=f"prefixshare bench: goals (run {results.get('run_id')}, commit {results.get('commit')})")
    for col in ("goal", "measured", "target", "result"):
        table.add_column(col)
    g = results["goals"]
    rows = [
        ("P1 raw cold/warm", f"{g['P1']['value']:.1f}x at {g['P1']['at_tokens']}", ">= 20x", g["P1"]["pass"]),
        ("P2 warm/floor", f"{g['P2']['value']:.2f}x (worst)", "<= 1.5x", g["P2"]["pass"]),
        ("P3 fs tier/raw I/O", f"{g['P3']['value']:.2f}x (worst)", ">= 0.8x", g["P3"]["pass"]),
        ("P4 auto regret", f"{g['P4']['value']:.2f}x (worst)", "<= 1.1x", g["P4"]["pass"]),
        ("P5 connector vs LMCache's", "not measured" if g["P5"].get("value_pct") is None else
         f"{g['P5']['value_pct']:+.2f} % of warm TTFT" + ("" if g["P5"].get("resolved") else " (unresolved)"),
         "<= 1 %", g["P5"]["pass"]),
        ("P5 calls (in-process)", f"{g['P5_calls']['value_us']:.1f} us", "<= 50 us", g["P5_calls"]["pass"]),
        ("P6 pre-warm/raw", f"{g['P6']['value']:.2f}x (worst)", "<= 1.1x", g["P6"]["pass"]),
        ("P7 miss overhead", f"{g['P7']['value']:.2f}x (worst)", "<= 1.03x", g["P7"]["pass"]),
        ("KV bytes/token", f"{g['KV']['value']} vs plan {g['KV']['plan']}", "equal", g["KV"]["pass"]),
    ]
    for name, measured, target, ok in rows:
        table.add_row(name, measured, target, "[green]pass[/]" if ok else "[red]MISS[/]")
    out.print(table)
    per = Table(title="TTFT per prompt length (median, s)")
    for col in ("tokens", "raw cold", "cold", "warm", "floor", "raw cold/warm", "warm/floor", "cold/raw cold"):
        per.add_column(col, justify="right")
    for n, r in sorted(results["per_length"].items(), key=lambda kv: int(kv[0])):
        per.add_row(n, f"{r['raw_cold_ttft_s']['median']:.3f}", f"{r['cold_ttft_s']['median']:.3f}",
                    f"{r['warm_ttft_s']['median']:.3f}", f"{r['floor_s']['total_s']:.3f}",
                    f"{r['speedup_raw_cold_over_warm']:.1f}x", f"{r['warm_over_floor']:.2f}x",
                    f"{r['miss_overhead']['ratio']:.2f}x")
    out.print(per)
    out.print(f"results: {results['results_path']}")
    for p in results.get("plots", []):
        out.print(f"plot: {p}")
    if results.get("docs_path"):
        out.print(f"docs: {results['docs_path']}")


def _range(value: str) -> tuple[int, int]:
    from prefixshare.plan import parse_prompt_lengths

    parts = [p for p in value.replace("-", ",").split(",") if p]
    lengths = list(parse_prompt_lengths(",".join(parts)))
    if len(lengths) == 1:
        lengths *= 2
    if len(lengths) != 2:
        raise typer.BadParameter(f"{value!r}: give MIN-MAX, e.g. 1500-2500 or 2k-4k")
    return lengths[0], lengths[1]


def register_load(app: typer.Typer) -> None:
    @app.command("bench-load")
    @handles_errors
    def bench_load_cmd(
        urls: list[str] = typer.Option(..., "--url", help="A replica's base URL (repeat for each replica), e.g. "
                                       "http://10.0.0.5:8000."),
        documents: int = typer.Option(16, "--documents", min=1, help="Distinct documents."),
        doc_tokens: str = typer.Option("1500-2500", "--doc-tokens", help="Document length range, tokens (MIN-MAX)."),
        questions: int = typer.Option(8, "--questions-per-doc", min=1, max=8, help="Distinct questions per document."),
        zipf: float = typer.Option(0.8, "--zipf", min=0.0, help="Zipf exponent of document popularity (0: uniform)."),
        rates: str = typer.Option("1", "--rate", help="Requests per second, open loop (Poisson); several, comma-"
                                  "separated, run one after another (e.g. 0.5,1,2 up to saturation)."),
        duration: float = typer.Option(60.0, "--duration", min=1.0, help="Seconds of arrivals per rate."),
        seed: int = typer.Option(0, "--seed", help="Seed of the documents and the request stream."),
        routing: str = typer.Option("random", "--routing", help="random | affinity (a document always to one "
                                    "replica) | round_robin; use one URL (a router's) to let your router decide."),
        unique: bool = typer.Option(False, "--zero-reuse", help="The control: every request a new document."),
        tenants: str = typer.Option("acme,globex", "--tenants", help="Tenants, comma-separated (cache salts)."),
        max_tokens: int = typer.Option(16, "--max-tokens", min=1, help="Tokens generated per request."),
        slo: float = typer.Option(2.0, "--ttft-slo", min=0.0, help="Goodput's TTFT bound, seconds."),
        prefixshare_params: bool = typer.Option(True, "--prefixshare-params/--no-prefixshare-params",
                                                help="Send the tenant and document id in kv_transfer_params (off "
                                                "for replicas without prefixshare)."),
        out_file: Path | None = typer.Option(None, "--out", help="Write the full result (every answer) here."),
        json: bool = JSON_OPTION,
    ) -> None:
        """Load a fleet with the shared-document workload: open-loop arrivals, Zipf documents, several questions
        each, spread over the replicas; report throughput, goodput at a TTFT SLO, TTFT/ITL percentiles, hits."""
        import json as _json
        import sys
        import time
        import uuid

        from prefixshare.bench import Workload, run_load

        runs = []
        run_id = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + uuid.uuid4().hex[:6]
        for rate in [float(r) for r in rates.split(",") if r.strip()]:
            workload = Workload(documents=documents, doc_tokens=_range(doc_tokens), questions=questions, zipf=zipf,
                                rate=rate, duration_s=duration, seed=seed, routing=routing, unique=unique,
                                tenants=tuple(t for t in tenants.split(",") if t), max_tokens=max_tokens,
                                ttft_slo_s=slo, prefixshare_params=prefixshare_params)
            if not json:
                out.print(f"rate {rate:g}/s for {duration:g} s, {routing} routing over {len(urls)} replica(s) ...")
            runs.append(run_load(list(urls), workload))
        result = {"run_id": run_id, "command": " ".join(["prefixshare", *sys.argv[1:]]), "runs": runs}
        if out_file is not None:
            out_file.write_text(_json.dumps(result, indent=1) + "\n")
        if json:
            emit_json({**result, "runs": [{k: v for k, v in r.items() if k != "answers"} for r in runs]})
            return
        table = Table(title=f"bench-load {run_id}: {documents} documents of {doc_tokens} tokens, zipf {zipf:g}, "
                            f"{routing} routing" + (", zero reuse" if unique else ""))
        for col in ("rate/s", "done", "errors", "req/s", f"goodput (TTFT<={slo:g}s)", "TTFT p50 ms", "TTFT p99 ms",
                    "ITL p50 ms", "cached", "hits"):
            table.add_column(col, justify="right")
        for r in runs:
            s = r["summary"]
            table.add_row(f"{r['workload']['rate']:g}", str(s["completed"]), str(s["errors"]),
                          f"{s['request_throughput']:.2f}", f"{s['goodput']:.2f}", str(s["p50_ttft_ms"]),
                          str(s["p99_ttft_ms"]), str(s["p50_itl_ms"]), f"{(s['cached_fraction'] or 0):.0%}",
                          f"{(s['hit_rate'] or 0):.0%}")
        out.print(table)
        if any(r["summary"]["errors"] for r in runs):
            raise typer.Exit(EXIT_RUNTIME)
