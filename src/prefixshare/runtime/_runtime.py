"""What every connector enforces, whatever the engine: namespace, admission, bounded loads, stats.

A :class:`ConnectorRuntime` is built inside the engine's processes (scheduler side and worker side)
from the connector's extra config alone, so requests that arrive through an engine's HTTP server are
covered exactly like those of application code. It

* computes the engine's compatibility fingerprint and turns it into the store namespace
  (:func:`prefixshare.keys.namespace`): KV written under another fingerprint is never looked up;
* writes the fingerprint's manifest beside the store and, when the store holds KV of other
  fingerprints only, logs once which fields differ;
* decides per request whether its KV may be stored (the policy's admission rules), and maps a request's
  tenant to a cache salt so tenants never hit each other;
* keeps the store's health (a store known to be down is skipped until it answers again) and counts every
  fallback to recompute;
* keeps counters (hits, tokens loaded and stored, bytes, lookup/load latency, refusals by reason,
  fallbacks) and publishes them (:mod:`prefixshare.runtime._stats`) for :meth:`PrefixShare.stats`.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefixshare import _metrics
from prefixshare._log import configure_from_environment, get_logger
from prefixshare.errors import IncompatibleError
from prefixshare.fingerprint import EngineSettings, explain, lora_digest, write_manifest
from prefixshare.keys import (
    KEY_EXPECT,
    KEY_INSTANCE,
    KEY_POLICY,
    KEY_POLICY_FILE,
    LOAD_MODES,
    REQ_DOCUMENT,
    REQ_LOAD,
    REQ_PREFIX_TOKENS,
    REQ_STORE,
    REQ_TENANT,
    REQ_VERIFY,
    admission_digest,
    engine_fingerprint,
    namespace,
    store_salt,
)
from prefixshare.plan import kv_bytes_per_token, shape_from_config
from prefixshare.policies import AdmissionRequest, ByteBudget, Decision, Policy, Rule, policy_from_mapping
from prefixshare.runtime._cost import CostModel, info_enabled, store_key
from prefixshare.runtime._stats import Stats, StatsPublisher
from prefixshare.runtime._verify import HitSampler, VerifyTask, find_task, new_token


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
_VERIFY_RUN = Decision(False, "verify: a verification run stores nothing", "verify")
_VERIFY_REFUSED = Decision(False, "verify: not a verify task of this replica for this prompt", "verify")
_NO_RULES = Decision(True, "no admission rules", "default")

#: the health gate's probe threads (a store marked down; a stalled lookup): named, so that whoever must let a
#: verdict in flight reach the log before the process exits can find them
PROBE_THREAD = "prefixshare-probe"
STALL_PROBE_THREAD = "prefixshare-stall-probe"


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
    #: per byte budget of the policy: whether this request reserved its prefix's bytes at admission
    reserved: list[bool] = field(default_factory=list)
    #: the request's own load mode (``prefixshare.load``); None: the policy's
    load_mode: str | None = None
    #: a verification run (``prefixshare.verify``): stores nothing, is never sampled itself
    verify_run: bool = False
    #: a verification run's store salt: the original request's ("" for none), whatever the engine's salt
    replay_salt: str | None = None


class ConnectorRuntime(StatsPublisher):
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
        configure_from_environment()  # an engine's process: log as the process that started the engine
        self.policy = load_policy(extra)
        self.role = role
        self.engine = settings.engine
        self.instance = str(extra.get(KEY_INSTANCE) or f"{settings.engine}-{os.getpid()}")
        self.fingerprint = engine_fingerprint(self.policy, model_dir, settings, tokenizer_dir=tokenizer_dir)
        expected = extra.get(KEY_EXPECT)
        if expected and expected != self.fingerprint.digest:
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
        #: cost-aware loading (scheduler side): estimates, decisions and their outcomes (see runtime._cost)
        self.cost = CostModel(self.namespace, store=store_key(self.policy), kv_bytes_per_token=self.kv_bytes_per_token,
                              chunk_size=self.policy.chunk_size, mode=self.policy.load.mode,
                              log=self.log) if role == "scheduler" else None
        #: sampled verification (scheduler side): which store hits are set aside to be checked later
        verify = self.policy.verify
        self.sampler = HitSampler(verify.sample, verify.max_per_minute, verify.max_pending, self.instance
                                  ) if role == "scheduler" and verify.enabled else None
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self._next_probe = 0.0
        #: a probe thread is running; the store being down is an outage (a probe found it not answering)
        self._probing = False
        self._outage = False
        #: (when it started, why the store did not answer) of the last stalled-lookup probe; one running
        self._stall: tuple[float, str | None] | None = None
        self._stall_running = False
        self._stall_started = 0.0
        if role == "scheduler":
            self._check_store()
        self._start_publishing()
        self.log.info("connector.ready", namespace=self.namespace, chunk_size=self.policy.chunk_size)

    # --- store manifests -----------------------------------------------------------------------------
    def _check_store(self) -> None:
        url = self.policy.manifest_url
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
    #: how long the request that starts a probe waits for its answer: a healthy server and its tiers answer in a
    #: few milliseconds, so that request already uses the store again; a partitioned tier's probe waits out its
    #: own timeout in its thread while the engine step goes on without the store
    PROBE_WAIT_S = 0.15

    def store_available(self) -> bool:
        """False while the store is known to be down: requests then skip it entirely (no lookup, no store)
        instead of each waiting out the timeout. The server's health endpoint and every tier are probed
        at most once a second, in a thread of their own, and sharing resumes as soon as they answer: the
        request that starts a probe waits for it up to ``PROBE_WAIT_S`` (a partitioned tier's probe waits out
        its timeout; the engine step must not)."""
        if self._down_since is None:
            return True
        now = time.monotonic()
        if now < self._next_probe or self._probing:
            return False
        self._next_probe = now + self.PROBE_INTERVAL_S
        self._probing = True
        done = threading.Event()
        threading.Thread(target=self._probe_down, args=(done,), name=PROBE_THREAD, daemon=True).start()
        done.wait(self.PROBE_WAIT_S)
        return self._down_since is None

    def _probe_down(self, done: threading.Event) -> None:
        try:
            if self.probe() is not None:
                return
            down_since, outage = self._down_since, self._outage
            if down_since is None:
                return
            self._down_since, self._outage = None, False
            self.log.warning("store.recovered", down_s=round(time.monotonic() - down_since, 2))
            if outage and self.cost is not None:
                # the timeouts of the window were the outage, not a slow store: not a reason to keep recomputing
                self.cost.outage_over()
        finally:
            self._probing = False
            done.set()

    #: a lookup pending this long has the store probed (off the request path, at most one probe a second): a store
    #: that does not answer -- a partition in the middle of a load -- ends the wait then, not at load.timeout_s
    STALL_PROBE_AFTER_S = 1.0
    #: ... with this timeout per check: longer than the health gate's, since the link may be busy with the load's
    #: own bytes (a shaped link queues a PING behind them: up to 0.2 s in the lab), and a cut link never answers
    STALL_PROBE_TIMEOUT_S = 1.0

    def store_unreachable(self, since: float) -> str | None:
        """Why the store does not answer, found by a probe started at or after ``since`` (a lookup's start), or
        None (it answers, or no such probe has finished: one is started, and the caller asks again next step)."""
        now = time.monotonic()
        with self._lock:
            last = self._stall
            if not self._stall_running and now - self._stall_started >= self.PROBE_INTERVAL_S and (
                    last is None or last[0] < since or last[1] is None):
                self._stall_running, self._stall_started = True, now
                threading.Thread(target=self._probe_stall, args=(now,), name=STALL_PROBE_THREAD,
                                 daemon=True).start()
        return last[1] if last is not None and last[0] >= since else None

    def _probe_stall(self, started: float) -> None:
        try:
            reason = self.probe(self.STALL_PROBE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - a probe that fails says nothing about the store
            self.log.warning("store.stall_probe_failed", error=str(exc))
            reason = None
        with self._lock:
            self._stall, self._stall_running = (started, reason), False

    def probe(self, timeout_s: float = 0.25) -> str | None:
        """None when the server and every L2 tier answer, else why not (cheap; no retries)."""
        try:
            import httpx

            if httpx.get(self.policy.server.http_url + "/healthcheck", timeout=timeout_s).status_code != 200:
                return f"the LMCache server at {self.policy.server.http_url} is not healthy"
        except Exception as exc:  # noqa: BLE001 - any failure means: down
            return f"the LMCache server at {self.policy.server.http_url} does not answer ({exc})"
        for tier in self.policy.l2:
            reason = tier.probe(timeout_s)
            if reason is not None:
                return f"tier {tier.describe()}: {reason}"
        return None

    def mark_down(self, reason: str, found: str | None = None) -> None:
        """Skip the store until it answers again. ``found``: why a probe just found it not answering (then the
        window is an outage at once, and the store is not probed again to say so)."""
        if self._down_since is None:
            self._down_since = time.monotonic()
            self._next_probe = self._down_since + self.PROBE_INTERVAL_S
            self._probing = True
            threading.Thread(target=self._probe_marked, args=(reason, found), name=PROBE_THREAD,
                             daemon=True).start()

    def _probe_marked(self, reason: str, found: str | None = None) -> None:
        """Why the store was just marked down, probed off the request path (unless a probe already ``found`` it
        not answering): when the server or a tier does not answer, the window is an outage (see
        :meth:`CostModel.outage_over`); when both answer, a slow store."""
        try:
            if found is None:
                found = self.probe()
            self._outage = found is not None
            self.log.warning("store.down", reason=reason, probe=found, outage=self._outage,
                             action="skip the store until the server and its tiers answer again")
        finally:
            self._probing = False

    # --- per request -----------------------------------------------------------------------------------
    def begin(self, request_id: str, prompt_token_ids: list[int] | tuple[int, ...], params: dict[str, Any] | None,
              lora_name: str | None = None, request_salt: str | None = None) -> RequestInfo:
        """Admission and identity of a new request (scheduler side). Idempotent per request id.

        ``lora_name`` and ``request_salt`` are what :meth:`salt` will salt the request's store keys with (its
        LoRA adapter's id and the engine's own cache salt): the admission digest covers them too."""
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
        mode = params.get(REQ_LOAD)
        if mode in LOAD_MODES:
            info.load_mode = mode
        elif mode is not None:
            self.log.warning("request.bad_param", request_id=request_id, key=REQ_LOAD, value=str(mode)[:40],
                             fix=f"one of {', '.join(LOAD_MODES)}; the policy's load.mode applies")
        if params.get(REQ_VERIFY):
            decision = self._replay(info, params[REQ_VERIFY], prompt_token_ids)
        elif params.get(REQ_STORE) is False:
            decision = _STORE_DISABLED
        elif self.rule is None:
            decision = _NO_RULES
        else:
            keyed = min(n, int(prefix_tokens)) if prefix_tokens else n
            aligned = keyed - keyed % self.policy.chunk_size
            # only rules read the digest (frequency, byte budget): without rules it is not computed (~32 us at 8k)
            digest = admission_digest(prompt_token_ids if aligned == n else prompt_token_ids[:aligned],
                                      self.policy.chunk_size, store_salt(tenant, request_salt, lora_name)
                                      ) if aligned else None
            req = AdmissionRequest(
                prompt_tokens=n, document_id=doc, tenant=tenant, prefix_digest=digest,
                kv_bytes=aligned * self.kv_bytes_per_token,
            )
            info.admission_request = req
            decision = self.rule(req)
        info.admitted, info.reason = decision.admit, decision.reason
        if decision.admit and info.admission_request is not None and self._budgets:
            # reserved now, not when the request finishes: requests admitted together would each pass the check
            # against what was committed before any of them (16 concurrent clients overshot a 48 MiB budget by
            # a fifth); what a request ends up not storing is released at finish
            info.reserved = [budget.commit(info.admission_request) for budget in self._budgets]
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

    def _replay(self, info: RequestInfo, token: Any, prompt_token_ids: Any) -> Decision:
        """A verification run of a sampled hit (see :mod:`prefixshare.runtime._verify`): keyed with the task's
        store salt; a token that names no task of this replica for this prompt loads nothing."""
        info.verify_run = True
        task = find_task(self.instance, token, prompt_token_ids)
        if task is None:
            info.load_mode = "never"
            self.log.warning("request.bad_param", request_id=info.request_id, key=REQ_VERIFY, value=str(token)[:60],
                             fix="a verify token of this replica's own sampled hits, with the hit's prompt; "
                             "recomputed, nothing loaded or stored")
            return _VERIFY_REFUSED
        info.replay_salt = task.store_salt or ""
        return _VERIFY_RUN

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
            try:
                lora_id = f"{name}\0{lora_digest(name, path)}"
            except Exception as exc:  # noqa: BLE001 - a remote or missing adapter path: the name still separates
                self.log.warning("lora.unhashed", lora=name, path=path, reason=str(exc),
                                 effect="keys salted by the adapter name only")
        self._lora_ids[key] = lora_id
        return lora_id

    def salt(self, info: RequestInfo, request_salt: str | None, lora_name: str | None = None) -> str | None:
        if info.replay_salt is not None:  # a verification run: the sampled request's keys, not the engine salt's
            return info.replay_salt
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

    def load_mode(self, info: RequestInfo | None) -> str:
        """The load mode that governs a request: its own (``prefixshare.load``), else the policy's."""
        return (info.load_mode if info is not None else None) or self.policy.load.mode

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

    def store_lost(self, request_id: str, reason: str, error: str | None = None) -> None:
        """A store this engine made never reached the server (``server_down``: dropped unsent while the server
        was down; ``rpc_failed``: its RPC failed or timed out; ``refused``: the server answered that it did not
        take it). Counted (stats ``stores_lost``, metric ``prefixshare_stores_lost``) and logged, every one."""
        with self._lock:
            self.stats.stores_lost[reason] += 1
            total = sum(self.stats.stores_lost.values())
        _metrics.store_lost(self.engine, reason)
        self.log.warning("store.lost", request_id=request_id, reason=reason, error=error, lost_total=total,
                         effect="this request's KV is not in the store; the next request with its prefix computes it")
        self.publish()

    def cost_fallback(self, info: RequestInfo | None) -> None:
        """A recompute chosen by the cost model: counted like other fallbacks, without a warning (nothing is
        wrong), and whatever the lookup found is not loaded."""
        with self._lock:
            self.stats.fallbacks["cost"] += 1
            if info is not None:
                info.fallback, info.loaded_tokens, info.load_started = "cost", 0, None
        _metrics.fallback(self.engine, "cost")

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
        if info.admission_request is not None:
            for budget, reserved in zip(self._budgets, info.reserved or [False] * len(self._budgets), strict=True):
                if stored:
                    budget.commit(info.admission_request)  # (a no-op when reserved: counted once per prefix)
                elif reserved:
                    budget.release(info.admission_request)  # reserved at admission, nothing written
        if info_enabled():
            self.log.info(
                "request.finished", request_id=request_id, prompt_tokens=info.prompt_tokens,
                loaded_tokens=info.loaded_tokens, stored_tokens=stored, admitted=info.admitted, reason=info.reason,
                document_id=info.document_id, tenant=info.tenant, fallback=info.fallback,
                lookup_ms=round(info.lookup_s * 1e3, 2) if info.lookup_s is not None else None,
            )
        self.publish()
        return info

    def sample_hit(self, info: RequestInfo | None, token_ids: Any, *, cache_salt: str | None,
                   store_salt: str | None, first_token: int | None, params: dict[str, Any] | None,
                   lora: bool = False) -> bool:
        """A finished request that loaded from the store: keep it for verification when sampled (see
        :mod:`prefixshare.runtime._verify`). Never raises: verification must not cost a request."""
        if (self.sampler is None or info is None or info.loaded_tokens <= 0 or info.verify_run
                or not self.sampler.chosen(info.request_id)):
            return False
        why = "lora" if lora else self.sampler.admit()  # a LoRA request cannot be replayed without its adapter
        if why is None:
            ours = {k: v for k, v in (params or {}).items() if k in (REQ_DOCUMENT, REQ_TENANT, REQ_PREFIX_TOKENS)}
            task = VerifyTask(self.instance, self.namespace, info.request_id, list(token_ids), info.loaded_tokens,
                              cache_salt=cache_salt or None, store_salt=store_salt or None, params=ours,
                              first_token=first_token, kv_dtype=self.fingerprint.engine.kv_dtype,
                              sampled_at=time.time(), token=new_token())
            try:
                self.sampler.keep(task)
            except OSError as exc:
                self.log.warning("verify.keep_failed", request_id=info.request_id, error=str(exc))
                why = "error"
        with self._lock:
            if why is None:
                self.stats.verify_sampled += 1
            else:
                self.stats.verify_dropped[why] += 1
        _metrics.verify(self.engine, "sampled" if why is None else "dropped")
        if why is None:
            self.log.info("verify.sampled", request_id=info.request_id, loaded_tokens=info.loaded_tokens)
        self.publish()
        return why is None

    # --- stats snapshot ------------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            data = self.stats.to_dict()
        return {
            "instance": self.instance, "role": self.role, "pid": os.getpid(), "namespace": self.namespace,
            "fingerprint": self.fingerprint.digest, "kv_bytes_per_token": self.kv_bytes_per_token,
            "updated_at": time.time(), **data, **({"cost": self.cost.snapshot()} if self.cost is not None else {}),
        }
