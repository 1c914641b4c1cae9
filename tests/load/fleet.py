"""A fleet under load: two ``vllm serve`` replicas ("nodes" A and B, each with its own LMCache MP server) on one
shared fs store, driven by many concurrent chat clients.

The workload: ~30 generated documents with Zipf popularity, two tenants, a few questions per document, each
request a chat prompt (the document in the system message) sent to a replica chosen at random, streamed (TTFT
is the first token's arrival), greedy, with the first tokens' logprobs. Every answer is compared with a cold
reference: a replica without prefixshare answering each distinct prompt alone, before the load.

Faults in the middle of a run (time-driven, so that they land while clients are busy): node A's MP server is
stopped and started again; later the store directory is replaced by a file for 10 s (root ignores ``chmod
000``: a plain file at the tier's path is what makes it unreadable). Sampled verification is on: after the
run each replica's set-aside hits are replayed through ``prefixshare verify --url`` (false alarms: mismatches
on hits that were right).

Used three ways:

* ``tests/load/test_fleet.py``: the CI subset (one short run with both faults; correctness asserted, timings
  reported, not asserted);
* ``python tests/load/fleet.py --full``: the same against the same replicas without prefixshare, for a
  Zipf workload and a 0 %-hit one (every request a new document): throughput ratios, p50/p99 TTFT of hits and
  misses (``docs/benchmarks/load.json``);
* ``python tests/load/fleet.py --soak 1800``: the Zipf workload at a steady rate, sampling every process's RSS
  and open file descriptors, ``/dev/shm`` and the store's bytes each minute (``docs/benchmarks/soak.json``
  and ``soak.png``).

Everything runs on loopback; every loop is bounded in count and time; every process is stopped on the way out.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/: e2e.common, faults._matrix

from e2e.common import CHUNK, free_port, http_server, pasted_command, policy_for, write_policy_file  # noqa: E402

SYSTEM = "Answer from the manual.\n\n"
QUESTIONS = ["What is this manual about?", "Who is named first?", "What happens at the end?"]
TENANTS = ("acme", "globex")
MAX_TOKENS = 6
#: logprobs of the same greedy tokens computed in different batches (fp32 on the CPU)
LOGPROB_TOL = 1e-3
SERVE_FLAGS = ["--dtype", "float32", "--enforce-eager", "--block-size", "32", "--max-model-len", "2048",
               "--enable-prompt-tokens-details", "--max-num-seqs", "16", "--seed", "0"]
SERVE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "PREFIXSHARE_LOG_JSON": "1",
             "PREFIXSHARE_LOG_LEVEL": "INFO"}
#: each replica's compute threads on a core of its own (a node each); servers and clients float
CORES = {"a": "0", "b": "1"}


# --- the workload --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    index: int
    doc: str
    tenant: str
    question: int
    replica: str


def documents(n: int, first_seed: int = 300) -> dict[str, str]:
    """``n`` generated documents of 250 to 700 words (about 330 to 930 tokens), each of its own seed."""
    from prefixshare.model import document_text

    rng = random.Random(first_seed)
    return {f"doc{i:02d}": document_text(rng.randint(250, 700), seed=first_seed + i) for i in range(n)}


class Zipf:
    """Requests over ``docs`` with Zipf popularity (exponent ``s``), tenants and questions uniform, replica at
    random: the same seed gives the same stream."""

    def __init__(self, docs: list[str], *, s: float = 1.1, seed: int = 0, replicas: tuple[str, ...] = ("a", "b")):
        self.docs, self.replicas = docs, replicas
        self.weights = [1.0 / (rank + 1) ** s for rank in range(len(docs))]
        self.rng = random.Random(seed)

    def next(self, index: int) -> Request:
        rng = self.rng
        doc = rng.choices(self.docs, self.weights)[0]
        return Request(index, doc, rng.choice(TENANTS), rng.randrange(len(QUESTIONS)), rng.choice(self.replicas))


class Unique:
    """Every request a document of its own (0 % hits): documents are generated as they are needed."""

    def __init__(self, *, seed: int = 0, replicas: tuple[str, ...] = ("a", "b")) -> None:
        self.rng, self.replicas, self.texts = random.Random(seed), replicas, {}
        self.seed = seed

    def next(self, index: int) -> Request:
        from prefixshare.model import document_text

        doc = f"u{self.seed}-{index:05d}"
        self.texts[doc] = document_text(self.rng.randint(250, 700), seed=100_000 + self.seed * 10_000 + index)
        return Request(index, doc, self.rng.choice(TENANTS), self.rng.randrange(len(QUESTIONS)),
                       self.rng.choice(self.replicas))


def messages(text: str, question: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM + text}, {"role": "user", "content": QUESTIONS[question]}]


def extra_body(req: Request, prefixshare: bool) -> dict[str, Any]:
    """What a user's gateway adds: the tenant (as the engine's cache salt too) and the document id."""
    body: dict[str, Any] = {"cache_salt": f"t-{req.tenant}"}
    if prefixshare:
        body["kv_transfer_params"] = {"prefixshare.tenant": req.tenant, "prefixshare.document_id": req.doc}
    return body


# --- one request ------------------------------------------------------------------------------------------------


@dataclass
class Answer:
    index: int
    replica: str
    doc: str
    tenant: str
    question: int
    started: float = 0.0  #: seconds since the run began
    ttft_s: float | None = None
    latency_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def hit(self) -> bool:
        """At least one chunk of the prompt came from a cache (the replica's own prefix cache or the store)."""
        return self.error is None and self.cached_tokens >= CHUNK


async def ask(client: Any, model: str, req: Request, text: str, *, prefixshare: bool, t0: float) -> Answer:
    ans = Answer(req.index, req.replica, req.doc, req.tenant, req.question, started=time.monotonic() - t0)
    begin = time.monotonic()
    try:
        stream = await client.chat.completions.create(
            model=model, messages=messages(text, req.question), max_tokens=MAX_TOKENS, temperature=0,
            logprobs=True, stream=True, stream_options={"include_usage": True},
            extra_body=extra_body(req, prefixshare))
        async for chunk in stream:
            if chunk.choices:
                choice = chunk.choices[0]
                content = choice.logprobs.content if choice.logprobs else None
                if content:
                    if ans.ttft_s is None:
                        ans.ttft_s = time.monotonic() - begin
                    ans.logprobs += [t.logprob for t in content]
                ans.text += choice.delta.content or ""
            if chunk.usage is not None:
                ans.prompt_tokens = chunk.usage.prompt_tokens
                details = chunk.usage.prompt_tokens_details
                ans.cached_tokens = int(details.cached_tokens or 0) if details is not None else 0
    except Exception as exc:  # noqa: BLE001 - every failure is a result: counted as an error
        cause = exc.__cause__ or exc.__context__
        ans.error = f"{type(exc).__name__}: {exc}" + (f" ({type(cause).__name__}: {cause})" if cause else "")
        ans.error = ans.error[:400]
    ans.latency_s = time.monotonic() - begin
    return ans


def same(a: Answer, ref: Answer) -> bool:
    return (a.text == ref.text and len(a.logprobs) == len(ref.logprobs) == MAX_TOKENS
            and all(abs(x - y) <= LOGPROB_TOL for x, y in zip(a.logprobs, ref.logprobs, strict=True)))


# --- replicas and nodes ----------------------------------------------------------------------------------------


def raw_command(model: Path) -> list[str]:
    """``vllm serve`` without prefixshare: the same engine, the baseline."""
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]


