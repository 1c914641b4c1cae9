"""The lab's engine half: vLLM replicas on two nodes, each beside its own MP server, the shared L2 (the ``resp``
tier: Redis) on the store node, and node B's link shaped, cut and made lossy between requests.

* **Node A** computes each document cold (prefixshare attached: its server stores the KV into Redis over A's
  link) and keeps its greedy token ids and logprobs: the cold reference every answer on B is compared with.
* **Node B** (policy ``load.mode: auto``) answers the same documents. Every B request empties the engine's
  prefix cache first, loads nothing back into the store (``prefixshare.store: false``) and, before a load,
  empties B's server L1, so each load crosses B's link from Redis.

**Load or recompute on a real link** (:meth:`EngineLab.sweep`): per prompt length, B first measures its own
forced load over the unshaped link (``L0``) and forced recompute (``R``); then, per point ``f``, B's link is
shaped (tbf, both ways) to the rate at which the plan's arithmetic says a load takes ``f x R``
(``rate = KV bytes / (f x R - L0)``), and per run the same document is forced to load, forced to recompute and
left to the cost model (``auto``), interleaved: regret = auto / the better of the two, measured in the same run.
Each point also says which GPU + link pairing it stands for: the same ratio of link bytes/s to the KV bytes/s
prefill produces, for Qwen3-8B (147,456 B/token) prefilled at 10,000 tokens/s on a GPU.

**Network faults** between node B and the store (:meth:`EngineLab.fault`): a partition before the lookup, a
partition in the middle of a load (cut once B's link has carried part of the payload), packet loss, and the link
healed; every answer compared with A's cold one, every request's added time against ``load.timeout_s``.

``python tests/lab/engines.py [--full]`` writes docs/benchmarks/lab-choice.json (``make bench`` runs ``--full``);
tests/lab/test_lab_engines.py is the CI subset.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from lab.lab import Lab, SshExport, commit  # noqa: E402

from prefixshare.bench._procs import ReplicaSession  # noqa: E402
from prefixshare.keys import REQ_LOAD, REQ_STORE  # noqa: E402

CHUNK_TOKENS = 256
BLOCK_SIZE = 128
REDIS_PORT = 6393
#: session -> (server port, http port): distinct per session (the servers' shared-memory segments are named by
#: port); "b-delay" is a second replica on node B that reaches Redis through the delay relay
PORTS = {"a": (17001, 17002), "b": (18001, 18002), "b-delay": (18101, 18102), "a-sshfs": (17201, 17202),
         "b-sshfs": (18201, 18202)}
#: the delay relay (tests/lab/delay.py) on the store node, in front of Redis: DELAY_MS each way
RELAY_PORT = 6394
DELAY_MS = 100
#: the GPU a point stands for: Qwen3-8B's KV bytes per token, prefilled at this many tokens/s
GPU_KV_BYTES_PER_TOKEN = 147_456
GPU_PREFILL_TOKENS_PER_S = 10_000
#: a logprob loaded through the store may differ from the cold one by float32 rounding at most
LOGPROB_TOL = 1e-3
SESSION_TIMEOUT_S = 900.0
#: a Redis PING's round trip, run inside a node: python -c _PING HOST PORT
_PING = """
import socket, sys, time
best = 9e9
for _ in range(3):
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), 5)
    t = time.monotonic()
    s.sendall(b"PING\\r\\n")
    s.recv(16)
    best = min(best, time.monotonic() - t)
    s.close()
print(best)
"""


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 3000) for _ in range(n)]


def policy(lab: Lab, session: str, *, timeout_s: float, mode: str = "auto", store_port: int = REDIS_PORT,
           l2: dict[str, Any] | None = None) -> dict[str, Any]:
    """A node's policy: Redis on the store node (at ``store_port``), or the ``l2`` tier given."""
    from prefixshare.policies import Policy

    port, http = PORTS[session]
    return Policy.build(
        chunk_size=CHUNK_TOKENS, l1={"size_gb": 1.0},
        server={"port": port, "http_port": http, "start_timeout_s": 180},
        load={"timeout_s": timeout_s, "mode": mode},
        l2=[l2 or {"type": "resp", "host": lab.ip("s"), "port": store_port}],
    ).to_dict()


