"""Render docs/reliability.md from the fault suite's results (tests/faults/_matrix.py rows).

    .venv/bin/python tests/faults/render.py [results.jsonl] > docs/reliability.md
    .venv/bin/python tests/faults/render.py [results.jsonl] --write     # writes docs/reliability.md itself

Every figure on the page comes from a row a passing test recorded; when a results file holds several runs, the
newest row of each (area, fault) is shown.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from faults._matrix import AREAS, ROOT, Row, load, results_path  # noqa: E402

COMMAND = ("rm -f build/faults/results.jsonl && .venv/bin/python -m pytest tests/faults tests/e2e/test_tiers.py -q && "
           ".venv/bin/python tests/faults/render.py > docs/reliability.md")

INTRO = """# Reliability

What happens to serving when the shared KV store breaks, is shared by tenants, is raced, fills up or is fed
bad input. Every row below was recorded by a test of `tests/faults/` (and, for the network tiers, of
`tests/e2e/test_tiers.py`) after its assertions passed: real vLLM engines (CPU, a tiny random-weight Llama),
real LMCache multiprocess servers, real stores (directories, Redis, a Mooncake master); no mocks. Faults are
injected from outside the product: servers are SIGKILLed, SIGSTOPped and restarted, the store directory is
moved away or replaced by a file, a private tmpfs fills up, chunk files are truncated, bit-flipped or swapped
for another model's, hostile files are planted in the store.

The rules every engine row is held to:

* **every request completes**, and its answer is **identical to a cold engine's** (greedy token ids equal,
  logprobs within 1e-4; a cold vLLM engine without prefixshare, or HF transformers where the prompt comes
  from `prefixshare.warm`);
* the **added latency** of a request served while the store is broken (its time minus the fastest cold
  request of the same length) stays within the policy's load timeout (`load.timeout_s`, 2 s in these tests)
  plus 1 s of allowed machine noise (the tests run on 2 shared CPU cores);
* when the store comes back, the **same engine process** loads from it again (no restart).

Before each timed request the engine's own prefix cache is cleared, so a hit can only come from the store.

Reproduce (about 15 minutes on 2 CPU cores):

```
{command}
```

Columns: *requests* served during (or right after) the fault; *hits*: of those, requests that loaded KV from
the store; *fallbacks*: requests the connector counted as recomputed because of the fault (`store_down`,
`lookup_timeout`, ...; a plain miss is not a fallback); *identical*: every answer equal to the cold one;
*added latency*: worst request minus cold, against the budget; *corrupt*: damaged objects detected.
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
  0 cross-tenant hits, warmed documents included);
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
  the first request after it hangs waits for its lookup: up to `load.timeout_s` (LMCache's 1 s heartbeat
  often gives up first), plus machine noise in the figure above. Later requests skip the store until its
  health check answers. A killed
  server costs nothing measurable: its port refuses, and the connector checks it (one TCP connect, ~0.1 ms
  on the same host) before every lookup and before every store or load the worker submits.
* **Before the fix, a dead server cost two RPC timeouts per stored request.** LMCache's worker submits a store
  as two synchronous RPCs (`prepare_store`, `commit_store`) inside the engine step, each waiting
  `mq_timeout` (the load timeout) when the server is gone: 5.8 s against a 2 s budget in
  `test_store_down_means_recompute_within_the_timeout`. The connector now clears LMCache's health flag when
  the port refuses, so LMCache drops the transfers at once and its heartbeat re-registers the KV caches when
  the server returns. A server that dies *between* the check and the RPC (a window of microseconds) still
  costs up to two timeouts for that one step.
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
* **An L1 smaller than one stored request drops that store.** LMCache allocates a request's chunks in one
  batch and evicts only above 80 % use, once a second: with `l1.size_gb` 0.004 (16 chunk buffers) and
  10-chunk documents, every document after the first was refused ("Failed to batched allocate ... short by
  4 blocks" in the server log) and never reached L2, although nothing failed for the engine. Size L1 for
  several of the largest prefixes (`prefixshare plan` does).
* **Store writes that fail are silent to the engine.** When the fs tier is gone or full, LMCache logs the
  failed writes in the server log; the engine only sees misses later. `prefixshare doctor` and
  `prefixshare inspect` show what the store actually holds.
* **Timing bounds are measured on a loaded 2-core machine.** Added latencies are compared with the fastest
  cold request of the same length and allowed 1 s of noise; they are bounds, not benchmarks.
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
    return f"{row.max_added_latency_s:+.2f} s{budget}"


def newest(rows: list[Row]) -> list[Row]:
    seen: dict[tuple[str, str], Row] = {}
    for row in rows:
        seen.pop((row.area, row.fault), None)
        seen[(row.area, row.fault)] = row
    return list(seen.values())


def render(rows: list[Row]) -> str:
    rows = newest(rows)
    out = [INTRO.format(command=COMMAND)]
    for area in AREAS:
        these = [r for r in rows if r.area == area]
        out.append(f"## {area[0].upper()}{area[1:]}\n")
        if not these:
            out.append("_No results recorded for this area in this run._\n")
            continue
        out.append("| fault | behaviour | engine / tier | requests | hits | fallbacks | identical to cold | "
                   "max added latency / budget | corrupt detected |")
        out.append("|---|---|---|---|---|---|---|---|---|")
        for r in these:
            out.append(f"| {_cell(r.fault)} | {_cell(r.behaviour)} | {r.engine} / {r.tier} | {r.requests} | {r.hits} | "
                       f"{r.fallbacks} | {_cell(r.identical_to_cold)} | {_latency(r)} | {r.corrupt_detected} |")
        notes = [r for r in these if r.extra]
        if notes:
            out.append("\n<details><summary>details recorded with these rows</summary>\n")
            for r in notes:
                extra = ", ".join(f"{k}={str(v).replace('|', '/')}" for k, v in r.extra.items())
                out.append(f"* *{_cell(r.fault)}*: {extra}")
            out.append("\n</details>\n")
        out.append("")
    side = next((r for r in rows if r.area == "isolation and exposure" and "timing side channel" in r.behaviour), None)
    if side is not None:
        leak = (f"{side.extra.get('unsalted_cached_tokens')} of 640 tokens served from the other tenant's blocks, "
                f"{side.extra.get('unsalted_s')} s")
        salted = f"{side.extra.get('salted_cached_tokens')} cached tokens, {side.extra.get('salted_s')} s"
    else:
        leak, salted = "not measured in this run", "not measured in this run"
    out.append(SIDE_CHANNEL.format(leak=leak, salted=salted))
    out.append(LIMITS)
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str]) -> int:
    args = [a for a in argv if not a.startswith("--")]
    path = Path(args[0]) if args else results_path()
    rows = load(path)
    if not rows:
        print(f"no fault results in {path}: run the suite first ({COMMAND})", file=sys.stderr)
        return 1
    text = render(rows)
    if "--write" in argv:
        target = ROOT / "docs" / "reliability.md"
        target.write_text(text, encoding="utf-8")
        print(f"wrote {target} from {len(rows)} rows of {path}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