@dataclass
class Node:
    name: str
    url: str
    instance: str | None = None
    server: Any = None  #: its LMCacheServer (None: a replica without prefixshare)
    policy_file: Path | None = None


class Fleet(contextlib.ExitStack):
    """Nodes A and B: with ``prefixshare``, each an MP server and a replica started from ``prefixshare
    vllm-args``' printed command (one shared fs store); without, plain ``vllm serve`` replicas."""

    def __init__(self, work: Path, model: Path, *, prefixshare: bool, tag: str, verify_sample: float = 0.0,
                 names: tuple[str, ...] = ("a", "b"), budget: str | None = None,
                 flags: list[str] | None = None, server: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.work, self.model, self.prefixshare, self.tag, self.names = work, model, prefixshare, tag, names
        self.flags = SERVE_FLAGS if flags is None else flags
        self.server_settings = server or {}  #: policy.server fields to change (e.g. max_workers)
        self.verify_sample, self.budget = verify_sample, budget
        self.store = work / "store"
        self.nodes: dict[str, Node] = {}

    def __enter__(self) -> Fleet:
        super().__enter__()
        from prefixshare.server import LMCacheServer

        try:
            for name in self.names:
                port = free_port()
                env = {**SERVE_ENV, "VLLM_CPU_OMP_THREADS_BIND": CORES.get(name, "auto"),
                       "PREFIXSHARE_FLEET": f"{self.tag}-{name}"}
                if self.prefixshare:
                    extra: dict[str, Any] = {} if self.budget is None else {
                        "admission": {"all": [{"min_tokens": 256}, {"byte_budget": {"max": self.budget}}]}}
                    policy = policy_for(self.store, verify={"sample": self.verify_sample, "max_per_minute": 600},
                                        **extra)
                    if self.server_settings:
                        policy = policy.model_copy(
                            update={"server": policy.server.model_copy(update=self.server_settings)})
                    server = self.enter_context(LMCacheServer(policy))
                    pfile = write_policy_file(self.work / f"policy-{name}.yaml", server.policy)
                    instance = f"{self.tag}-{name}"
                    argv, printed = pasted_command("vllm", pfile, self.model, instance)
                    env.update(printed)
                else:
                    server, pfile, instance, argv = None, None, None, raw_command(self.model)
                argv += ["--host", "127.0.0.1", "--port", str(port), *self.flags]
                url = self.enter_context(http_server(argv, env, self.work / f"{self.tag}-{name}.log", port))
                self.nodes[name] = Node(name, url, instance, server, pfile)
        except BaseException:
            self.close()
            raise
        return self

    def processes(self) -> dict[str, int]:
        """Every process of the fleet by label: each MP server and each replica (API server and engine core),
        with their children."""
        found: dict[str, int] = {}
        roots = {f"server-{n.name}": n.server.pid for n in self.nodes.values() if n.server is not None}
        table = _process_table()
        for label, pid in roots.items():
            for i, p in enumerate(_tree(table, pid) if pid else []):
                found[f"{label}" + (f"-{i}" if i else "")] = p
        for pid, (_, environ, _) in table.items():
            for name in self.names:
                if f"PREFIXSHARE_FLEET={self.tag}-{name}".encode() in environ.split(b"\0"):
                    found[f"replica-{name}-{pid}"] = pid
        return found


def _process_table() -> dict[int, tuple[int, bytes, bytes]]:
    """pid -> (parent pid, environment, command line) of every process we can read."""
    table: dict[int, tuple[int, bytes, bytes]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            table[int(entry.name)] = (ppid, (entry / "environ").read_bytes(), (entry / "cmdline").read_bytes())
        except (OSError, ValueError, IndexError):
            continue
    return table


def _tree(table: dict[int, tuple[int, bytes, bytes]], root: int) -> list[int]:
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in table:
            out.append(pid)
            todo += [p for p, (ppid, _, _) in table.items() if ppid == pid]
    return out


# --- faults ----------------------------------------------------------------------------------------------------


class Faults:
    """Faults injected while the clients run, one after another, each noting what shows it happened.

    A fault starts at its time or when the one before it has ended, whichever is later: two faults that
    overlap are a different fault (a server restarted while its store is unreadable does not start at all:
    LMCache creates the store directory at start), and under load a restart can take most of a minute (the
    new server's imports compete with two engines for the cores)."""

    def __init__(self, fleet: Fleet, t0: float) -> None:
        self.fleet, self.t0 = fleet, t0
        self.log: list[dict[str, Any]] = []
        self._plan: list[tuple[float, str, Callable[[], dict[str, Any]]]] = []
        self._thread: threading.Thread | None = None

    def at(self, seconds: float, name: str, action: Callable[[], dict[str, Any]]) -> None:
        assert self._thread is None, "schedule every fault before the first one starts"
        self._plan.append((seconds, name, action))

    def start(self) -> None:
        def run() -> None:
            for seconds, name, action in sorted(self._plan, key=lambda p: p[0]):
                time.sleep(max(0.0, self.t0 + seconds - time.monotonic()))
                began = time.monotonic() - self.t0
                try:
                    observed = action()
                except Exception as exc:  # noqa: BLE001 - a fault that could not be injected is reported, not hidden
                    observed = {"error": f"{type(exc).__name__}: {exc}"}
                self.log.append({"fault": name, "planned_s": seconds, "from_s": round(began, 2),
                                 "to_s": round(time.monotonic() - self.t0, 2), **observed})

        self._thread = threading.Thread(target=run, name="faults", daemon=True)
        self._thread.start()

    def join(self, timeout_s: float = 180.0) -> None:
        if self._thread is None:
            return
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), f"the faults did not finish in {timeout_s} s"

    def restart_server(self, node: str) -> dict[str, Any]:
        """Stop node ``node``'s MP server and start it again on the same ports."""
        server = self.fleet.nodes[node].server
        old = server.pid
        began = time.monotonic()
        server.stop()
        stopped = not _alive(old)
        stop_s = time.monotonic() - began
        server.start(reuse=False)
        return {"node": node, "old_pid": old, "new_pid": server.pid, "old_pid_gone": stopped,
                "stop_s": round(stop_s, 2), "down_s": round(time.monotonic() - began, 2), "healthy": server.healthy()}

    def unreadable(self, seconds: float) -> dict[str, Any]:
        """The store directory replaced by a plain file for ``seconds`` (root ignores chmod 000)."""
        store = self.fleet.store
        away = store.with_name(store.name + ".away")
        logs = [n.server.log_path for n in self.fleet.nodes.values() if n.server is not None]
        offsets = [p.stat().st_size for p in logs]
        store.rename(away)
        store.write_text("not a directory\n")
        is_file = store.is_file()
        time.sleep(seconds)
        store.unlink()
        away.rename(store)
        time.sleep(1.0)  # what the servers logged about the window reaches their logs
        text = "".join(_since(p, o) for p, o in zip(logs, offsets, strict=True))
        return {"seconds": seconds, "path_was_file": is_file, "restored": store.is_dir(),
                "failed_l2_io_logged": text.count("store.write_failed") + text.count("store.read_failed"),
                "server_tracebacks": text.count("Traceback")}


def _alive(pid: int | None) -> bool:
    return pid is not None and Path(f"/proc/{pid}").exists()


def _since(path: Path, offset: int) -> str:
    with path.open("rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


# --- a run -----------------------------------------------------------------------------------------------------


@dataclass
class Run:
    tag: str
    prefixshare: bool
    duration_s: float
    concurrency: int
    answers: list[Answer]
    faults: list[dict[str, Any]] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)  #: each node's connector counters (prefixshare only)


def served_model(url: str) -> str:
    import httpx

    return str(httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"])


def drive(fleet: Fleet, source: Any, texts: dict[str, str] | Callable[[str], str], *, duration_s: float,
          concurrency: int, rate: float | None = None, max_requests: int = 100_000,
          schedule: Callable[[Faults], None] | None = None) -> Run:
    """``concurrency`` clients send the ``source``'s requests for ``duration_s`` (at most ``rate`` per second
    in all, when given); faults from ``schedule`` fire meanwhile."""
    model = served_model(next(iter(fleet.nodes.values())).url)
    t0 = time.monotonic()
    faults = Faults(fleet, t0)
    if schedule is not None:
        schedule(faults)
        faults.start()
    text_of = texts if callable(texts) else texts.__getitem__
    answers = asyncio.run(_clients(fleet, model, source, text_of, t0, duration_s, concurrency, rate, max_requests))
    faults.join()
    return Run(fleet.tag, fleet.prefixshare, duration_s, concurrency, answers, faults.log)


def seed(fleet: Fleet, texts: dict[str, str], docs_by_replica: dict[str, list[str]], timeout_s: float = 60.0) -> int:
    """Before a run: each replica answers its documents once per tenant (question 0, one request at a time), so
    their KV is in the shared store from the run's first second and the *other* replica can load them then,
    instead of only in the windows the faults leave. Returns the chunk files in the store once they stop
    changing for 0.5 s (the stores land after the answers), waiting at most ``timeout_s``."""
    model = served_model(next(iter(fleet.nodes.values())).url)

    async def all_of() -> None:
        for name, docs in docs_by_replica.items():
            client = client_for(fleet.nodes[name].url)
            try:
                for doc in docs:
                    for tenant in TENANTS:
                        ans = await ask(client, model, Request(-1, doc, tenant, 0, name), texts[doc], prefixshare=True,
                                        t0=time.monotonic())
                        assert ans.error is None, ans.error
            finally:
                await client.close()

    asyncio.run(all_of())
    deadline, count, since = time.monotonic() + timeout_s, -1, time.monotonic()
    while time.monotonic() < deadline:
        now = len(list(fleet.store.rglob("*.data")))
        if now != count:
            count, since = now, time.monotonic()
        elif time.monotonic() - since >= 0.5:
            break
        time.sleep(0.05)
    return count


def client_for(url: str) -> Any:
    """An OpenAI client with no retries (every failure counts) whose idle connections expire before the server's
    (vLLM's uvicorn closes them after 5 s; httpx's default expiry is also 5 s, and a request sent on a connection
    the server is closing at that moment fails without reaching it: a client-side race, not the replica's)."""
    import httpx
    from openai import AsyncOpenAI

    http = httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64, keepalive_expiry=2.0))
    return AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0, http_client=http)


