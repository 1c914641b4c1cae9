"""What every connector enforces, whatever the engine: namespace, admission, bounded loads, stats.

A :class:`ConnectorRuntime` is built inside the engine's processes (scheduler side and worker side)
from the connector's extra config alone, so requests that arrive through an engine's HTTP server are
covered exactly like those of application code. It

* computes the engine's compatibility fingerprint and turns it into the store namespace
  (``prefixshare-<digest>``): KV written under another fingerprint is never looked up;
* writes the fingerprint's manifest beside the store and, when the store holds KV of other
  fingerprints only, logs once which fields differ;
* decides per request whether its KV may be stored (the policy's admission rules), and maps a request's
  tenant to a cache salt so tenants never hit each other;
* keeps counters (hits, tokens loaded and stored, bytes, lookup/load latency, refusals by reason,
  fallbacks) and publishes them as a JSON snapshot that :meth:`PrefixShare.stats` reads.

Nothing is written on the request path: a finished request only marks its runtime's snapshot out of date
(an in-memory counter, shared with readers through a small memory-mapped ``.seq`` file beside the
snapshot), and one daemon thread per process writes the snapshots (and the cost model's estimates) at most
every ``PUBLISH_INTERVAL_S``. :func:`read_stats` waits for a live process's snapshot to catch up with its
counter, so a reader never sees counters older than the requests it saw finish.
"""

from __future__ import annotations

import atexit
import functools
import json
import mmap
import os
import re
import struct
import threading
import time
import weakref
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3

from prefixshare import _metrics
from prefixshare._log import get_logger
from prefixshare._paths import run_dir
from prefixshare.adapters._cost import CostModel, info_enabled, store_key
from prefixshare.fingerprint import EngineSettings, Fingerprint, compute_fingerprint, explain, write_manifest
from prefixshare.plan import kv_bytes_per_token, shape_from_config
from prefixshare.policies import AdmissionRequest, ByteBudget, Decision, Rule
from prefixshare.policy import Policy, policy_from_mapping

#: keys of the connector's extra config (and of per-request kv_transfer_params) that are ours
KEY_POLICY = "prefixshare.policy"
KEY_POLICY_FILE = "prefixshare.policy_file"
KEY_INSTANCE = "prefixshare.instance"
KEY_EXPECT = "prefixshare.fingerprint"
REQ_DOCUMENT = "prefixshare.document_id"
REQ_TENANT = "prefixshare.tenant"
REQ_PREFIX_TOKENS = "prefixshare.prefix_tokens"
REQ_STORE = "prefixshare.store"

_SAFE = re.compile(r"^[A-Za-z0-9._-]{1,48}$")


def tenant_salt(tenant: str) -> str:
    """A cache-salt component for a tenant: readable when safe, else a digest (salts forbid '@', '/')."""
    return f"t-{tenant}" if _SAFE.match(tenant) else "t-" + blake3.blake3(tenant.encode()).hexdigest()[:24]


def store_salt(tenant: str | None, request_salt: str | None, lora_name: str | None = None) -> str | None:
    """The cache salt a request's store keys carry: its tenant's, its LoRA adapter's and its own salt, joined.

    The engine's own salt set to the tenant's (what ``prompt_for`` does, to split the engine's prefix cache by
    tenant too) is not a second component: the store key is the same with or without it. Salts may not hold
    '@' or '/' (they are part of file names), so a long or unsafe one becomes a digest.
    """
    parts = [tenant_salt(tenant)] if tenant else []
    if lora_name:
        parts.append("lora-" + blake3.blake3(lora_name.encode()).hexdigest()[:12])
    if request_salt and not (parts and request_salt == parts[0] and tenant):
        parts.append(request_salt)
    if not parts:
        return request_salt
    salt = "-".join(parts)
    return salt if len(salt) <= 128 and "@" not in salt and "/" not in salt else (
        "s-" + blake3.blake3(salt.encode()).hexdigest()[:40]
    )


