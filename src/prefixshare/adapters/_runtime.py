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
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3

from prefixshare import _metrics
from prefixshare._log import get_logger
from prefixshare._paths import run_dir
from prefixshare.adapters._cost import CostModel, store_key
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


def namespace(fp: Fingerprint) -> str:
    """The store namespace of a fingerprint: what the MP server sees as the model name."""
    return f"prefixshare-{fp.digest[:20]}"


def manifest_url(policy: Policy) -> str | None:
    """Where manifests live: beside the first directory tier (None when the policy has none)."""
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
        settings = settings.model_copy(update={"chunk_size": self.policy.chunk_size, "tenant": self.policy.tenant})
        self.fingerprint = compute_fingerprint(
            model_dir,
            settings,
            weights=self.policy.fingerprint.weights,
            revision=self.policy.fingerprint.revision,
            tokenizer_dir=tokenizer_dir,
        )
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
        self.requests: dict[str, RequestInfo] = {}
        #: cost-aware loading (scheduler side): estimates, decisions and their outcomes (see adapters._cost)
        self.cost = CostModel(self.namespace, store=store_key(self.policy), kv_bytes_per_token=self.kv_bytes_per_token,
                              chunk_size=self.policy.chunk_size, mode=self.policy.load.mode,
                              log=self.log) if role == "scheduler" else None
        self._lock = threading.Lock()
        self._stats_path = run_dir() / "stats" / f"{self.instance}-{role}-{os.getpid()}.json"
        self._stats_path.parent.mkdir(parents=True, exist_ok=True)
        self._last_publish = 0.0
        self._pending_publish: threading.Timer | None = None
        self._down_since: float | None = None
        self._next_probe = 0.0
        if role == "scheduler":
            self._check_store()
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
        keyed = prompt_token_ids[: int(prefix_tokens)] if prefix_tokens else prompt_token_ids
        aligned = len(keyed) - len(keyed) % self.policy.chunk_size
        # only rules read the digest (frequency, byte budget); without rules it is not worth its cost (~0.9 ms at 8k)
        digest = blake3.blake3(json.dumps(list(keyed[:aligned])).encode()).hexdigest()[:32] \
            if aligned and self.rule is not None else None
        req = AdmissionRequest(
            prompt_tokens=n, document_id=doc, tenant=tenant, prefix_digest=digest,
            kv_bytes=aligned * self.kv_bytes_per_token,
        )
        info.admission_request = req
        if params.get(REQ_STORE) is False:
            decision = Decision(False, "request: store disabled", "request")
        elif self.rule is None:
            decision = Decision(True, "no admission rules", "default")
        else:
            decision = self.rule(req)
        info.admitted, info.reason = decision.admit, decision.reason
        if prefix_tokens:
            info.store_limit = int(prefix_tokens)
        with self._lock:
            self.requests[request_id] = info
            self.stats.requests += 1
            if decision.admit:
                self.stats.admitted += 1
            else:
                self.stats.refused[decision.reason.split(":")[0]] += 1
        _metrics.admission(self.engine, decision.admit, decision.reason.split(":")[0])
        return info

    def salt(self, info: RequestInfo, request_salt: str | None, lora_name: str | None = None) -> str | None:
        parts = [tenant_salt(info.tenant)] if info.tenant else []
        if lora_name:
            parts.append("lora-" + blake3.blake3(lora_name.encode()).hexdigest()[:12])
        if request_salt:
            parts.append(request_salt)
        if not parts:
            return request_salt
        salt = "-".join(parts)
        return salt if len(salt) <= 128 and "@" not in salt and "/" not in salt else (
            "s-" + blake3.blake3(salt.encode()).hexdigest()[:40]
        )

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

    PUBLISH_INTERVAL_S = 0.05

    def _publish_pending(self) -> None:
        with self._lock:
            self._pending_publish = None
        self.publish(force=True)

    def publish(self, force: bool = False) -> None:
        now = time.monotonic()
        wait = self.PUBLISH_INTERVAL_S - (now - self._last_publish)
        if not force and wait > 0:
            # Throttled: make sure the newest counters still get written once the interval has passed
            # (otherwise the last requests of a burst would never be published).
            with self._lock:
                if self._pending_publish is None:
                    timer = threading.Timer(wait, self._publish_pending)
                    timer.daemon = True
                    self._pending_publish = timer
                    timer.start()
            return
        self._last_publish = now
        tmp = self._stats_path.with_suffix(f".{threading.get_ident()}.tmp")
        try:
            tmp.write_text(json.dumps(self.snapshot()))
            tmp.replace(self._stats_path)
        except OSError as exc:
            self.log.warning("stats.publish_failed", error=str(exc))


def read_stats(instance: str) -> dict[str, Any]:
    """Merge the stats snapshots every process of ``instance`` published (see ConnectorRuntime.publish)."""
    total: dict[str, Any] = {"instance": instance, "processes": 0}
    counters = ("requests", "lookups", "hits", "tokens_loaded", "tokens_stored", "bytes_loaded", "bytes_stored",
                "admitted")
    for name in counters:
        total[name] = 0
    refused: Counter[str] = Counter()
    fallbacks: Counter[str] = Counter()
    for path in sorted((run_dir() / "stats").glob(f"{instance}-*.json")):
        try:
            snap = json.loads(path.read_text())
        except (OSError, ValueError):
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