async def _clients(fleet: Fleet, model: str, source: Any, text_of: Callable[[str], str], t0: float,
                   duration_s: float, concurrency: int, rate: float | None, max_requests: int) -> list[Answer]:
    clients = {name: client_for(node.url) for name, node in fleet.nodes.items()}
    deadline = t0 + duration_s
    answers: list[Answer] = []
    issued = 0

    async def client() -> None:
        nonlocal issued
        while time.monotonic() < deadline and issued < max_requests:
            index = issued
            issued += 1
            req = source.next(index)  # no await since the index was taken: the stream's order is the index order
            if rate is not None:
                wait = t0 + index / rate - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(min(wait, max(0.0, deadline - time.monotonic())))
                if time.monotonic() >= deadline:
                    return
            answers.append(await ask(clients[req.replica], model, req, text_of(req.doc),
                                     prefixshare=fleet.prefixshare, t0=t0))

    try:
        await asyncio.gather(*(client() for _ in range(concurrency)))
    finally:
        for c in clients.values():
            await c.close()
    return sorted(answers, key=lambda a: a.index)


def references(fleet: Fleet, texts: dict[str, str], keys: list[tuple[str, int]]) -> dict[tuple[str, int], Answer]:
    """Each distinct prompt answered alone (one request at a time) by a replica without prefixshare."""
    model = served_model(fleet.nodes["a"].url)

    async def all_of() -> dict[tuple[str, int], Answer]:
        client = client_for(fleet.nodes["a"].url)
        out = {}
        try:
            for i, (doc, q) in enumerate(keys):
                ans = await ask(client, model, Request(i, doc, TENANTS[0], q, "a"), texts[doc], prefixshare=False,
                                t0=time.monotonic())
                assert ans.error is None, ans.error
                out[(doc, q)] = ans
        finally:
            await client.close()
        return out

    return asyncio.run(all_of())