@functools.lru_cache(maxsize=256)
def _u32_packer(n: int) -> Any:
    return struct.Struct(f"<{n}I").pack


def token_bytes(ids: Any) -> bytes:
    """Token ids as little-endian u32, packed in one C call (~3.5 ns a token, no per-token Python work); ids that do
    not fit a u32 (none of any real vocabulary) are packed as u64 behind a marker, whose length can never equal
    a u32 packing's."""
    try:
        return _u32_packer(len(ids))(*ids)
    except struct.error:
        return b"\xffq" + struct.pack(f"<{len(ids)}q", *ids)


#: version of :func:`admission_digest`'s encoding. Admission digests are never persisted (the frequency rule's
#: sightings and the byte budget's commitments live in the connector's memory), so a new version needs no
#: migration; it only must be the same in the connector and in :mod:`prefixshare.warm` (tests/test_warm.py).
#: v1 was blake3 of the JSON list of the ids (~0.4 ms at 8k tokens); v2 is keyed blake3 of ``token_bytes``.
ADMISSION_DIGEST_VERSION = 2
_ADMISSION_KEY = blake3.blake3(f"prefixshare admission digest v{ADMISSION_DIGEST_VERSION}".encode()).digest()


def admission_digest(ids: Any, chunk_size: int) -> str | None:
    """The prefix digest the admission rules see (``AdmissionRequest.prefix_digest``): keyed blake3 of the
    chunk-aligned token ids (``token_bytes``), 32 hex; None below one chunk. ``prefixshare.warm`` uses it too."""
    aligned = len(ids) - len(ids) % chunk_size
    if not aligned:
        return None
    data = token_bytes(ids if aligned == len(ids) else ids[:aligned])
    return blake3.blake3(data, key=_ADMISSION_KEY).hexdigest()[:32]


def namespace(fp: Fingerprint) -> str:
    """The store namespace of a fingerprint: what the MP server sees as the model name."""
    return f"prefixshare-{fp.digest[:20]}"


def engine_fingerprint(policy: Policy, model_dir: str, settings: EngineSettings, *,
                       tokenizer_dir: str | None = None) -> Fingerprint:
    """The fingerprint an engine with these settings namespaces the store with: the one place the connectors
    and ``warm`` compute it, so a warm checks exactly the objects the engine's replicas will look up."""
    settings = settings.model_copy(update={"chunk_size": policy.chunk_size, "tenant": policy.tenant})
    return compute_fingerprint(model_dir, settings, weights=policy.fingerprint.weights,
                               revision=policy.fingerprint.revision, tokenizer_dir=tokenizer_dir)


def manifest_url(policy: Policy) -> str | None:
    """Where manifests live: ``fingerprint.manifests``, else beside the first directory tier (None: nowhere)."""
    if policy.fingerprint.manifests:
        return policy.fingerprint.manifests
    for tier in policy.l2:
        path = getattr(tier, "base_path", None)
        if path:
            return str(path)
    return None


def load_policy(extra: dict[str, Any]) -> Policy:
    if KEY_POLICY in extra:
        raw = extra[KEY_POLICY]
        return policy_from_mapping(json.loads(raw) if isinstance(raw, str) else dict(raw), source="connector config")
    if KEY_POLICY_FILE in extra:
        return Policy.from_yaml(str(extra[KEY_POLICY_FILE]))
    return policy_from_mapping({}, source="default")


def _budget_rules(rule: Rule | None) -> list[ByteBudget]:
    found: list[ByteBudget] = []
    stack = [rule] if rule is not None else []
    while stack:
        node = stack.pop()
        if isinstance(node, ByteBudget):
            found.append(node)
        stack.extend(getattr(node, "rules", ()))
        inner = getattr(node, "rule", None)
        if isinstance(inner, Rule):
            stack.append(inner)
    return found


_STORE_DISABLED = Decision(False, "request: store disabled", "request")
_NO_RULES = Decision(True, "no admission rules", "default")


