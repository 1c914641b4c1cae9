"""Store / lookup / load throughput of each L2 tier of a policy, measured the same way for every tier.

Each tier's adapter is built as LMCache's MP server builds it: the tier's ``--l2-adapter`` JSON (rendered as
:func:`prefixshare.policies.server_argv` renders it) goes through LMCache's own parser
(``parse_args_to_l2_adapters_config``) and factory (``create_l2_adapter``, with the L1 arena's descriptor),
with the tier's server environment (credentials) set. The chunks are LMCache memory objects allocated from a
real L1 memory manager, and every task is awaited on the adapter's event fd with ``poll``, as the server's
controllers do. Per repetition, with fresh keys:

* **store**: one store task of ``chunks`` objects, until its result is popped (it must report success);
* **lookup**: one lookup-and-lock task of the same keys, on a second adapter built the same way (another
  node's server: a fresh client, no memory of what was stored); all must be found;
* **load**: one load task on that second adapter into fresh (zeroed) objects (all must load), then every byte
  is compared with what was stored: a rate over wrong bytes is an error, not a figure. For ``fs`` tiers the
  load is repeated with the files evicted from the page cache;
* untimed: unlock, delete the keys.

A **raw** baseline moves the same bytes through the medium without the adapter, where that is cheap: ``fs``
(write ``chunks`` files, read them back warm and evicted, one thread) and ``resp`` (one pipelined connection:
SET, EXISTS, GET). None for ``s3``, ``valkey``, ``mooncake_store``, ``nixl_store``.

Nothing here imports LMCache at module level: ``import prefixshare.bench`` stays light. Results are plain
dicts (JSON) with medians, min, max over the repetitions; MB are 10^6 bytes.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from prefixshare._log import get_logger
from prefixshare.bench._micro import adapter_env, environment, evict, machine, summary

log = get_logger("prefixshare.bench")

_MB = 1e6
SECTION = "## Measured throughput"


class TierBenchError(RuntimeError):
    """A tier's measurement failed (the adapter could not be built, a task failed, or bytes differ)."""


@dataclass
class TierBenchSettings:
    chunks: int = 16
    chunk_tokens: int = 256
    shape: str = "bench"
    reps: int = 5
    raw: bool = True
    #: seconds one adapter task may take before the tier's measurement fails
    task_timeout_s: float = 120.0
    #: KV bytes per token when given (e.g. a user's model, from the plan's arithmetic), else ``shape``'s
    bytes_per_token: int | None = None

    @property
    def chunk_bytes(self) -> int:
        if self.bytes_per_token is not None:
            return self.chunk_tokens * self.bytes_per_token
        from prefixshare.model import kv_bytes_per_token

        return self.chunk_tokens * kv_bytes_per_token(self.shape)


# --- the adapter, as the MP server builds it ---------------------------------------------------------------


def adapter_spec(tier: Any) -> str:
    """The ``--l2-adapter`` argument the MP server receives for this tier (as ``server_argv`` renders it)."""
    return json.dumps(tier.server_config(), sort_keys=True, separators=(",", ":"))


def label(tier: Any) -> str:
    """A short name for a tier in tables: its type, plus what changes the fs tier's path (integrity)."""
    if tier.type == "fs":
        return f"fs (integrity: {tier.integrity})"
    return str(tier.type)


def build_adapter(tier: Any, l1: Any) -> tuple[Any, Any]:
    """(adapter, parsed config) for ``tier`` through LMCache's parser and factory, with ``l1``'s descriptor."""
    import argparse

    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.config import (
        get_type_name_for_config,
        parse_args_to_l2_adapters_config,
    )

    tier.prepare()
    config = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[adapter_spec(tier)])).adapters[0]
    if config.serde_config is not None:  # the server would wrap the adapter; no tier renders serde today
        raise TierBenchError(f"{label(tier)}: serde wrappers are not measured here")
    with environment({**adapter_env(), **tier.server_env()}):
        adapter = create_l2_adapter(config, l1.get_l1_memory_desc())
    adapter.set_backend_identity(get_type_name_for_config(config), shared=config.shared)
    return adapter, config