def node_stats(fleet: Fleet) -> dict[str, Any]:
    from prefixshare.runtime import read_stats

    return {name: read_stats(node.instance) for name, node in fleet.nodes.items() if node.instance}


def verify_nodes(fleet: Fleet) -> dict[str, Any]:
    """``prefixshare verify --url`` against each replica: its set-aside hits replayed."""
    out = {}
    exe = Path(sys.executable).parent / "prefixshare"
    for name, node in fleet.nodes.items():
        proc = subprocess.run([str(exe), "verify", "--policy", str(node.policy_file), "--url", node.url,
                               "--instance", str(node.instance), "--json"], capture_output=True, text=True,
                              timeout=900, env=os.environ.copy())
        (fleet.work / f"{fleet.tag}-verify-{name}.stderr").write_text(proc.stderr)
        report = json.loads(proc.stdout) if proc.stdout.strip() else {"error": proc.stderr[-2000:]}
        report["exit_code"] = proc.returncode
        # what each check that did not pass said (kept; the full checks are in the replica's stats)
        report["not_ok"] = [{"verdict": c["verdict"], "reason": c.get("reason")}
                            for c in report.pop("checks", []) if c.get("verdict") != "ok"]
        out[name] = report
    return out


# --- what a run shows ----------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    k = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return round(values[k], 4)


