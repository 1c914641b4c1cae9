"""Render docs/reliability.md from ONE run of the fault suite (tests/faults/_matrix.py rows).

    .venv/bin/python tests/faults/render.py [results.jsonl] [--run ID]            # the page, to stdout
    .venv/bin/python tests/faults/render.py [results.jsonl] [--run ID] --write    # docs/reliability.md + .jsonl

A results file may hold rows of several runs (``run_id``: one per pytest session). One run is selected (the
newest by default, or ``--run ID``) and only its rows are rendered; rows of other runs are ignored. Within the
selected run an (area, fault) recorded twice is an error. ``--write`` writes the page and copies the run's raw
rows beside it (``docs/reliability.jsonl``), so every figure on the page can be traced to what a test
recorded. Rows over their latency budget are marked, never hidden.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from faults._matrix import AREAS, ROOT, SLACK_S, Row, load_raw, results_path  # noqa: E402

COMMAND = (".venv/bin/python -m pytest tests/faults tests/e2e/test_tiers.py tests/load -q && "
           ".venv/bin/python tests/faults/render.py --write")
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang"}
OVER = "**over budget**"


class RenderError(Exception):
    """The results cannot make one page: no run, an unknown run, or a fault recorded twice in one run."""


INTRO = """# Reliability

What happens to serving when the shared KV store breaks, is shared by tenants, is raced, fills up or is fed
bad input.

> **Run `{run}`** on commit `{commit}`, rows recorded {first} to {last} (UTC, {minutes} min):
> {rows} rows, {engine_rows} with a real inference engine, {over} over budget. The raw rows are
> [`reliability.jsonl`](reliability.jsonl).

Every row below was recorded in that one run, by a test of `tests/faults/` (for the network tiers, of
`tests/e2e/test_tiers.py`; for the fleet, of `tests/load/`) after its assertions passed; every figure is what the test observed: the
connector's own counters, answers compared with a cold engine's, wall times. {engine_rows} of the {rows} rows
ran a real inference engine ({engines}) against real LMCache multiprocess servers and real stores
(directories{tiers}); the other {no_engine} exercise the store tools, the policy loader and the CLI without an
engine (column *real engine*). No mocks. Faults are injected from outside the product: servers are
SIGKILLed, SIGSTOPped and restarted, the store directory is moved away or replaced by a file, a private tmpfs
fills up, chunk files are truncated, bit-flipped or swapped for another model's, hostile files are planted in
the store; each test also checks that its fault really happened (the observation is in the row's details).

The rules every engine row is held to:

* **every request completes**, and its answer is **identical to a cold engine's** (greedy token ids equal,
  logprobs within 1e-4; a cold vLLM engine without prefixshare, given the same token ids);
* the **added latency** of a request served while the store is broken (its time minus the fastest cold
  request of the same length) is held to a budget, the policy's load timeout (`load.timeout_s`, {budgets}
  in these tests). A row whose worst added latency exceeds its budget is marked {over_mark} ({over} in this
  run). That is against the budget itself: the tests tolerate {slack:g} s of machine noise on top (they run on
  2 shared CPU cores), so a marked row passed its test without staying within the budget;
* when the store comes back, the **same engine process** loads from it again (no restart).

Before each timed request the engine's own prefix cache is cleared, so a hit can only come from the store.

Reproduce:

```
{command}
```

Columns: *real engine*: whether the row ran an inference engine (no: store tools, policy loading, CLI; its
counters are "–"); *requests* the connector counted during (or right after) the fault; *hits*: of those,
requests whose lookup found KV in the store; *fallbacks*: requests the connector counted as recomputed
(`store_down`, `lookup_timeout`, `load_failed`, ...; a plain miss is not a fallback); *tokens loaded* from the
store; *identical*: every answer equal to the cold one; *added latency*: worst request minus cold, against
the budget; *corrupt*: damaged objects detected.
"""

SIDE_CHANNEL = """## The prefix-cache timing side channel

A prefix cache is shared state: a request whose prefix is cached answers faster (lower time to first token)
than one that must prefill. Whoever can send a prompt and time the answer can therefore test whether
*someone else* recently sent the same prefix: a document, a system prompt, a guessed record. On a shared
store the same holds across every replica behind it.

What closes it in prefixshare:

* **per request, `kv_transfer_params["prefixshare.tenant"]`** (and `prefixshare.warm(..., tenant=...)` /
  `prompt_for(..., tenant=...)`): the tenant becomes part of the cache salt of every key the request looks
  up or stores in the shared store, so tenants never read each other's KV and cannot time it (rows above:
  {cross}, warmed documents included);
* **per deployment, the policy's `tenant`**: part of the compatibility fingerprint, hence of the store
  namespace: deployments of different tenants share nothing, not even documents warmed without a tenant.

* **the engine's own prefix cache** (vLLM's, in GPU/CPU memory) is keyed by the prompt and by vLLM's own
  per-request `cache_salt` only, and the connector sees requests after vLLM has matched them against it. On
  one engine serving several tenants, tenant B's request reuses the blocks tenant A's identical prefix left
  behind (measured: {leak}). The tenant's salt as vLLM's `cache_salt` closes it ({salted}): prompts built
  by `prompt_for(..., tenant=...)` carry it (`engine_input()["cache_salt"]`), and prefixshare counts it once
  in the store key, so warmed documents still hit. Requests you build yourself (or send over HTTP) must set
  `cache_salt` to `t-<tenant>` (the prompt's `"cache_salt"` field, or `cache_salt` in the OpenAI request)
  next to `prefixshare.tenant`; the connector cannot add it after vLLM's own lookup.

Within one tenant, the channel stays open by design: that is the sharing.
"""

LIMITS = """## Known limits

Faults we could not make safe, or bounds we could only measure:

* **A hung server costs one load timeout.** A SIGSTOPped server accepts TCP connections (the kernel does), so
  the first request after it hangs waits for its lookup: up to `load.timeout_s`, plus machine noise in the
  figures above. Later requests skip the store until its health check answers. The connector's heartbeat
  gives a ping 5 s and calls the server unhealthy after two unanswered pings (LMCache's own calls it
  unhealthy after one ping later than its 1 s interval, and then drops every store in flight, which a
  loaded server caused): a hung server is found first by its lookups' and stores' RPC timeouts. A killed
  server costs nothing measurable: its port refuses, and the connector checks it (one TCP connect, ~0.1 ms
  on the same host) before every lookup and before every store or load the worker submits.
* **Before the fix, a dead server cost two RPC timeouts per stored request.** LMCache's worker submits a store
  as two synchronous RPCs (`prepare_store`, `commit_store`) inside the engine step, each waiting
  `mq_timeout` (the load timeout) when the server is gone: 5.8 s against a 2 s budget in
  `test_store_down_means_recompute_within_the_timeout`. The connector now clears LMCache's health flag when
  the port refuses, so LMCache drops the transfers at once and its heartbeat re-registers the KV caches when
  the server returns. A server that dies *between* the check and the RPC still costs up to one RPC timeout
  for that step; the step's transfers are then dropped (stores) or reported failed and recomputed (loads).
  Until the fleet load test restarted a server under 16 clients, that failed RPC was raised into vLLM's
  forward pass and stopped the engine.
* **Sharing a document with chosen tenants is not supported.** A document is either untenanted (read by
  untenanted requests only) or a tenant's. There is no per-document allow list; a tenant that needs a shared
  document warms its own copy (the store then holds it once per tenant).
* **LoRA adapters must be local paths to be told apart by their weights.** A LoRA request's keys are salted by
  the adapter's name and a digest of its files (hashed once per adapter and process); an adapter whose path
  the scheduler cannot read (a remote URI) falls back to its name alone, with a `lora.unhashed` warning. Name
  such adapters uniquely (e.g. with a version).
* **An L2 tier that is down when the server starts fails the start.** `LMCacheServer.start` (and
  `prefixshare server start`) probe every L2 tier and refuse to start over an unreachable one, naming it: a
  misconfigured address is loud. A tier that goes down later only costs misses. With a `launcher` (the server
  in another network or mount namespace) the probe is skipped: our view of the network is not the server's.
* **A store L1 has no room for is dropped.** LMCache allocates a request's chunks in one batch and fails the
  batch when L1 cannot hold it ("Failed to batched allocate ... short by N blocks" in the server log); the chunk
  never reaches L2, and nothing fails for the engine. LMCache alone evicts once a second, above 80 % use: with
  `l1.size_gb` 0.004 (16 chunk buffers) and 10-chunk documents, every document after the first was refused.
  prefixshare's server evicts before a reservation that would not fit (and whenever L1 takes a write), so what
  drops a store is L1 full of chunks nothing can evict: staged, being loaded, or waiting for their L2 write.
  Size L1 for several of the largest prefixes (`prefixshare plan` does), and for the stores that arrive while
  the L2 tier writes. `warm` paces its engine calls to the room the server reports (L1 less what it cannot
  evict, and KV not yet reserved) and prefills again what verification still finds missing: a corpus 3x a
  16 MiB L1 behind a store writing 8 MiB/s lost 29 of 48 documents unpaced and none paced
  (`test_a_corpus_larger_than_the_servers_memory_is_warmed_whole`).
  Serving replicas are not paced: once L1 is full, the server takes new KV only as fast as its L2 tier writes
  chunks (with LMCache's own once-a-second check, `l1.eviction_ratio` of L1 per second at most).
* **Store writes that fail are silent to the engine.** When the fs tier is gone or full, LMCache logs the
  failed writes in the server log; the engine only sees misses later. `prefixshare doctor` and
  `prefixshare inspect` show what the store actually holds.
* **Timing bounds are measured on a loaded 2-core machine.** Added latencies are compared with the fastest
  cold request of the same length and marked against the budget itself; the tests allow {slack:g} s of noise on
  top. They are bounds, not benchmarks.
"""


def _cell(value: object) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "**no**"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _latency(row: Row) -> str:
    if row.max_added_latency_s is None:
        return "–"
    budget = f" / {row.budget_s:g} s" if row.budget_s is not None else ""
    return f"{row.max_added_latency_s:+.2f} s{budget}" + (f" {OVER}" if row.over_budget else "")


def runs(raw: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Rows by run id, newest run last (by its latest row; rows without a run id are left out)."""
    by: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for i, row in enumerate(raw):
        if row.get("run_id"):
            by.setdefault(row["run_id"], []).append((i, row))
    order = sorted(by, key=lambda r: (max(str(x.get("recorded_at", "")) for _, x in by[r]), max(i for i, _ in by[r])))
    return {r: [x for _, x in by[r]] for r in order}


def select(raw: list[dict[str, Any]], run: str | None = None) -> tuple[str, list[dict[str, Any]]]:
    """One run's raw rows: ``run``, or the newest. Raises RenderError when there is none, or when the run
    recorded an (area, fault) twice."""
    by = runs(raw)
    if not by:
        raise RenderError("no row carries a run id (rows recorded before run ids existed): run the suite again")
    if run is None:
        run = list(by)[-1]
    elif run not in by:
        raise RenderError(f"no rows of run {run!r}; runs in the file: {', '.join(by)}")
    rows = by[run]
    twice = [key for key, n in Counter((r["area"], r["fault"]) for r in rows).items() if n > 1]
    if twice:
        raise RenderError(f"run {run} recorded {len(twice)} fault(s) more than once (a test ran twice into one "
                          "run?): " + "; ".join(f"{a}: {f}" for a, f in twice))
    return run, rows


def _span_minutes(first: str, last: str) -> str:
    from datetime import datetime

    try:
        t0, t1 = (datetime.strptime(t, "%Y-%m-%dT%H:%M:%SZ") for t in (first, last))
    except ValueError:
        return "?"
    return f"{(t1 - t0).total_seconds() / 60:.0f}"


FLEET = """## The fleet under load, and the soak (`make bench`, `make bench-soak`)

These come from their own runs (named in each table), not from the fault suite's run above: the full fleet
run compares prefixshare's replicas with the same replicas without it, and the soak runs for 30 minutes. The
fault suite's own fleet row (16 clients for 45 s, with a server restart and an unreadable store) is in
*Under load* above. Workload: 30 generated documents with Zipf popularity (exponent 1.1), two tenants, chat
prompts with the document in the system message, 6 greedy tokens streamed; two `vllm serve` replicas (tiny
model, one CPU core each), each with its node's LMCache MP server, one shared fs store. Every answer is
compared with a cold reference (a replica without prefixshare answering each distinct prompt alone).
"""


def fleet_section(bench: Path) -> str:
    """The full fleet run and the soak, from ``docs/benchmarks/load.json`` and ``soak.json`` when present."""
    load = _read(bench / "load.json")
    soak = _read(bench / "soak.json")
    if load is None and soak is None:
        return ""
    out = [FLEET]
    if load is not None:
        out.append(f"**Fleet run `{load['run_id']}`** on commit `{load['commit']}` ({load['recorded_at']}; "
                   f"{load['concurrency']} clients, {load['duration_s']:g} s per workload):\n")
        out.append("| workload | replicas | requests | errors | wrong answers | hit rate | TTFT p50 / p99, hits | "
                   "TTFT p50 / p99, misses | throughput (req/s) |")
        out.append("|---|---|---|---|---|---|---|---|---|")
        for key, name in (("raw_unique", "0 % hits"), ("prefixshare_unique", "0 % hits"),
                          ("raw_zipf", "Zipf"), ("prefixshare_zipf", "Zipf, with faults")):
            r = load["runs"].get(key)
            if r is None:
                continue
            out.append(f"| {name} | {'prefixshare' if r['prefixshare'] else 'without prefixshare'} | {r['requests']} | "
                       f"{r['errors']} | {r['wrong_answers'] if r['compared_with_cold'] else '–'} | "
                       f"{_cell(r['hit_rate'])} | {_pair(r, 'hit')} | {_pair(r, 'miss')} | {r['throughput_rps']} |")
        out.append("\n| goal | value | |\n|---|---|---|")
        for key, goal in load["goals"].items():
            out.append(f"| {key} {goal['goal']} | {_cell(goal['value'])} | {'pass' if goal['pass'] else '**MISS**'} |")
        out.append("")
    if soak is not None:
        out.append(f"**Soak `{soak['run_id']}`** on commit `{soak['commit']}` ({soak['recorded_at']}): "
                   f"{soak['duration_s'] / 60:.0f} min at {soak['rate_rps']:g} requests/s, resources sampled every "
                   f"{soak['sample_every_s']:g} s, growth measured after {soak['warmup_s'] / 60:.0f} min; "
                   f"{soak['summary']['requests']} requests, {soak['summary']['errors']} errors, "
                   f"{soak['summary']['wrong_answers']} wrong answers.\n")
        out.append("![soak](benchmarks/soak.png)\n")
        out.append("| resource | first | last | growth | slope (% per 25 min) | rising steps |")
        out.append("|---|---|---|---|---|---|")
        for key, g in sorted(soak["growth"].items()):
            if "growth_pct" in g:
                out.append(f"| {key} | {g['first']:.0f} | {g['last']:.0f} | {g['growth_pct']:+.2f} % | "
                           f"{g['slope_pct_per_25min']:+.2f} | {g['rising_steps']}/{g['steps']} |")
        out.append("\n| goal | value | |\n|---|---|---|")
        for key, goal in soak["goals"].items():
            out.append(f"| {key} {goal['goal']} | {_cell(goal['value'])} | {'pass' if goal['pass'] else '**MISS**'} |")
        out.append("")
    return "\n".join(out)


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _pair(r: dict[str, Any], kind: str) -> str:
    p50, p99 = r.get(f"ttft_{kind}_p50_s"), r.get(f"ttft_{kind}_p99_s")
    return "–" if p50 is None else f"{p50:.3f} / {p99:.3f} s"


def render(rows: list[Row], extra: str = "") -> str:
    """The page of one run's rows (RenderError when they come from several runs), then ``extra`` sections."""
    ids = sorted({r.run_id for r in rows})
    if len(ids) != 1 or not ids[0]:
        raise RenderError(f"the rows come from {len(ids)} runs ({', '.join(map(repr, ids))}): render one run")
    commits = sorted({r.commit for r in rows})
    times = sorted(r.recorded_at for r in rows)
    engine_rows = [r for r in rows if r.real_engine]
    kinds = Counter(r.engine for r in engine_rows)
    tiers = sorted({r.tier for r in engine_rows if r.tier != "fs"})
    budgets = sorted({r.budget_s for r in rows if r.budget_s is not None})
    over = [r for r in rows if r.over_budget]
    out = [INTRO.format(
        run=ids[0], commit="`, `".join(commits), first=times[0], last=times[-1],
        minutes=_span_minutes(times[0], times[-1]), rows=len(rows), engine_rows=len(engine_rows),
        no_engine=len(rows) - len(engine_rows), over=len(over), over_mark=OVER, slack=SLACK_S, command=COMMAND,
        engines=", ".join(f"{ENGINE_NAMES.get(k, k)}: {n} rows" for k, n in sorted(kinds.items())) or "none",
        tiers="".join(f", {t}" for t in tiers),
        budgets=", ".join(f"{b:g} s" for b in budgets) or "none recorded")]
    for area in AREAS:
        these = [r for r in rows if r.area == area]
        out.append(f"## {area[0].upper()}{area[1:]}\n")
        if not these:
            out.append("_No results recorded for this area in this run._\n")
            continue
        out.append("| fault | behaviour | real engine | engine / tier | requests | hits | fallbacks | tokens loaded | "
                   "identical to cold | max added latency / budget | corrupt detected |")
        out.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in these:
            out.append(f"| {_cell(r.fault)} | {_cell(r.behaviour)} | {'yes' if r.real_engine else 'no'} | "
                       f"{r.engine} / {r.tier} | {_cell(r.requests)} | {_cell(r.hits)} | {_cell(r.fallbacks)} | "
                       f"{_cell(r.tokens_loaded)} | {_cell(r.identical_to_cold)} | {_latency(r)} | "
                       f"{r.corrupt_detected} |")
        notes = [r for r in these if r.extra]
        if notes:
            out.append("\n<details><summary>details recorded with these rows</summary>\n")
            for r in notes:
                details = ", ".join(f"{k}={str(v).replace('|', '/')}" for k, v in r.extra.items())
                out.append(f"* *{_cell(r.fault)}*: {details}")
            out.append("\n</details>\n")
        out.append("")
    iso = [r for r in rows if r.area == "isolation and exposure"]
    side = next((r for r in iso if "timing side channel" in r.behaviour), None)
    if side is not None:
        leak = (f"{side.extra.get('unsalted_cached_tokens')} of {side.extra.get('prompt_tokens', '?')} tokens served "
                f"from the other tenant's blocks, {side.extra.get('unsalted_s')} s")
        salted = f"{side.extra.get('salted_cached_tokens')} cached tokens, {side.extra.get('salted_s')} s"
    else:
        leak, salted = "not measured in this run", "not measured in this run"
    tenants = next((r for r in iso if "cross_tenant_hits" in r.extra), None)
    cross = (f"{tenants.extra['cross_tenant_hits']} cross-tenant hits in {tenants.extra.get('cross_tenant_requests')} "
             "cross-tenant requests" if tenants is not None else "cross-tenant hits not measured in this run")
    out.append(SIDE_CHANNEL.format(leak=leak, salted=salted, cross=cross))
    if extra:
        out.append(extra)
    out.append(LIMITS.format(slack=SLACK_S))
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="render.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="?", type=Path, default=None, help="results file (default: %(default)s)")
    parser.add_argument("--run", default=None, help="the run id to render (default: the newest in the file)")
    parser.add_argument("--write", action="store_true",
                        help="write <docs>/reliability.md and copy the run's raw rows to <docs>/reliability.jsonl")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs", help="where --write writes (default: docs/)")
    args = parser.parse_args(argv)
    path = args.results or results_path()
    raw = load_raw(path)
    if not raw:
        print(f"no fault results in {path}: run the suite first ({COMMAND})", file=sys.stderr)
        return 1
    try:
        run, chosen = select(raw, args.run)
        text = render([Row.from_dict(r) for r in chosen], fleet_section(args.docs / "benchmarks"))
    except RenderError as exc:
        print(f"render.py: {exc}", file=sys.stderr)
        return 2
    ignored = len(raw) - len(chosen)
    missing = [a for a in AREAS if not any(r["area"] == a for r in chosen)]
    note = f"run {run}: {len(chosen)} rows of {path}" + (f" ({ignored} rows of other runs ignored)" if ignored else "")
    if missing:
        note += f"; no rows for: {', '.join(missing)} (a partial run?)"
    if args.write:
        args.docs.mkdir(parents=True, exist_ok=True)
        (args.docs / "reliability.md").write_text(text, encoding="utf-8")
        (args.docs / "reliability.jsonl").write_text(
            "".join(json.dumps(r, sort_keys=True) + "\n" for r in chosen), encoding="utf-8")
        print(f"wrote {args.docs / 'reliability.md'} and reliability.jsonl from {note}", file=sys.stderr)
    else:
        sys.stdout.write(text)
        print(note, file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