def _wait(fd: int, query: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """Poll the adapter's event fd (consuming each signal) until ``query`` answers, as the server's loops do."""
    from lmcache.v1.platform.event_notifier import consume_fd

    poller = select.poll()
    poller.register(fd, select.POLLIN)
    deadline = time.monotonic() + timeout_s
    while True:
        result = query()
        if result is not None:
            return result
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TierBenchError(f"{what} did not complete within {timeout_s:.0f} s")
        for ready, events in poller.poll(min(remaining, 0.2) * 1000):
            if events & select.POLLIN:
                consume_fd(ready)


class _Buffers:
    """2 x ``chunks`` LMCache memory objects from a real L1 memory manager: sources (distinct random bytes) and
    load targets."""

    def __init__(self, chunks: int, chunk_bytes: int) -> None:
        import torch
        from lmcache.v1.distributed.api import MemoryLayoutDesc
        from lmcache.v1.distributed.config import L1MemoryManagerConfig
        from lmcache.v1.distributed.memory_manager.l1_memory_manager import L1MemoryManager

        align = 1 << 12
        per = -(-chunk_bytes // align) * align
        self.manager = L1MemoryManager(L1MemoryManagerConfig(size_in_bytes=2 * chunks * per + (8 << 20),
                                                             use_lazy=False, shm_name=""))
        layout = MemoryLayoutDesc(shapes=[torch.Size([chunk_bytes])], dtypes=[torch.uint8])
        err, objs = self.manager.allocate(layout, 2 * chunks)
        if len(objs) != 2 * chunks:
            self.manager.free(objs)
            self.manager.close()
            raise TierBenchError(f"L1 allocation of {2 * chunks} x {chunk_bytes} B failed: {err}")
        self.src, self.dst = objs[:chunks], objs[chunks:]
        self.chunk_bytes = chunk_bytes
        # plain byte views of the objects' memory (their own ``byte_array`` has format '<B', which file and
        # socket calls accept but slicing assignment does not)
        self.src_views = [_view(o, chunk_bytes) for o in self.src]
        self.dst_views = [_view(o, chunk_bytes) for o in self.dst]
        stride = 64
        base = os.urandom(chunk_bytes + chunks * stride)
        for i, view in enumerate(self.src_views):  # distinct windows: a chunk loaded into the wrong slot is caught
            view[:] = base[i * stride:i * stride + chunk_bytes]

    def clear_targets(self) -> None:
        for obj in self.dst:
            ctypes.memset(obj.data_ptr, 0, self.chunk_bytes)

    def mismatches(self) -> list[int]:
        return [i for i, (s, d) in enumerate(zip(self.src_views, self.dst_views, strict=True)) if s != d]

    def close(self) -> None:
        self.manager.free(self.src + self.dst)
        self.manager.close()


def _view(obj: Any, size: int) -> memoryview:
    return memoryview((ctypes.c_ubyte * size).from_address(obj.data_ptr)).cast("B")


def _mount(path: str) -> str | None:
    """'FSTYPE on DEVICE' of the mount holding ``path`` (from /proc/mounts), or None."""
    try:
        mounts = [line.split()[:3] for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return None
    real = os.path.realpath(path)
    best = max((m for m in mounts if len(m) == 3 and (real == m[1] or real.startswith(m[1].rstrip("/") + "/"))),
               key=lambda m: len(m[1]), default=None)
    return f"{best[2]} on {best[0]}" if best else None


def _fs_files(base_path: str, model: str) -> list[Path]:
    return [p for p in Path(base_path).rglob(f"*{model}*") if p.is_file()]


def measure_adapter(tier: Any, settings: TierBenchSettings, buffers: _Buffers) -> dict[str, Any]:
    """Time store / lookup / load of ``settings.chunks`` chunks through ``tier``'s adapters, ``settings.reps``
    times. Two adapters, as two nodes' servers would hold: a *writer* stores, a *reader* built the same way looks
    up and loads what the writer stored (an adapter answering lookups of its own stores from memory — LMCache's
    S3 adapter does — would otherwise time no request to the medium)."""
    from lmcache.v1.distributed.api import ObjectKey

    n, size, timeout = settings.chunks, buffers.chunk_bytes, settings.task_timeout_s
    total = n * size
    is_fs = tier.type == "fs"
    store_t, lookup_t, load_t, evicted_t, stored_bytes = [], [], [], [], []
    writer, _ = build_adapter(tier, buffers.manager)
    try:
        reader, _ = build_adapter(tier, buffers.manager)
    except BaseException:
        writer.close()
        raise
    try:
        for rep in range(settings.reps):
            model = f"psbench-{uuid.uuid4().hex[:12]}"
            keys = [ObjectKey(chunk_hash=os.urandom(16), model_name=model, kv_rank=0) for _ in range(n)]
            done: dict[int, Any] = {}

            def popped(tid: int) -> Any:
                done.update(writer.pop_completed_store_tasks())
                return done.pop(tid, None)

            t0 = time.perf_counter()
            tid = writer.submit_store_task(keys, buffers.src)
            result = _wait(writer.get_store_event_fd(), lambda tid=tid: popped(tid), timeout, "store")
            store_t.append(time.perf_counter() - t0)
            if not result.is_successful():
                raise TierBenchError(f"store of {n} chunks failed (repetition {rep + 1})")
            stored_bytes.append(int(result.bytes_transferred()))

            t0 = time.perf_counter()
            tid = reader.submit_lookup_and_lock_task(keys, {})
            found = _wait(reader.get_lookup_and_lock_event_fd(),
                          lambda tid=tid: reader.query_lookup_and_lock_result(tid), timeout, "lookup")
            lookup_t.append(time.perf_counter() - t0)
            if found.popcount() != n:
                raise TierBenchError(f"lookup found {found.popcount()} of {n} stored chunks (repetition {rep + 1})")

            for target in [load_t, evicted_t] if is_fs else [load_t]:
                if target is evicted_t:
                    files = _fs_files(tier.base_path, model)
                    if len(files) != n:
                        raise TierBenchError(f"found {len(files)} files of {n} chunks under {tier.base_path}")
                    for path in files:
                        evict(path)
                buffers.clear_targets()
                t0 = time.perf_counter()
                tid = reader.submit_load_task(keys, buffers.dst)
                got = _wait(reader.get_load_event_fd(), lambda tid=tid: reader.query_load_result(tid), timeout,
                            "load")
                target.append(time.perf_counter() - t0)
                if got.popcount() != n:
                    raise TierBenchError(f"load returned {got.popcount()} of {n} chunks (repetition {rep + 1})")
                bad = buffers.mismatches()
                if bad:
                    raise TierBenchError(f"load returned other bytes than were stored for chunks {bad} "
                                         f"(repetition {rep + 1})")
            reader.submit_unlock(keys)
            writer.delete(keys)
    finally:
        reader.close()
        writer.close()

    def rate(times: list[float]) -> dict[str, float]:
        return summary([total / t / _MB for t in times])

    out: dict[str, Any] = {
        "store_mbps": rate(store_t), "lookup_ms": summary([t * 1e3 for t in lookup_t]),
        "lookup_keys_per_s": summary([n / t for t in lookup_t]), "load_mbps": rate(load_t),
        "bytes_equal": True, "chunks_loaded": f"{n}/{n}",
        "store_bytes_reported": sorted(set(stored_bytes)),
    }
    if evicted_t:
        out["load_evicted_mbps"] = rate(evicted_t)
    return out


# --- raw baselines -----------------------------------------------------------------------------------------


def _read_file(path: Path, mv: memoryview) -> None:
    with open(path, "rb", buffering=0) as f:
        got = 0
        while got < len(mv):
            k = f.readinto(mv[got:])
            if not k:
                raise TierBenchError(f"{path} is shorter than written")
            got += k


def raw_fs(base_path: str, settings: TierBenchSettings, buffers: _Buffers) -> dict[str, Any]:
    """``chunks`` files of ``chunk_bytes`` written (page cache, no fsync) and read back, warm and evicted, one
    thread: the medium without the adapter."""
    n, size = settings.chunks, buffers.chunk_bytes
    directory = Path(base_path) / f".psbench-raw-{os.getpid()}"
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / f"chunk-{i}" for i in range(n)]
    writes, warm, cold = [], [], []
    try:
        for _ in range(settings.reps):
            for p in paths:
                p.unlink(missing_ok=True)
            t0 = time.perf_counter()
            for p, view in zip(paths, buffers.src_views, strict=True):
                with open(p, "wb", buffering=0) as f:
                    f.write(view)
            writes.append(time.perf_counter() - t0)
            for target in (warm, cold):
                if target is cold:
                    for p in paths:
                        evict(p)
                buffers.clear_targets()
                t0 = time.perf_counter()
                for p, view in zip(paths, buffers.dst_views, strict=True):
                    _read_file(p, view)
                target.append(time.perf_counter() - t0)
                if buffers.mismatches():
                    raise TierBenchError("raw fs read returned other bytes than were written")
    finally:
        for p in paths:
            p.unlink(missing_ok=True)
        directory.rmdir()

    def rate(times: list[float]) -> dict[str, float]:
        return summary([n * size / t / _MB for t in times])

    return {"what": f"{n} files written and read back by one thread (page cache, no fsync)",
            "store_mbps": rate(writes), "load_mbps": rate(warm), "load_evicted_mbps": rate(cold)}


class _Resp:
    """A minimal RESP client over one socket: pipelined commands, bulk replies read into given buffers."""

    def __init__(self, host: str, port: int, username: str, password: str | None, timeout_s: float) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.reader = self.sock.makefile("rb", buffering=1 << 20)
        if password:
            self.send([[b"AUTH", *([username.encode()] if username else []), password.encode()]])
            self.simple()

    @staticmethod
    def encode(args: list[bytes]) -> list[Any]:
        parts: list[Any] = [b"*%d\r\n" % len(args)]
        for a in args:
            parts += [b"$%d\r\n" % len(a), a, b"\r\n"]
        return parts

    def send(self, commands: list[list[Any]]) -> None:
        for cmd in commands:
            for part in self.encode(cmd):
                self.sock.sendall(part)

    def line(self) -> bytes:
        got = self.reader.readline()
        if not got.endswith(b"\r\n"):
            raise TierBenchError(f"RESP server closed the connection ({got[:40]!r})")
        if got[:1] == b"-":
            raise TierBenchError(f"RESP server answered {got.strip().decode(errors='replace')}")
        return got[:-2]

    def simple(self) -> bytes:
        return self.line()

    def bulk_into(self, mv: memoryview) -> None:
        head = self.line()
        if head[:1] != b"$" or int(head[1:]) != len(mv):
            raise TierBenchError(f"RESP GET answered {head[:40]!r}, expected ${len(mv)}")
        got = 0
        while got < len(mv):
            k = self.reader.readinto(mv[got:])
            if not k:
                raise TierBenchError("RESP server closed the connection mid-reply")
            got += k
        self.line()

    def close(self) -> None:
        self.reader.close()
        self.sock.close()


def raw_resp(tier: Any, settings: TierBenchSettings, buffers: _Buffers) -> dict[str, Any]:
    """The same chunks through one pipelined RESP connection: N SET, one EXISTS of N keys, N GET."""
    from prefixshare.tiers import read_secret

    n, size = settings.chunks, buffers.chunk_bytes
    client = _Resp(tier.host, tier.port, tier.username, read_secret(tier.password_env), settings.task_timeout_s)
    writes, lookups, reads = [], [], []
    try:
        for _ in range(settings.reps):
            tag = uuid.uuid4().hex[:12]
            keys = [f"psbench-raw-{tag}-{i}".encode() for i in range(n)]
            t0 = time.perf_counter()
            client.send([[b"SET", k, view] for k, view in zip(keys, buffers.src_views, strict=True)])
            for _ in keys:
                client.simple()
            writes.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            client.send([[b"EXISTS", *keys]])
            found = int(client.simple()[1:])
            lookups.append(time.perf_counter() - t0)
            if found != n:
                raise TierBenchError(f"raw RESP EXISTS found {found} of {n} keys")
            buffers.clear_targets()
            t0 = time.perf_counter()
            client.send([[b"GET", k] for k in keys])
            for view in buffers.dst_views:
                client.bulk_into(view)
            reads.append(time.perf_counter() - t0)
            if buffers.mismatches():
                raise TierBenchError("raw RESP GET returned other bytes than were SET")
            client.send([[b"DEL", *keys]])
            client.simple()
    finally:
        client.close()

    def rate(times: list[float]) -> dict[str, float]:
        return summary([n * size / t / _MB for t in times])

    return {"what": f"one connection, pipelined: {n} SET, one EXISTS of {n} keys, {n} GET",
            "store_mbps": rate(writes), "lookup_ms": summary([t * 1e3 for t in lookups]), "load_mbps": rate(reads)}


def _raw(tier: Any, settings: TierBenchSettings, buffers: _Buffers) -> dict[str, Any] | None:
    if tier.type == "fs":
        return raw_fs(tier.base_path, settings, buffers)
    if tier.type == "resp":
        return raw_resp(tier, settings, buffers)
    return None


# --- all tiers of a policy ---------------------------------------------------------------------------------


def measure_tier(tier: Any, settings: TierBenchSettings) -> dict[str, Any]:
    """One tier's figures (and its raw baseline where there is one); ``error`` instead when it failed."""
    entry: dict[str, Any] = {"tier": label(tier), "type": tier.type, "describe": tier.describe(),
                             "adapter_config": tier.redacted()}
    cfg = tier.server_config()
    entry["adapter"] = (f"{cfg['module_path']}.{cfg['class_name']}" if cfg.get("type") == "plugin"
                        else f"lmcache {cfg.get('type')}")
    if tier.type == "fs":
        entry["medium"] = _mount(tier.base_path)
    entry["load_average_before"] = [round(x, 2) for x in os.getloadavg()]
    unreachable = tier.probe(timeout_s=2.0)  # LMCache's RESP client retries a dead server instead of failing
    if unreachable:
        log.warning("tier_bench_unreachable", tier=label(tier), reason=unreachable)
        entry["error"] = f"unreachable: {unreachable}"
        return entry
    buffers = _Buffers(settings.chunks, settings.chunk_bytes)
    try:
        entry.update(measure_adapter(tier, settings, buffers))
        if settings.raw:
            raw = _raw(tier, settings, buffers)
            if raw is not None:
                entry["raw"] = raw
                entry["adapter_over_raw"] = {
                    key: entry[key]["median"] / raw[key]["median"]
                    for key in ("store_mbps", "load_mbps", "load_evicted_mbps") if key in entry and key in raw
                }
    except Exception as exc:  # noqa: BLE001 - one tier's failure is reported, the others are still measured
        log.warning("tier_bench_failed", tier=label(tier), error=str(exc))
        entry["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        buffers.close()
    entry["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    return entry


def measure_tiers(policy: Any, settings: TierBenchSettings, *, log_line: Callable[[str], None] | None = None,
                  command: str = "") -> dict[str, Any]:
    """Every L2 tier of ``policy``, in order, each on its own adapter and buffers."""
    results: dict[str, Any] = {
        "kind": "tier throughput", "command": command, "machine": machine(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "settings": {**asdict(settings), "chunk_bytes": settings.chunk_bytes},
        "units": "MB/s = 10^6 bytes per second; medians, min, max over the repetitions",
        "tiers": [],
    }
    with environment(adapter_env()):  # LMCache's loggers made while measuring stay at its quiet level
        for tier in policy.l2:
            if log_line:
                log_line(f"tier {label(tier)}: {settings.reps} x ({settings.chunks} chunks of "
                         f"{settings.chunk_bytes / 2**20:.2f} MiB)")
            started = time.perf_counter()
            entry = measure_tier(tier, settings)
            entry["seconds"] = round(time.perf_counter() - started, 2)
            results["tiers"].append(entry)
    results["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    return results


# --- publishing ----------------------------------------------------------------------------------------------


def _fmt(s: dict[str, float] | None, digits: int = 0) -> str:
    if not s or not s.get("n"):
        return "–"
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


def markdown(results: dict[str, Any]) -> str:
    """The "Measured throughput" section of docs/tiers.md for these results."""
    st, m = results["settings"], results["machine"]
    lines = [
        SECTION,
        "",
        f"Each tier's adapter built as the MP server builds it (LMCache's parser and factory on the tier's "
        f"`--l2-adapter` JSON), driven directly: {st['chunks']} chunks of {st['chunk_bytes'] / 2**20:.2f} MiB "
        f"({st['chunk_tokens']} tokens of the `{st['shape']}` model) per task, LMCache memory objects from an L1 "
        f"memory manager, completion awaited on the adapters' event fds. One adapter stores; a second one, built "
        f"the same way (another node's server), looks up and loads; every load is compared byte for byte with "
        f"what was stored. Median (min–max) of {st['reps']} repetitions; MB/s = 10^6 B/s; lookup = one "
        f"lookup-and-lock task of {st['chunks']} keys. *raw*: the same bytes through the medium without the "
        "adapter (fs: one thread writing and reading the files; Redis: one pipelined connection, SET / EXISTS / "
        "GET).",
        "",
        "| tier | store MB/s | lookup ms | load MB/s | load, page cache evicted | raw store | raw load | "
        "adapter/raw store | adapter/raw load |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for t in results["tiers"]:
        if "error" in t:
            lines.append(f"| {t['tier']} | failed: {t['error']} | | | | | | | |")
            continue
        raw, ratio = t.get("raw") or {}, t.get("adapter_over_raw") or {}
        raw_load = _fmt(raw.get("load_mbps"))
        if raw.get("load_evicted_mbps"):
            raw_load += f"; evicted {_fmt(raw['load_evicted_mbps'])}"
        r_load = f"{ratio['load_mbps']:.2f}" if "load_mbps" in ratio else "–"
        if "load_evicted_mbps" in ratio:
            r_load += f"; evicted {ratio['load_evicted_mbps']:.2f}"
        lines.append(
            f"| {t['tier']} | {_fmt(t['store_mbps'])} | {_fmt(t['lookup_ms'], 1)} | {_fmt(t['load_mbps'])} | "
            f"{_fmt(t.get('load_evicted_mbps'))} | {_fmt(raw.get('store_mbps'))} | {raw_load} | "
            f"{ratio['store_mbps']:.2f} | {r_load} |" if ratio else
            f"| {t['tier']} | {_fmt(t['store_mbps'])} | {_fmt(t['lookup_ms'], 1)} | {_fmt(t['load_mbps'])} | "
            f"{_fmt(t.get('load_evicted_mbps'))} | – | – | – | – |")
    loads = [t.get("load_average_before") for t in results["tiers"]] + [results.get("load_average_end")]
    one_min = [la[0] for la in loads if la]
    versions = ", ".join(f"{k} {v}" for k, v in m.get("versions", {}).items() if k in ("lmcache", "prefixshare"))
    lines += [
        "",
        f"Machine: {m.get('cpu')}, {m.get('cores_usable') or m.get('cores')} usable cores, {m.get('memory_gb')} GB "
        f"memory, {m.get('os')}, Python {m.get('python')}, {versions}; load average (1 min) "
        f"{min(one_min, default=0):.1f}–{max(one_min, default=0):.1f} during the run (the cores are shared with "
        f"other test runs: spreads are theirs). Measured {results.get('started', '')}.",
        "",
        "Reproduce:",
        "",
        "```sh",
        results.get("command") or "prefixshare bench --tiers POLICY.yaml",
        "```",
        "",
        "Figures: [benchmarks/tiers.json](benchmarks/tiers.json). For your own tiers: "
        "`prefixshare bench --tiers POLICY.yaml` (`--tier-chunks`, `--tier-chunk-tokens`, `--shape`, `--runs`).",
    ]
    reading = _reading(results)
    if reading:
        lines += ["", "Reading it:", "", *reading]
    notes = results.get("notes")
    if notes:
        lines += ["", *notes]
    return "\n".join(lines) + "\n"


def _integrity_cost(checked: dict[str, Any], plain: dict[str, Any], digest: str) -> str:
    """One line: a checked fs tier's medians over the plain adapter's."""
    keys = {"store_mbps": "store", "load_mbps": "load from the page cache", "load_evicted_mbps": "load from the device"}

    def overlap(k: str) -> bool:
        return checked[k]["min"] <= plain[k]["max"] and plain[k]["min"] <= checked[k]["max"]

    parts = [f"{what} {checked[k]['median'] / plain[k]['median']:.2f}x"
             f"{' (min–max ranges overlap)' if overlap(k) else ''}" for k, what in keys.items()]
    return (f"- *fs, integrity {digest} vs off* (median of the checked adapter over the plain one): "
            f"{', '.join(parts)}. The checked adapter adds one {digest} pass per chunk on store and on load, and "
            "moves a request's chunks io_threads at a time (from 2026-12-04; runs before that moved them one "
            "after another).")


def _reading(results: dict[str, Any]) -> list[str]:
    """Observations that follow from the figures themselves (regenerated with them)."""
    ok = {t["tier"]: t for t in results["tiers"] if "error" not in t}
    out: list[str] = []
    media = sorted({t["medium"] for t in ok.values() if t.get("medium")})
    if media:
        out.append(f"- *fs* directories on {', '.join(media)}; \"evicted\": the chunk files dropped from the page "
                   "cache (fsync, then `posix_fadvise(DONTNEED)`) before the load, so the bytes come from the device.")
    plain = ok.get("fs (integrity: none)")
    for digest in ("xxh3", "blake3"):
        checked = ok.get(f"fs (integrity: {digest})")
        if checked and plain:
            out.append(_integrity_cost(checked, plain, digest))
    if "s3" in ok:
        out.append(
            f"- *s3*: lookup = {results['settings']['chunks']} HEAD requests from the reading adapter. The adapter "
            "that stored the chunks answers its own lookups from memory (LMCache's S3 adapter caches the sizes of "
            "what it stored), which is why the lookup and load are timed on a second adapter: a replica on another "
            "node pays the HEADs.")
    if "resp" in ok and ok["resp"].get("raw"):
        out.append(
            "- *resp*: the adapter runs `num_workers` connections (8 by default), the raw baseline one: a ratio "
            "above 1 is the adapter's parallelism, not a faster medium.")
    return out


def write_docs(results: dict[str, Any], docs: Path) -> Path:
    """Replace (or append) the "Measured throughput" section of ``docs``; the rest of the page is untouched."""
    text = docs.read_text() if docs.exists() else ""
    section = markdown(results)
    start = text.find(SECTION + "\n")
    if start < 0:
        text = text.rstrip("\n") + ("\n\n" if text else "") + section
    else:
        end = text.find("\n## ", start + len(SECTION))
        rest = text[end + 1:] if end >= 0 else ""
        text = text[:start] + section + ("\n" + rest if rest else "")
    docs.write_text(text)
    return docs


def write_results(results: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, default=str) + "\n")
    return path