def summarize(run: Run, refs: dict[tuple[str, int], Answer] | None) -> dict[str, Any]:
    """Requests, errors, wrong answers, hit rate, TTFT percentiles of hits and misses, throughput."""
    ok = [a for a in run.answers if a.error is None]
    hits, misses = [a for a in ok if a.hit], [a for a in ok if not a.hit]
    compared = [a for a in ok if refs is not None and (a.doc, a.question) in refs]
    wrong = [a for a in compared if not same(a, refs[(a.doc, a.question)])] if refs is not None else []
    out: dict[str, Any] = {
        "tag": run.tag, "prefixshare": run.prefixshare, "duration_s": run.duration_s, "concurrency": run.concurrency,
        "requests": len(run.answers), "errors": len(run.answers) - len(ok),
        "error_samples": [{"index": a.index, "replica": a.replica, "started_s": round(a.started, 2),
                           "latency_s": round(a.latency_s or 0, 2), "error": a.error} for a in run.answers if a.error][:5],
        "compared_with_cold": len(compared), "wrong_answers": len(wrong),
        "wrong_samples": [{"index": a.index, "doc": a.doc, "replica": a.replica, "text": a.text,
                           "expected": refs[(a.doc, a.question)].text} for a in wrong[:5]] if refs else [],
        "hits": len(hits), "hit_rate": round(len(hits) / len(ok), 4) if ok else None,
        "ttft_hit_p50_s": percentile([a.ttft_s for a in hits if a.ttft_s is not None], 50),
        "ttft_hit_p99_s": percentile([a.ttft_s for a in hits if a.ttft_s is not None], 99),
        "ttft_miss_p50_s": percentile([a.ttft_s for a in misses if a.ttft_s is not None], 50),
        "ttft_miss_p99_s": percentile([a.ttft_s for a in misses if a.ttft_s is not None], 99),
        "ttft_all_p50_s": percentile([a.ttft_s for a in ok if a.ttft_s is not None], 50),
        "throughput_rps": round(len(ok) / run.duration_s, 3),
        "prompt_tokens_per_s": round(sum(a.prompt_tokens for a in ok) / run.duration_s, 1),
        "faults": run.faults,
    }
    if run.stats:
        out["connector"] = {name: {k: s.get(k) for k in ("requests", "hits", "tokens_loaded", "tokens_stored",
                                                           "fallbacks", "verify", "stores_lost")}
                            for name, s in run.stats.items()}
    return out


def during(run: Run, fault: str) -> list[Answer]:
    """The requests sent while ``fault`` was in place."""
    entry = next(f for f in run.faults if f["fault"] == fault)
    return [a for a in run.answers if entry["from_s"] <= a.started <= entry["to_s"]]


# --- resources over time (the soak) ------------------------------------------------------------------------------


def rss_kb(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def open_fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def dir_bytes(path: Path) -> tuple[int, int]:
    """(files, bytes) under ``path``."""
    files = size = 0
    for root, _, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):
                size += os.stat(os.path.join(root, name)).st_size
                files += 1
    return files, size