@dataclass
class RequestInfo:
    """What the connector knows of one request, from admission to finish."""

    request_id: str
    prompt_tokens: int
    document_id: str | None = None
    tenant: str | None = None
    admitted: bool = True
    reason: str = ""
    store_limit: int | None = None
    lookup_started: float | None = None
    lookup_s: float | None = None
    loaded_tokens: int = 0
    load_started: float | None = None
    load_s: float | None = None
    fallback: str | None = None
    stored_tokens: int = 0
    admission_request: AdmissionRequest | None = None


@dataclass
class Stats:
    requests: int = 0
    lookups: int = 0
    hits: int = 0
    tokens_loaded: int = 0
    tokens_stored: int = 0
    bytes_loaded: int = 0
    bytes_stored: int = 0
    fallbacks: Counter[str] = field(default_factory=Counter)
    admitted: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    # the newest latencies only (a long-running engine must not grow these, nor sort them all on every publish)
    lookup_ms: deque[float] = field(default_factory=lambda: deque(maxlen=1024))
    load_ms: deque[float] = field(default_factory=lambda: deque(maxlen=1024))

    def to_dict(self) -> dict[str, Any]:
        def summary(values: deque[float]) -> dict[str, float | int | None]:
            ordered = sorted(values)
            return {
                "count": len(ordered),
                "median": ordered[len(ordered) // 2] if ordered else None,
                "max": ordered[-1] if ordered else None,
            }

        return {
            "requests": self.requests,
            "lookups": self.lookups,
            "hits": self.hits,
            "tokens_loaded": self.tokens_loaded,
            "tokens_stored": self.tokens_stored,
            "bytes_loaded": self.bytes_loaded,
            "bytes_stored": self.bytes_stored,
            "admitted": self.admitted,
            "refused": dict(self.refused),
            "fallbacks": dict(self.fallbacks),
            "lookup_ms": summary(self.lookup_ms),
            "load_ms": summary(self.load_ms),
        }


class ConnectorRuntime:
    """Engine-agnostic enforcement shared by the vLLM and SGLang connectors."""

    def __init__(
        self,
        extra: dict[str, Any],
        *,
        model_dir: str,
        settings: EngineSettings,
        role: str,
        tokenizer_dir: str | None = None,
    ) -> None:
        self.policy = load_policy(extra)
        self.role = role
        self.engine = settings.engine
        self.instance = str(extra.get(KEY_INSTANCE) or f"{settings.engine}-{os.getpid()}")
        self.fingerprint = engine_fingerprint(self.policy, model_dir, settings, tokenizer_dir=tokenizer_dir)
        expected = extra.get(KEY_EXPECT)
        if expected and expected != self.fingerprint.digest:
            from prefixshare.errors import IncompatibleError

            raise IncompatibleError(
                [f"the engine's fingerprint {self.fingerprint.short} differs from the one prefixshare computed "
                 f"before starting it ({str(expected)[:12]}); the model files changed in between"]
            )
        self.namespace = namespace(self.fingerprint)
        self.log = get_logger(
            "prefixshare.connector", engine=settings.engine, role=role, instance=self.instance,
            fingerprint=self.fingerprint.short,
        )
        self.rule = self.policy.admission_rule()
        self._budgets = _budget_rules(self.rule)
        shape = shape_from_config(Path(model_dir) / "config.json" if Path(model_dir).is_dir() else model_dir)
        self.kv_bytes_per_token = kv_bytes_per_token(shape, self.fingerprint.engine.kv_dtype)
        self.stats = Stats()
        self._lora_ids: dict[tuple[str, str | None], str] = {}
        self.requests: dict[str, RequestInfo] = {}
        #: cost-aware loading (scheduler side): estimates, decisions and their outcomes (see adapters._cost)
        self.cost = CostModel(self.namespace, store=store_key(self.policy), kv_bytes_per_token=self.kv_bytes_per_token,
                              chunk_size=self.policy.chunk_size, mode=self.policy.load.mode,
                              log=self.log) if role == "scheduler" else None
        self._lock = threading.Lock()
        self._stats_path = run_dir() / "stats" / f"{self.instance}-{role}-{os.getpid()}.json"
        self._stats_path.parent.mkdir(parents=True, exist_ok=True)
        #: bumped on the request path whenever the snapshot is out of date; readers compare it with the snapshot's
        self._seq = _SharedCounter(self._stats_path.with_suffix(".seq"))
        self._write_lock = threading.Lock()
        self._written = -1  # the counter value the newest written snapshot covers
        self._last_publish = 0.0
        self._queued = False  # waiting for the writer thread
        self._closed = False
        if self.cost is not None:
            self.cost.defer = self._mark  # its estimates are persisted by the writer thread as well
        self._down_since: float | None = None
        self._next_probe = 0.0
        if role == "scheduler":
            self._check_store()
        _LIVE.add(self)
        self.publish(force=True)
        self.log.info("connector.ready", namespace=self.namespace, chunk_size=self.policy.chunk_size)

    # --- store manifests -----------------------------------------------------------------------------
    def _check_store(self) -> None:
        url = manifest_url(self.policy)
        if url is None:
            return
        try:
            report = explain(url, self.fingerprint)
            if report and all(diffs for _, diffs in report):
                manifest, diffs = report[0]
                self.log.warning(
                    "store.incompatible",
                    message="the store holds KV of other fingerprints only; nothing of it will be loaded",
                    closest=manifest.fingerprint.short,
                    differences=[d.message for d in diffs],
                )
            write_manifest(url, self.fingerprint, extra={"namespace": self.namespace, "instance": self.instance})
        except Exception as exc:  # a store we cannot annotate must not stop serving
            self.log.warning("store.manifest_failed", error=str(exc), store=url)

    # --- health gate -----------------------------------------------------------------------------------
    PROBE_INTERVAL_S = 1.0

    def store_available(self) -> bool:
        """False while the store is known to be down: requests then skip it entirely (no lookup, no store)
        instead of each waiting out the timeout. The server's health endpoint and every tier are probed
        at most once a second, and sharing resumes as soon as they answer."""
        if self._down_since is None:
            return True
        now = time.monotonic()
        if now < self._next_probe:
            return False
        self._next_probe = now + self.PROBE_INTERVAL_S
        healthy = self.probe() is None
        if healthy:
            self.log.warning("store.recovered", down_s=round(now - self._down_since, 2))
            self._down_since = None
        return healthy

    def probe(self) -> str | None:
        """None when the server and every L2 tier answer, else why not (cheap; no retries)."""
        try:
            import httpx

            if httpx.get(self.policy.server.http_url + "/healthcheck", timeout=0.25).status_code != 200:
                return f"the LMCache server at {self.policy.server.http_url} is not healthy"
        except Exception as exc:  # noqa: BLE001 - any failure means: down
            return f"the LMCache server at {self.policy.server.http_url} does not answer ({exc})"
        for tier in self.policy.l2:
            reason = tier.probe()
            if reason is not None:
                return f"tier {tier.describe()}: {reason}"
        return None

    def mark_down(self, reason: str) -> None:
        if self._down_since is None:
            self._down_since = time.monotonic()
            self._next_probe = self._down_since + self.PROBE_INTERVAL_S
            self.log.warning("store.down", reason=reason, probe=self.probe(),
                             action="skip the store until the server and its tiers answer again")

    # --- per request -----------------------------------------------------------------------------------
    def begin(self, request_id: str, prompt_token_ids: list[int] | tuple[int, ...], params: dict[str, Any] | None,
              lora_name: str | None = None) -> RequestInfo:
        """Admission and identity of a new request (scheduler side). Idempotent per request id."""
        with self._lock:
            info = self.requests.get(request_id)
            if info is not None:
                return info
        params = params or {}
        doc = params.get(REQ_DOCUMENT)
        tenant = params.get(REQ_TENANT)
        prefix_tokens = params.get(REQ_PREFIX_TOKENS)
        n = len(prompt_token_ids)
        info = RequestInfo(request_id, n, document_id=doc, tenant=tenant)
        if params.get(REQ_STORE) is False:
            decision = _STORE_DISABLED
        elif self.rule is None:
            decision = _NO_RULES
        else:
            keyed = min(n, int(prefix_tokens)) if prefix_tokens else n
            aligned = keyed - keyed % self.policy.chunk_size
            # only rules read the digest (frequency, byte budget): without rules it is not computed (~32 us at 8k)
            digest = admission_digest(prompt_token_ids if aligned == n else prompt_token_ids[:aligned],
                                      self.policy.chunk_size) if aligned else None
            req = AdmissionRequest(
                prompt_tokens=n, document_id=doc, tenant=tenant, prefix_digest=digest,
                kv_bytes=aligned * self.kv_bytes_per_token,
            )
            info.admission_request = req
            decision = self.rule(req)
        info.admitted, info.reason = decision.admit, decision.reason
        if prefix_tokens:
            info.store_limit = int(prefix_tokens)
        reason = decision.reason.split(":", 1)[0]
        with self._lock:
            self.requests[request_id] = info
            self.stats.requests += 1
            if decision.admit:
                self.stats.admitted += 1
            else:
                self.stats.refused[reason] += 1
        _metrics.admission(self.engine, decision.admit, reason)
        return info

    def lora_id(self, name: str | None, path: str | None) -> str | None:
        """What salts a LoRA request's keys: the adapter's name AND a digest of its files (config and weights),
        so two replicas serving different adapters under one name never share KV. Hashed once per adapter and
        process (file digests are cached by path, size and mtime); a path that cannot be read falls back to
        the name alone, with a warning."""
        if name is None:
            return None
        key = (name, path)
        cached = self._lora_ids.get(key)
        if cached is not None:
            return cached
        lora_id = name
        if path:
            from prefixshare.fingerprint import DigestCache
            from prefixshare.fingerprint._compute import _lora_info

            try:
                with DigestCache() as cache:
                    lora_id = f"{name}\0{_lora_info(name, path, cache).digest}"
            except Exception as exc:  # noqa: BLE001 - a remote or missing adapter path: the name still separates
                self.log.warning("lora.unhashed", lora=name, path=path, reason=str(exc),
                                 effect="keys salted by the adapter name only")
        self._lora_ids[key] = lora_id
        return lora_id

    def salt(self, info: RequestInfo, request_salt: str | None, lora_name: str | None = None) -> str | None:
        return store_salt(info.tenant, request_salt, lora_name)

    def lookup_done(self, info: RequestInfo, hit_tokens: int, seconds: float | None) -> None:
        with self._lock:
            self.stats.lookups += 1
            if seconds is not None:
                self.stats.lookup_ms.append(seconds * 1e3)
                info.lookup_s = seconds
            if hit_tokens > 0:
                self.stats.hits += 1
                info.loaded_tokens = hit_tokens
                info.load_started = time.monotonic()
        if seconds is not None:
            _metrics.lookup(self.engine, seconds, hit_tokens)

    def load_done(self, request_id: str) -> None:
        with self._lock:
            info = self.requests.get(request_id)
            if info is None or info.load_started is None or info.load_s is not None:
                return
            info.load_s = time.monotonic() - info.load_started
            self.stats.load_ms.append(info.load_s * 1e3)
        _metrics.load(self.engine, info.load_s, info.loaded_tokens, info.loaded_tokens * self.kv_bytes_per_token)

    def fallback(self, info: RequestInfo | None, reason: str) -> None:
        if reason in ("lookup_timeout", "store_down"):
            self.mark_down(reason)
        with self._lock:
            self.stats.fallbacks[reason] += 1
            if info is not None:
                info.fallback = reason
                info.loaded_tokens = 0
        _metrics.fallback(self.engine, reason)
        self.log.warning("load.fallback", reason=reason, request_id=info.request_id if info else None,
                         action="recompute")

    def finish(self, request_id: str, stored_tokens: int) -> RequestInfo | None:
        with self._lock:
            info = self.requests.pop(request_id, None)
            if info is None:
                return None
            stored = stored_tokens if info.admitted else 0
            self.stats.tokens_stored += stored
            self.stats.bytes_stored += stored * self.kv_bytes_per_token
            self.stats.tokens_loaded += info.loaded_tokens
            self.stats.bytes_loaded += info.loaded_tokens * self.kv_bytes_per_token
        if stored:
            _metrics.stored(self.engine, stored, stored * self.kv_bytes_per_token)
        if stored and info.admission_request is not None:
            for budget in self._budgets:
                budget.commit(info.admission_request)
        if info_enabled():
            self.log.info(
                "request.finished", request_id=request_id, prompt_tokens=info.prompt_tokens,
                loaded_tokens=info.loaded_tokens, stored_tokens=stored, admitted=info.admitted, reason=info.reason,
                document_id=info.document_id, tenant=info.tenant, fallback=info.fallback,
                lookup_ms=round(info.lookup_s * 1e3, 2) if info.lookup_s is not None else None,
            )
        self.publish()
        return info

    # --- stats snapshot ------------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            data = self.stats.to_dict()
        return {
            "instance": self.instance, "role": self.role, "pid": os.getpid(), "namespace": self.namespace,
            "fingerprint": self.fingerprint.digest, "kv_bytes_per_token": self.kv_bytes_per_token,
            "updated_at": time.time(), **data, **({"cost": self.cost.snapshot()} if self.cost is not None else {}),
        }

    #: a runtime's snapshot is written at most this often (by the writer thread, never on the request path)
    PUBLISH_INTERVAL_S = 0.05

    def publish(self, force: bool = False) -> None:
        """Mark the snapshot out of date: the writer thread writes it within ``PUBLISH_INTERVAL_S`` (at once when it
        was idle). This is all a request pays: a counter in shared memory and, at most once per write, a hand-off
        to the writer. ``force``: write it now, in this thread (start-up, shutdown)."""
        if force:
            self.flush()
        else:
            self._mark()

    def _mark(self) -> None:
        self._seq.bump()
        if not self._queued and not self._closed:
            self._queued = True
            _writer().submit(self)

    def flush(self, cost: bool = True) -> None:
        """Write the snapshot (and, with ``cost``, the cost model's estimates when they changed) now, in the calling
        thread."""
        with self._write_lock:
            seq = self._seq.value
            self._last_publish = time.monotonic()
            tmp = self._stats_path.with_suffix(f".{threading.get_ident()}.tmp")
            try:
                tmp.write_text(json.dumps({**self.snapshot(), "seq": seq}))
                tmp.replace(self._stats_path)
                self._written = seq
            except OSError as exc:
                self.log.warning("stats.publish_failed", error=str(exc))
            if cost and self.cost is not None:
                self.cost.save(force=True)

    def _background_write(self) -> bool:
        """The writer thread's turn: the snapshot when it changed, the cost estimates at most once a second (the
        estimates file is read, merged and written: ~0.5 ms). True while something is left to write."""
        if self.dirty:
            self.flush(cost=False)
        if self._cost_pending():
            self.cost.save()  # type: ignore[union-attr]
            return self._cost_pending()
        return False

    def _cost_pending(self) -> bool:
        return self.cost is not None and self.cost._dirty and self.cost.path is not None

    @property
    def dirty(self) -> bool:
        """True while the published snapshot is older than the counters."""
        return self._written != self._seq.value

    @property
    def pending(self) -> bool:
        """True while the snapshot or the cost model's estimates are not written yet."""
        return self.dirty or self._cost_pending()

    def close(self) -> None:
        """Write the final snapshot and stop publishing (idempotent; also run at interpreter exit)."""
        if self._closed:
            return
        self._closed = True
        _LIVE.discard(self)
        if self.pending:
            self.flush()
        self._seq.close()


# --- publishing off the request path ------------------------------------------------------------------------


class _SharedCounter:
    """A counter other processes can read: 8 bytes of a memory-mapped file beside the snapshot. Bumping it is a
    store to memory (no system call); :func:`read_stats` reads the file to see whether a snapshot is behind."""

    def __init__(self, path: Path) -> None:
        self.path: Path | None = path
        self._map: mmap.mmap | None = None
        self._view: Any = [0]
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o640)
            try:
                os.ftruncate(fd, 8)
                self._map = mmap.mmap(fd, 8)
            finally:
                os.close(fd)
            self._view = memoryview(self._map).cast("Q")
        except (OSError, ValueError):  # still counts; readers just cannot wait for this process
            self.path = None

    def bump(self) -> None:
        self._view[0] += 1

    @property
    def value(self) -> int:
        return int(self._view[0])

    def detach(self) -> None:
        """In a forked child: keep counting privately (the parent's file and its readers are the parent's)."""
        self._view, self._map, self.path = [self.value], None, None

    def close(self) -> None:
        value = self.value
        if self._map is not None:
            self._view.release()
            self._map.close()
            self._map = None
        self._view = [value]
        if self.path is not None:
            self.path.unlink(missing_ok=True)  # a closed runtime's snapshot is final: nothing to wait for
            self.path = None


