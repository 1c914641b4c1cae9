"""The rated link table, measured: one request's KV moved from node A through the store node to node B over
shaped links, against ``prefixshare plan``'s arithmetic for the same bytes and rate.

Per link class (both nodes' links shaped to the class's rate with ``tbf``), transport and payload (a model
shape's KV bytes per token x a prompt length, in the policy's 256-token chunks): node A stores the chunks through
a tier's adapter — ``resp`` (Redis on the store node), ``sshfs`` (the ``fs`` tier on the store node's directory
mounted over sshfs in each node) or ``mooncake`` (``mooncake_store``: master and segment holder on the store
node, a fresh one per cell) — then node B, another process with no memory of the store, looks them up and loads
them and compares every byte. A row holds the measured store and load
times (median of ``reps``), the plan's time for the same bytes on the class's rated link, their ratio, and
the bytes the kernel counted on B's link (what the wire really carried).

``python tests/lab/links.py [--full]`` writes docs/benchmarks/lab.json (``make bench`` runs ``--full``);
tests/lab/test_lab.py runs one class as the CI subset.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from lab.lab import SSH_CIPHER, Lab, MooncakeStore, S3Bucket, commit  # noqa: E402

from prefixshare.plan import kv_bytes_per_token, link_from_gbps, shape_from_config  # noqa: E402

CHUNK_TOKENS = 256
#: a transfer process that outlives its own timeout by this much is killed (and reported as failed)
KILL_GRACE_S = 10.0
REDIS_PORT = 6391
#: link classes (Gbit/s) and the payloads: the bench model at 1k-8k tokens, and a Qwen3-8B-sized KV
#: (147,456 B/token) at 1k and 4k tokens
CLASSES_GBIT = (1.0, 2.5, 10.0)
PAYLOADS = (("bench", 1024), ("bench", 4096), ("bench", 8192), ("qwen3-8b", 1024), ("qwen3-8b", 4096))


class Transport:
    """How a node reaches the store: the tier config both sides use, and what a transfer command is wrapped in
    (for sshfs: the mount, made inside the node's own mount namespace for that command only)."""

    name = "resp"

    def __init__(self, lab: Lab, work: Path) -> None:
        self.lab, self.work = lab, work

    def tier(self, node: str) -> dict[str, Any]:
        return {"type": "resp", "host": self.lab.ip("s"), "port": REDIS_PORT}

    def wrap(self, node: str, args: list[str]) -> list[str]:
        return args

    def fresh(self) -> None:
        """Before a cell: the store as the cell needs it (the rounds delete what they stored)."""


class SshfsTransport(Transport):
    """The ``fs`` tier (blake3-checked) on a directory of the store node mounted over sshfs on each node."""

    name = "sshfs"

    def __init__(self, lab: Lab, work: Path) -> None:
        super().__init__(lab, work)
        self.export = lab.start_sshd(work)

    def mountpoint(self, node: str) -> Path:
        path = self.work / f"mnt-{node}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def tier(self, node: str) -> dict[str, Any]:
        return {"type": "fs", "base_path": str(self.mountpoint(node))}

    def wrap(self, node: str, args: list[str]) -> list[str]:
        return self.lab.sshfs_wrap(self.export, self.mountpoint(node), args)


class MooncakeTransport(Transport):
    """The ``mooncake_store`` tier: master and the segment holder on the store node (TCP); each node's client
    contributes no memory and names its own lab address."""

    name = "mooncake"

    def __init__(self, lab: Lab, work: Path) -> None:
        super().__init__(lab, work)
        self.cells = 0
        self.store: MooncakeStore | None = None  # started by fresh(), before each cell

    def fresh(self) -> None:
        """A new master and segment holder for every cell (new ports: no wait for the old ones' sockets):
        Mooncake refuses to delete an object read in the last 10 s, so the rounds' deletes free nothing, and a
        put into a full segment fails."""
        if self.store is not None:
            self.lab.stop(self.store.procs)
        self.store = self.lab.start_mooncake(self.work, port_offset=10 * self.cells)
        self.cells += 1

    def tier(self, node: str) -> dict[str, Any]:
        assert self.store is not None, "fresh() starts the store before a cell"
        return {"type": "mooncake_store", "master_server_addr": self.store.master,
                "metadata_server": self.store.metadata, "local_hostname": self.lab.ip(node),
                "global_segment_size": 0, "local_buffer_size": 256 * 2**20}


class S3Transport(Transport):
    """The ``s3`` tier (LMCache's S3 client, plain HTTP) against moto's S3 server on the store node: a stand-in
    for an object store on the LAN (MinIO, Ceph RGW), measured for what the client and the link cost; moto is a
    Python server, so on fast links the figures are the stand-in's, not S3's."""

    name = "s3"

    def __init__(self, lab: Lab, work: Path) -> None:
        super().__init__(lab, work)
        self.bucket: S3Bucket = lab.start_s3(work)

    def tier(self, node: str) -> dict[str, Any]:
        return {"type": "s3", "endpoint": self.bucket.endpoint, "region": "us-east-1", "disable_tls": True}

    def wrap(self, node: str, args: list[str]) -> list[str]:
        return self.lab.s3_wrap(self.bucket, args)


TRANSPORTS = {"resp": Transport, "sshfs": SshfsTransport, "mooncake": MooncakeTransport, "s3": S3Transport}


def _transfer(lab: Lab, node: str, spec: dict[str, Any], work: Path, timeout_s: float,
              transport: Transport | None = None) -> dict[str, Any]:
    path = work / f"{spec['role']}-{uuid.uuid4().hex[:8]}.json"
    path.write_text(json.dumps(spec))
    bound = timeout_s + KILL_GRACE_S
    args = [sys.executable, str(HERE / "transfer.py"), str(path)]
    try:
        proc = lab.in_ns(lab.ns(node), transport.wrap(node, args) if transport else args, check=False,
                         timeout=bound)
    except subprocess.TimeoutExpired:
        # the process did not answer at all: against an unreachable store LMCache's resp client connects while
        # holding the interpreter (its own watchdog thread cannot run); killed at the bound
        return {"role": spec["role"], "ok": False, "killed": True,
                "error": f"no answer within {bound:g} s (killed; phase unknown)"}
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{spec['role']} on {node} failed (rc {proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(line[len("RESULT "):])


def payload_bytes(shape: str, tokens: int) -> tuple[int, int]:
    """(chunk bytes, chunks) of ``tokens`` tokens of ``shape``'s KV (float32 for the bench model as the
    benchmarks run it, bf16 for Qwen3-8B as GPUs run it)."""
    dtype = "float32" if shape == "bench" else "bfloat16"
    per_token = kv_bytes_per_token(shape_from_config(shape), dtype)
    return per_token * CHUNK_TOKENS, tokens // CHUNK_TOKENS


def measure_cell(lab: Lab, work: Path, gbit: float, shape: str, tokens: int, reps: int,
                 transport: Transport | None = None) -> dict[str, Any]:
    """One link class x payload: ``reps`` store-then-load rounds, A -> store -> B (through Redis, or
    ``transport``'s tier)."""
    transport = transport or Transport(lab, work)
    transport.fresh()
    chunk_bytes, chunks = payload_bytes(shape, tokens)
    total = chunk_bytes * chunks
    link = link_from_gbps(gbit)
    rated_s = link.seconds_for(total)
    timeout_s = max(60.0, 20 * rated_s)
    stores, lookups, loads, wire = [], [], [], []
    for rep in range(reps):
        model = f"lab-{uuid.uuid4().hex[:10]}"
        base = {"chunks": chunks, "chunk_bytes": chunk_bytes, "seed": rep + 1, "model": model,
                "timeout_s": timeout_s}
        stored = _transfer(lab, "a", {**base, "role": "store", "tier": transport.tier("a")}, work, timeout_s,
                           transport)
        if not stored.get("ok"):
            raise RuntimeError(f"store failed: {stored}")
        before = lab.counters("b")
        loaded = _transfer(lab, "b", {**base, "role": "load", "delete": True, "tier": transport.tier("b")}, work,
                           timeout_s, transport)
        after = lab.counters("b")
        if not loaded.get("ok"):
            raise RuntimeError(f"load failed: {loaded}")
        stores.append(stored["store_s"])
        lookups.append(loaded["lookup_s"])
        loads.append(loaded["load_s"])
        wire.append(after["rx_bytes"] - before["rx_bytes"])
    store_s, load_s = statistics.median(stores), statistics.median(loads)
    return {
        "transport": transport.name, "link_gbit": gbit, "shape": shape, "tokens": tokens, "bytes": total, "chunks": chunks,
        "rated_s": rated_s, "store_s": store_s, "lookup_s": statistics.median(lookups), "load_s": load_s,
        "store_over_rated": store_s / rated_s, "load_over_rated": load_s / rated_s,
        "load_gbps": total / load_s / 1e9, "wire_bytes_b": statistics.median(wire),
        "wire_over_payload": statistics.median(wire) / total,
        "values": {"store_s": stores, "lookup_s": lookups, "load_s": loads}, "bytes_equal": True,
    }


def measure(classes: tuple[float, ...], payloads: tuple[tuple[str, int], ...], reps: int, work: Path,
            log: Any = print, transports: tuple[str, ...] = ("resp",)) -> dict[str, Any]:
    """The whole table in one lab (the stores of ``transports`` -- names of :data:`TRANSPORTS` -- on the store
    node; links reshaped per class)."""
    work.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    started = time.monotonic()
    with Lab() as lab:
        lab.start_redis(REDIS_PORT, work)
        made = {name: TRANSPORTS[name](lab, work) for name in transports}
        for gbit in classes:
            for node in ("a", "b"):
                lab.shape(node, gbit * 1000)
            for transport in made.values():
                for shape, tokens in payloads:
                    try:
                        row = measure_cell(lab, work, gbit, shape, tokens, reps, transport)
                    except RuntimeError as exc:  # a failed cell is a row that says so; the table goes on
                        rows.append({"transport": transport.name, "link_gbit": gbit, "shape": shape, "tokens": tokens,
                                     "error": str(exc)[:400]})
                        log(f"{transport.name} {gbit:g} Gbit/s {shape} {tokens} tok: FAILED {exc}")
                        continue
                    log(f"{transport.name} {gbit:g} Gbit/s {shape} {tokens} tok: {row['bytes'] / 1e6:.0f} MB load "
                        f"{row['load_s']:.2f} s = {row['load_over_rated']:.2f}x rated, store "
                        f"{row['store_over_rated']:.2f}x")
                    rows.append(row)
    return {"rows": rows, "seconds": round(time.monotonic() - started, 1), "chunk_tokens": CHUNK_TOKENS,
            "reps": reps, "transports": {
                "resp": "resp tier (Redis on the store node), tbf-shaped veth links via a bridge",
                "sshfs": "fs tier (blake3-checked) on the store node's directory mounted over sshfs (SFTP, "
                         f"{SSH_CIPHER}) on each node, the same links",
                "mooncake": "mooncake_store tier: mooncake_master and one mooncake_client holding the segment on "
                            "the store node (TCP transport), the same links",
                "s3": "s3 tier (LMCache's S3 client, plain HTTP) against moto's S3 server on the store node, the "
                      "same links"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="every link class and payload (make bench)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=HERE.parents[1] / "docs" / "benchmarks" / "lab.json")
    parser.add_argument("--transports", help=f"comma-separated, of {', '.join(TRANSPORTS)} (default: all with "
                        "--full, else resp)")
    parser.add_argument("--merge", action="store_true", help="keep the rows of other transports already in --out "
                        "(each row keeps the run id and commit that measured it)")
    args = parser.parse_args()
    run_id = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + uuid.uuid4().hex[:6]
    rev = commit()
    classes = CLASSES_GBIT if args.full else (2.5,)
    payloads = PAYLOADS if args.full else (("bench", 4096), ("qwen3-8b", 1024))
    transports = (tuple(args.transports.split(",")) if args.transports else
                  tuple(TRANSPORTS) if args.full else ("resp",))
    unknown = set(transports) - set(TRANSPORTS)
    if unknown:
        parser.error(f"unknown transports {sorted(unknown)}; known: {', '.join(TRANSPORTS)}")
    result = measure(classes, payloads, args.reps, Path("/var/tmp") / f"prefixshare-lab-{run_id}",
                     transports=transports)
    for row in result["rows"]:
        row.update(run_id=run_id, commit=rev)
    if args.merge and args.out.is_file():
        old = json.loads(args.out.read_text())
        kept = [{"run_id": old.get("run_id"), "commit": old.get("commit"), **r} for r in old.get("rows", [])
                if r.get("transport", "resp") not in transports]
        result["rows"] = kept + result["rows"]
        result["transports"] = {**old.get("transports", {}), **result["transports"]}
        # seconds stay this run's own; the runs whose rows were kept are named beside them
        result["merged"] = [*old.get("merged", []), {k: old.get(k) for k in ("run_id", "commit", "seconds")}]
    result.update(run_id=run_id, commit=rev, kind="full" if args.full else "subset")
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"lab {run_id}: {len(result['rows'])} cells in {result['seconds']} s -> {args.out}")
    bench = args.out.parent / "results.json"
    if args.full and bench.is_file():  # the bench page carries the lab's table: render it again with this run
        from prefixshare.bench import render_results

        render_results(bench, args.out.parents[1] / "benchmarks.md")
        print(f"rendered {args.out.parents[1] / 'benchmarks.md'} with the lab's table")


if __name__ == "__main__":
    main()