def _cpu_s(stat: Path) -> float:
    """User + system CPU seconds from a ``/proc/<pid>/stat`` or ``/proc/<pid>/task/<tid>/stat`` file."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(fleet: Fleet) -> dict[str, float]:
    """CPU seconds (user + system, every thread) each process of the fleet has used so far: ``server-<node>`` (the
    MP server and its children), ``<process name>-<node>`` for a replica's processes (API server, engine core,
    worker; processes of one name add up)."""
    out: dict[str, float] = {}
    for label, pid in fleet.processes().items():
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            seconds = _cpu_s(Path(f"/proc/{pid}/stat"))
        except OSError:
            continue
        node = label.split("-")[1]
        role = "server" if label.startswith("server-") else comm
        key = f"{role}-{node}"
        out[key] = round(out.get(key, 0.0) + seconds, 2)
    return out


def thread_cpu_seconds(fleet: Fleet) -> dict[str, dict[str, float]]:
    """CPU seconds so far of every thread of every process of the fleet: ``{label: {tid: seconds}}`` (a
    profile names the threads)."""
    out: dict[str, dict[str, float]] = {}
    for label, pid in fleet.processes().items():
        threads: dict[str, float] = {}
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{pid}/task").iterdir():
                with contextlib.suppress(OSError, IndexError, ValueError):
                    threads[task.name] = _cpu_s(task / "stat")
        out[label] = threads
    return out


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: round(v - before.get(k, 0.0), 2) for k, v in after.items()}


def sample(fleet: Fleet, t0: float) -> dict[str, Any]:
    """One sample of every resource a slow leak would grow."""
    procs = fleet.processes()
    shm_files, shm_bytes = dir_bytes(Path("/dev/shm"))
    store_files, store_bytes = dir_bytes(fleet.store)
    return {"t_s": round(time.monotonic() - t0, 1),
            "rss_kb": {label: rss_kb(pid) for label, pid in procs.items()},
            "fds": {label: open_fds(pid) for label, pid in procs.items()},
            "shm_files": shm_files, "shm_bytes": shm_bytes, "store_files": store_files, "store_bytes": store_bytes}


class Sampler(threading.Thread):
    def __init__(self, fleet: Fleet, t0: float, every_s: float, until_s: float) -> None:
        super().__init__(name="soak-sampler", daemon=True)
        self.fleet, self.t0, self.every_s, self.until_s = fleet, t0, every_s, until_s
        self.samples: list[dict[str, Any]] = []

    def run(self) -> None:
        k = 0
        while time.monotonic() - self.t0 <= self.until_s + 1:
            self.samples.append(sample(self.fleet, self.t0))
            k += 1
            time.sleep(max(0.0, self.t0 + k * self.every_s - time.monotonic()))


def series(samples: list[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """Per resource (a process's RSS or fds by its role, /dev/shm, the store): (t, value); processes are summed
    by role so that a restarted process continues its role's series."""
    out: dict[str, list[tuple[float, float]]] = {}
    for s in samples:
        groups: dict[str, float] = {}
        for metric in ("rss_kb", "fds"):
            for label, value in s[metric].items():
                if value is None:
                    continue
                role = "-".join(label.split("-")[:2])  # server-a, replica-b, ...
                key = f"{metric}:{role}"
                groups[key] = groups.get(key, 0.0) + value
        groups.update({"shm_bytes": s["shm_bytes"], "store_bytes": s["store_bytes"]})
        for key, value in groups.items():
            out.setdefault(key, []).append((s["t_s"], float(value)))
    return out


def growth(points: list[tuple[float, float]], after_s: float) -> dict[str, Any]:
    """Growth of one series after ``after_s``: last vs first value (%), the least-squares slope over that part
    (% of the first value per 25 min, i.e. over a 30-minute soak's measured part), and how many steps rose."""
    part = [(t, v) for t, v in points if t >= after_s]
    if len(part) < 3:
        return {"points": len(part)}
    first, last = part[0][1], part[-1][1]
    ts, vs = [t for t, _ in part], [v for _, v in part]
    mt, mv = statistics.fmean(ts), statistics.fmean(vs)
    var = sum((t - mt) ** 2 for t in ts)
    slope = sum((t - mt) * (v - mv) for t, v in part) / var if var else 0.0
    base = first if first else 1.0
    rises = sum(1 for (_, a), (_, b) in zip(part, part[1:], strict=False) if b > a)
    return {"points": len(part), "first": first, "last": last, "growth_pct": round(100 * (last - first) / base, 2),
            "slope_pct_per_25min": round(100 * slope * 1500 / base, 2), "rising_steps": rises,
            "steps": len(part) - 1}


# --- the full run and the soak (make bench) -------------------------------------------------------------------


def _meta() -> dict[str, Any]:
    from faults._matrix import commit, now, run_id

    return {"run_id": run_id(), "commit": commit(), "recorded_at": now(), "cpus": os.cpu_count(),
            "cpu_flags": sorted({f for f in ("avx2", "avx512f", "amx_tile") if f in Path("/proc/cpuinfo").read_text()})}


def full(work: Path, model: Path, *, duration_s: float, concurrency: int) -> dict[str, Any]:
    """The same workloads against raw replicas and prefixshare replicas: throughput and TTFT ratios."""
    texts = documents(30)
    keys = [(d, q) for d in texts for q in range(len(QUESTIONS))]
    with Fleet(work, model, prefixshare=False, tag="cold", names=("a",)) as cold:
        refs = references(cold, texts, keys)
    unique_texts: dict[str, str] = {}
    runs: dict[str, Any] = {}
    with Fleet(work, model, prefixshare=False, tag="raw") as raw:
        runs["raw_zipf"] = summarize(drive(raw, Zipf(list(texts), seed=2), texts, duration_s=duration_s,
                                           concurrency=concurrency), refs)
        source = Unique(seed=3)
        runs["raw_unique"] = summarize(drive(raw, source, lambda d: source.texts[d], duration_s=duration_s,
                                             concurrency=concurrency), None)
        unique_texts.update(source.texts)

    def schedule(faults: Faults) -> None:
        faults.at(duration_s * 0.25, "mp_server_restart", lambda: faults.restart_server("a"))
        faults.at(duration_s * 0.5, "store_unreadable", lambda: faults.unreadable(10.0))

    with Fleet(work, model, prefixshare=True, tag="ps", verify_sample=0.5) as fleet:
        source = Unique(seed=3)  # the same documents, in the same order, as the raw replicas got
        run = drive(fleet, source, lambda d: source.texts[d], duration_s=duration_s, concurrency=concurrency)
        run.stats = node_stats(fleet)
        runs["prefixshare_unique"] = summarize(run, None)
        run = drive(fleet, Zipf(list(texts), seed=2), texts, duration_s=duration_s, concurrency=concurrency,
                    schedule=schedule)
        before = runs["prefixshare_unique"]["connector"]
        run.stats = node_stats(fleet)
        runs["prefixshare_zipf"] = summarize(run, refs)
        runs["prefixshare_zipf"]["connector_before"] = before
        verification = verify_nodes(fleet)
    ratios = {
        "throughput_unique": _ratio(runs["prefixshare_unique"]["throughput_rps"], runs["raw_unique"]["throughput_rps"]),
        "throughput_zipf": _ratio(runs["prefixshare_zipf"]["throughput_rps"], runs["raw_zipf"]["throughput_rps"]),
        "ttft_p50_zipf": _ratio(_p50(runs["prefixshare_zipf"]), _p50(runs["raw_zipf"])),
    }
    goals = {
        "errors": {"goal": 0, "value": runs["prefixshare_zipf"]["errors"] + runs["prefixshare_unique"]["errors"]},
        "wrong_answers": {"goal": 0, "value": runs["prefixshare_zipf"]["wrong_answers"]},
        "throughput_unique": {"goal": ">= 0.95", "value": ratios["throughput_unique"]},
        "throughput_zipf": {"goal": "> 1.0", "value": ratios["throughput_zipf"]},
        "false_alarms": {"goal": 0, "value": sum(r.get("mismatch", 0) for r in verification.values())},
    }
    goals["errors"]["pass"] = goals["errors"]["value"] == 0
    goals["wrong_answers"]["pass"] = goals["wrong_answers"]["value"] == 0
    goals["throughput_unique"]["pass"] = (ratios["throughput_unique"] or 0) >= 0.95
    goals["throughput_zipf"]["pass"] = (ratios["throughput_zipf"] or 0) > 1.0
    goals["false_alarms"]["pass"] = goals["false_alarms"]["value"] == 0
    return {**_meta(), "kind": "load", "duration_s": duration_s, "concurrency": concurrency, "documents": len(texts),
            "runs": runs, "ratios": ratios, "verification": verification, "goals": goals}


def _p50(summary: dict[str, Any]) -> float | None:
    """The run's median TTFT over every request (hits and misses)."""
    return summary.get("ttft_all_p50_s")


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def soak(work: Path, model: Path, *, duration_s: float, rate: float, concurrency: int, every_s: float,
         warmup_s: float, budget: str) -> dict[str, Any]:
    """The Zipf workload at a steady rate; every resource sampled every ``every_s``."""
    texts = documents(30)
    keys = [(d, q) for d in texts for q in range(len(QUESTIONS))]
    with Fleet(work, model, prefixshare=False, tag="cold", names=("a",)) as cold:
        refs = references(cold, texts, keys)
    with Fleet(work, model, prefixshare=True, tag="soak", verify_sample=0.02, budget=budget) as fleet:
        t0 = time.monotonic()
        sampler = Sampler(fleet, t0, every_s, duration_s)
        sampler.start()
        run = drive(fleet, Zipf(list(texts), seed=4), texts, duration_s=duration_s, concurrency=concurrency,
                    rate=rate)
        sampler.join(every_s * 2 + 30)
        run.stats = node_stats(fleet)
        verification = verify_nodes(fleet)
    summary = summarize(run, refs)
    per = {key: growth(points, warmup_s) for key, points in series(sampler.samples).items()}
    limit = _budget_bytes(budget) * len(fleet.nodes)
    worst = max((g.get("growth_pct", 0.0) for k, g in per.items() if k != "store_bytes"), default=0.0)
    store_max = max(s["store_bytes"] for s in sampler.samples)
    goals = {"growth": {"goal": "<= 5 % after the first 5 minutes", "value": worst, "pass": worst <= 5.0},
             "store_within_budget": {"goal": f"<= {limit} bytes ({budget} per writer)", "value": store_max,
                                     "pass": store_max <= limit},
             "errors": {"goal": 0, "value": summary["errors"], "pass": summary["errors"] == 0},
             "wrong_answers": {"goal": 0, "value": summary["wrong_answers"], "pass": summary["wrong_answers"] == 0}}
    return {**_meta(), "kind": "soak", "duration_s": duration_s, "rate_rps": rate, "concurrency": concurrency,
            "sample_every_s": every_s, "warmup_s": warmup_s, "summary": summary, "verification": verification,
            "growth": per, "samples": sampler.samples, "goals": goals}


def _budget_bytes(text: str) -> int:
    from prefixshare._units import parse_size

    return int(parse_size(text))


def plot_soak(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = series(result["samples"])
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for key, values in sorted(pts.items()):
        t = [x / 60 for x, _ in values]
        v = [y for _, y in values]
        if key.startswith("rss_kb:"):
            axes[0].plot(t, [y / 1024 for y in v], label=key.split(":", 1)[1])
        elif key.startswith("fds:"):
            axes[1].plot(t, v, label=key.split(":", 1)[1])
        else:
            axes[2].plot(t, [y / 2**20 for y in v], label=key)
    for ax, title in zip(axes, ("RSS (MiB) by process role", "open file descriptors", "MiB"), strict=True):
        ax.axvline(result["warmup_s"] / 60, color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel("minutes")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.suptitle(f"soak {result['run_id']} ({result['commit'][:12]}): {result['summary']['requests']} requests at "
                 f"{result['rate_rps']} rps")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--full", action="store_true", help="raw vs prefixshare replicas, Zipf and 0 %%-hit workloads")
    mode.add_argument("--soak", type=float, metavar="SECONDS", help="steady load for this long, resources sampled")
    parser.add_argument("--duration", type=float, default=120.0, help="--full: seconds per workload run")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rate", type=float, default=3.0, help="--soak: requests per second")
    parser.add_argument("--every", type=float, default=60.0, help="--soak: seconds between samples")
    parser.add_argument("--warmup", type=float, default=300.0, help="--soak: seconds before growth is measured")
    parser.add_argument("--budget", default="48MiB", help="--soak: each replica's byte budget (admission)")
    parser.add_argument("--work", type=Path, default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument("--out", type=Path, default=None, help="results JSON (default: docs/benchmarks/<kind>.json)")
    args = parser.parse_args(argv)
    from faults._matrix import commit, run_id
    from prefixshare.model import create_model

    commit(), run_id()  # fixed now: the tree may change during a 30-minute run, and the row must name what ran

    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    work = args.work or Path(tempfile_dir())
    work.mkdir(parents=True, exist_ok=True)
    model = create_model(work / "model", shape="tiny", seed=0)
    docs = HERE.parents[1] / "docs" / "benchmarks"
    if args.full:
        result = full(work, model, duration_s=args.duration, concurrency=args.concurrency)
        out = args.out or docs / "load.json"
    else:
        result = soak(work, model, duration_s=args.soak, rate=args.rate, concurrency=args.concurrency,
                      every_s=args.every, warmup_s=args.warmup, budget=args.budget)
        out = args.out or docs / "soak.json"
        plot_soak(result, out.with_suffix(".png"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    misses = [k for k, g in result["goals"].items() if not g["pass"]]
    sys.stdout.write(f"{result['kind']} {result['run_id']}: " + ", ".join(
        f"{k} {g['value']} ({'pass' if g['pass'] else 'MISS'})" for k, g in result["goals"].items()) + f" -> {out}\n")
    return 1 if "errors" in misses or "wrong_answers" in misses or "false_alarms" in misses else 0


def tempfile_dir() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="prefixshare-load-")


if __name__ == "__main__":
    sys.exit(main())