class EngineLab:
    """The lab with Redis on the store node and replica sessions on A and B (see the module's docstring)."""

    def __init__(self, work: Path, model: Path, *, max_tokens: int, timeout_s: float, log: Any = None) -> None:
        self.work, self.model, self.max_tokens, self.timeout_s = work, model, max_tokens, timeout_s
        self.log = log or (lambda line: None)
        self.lab = Lab()
        self.sessions: dict[str, ReplicaSession] = {}
        #: document seed -> A's cold answer (token ids, logprobs, seconds)
        self.cold: dict[int, dict[str, Any]] = {}
        self.docs: dict[int, list[int]] = {}
        #: session -> its connector counters after its last request (they are cumulative)
        self._stats: dict[str, dict[str, Any]] = {}

    # --- set-up ----------------------------------------------------------------------------------------------
    def __enter__(self) -> EngineLab:
        self.work.mkdir(parents=True, exist_ok=True)
        self.lab.up()
        try:
            self.lab.start_redis(REDIS_PORT, self.work)
            self.sessions["a"] = self._session("a")
            self.sessions["b"] = self._session("b")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for name in list(self.sessions):
            self.stop_session(name)
        self.lab.down()
        # a node server killed with its namespace cannot remove its shared-memory L1 pool: up to l1.size_gb of
        # /dev/shm each, which later servers on this machine would find missing (they then copy through the socket)
        from prefixshare.server import shm_path

        for port, _ in PORTS.values():
            path = shm_path(f"prefixshare-{port}")
            if path is not None:
                path.unlink(missing_ok=True)

    def _session(self, node: str, name: str | None = None, store_port: int = REDIS_PORT,
                 l2: dict[str, Any] | None = None, wrap: Any = None) -> ReplicaSession:
        """A replica (and its server) on ``node``; ``wrap`` turns the node's command into the one run (a mount
        around it)."""
        name = name or node
        spec = {"model": str(self.model),
                "policy": policy(self.lab, name, timeout_s=self.timeout_s, store_port=store_port, l2=l2),
                "instance": f"lab-{name}-{uuid.uuid4().hex[:6]}", "steps": [], "log_level": "INFO",
                "server_log": str(self.work / f"server-{name}.log"),
                "engine": {"max_model_len": self.max_tokens + 256, "block_size": BLOCK_SIZE}}
        env = {"PREFIXSHARE_CACHE_DIR": str(self.work / f"cache-{name}"), "VLLM_CPU_KVCACHE_SPACE": "2"}
        self.log(f"node {node}: starting the server and replica {name}")
        session = ReplicaSession(self.work, f"replica-{name}", spec, timeout_s=SESSION_TIMEOUT_S, env=env,
                                 command=["ip", "netns", "exec", self.lab.ns(node),
                                          *(wrap or list)([sys.executable, str(HERE / "node.py")])])
        session.run([{"op": "generate", "ids": _ids(256, 10**6 + ord(node)), "tag": "warmup",
                      "params": {REQ_LOAD: "never", REQ_STORE: False}}])
        return session

    def start_delayed(self, delay_ms: float = DELAY_MS) -> Path:
        """The delay relay on the store node in front of Redis, and a second replica on node B (session
        ``b-delay``, its own server and cost model) whose L2 is Redis through it; returns the relay's log."""
        log = self.work / "delay.log"
        self.lab.spawn("s", [sys.executable, str(HERE / "delay.py"), self.lab.ip("s"), str(RELAY_PORT),
                             self.lab.ip("s"), str(REDIS_PORT), f"{delay_ms:g}"], log=log)
        self.lab.wait_port("s", RELAY_PORT, from_node="b")
        self.sessions["b-delay"] = self._session("b", "b-delay", store_port=RELAY_PORT)
        return log

    def start_sshfs(self) -> SshExport:
        """An SSH server on the store node exporting a directory, and a replica on node A (``a-sshfs``) and one
        on node B (``b-sshfs``) whose L2 is the ``fs`` tier (blake3-checked) on that directory, mounted over
        sshfs in each node (inside the replica's own mount namespace); returns the export."""
        export = self.lab.start_sshd(self.work)
        for node in ("a", "b"):
            mnt = self.work / f"mnt-{node}"
            mnt.mkdir(exist_ok=True)
            self.sessions[f"{node}-sshfs"] = self._session(
                node, f"{node}-sshfs", l2={"type": "fs", "base_path": str(mnt)},
                wrap=lambda args, mnt=mnt: self.lab.sshfs_wrap(export, mnt, args))
        return export

    def stop_session(self, name: str) -> None:
        """Close one replica (and its server), freeing its memory for the next test."""
        session = self.sessions.pop(name, None)
        if session is not None:
            try:
                session.close()
            except Exception:  # noqa: BLE001 - a session that cannot close cleanly is killed
                if session.proc.poll() is None:
                    session.proc.kill()

    def rtt_to_store(self, port: int) -> float:
        """Seconds of one Redis PING from node B to ``port`` on the store node (fastest of three)."""
        out = self.lab.in_ns(self.lab.ns("b"), [sys.executable, "-c", _PING, self.lab.ip("s"), str(port)]).stdout
        return float(out.strip())

    def url(self, session: str) -> str:
        return f"http://127.0.0.1:{PORTS[session][1]}"

    def redis_keys(self) -> int:
        out = self.lab.in_ns(self.lab.ns("s"), ["redis-cli", "-h", self.lab.ip("s"), "-p", str(REDIS_PORT),
                                                "dbsize"]).stdout
        return int(out.strip() or 0)

    def seed(self, seeds: list[int], tokens: int, session: str = "a", stored: Any = None) -> list[dict[str, Any]]:
        """Node A (replica ``session``) computes each document cold (its server stores it into the store); waits
        until the store (``stored()``: objects it holds; default Redis's key count) stops growing. The first
        cold answer of a document is the reference every later answer is compared with; returns A's answers."""
        stored = stored or self.redis_keys
        steps = []
        for s in seeds:
            self.docs[s] = _ids(tokens + 1, s)
            steps.append({"op": "generate", "ids": self.docs[s], "tag": f"cold:{s}", "reset_local": True})
        before = stored()
        outs = self.sessions[session].run(steps)
        for out in outs:
            self.cold.setdefault(int(out["tag"].split(":")[1]), out)
        expected = before + len(seeds) * (tokens // CHUNK_TOKENS)
        deadline, last, stable = time.monotonic() + 120, -1, 0
        while time.monotonic() < deadline:
            keys = stored()
            stable = stable + 1 if keys == last else 0
            if keys >= expected and stable >= 2:
                return outs
            last = keys
            time.sleep(0.5)
        raise RuntimeError(f"the store holds {stored()} objects, expected at least {expected} after node A's "
                           "stores")

    # --- node B ----------------------------------------------------------------------------------------------
    def b(self, seed: int, tag: str, *, load: str | None = None, clear_l1: bool = True,
          session: str = "b") -> dict[str, Any]:
        """One request for document ``seed`` on node B (replica ``session``), with what it did and whether it
        equals A's cold answer."""
        steps: list[dict[str, Any]] = []
        if clear_l1:
            steps.append({"op": "clear_l1", "url": self.url(session)})
        params: dict[str, Any] = {REQ_STORE: False}
        if load is not None:
            params[REQ_LOAD] = load
        steps.append({"op": "generate", "ids": self.docs[seed], "tag": tag, "reset_local": True, "params": params})
        out = self.sessions[session].run(steps)[-1]
        out["same_as_cold"] = same_answer(out, self.cold[seed])
        # what this request added to the replica's connector counters (its stats are cumulative)
        stats, prev = out.get("stats") or {}, self._stats.get(session, {})
        now, before = stats.get("fallbacks") or {}, prev.get("fallbacks") or {}
        out["fallbacks_added"] = {k: v - before.get(k, 0) for k, v in now.items() if v - before.get(k, 0)}
        now, before = stats.get("cost_decisions") or {}, prev.get("cost_decisions") or {}
        out["decisions_added"] = {k: v - before.get(k, 0) for k, v in now.items() if v - before.get(k, 0)}
        self._stats[session] = stats
        return out

    def relearn(self, seeds: list[int]) -> None:
        """Forced loads over B's link as it is now, so that B's cost model (which may last have seen a slower
        link) trusts the store again before a fault: a fault must meet a lookup, not a model that already
        recomputes."""
        for s in seeds:
            out = self.b(s, f"relearn:{s}", load="always")
            if out["num_cached_tokens"] < CHUNK_TOKENS:
                raise RuntimeError(f"a forced load of document {s} over the healthy link loaded nothing: {out}")

    def triple(self, seed: int, tag: str, *, auto: bool = True) -> dict[str, dict[str, Any]]:
        done = {"load": self.b(seed, f"load:{tag}", load="always"),
                "recompute": self.b(seed, f"recompute:{tag}", load="never", clear_l1=False)}
        if auto:
            done["auto"] = self.b(seed, f"auto:{tag}")
        return done

    # --- load or recompute -----------------------------------------------------------------------------------
    def sweep(self, tokens: int, factors: tuple[float, ...], runs: int, kv_bytes_per_token: int) -> dict[str, Any]:
        """P4 across the real link at ``tokens`` (see the module's docstring)."""
        seeds = [tokens * 1000 + r for r in range(runs)]
        self.seed(seeds, tokens)
        kv_bytes = tokens * kv_bytes_per_token
        self.lab.shape("b", None)
        # the first prompt of a new length in a process pays one-off costs: not a calibration sample
        self.b(seeds[0], f"{tokens}:warm", load="never", clear_l1=False)
        calibration = [self.triple(s, f"{tokens}:cal:{i}", auto=False) for i, s in enumerate(seeds)]
        l0 = statistics.median(c["load"]["seconds"] for c in calibration)
        r = statistics.median(c["recompute"]["seconds"] for c in calibration)
        self.log(f"{tokens} tokens: unshaped load {l0:.3f} s, recompute {r:.3f} s")
        points = []
        for f in factors:
            wire_s = f * r - l0
            if wire_s <= 0.05 * f * r:
                points.append({"factor": f, "skipped": f"a load over the unshaped link already takes {l0:.2f} s"})
                continue
            rate_mbit = kv_bytes * 8 / wire_s / 1e6
            self.lab.shape("b", rate_mbit)
            try:
                rows = [self.triple(s, f"{tokens}:{f}:{i}") for i, s in enumerate(seeds)]
            finally:
                self.lab.shape("b", None)
            points.append(_point(f, rate_mbit, kv_bytes, l0, r, rows, tokens))
            p = points[-1]
            self.log(f"  f={f:g} ({rate_mbit:.0f} Mbit/s): load {p['load_s']:.2f} s, recompute "
                     f"{p['recompute_s']:.2f} s, auto {p['auto_s']:.2f} s ({'/'.join(p['auto_choices'])}); regret "
                     f"{p['regret']:.3f}")
        every = [c["recompute"]["seconds"] for c in calibration] + [
            run["recompute"]["seconds"] for p in points for run in p.get("runs", [])]
        return {"tokens": tokens, "kv_bytes": kv_bytes, "unshaped_load_s": l0, "recompute_s": r,
                "recompute_all_s": statistics.median(every),
                "calibration": [{k: _slim(v) for k, v in c.items()} for c in calibration], "points": points}

    # --- faults ----------------------------------------------------------------------------------------------
    def b_rx_bytes(self) -> int:
        """Bytes node B's eth0 received, read from a process inside B's namespace (/proc/PID/net/dev: no process
        started, so polling it costs the engines nothing)."""
        text = Path(f"/proc/{self.sessions['b'].proc.pid}/net/dev").read_text()
        line = next(ln for ln in text.splitlines() if ln.strip().startswith("eth0:"))
        return int(line.split(":", 1)[1].split()[0])

    def cut_after(self, fraction: float, total_bytes: int, timeout_s: float = 60.0) -> dict[str, Any]:
        """A thread that cuts B's link once B's link has received ``fraction`` of ``total_bytes`` (or gives up
        after ``timeout_s``); the returned dict gets what it observed."""
        seen: dict[str, Any] = {}
        start = self.b_rx_bytes()

        def watch() -> None:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                got = self.b_rx_bytes() - start
                if got >= fraction * total_bytes:
                    self.lab.cut("b")
                    seen.update(cut=True, rx_bytes_at_cut=got, at=time.monotonic())
                    return
                time.sleep(0.02)
            seen.update(cut=False)

        thread = threading.Thread(target=watch, daemon=True)
        seen["thread"] = thread
        thread.start()
        return seen

    def first_hit_after_heal(self, seeds: list[int], bound_s: float = 90.0) -> dict[str, Any]:
        """Heal B's link and ask documents (auto) until one loads; how long and how many requests that took."""
        self.lab.cut("b", False)
        healed = time.monotonic()
        answers = []
        i = 0
        while time.monotonic() - healed < bound_s:
            out = self.b(seeds[i % len(seeds)], f"heal:{i}")
            answers.append(out)
            i += 1
            if out["num_cached_tokens"] > 0:
                return {"resumed": True, "after_s": time.monotonic() - healed, "requests": i, "answers": answers}
        return {"resumed": False, "after_s": time.monotonic() - healed, "requests": i, "answers": answers}


def same_answer(out: dict[str, Any], cold: dict[str, Any]) -> bool:
    return out["token_ids"] == cold["token_ids"] and all(
        abs(a - b) <= LOGPROB_TOL for a, b in zip(out["logprobs"], cold["logprobs"], strict=True))


def _slim(out: dict[str, Any]) -> dict[str, Any]:
    return {k: out.get(k) for k in ("seconds", "num_cached_tokens", "same_as_cold", "fallbacks_added",
                                    "decisions_added")}


def fallbacks(outs: list[dict[str, Any]]) -> int:
    """Fallbacks B's connector counted over these requests."""
    return sum(sum(o.get("fallbacks_added", {}).values()) for o in outs)


def _point(f: float, rate_mbit: float, kv_bytes: int, l0: float, r: float, rows: list[dict[str, dict[str, Any]]],
           tokens: int) -> dict[str, Any]:
    med = {k: statistics.median(row[k]["seconds"] for row in rows) for k in ("load", "recompute", "auto")}
    choices = ["load" if row["auto"]["num_cached_tokens"] >= CHUNK_TOKENS else "recompute" for row in rows]
    better = "load" if med["load"] < med["recompute"] else "recompute"
    rate_bps = rate_mbit * 1e6 / 8
    # the KV bytes per second this engine's prefill produces at this length, and the link's share of it
    produced_bps = kv_bytes / r
    ratio = rate_bps / produced_bps
    gpu_link_gbit = ratio * GPU_KV_BYTES_PER_TOKEN * GPU_PREFILL_TOKENS_PER_S * 8 / 1e9
    return {
        "factor": f, "rate_mbit": rate_mbit, "predicted_load_s": l0 + kv_bytes / rate_bps,
        "load_s": med["load"], "recompute_s": med["recompute"], "auto_s": med["auto"],
        "achieved_load_over_recompute": med["load"] / med["recompute"],
        "better": better, "auto_choices": choices, "right_choices": sum(c == better for c in choices),
        "regret": med["auto"] / min(med["load"], med["recompute"]),
        # the first auto request after the link was reshaped, on its own: how fast the cost model followed (its
        # forced load just before it is the only measurement of the new link it had)
        "first_auto_choice": choices[0], "first_auto_regret": rows[0]["auto"]["seconds"] / min(med["load"],
                                                                                                 med["recompute"]),
        "link_over_prefill_kv_rate": ratio, "gpu_equivalent_link_gbit": gpu_link_gbit,
        "all_same_as_cold": all(row[k]["same_as_cold"] for row in rows for k in row),
        "fallbacks": fallbacks([row[k] for row in rows for k in row]),
        "loads_loaded": [row["load"]["num_cached_tokens"] for row in rows],
        "recomputes_loaded": [row["recompute"]["num_cached_tokens"] for row in rows],
        "runs": [{k: _slim(v) for k, v in row.items()} for row in rows], "tokens": tokens,
    }


FULL_LENGTHS = (1024, 4096)
FULL_FACTORS = (0.25, 0.5, 0.8, 1.25, 2.0, 4.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="every length and factor (make bench)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=HERE.parents[1] / "docs" / "benchmarks" / "lab-choice.json")
    args = parser.parse_args()
    from prefixshare.model import create_model, kv_bytes_per_token

    run_id = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + uuid.uuid4().hex[:6]
    work = Path("/var/tmp") / f"prefixshare-lab-engines-{run_id}"
    lengths = FULL_LENGTHS if args.full else (1024,)
    factors = FULL_FACTORS if args.full else (0.8, 1.25)
    model = create_model(work / "model", shape="bench", seed=0)
    started = time.monotonic()
    with EngineLab(work, model, max_tokens=max(lengths) + 1, timeout_s=600.0, log=print) as el:
        sweeps = [el.sweep(n, factors, args.runs, kv_bytes_per_token("bench", 4)) for n in lengths]
    result = {"kind": "full" if args.full else "subset", "run_id": run_id, "commit": commit(),
              "seconds": round(time.monotonic() - started, 1), "model": "bench (float32 KV, 24,576 B/token)",
              "transport": "resp tier (Redis on the store node); node B's link shaped with tbf",
              "gpu_assumption": f"Qwen3-8B ({GPU_KV_BYTES_PER_TOKEN:,} B/token) prefilled at "
                                f"{GPU_PREFILL_TOKENS_PER_S:,} tokens/s", "sweeps": sweeps}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"lab engines {run_id}: {sum(len(s['points']) for s in sweeps)} points in {result['seconds']} s "
          f"-> {args.out}")
    bench = args.out.parent / "results.json"
    if args.full and bench.is_file():  # the bench page carries the lab's tables: render it again with this run
        from prefixshare.bench import render_results

        render_results(bench, args.out.parents[1] / "benchmarks.md")
        print(f"rendered {args.out.parents[1] / 'benchmarks.md'} with the lab's sweep")


if __name__ == "__main__":
    main()