def read_counter(path: Path) -> int | None:
    """The value of a :class:`_SharedCounter` file (None when there is none)."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    return struct.unpack("=Q", data)[0] if len(data) == 8 else None


class _Writer:
    """The one daemon thread per process that writes runtimes' snapshots off the request path.

    While requests come it ticks every ``PUBLISH_INTERVAL_S`` and writes the snapshots marked since the last tick:
    handing one over is a list append under an uncontended lock, no system call. After ``PARK_AFTER_S`` without
    anything to write it parks on an event; the next request wakes it (one futex call) and is written at once."""

    PARK_AFTER_S = 1.0

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._lock = threading.Lock()
        self._pending: list[ConnectorRuntime] = []
        self._wake = threading.Event()
        self.parked = False
        self.thread = threading.Thread(target=self._run, name="prefixshare-stats", daemon=True)
        self.thread.start()

    def submit(self, rt: ConnectorRuntime) -> None:
        with self._lock:
            self._pending.append(rt)
        if self.parked:
            self.parked = False
            self._wake.set()

    def _run(self) -> None:
        idle_since = time.monotonic()
        while True:
            with self._lock:
                batch, self._pending = self._pending, []
            now = time.monotonic()
            if not batch:
                if now - idle_since < self.PARK_AFTER_S:
                    time.sleep(self.interval)
                    continue
                self.parked = True
                with self._lock:
                    if self._pending:  # handed over just before it parked: nobody will wake it
                        self.parked = False
                        continue
                self._wake.wait()
                self._wake.clear()
                idle_since = time.monotonic()
                continue
            idle_since = now
            later: list[ConnectorRuntime] = []
            for rt in dict.fromkeys(batch):
                if rt._closed:
                    continue  # close() wrote the final snapshot
                if rt.dirty and now - rt._last_publish < rt.PUBLISH_INTERVAL_S:
                    later.append(rt)  # written moments ago (a reader flushed it): keep the interval
                    continue
                rt._queued = False  # a request finishing from here on hands it over again
                try:
                    if rt._background_write():
                        later.append(rt)  # the cost estimates wait for their interval: come back
                except Exception as exc:  # noqa: BLE001 - the writer must survive whatever one snapshot does
                    rt.log.warning("stats.publish_failed", error=str(exc))
            if later:
                with self._lock:
                    self._pending.extend(later)
            time.sleep(self.interval)


_LIVE: weakref.WeakSet[ConnectorRuntime] = weakref.WeakSet()
_WRITER: _Writer | None = None
_WRITER_LOCK = threading.Lock()


def _writer() -> _Writer:
    global _WRITER
    writer = _WRITER
    if writer is None:
        with _WRITER_LOCK:
            if _WRITER is None:
                _WRITER = _Writer(ConnectorRuntime.PUBLISH_INTERVAL_S)
            writer = _WRITER
    return writer


def _close_all() -> None:
    """At interpreter exit: every runtime still open writes its final snapshot."""
    for rt in list(_LIVE):
        try:
            rt.close()
        except Exception:  # noqa: BLE001, S110 - exiting anyway; a snapshot we cannot write is lost either way
            pass


def _after_fork_in_child() -> None:
    global _WRITER, _WRITER_LOCK
    _WRITER, _WRITER_LOCK = None, threading.Lock()  # the parent's thread does not exist here
    for rt in list(_LIVE):
        rt._queued = False
        rt._seq.detach()


atexit.register(_close_all)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

#: how long :func:`read_stats` waits for live processes' snapshots to catch up with their counters
READ_SETTLE_S = 1.0


def _pid_alive(pid: Any) -> bool:
    """Whether a process that may still publish runs (a zombie, killed and not yet reaped, does not)."""
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, TypeError, ValueError, OverflowError):
        return isinstance(pid, int)
    try:
        stat = Path(f"/proc/{int(pid)}/stat").read_text()
        return stat[stat.rindex(")") + 2:][:1] not in ("Z", "X")
    except (OSError, ValueError):
        return True


def _read_settled(path: Path, deadline: float) -> dict[str, Any] | None:
    """A snapshot, once it covers every request its (live) process has finished, or at ``deadline``."""
    while True:
        try:
            snap = json.loads(path.read_text())
        except (OSError, ValueError):
            snap = None
        if snap is None or "seq" not in snap or time.monotonic() >= deadline:
            return snap
        counter = read_counter(path.with_suffix(".seq"))
        if counter is None or counter <= snap["seq"] or not _pid_alive(snap.get("pid")):
            return snap
        time.sleep(0.005)


def read_stats(instance: str) -> dict[str, Any]:
    """Merge the stats snapshots every process of ``instance`` published (see ConnectorRuntime.publish).

    Snapshots are current: this process's runtimes write what is pending first, and a live process's snapshot
    is waited for (up to ``READ_SETTLE_S``) until it covers every request that process has finished."""
    total: dict[str, Any] = {"instance": instance, "processes": 0}
    counters = ("requests", "lookups", "hits", "tokens_loaded", "tokens_stored", "bytes_loaded", "bytes_stored",
                "admitted")
    for name in counters:
        total[name] = 0
    refused: Counter[str] = Counter()
    fallbacks: Counter[str] = Counter()
    for rt in list(_LIVE):  # this process's own engines: write what is pending, no waiting for the thread
        if rt.instance == instance and rt.pending:
            rt.flush()
    deadline = time.monotonic() + READ_SETTLE_S
    for path in sorted((run_dir() / "stats").glob(f"{instance}-*.json")):
        snap = _read_settled(path, deadline)
        if snap is None:
            continue
        total["processes"] += 1
        if snap.get("role") != "scheduler":
            continue
        for name in counters:
            total[name] += snap.get(name, 0)
        refused.update(snap.get("refused", {}))
        fallbacks.update(snap.get("fallbacks", {}))
        total["namespace"] = snap.get("namespace")
        total["fingerprint"] = snap.get("fingerprint")
        total["kv_bytes_per_token"] = snap.get("kv_bytes_per_token")
        total["lookup_ms"] = snap.get("lookup_ms")
        total["load_ms"] = snap.get("load_ms")
        if "cost" in snap:
            total["cost"] = snap["cost"]
    total["refused"], total["fallbacks"] = dict(refused), dict(fallbacks)
    return total
