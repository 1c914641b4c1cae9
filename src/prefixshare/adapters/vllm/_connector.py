"""prefixshare's vLLM connector: LMCache's MP connector plus namespace, admission and bounded loads.

vLLM loads it by module path (``kv_connector_module_path``), in the scheduler process (scheduler side)
and in every worker (worker side), so requests that arrive through ``vllm serve``'s HTTP API are covered
exactly like those of application code. What it adds to LMCache's connector:

* **namespace** — the model name sent to the MP server is ``prefixshare-<fingerprint>``: KV written by an
  engine with another fingerprint (weights, tokenizer, dtype, layout, block/chunk size, TP/PP, tenant) is
  never looked up;
* **admission** — the policy's rules decide, per request, whether its KV is stored (a refused request
  still loads what others stored);
* **tenants** — a request's tenant (``kv_transfer_params["prefixshare.tenant"]``) becomes part of its cache
  salt, so tenants never hit each other's KV;
* **bounded loads** — failed loads are recomputed (``kv_load_failure_policy=recompute``), RPCs to the server
  are bounded by the policy's load timeout, and a lookup that outlives it is abandoned (recompute);
* **stats** — counters and structured log events, published for :meth:`PrefixShare.stats`;
* **cost-aware loading** (policy ``load.mode: auto``) — a load happens only when it is predicted faster
  than recomputing the prefix (see :mod:`prefixshare.adapters._cost`); the prefill-rate estimate comes from
  this scheduler's own step timings (``build_connector_meta`` -> ``update_connector_output``).

Both sides build the same namespace from the connector's extra config alone.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Any

from lmcache.integration.vllm.lmcache_mp_connector import LMCacheMPConnector
from lmcache.integration.vllm.lmcache_mp_metadata import LMCacheMPRequestState

from prefixshare import _metrics
from prefixshare.adapters._reach import PortCheck, port_open
from prefixshare.adapters._runtime import ConnectorRuntime
from prefixshare.adapters.vllm._settings import engine_settings, model_dirs

if TYPE_CHECKING:  # pragma: no cover
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.request import Request

#: LMCache MP connector settings we default (users may override them in the extra config)
HEARTBEAT_S = 1.0


def _mp_address(extra: dict[str, Any]) -> tuple[str, int] | None:
    """(host, port) of the MP server's request socket, from the connector's extra config."""
    raw = str(extra.get("lmcache.mp.host", ""))
    scheme, _, host = raw.rpartition("://")
    if scheme not in ("", "tcp"):
        return None  # ipc:// and other transports: no TCP port to check
    try:
        return (host, int(extra["lmcache.mp.port"])) if host else None
    except (KeyError, TypeError, ValueError):
        return None


class PrefixShareConnector(LMCacheMPConnector):
    """LMCache's MP connector, namespaced by compatibility fingerprint and governed by a Policy."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        kt = vllm_config.kv_transfer_config
        assert kt is not None
        extra = kt.kv_connector_extra_config
        role_name = "scheduler" if str(getattr(role, "name", role)).upper().endswith("SCHEDULER") else "worker"
        model_dir, tokenizer_dir = model_dirs(vllm_config)
        self.prefixshare = ConnectorRuntime(
            extra, model_dir=model_dir, tokenizer_dir=tokenizer_dir, settings=engine_settings(vllm_config),
            role=role_name,
        )
        policy = self.prefixshare.policy
        # A load that fails must mean recompute, never an errored request (vLLM's default is "fail").
        kt.kv_load_failure_policy = "recompute"
        # Bound every RPC to the server (LMCache's default is 300 s: a dead server would stall the engine).
        extra.setdefault("lmcache.mp.mq_timeout", policy.load.timeout_s)
        extra.setdefault("lmcache.mp.heartbeat_interval", HEARTBEAT_S)
        extra.setdefault("lmcache.mp.host", f"tcp://{policy.server.host}")
        extra.setdefault("lmcache.mp.port", policy.server.port)
        self._mp_address = _mp_address(extra)
        self._mp_port = PortCheck(self._mp_address)
        super().__init__(vllm_config, role, kv_cache_config)
        for side in ("scheduler_adapter", "worker_adapter"):
            adapter = getattr(self, side, None)
            if adapter is not None:
                adapter.model_name = self.prefixshare.namespace
        self._lookup_timeout_s = policy.load.timeout_s
        self._load_mode = policy.load.mode
        #: cost-aware loading: scheduler steps in flight (start, spans, had a load), requests decided on,
        #: chunks a bypassed lookup found in the store (not re-stored, not counted as stored by us),
        #: lookups abandoned while running (their locks are released once the server has settled them)
        self._steps: deque[tuple[float, list[tuple[str, int, int, int]], bool]] = deque(maxlen=64)
        self._decided: set[str] = set()
        self._present: dict[str, int] = {}
        self._abandoned: set[str] = set()

    # --- scheduler side --------------------------------------------------------------------------------
    def _get_or_create_request_tracker(self, request: Request) -> Any:
        fresh = request.request_id not in self.request_trackers
        tracker = super()._get_or_create_request_tracker(request)
        new = request.request_id not in self.prefixshare.requests
        if not (fresh or new):
            return tracker  # called on every scheduler step: a known request's tracker is already set up
        lora = getattr(request, "lora_request", None)
        lora_id = self.prefixshare.lora_id(getattr(lora, "lora_name", None), getattr(lora, "lora_path", None)
                                           ) if lora is not None else None
        if new:
            info = self.prefixshare.begin(
                request.request_id, request.prompt_token_ids or [], getattr(request, "kv_transfer_params", None)
            )
        else:
            # a preempted request's tracker is rebuilt: keep the decision and salt taken at admission
            info = self.prefixshare.requests[request.request_id]
        tracker.cache_salt = self.prefixshare.salt(info, tracker.cache_salt, lora_id) or ""
        if not info.admitted:
            tracker.max_offload_tokens = 0
        elif new and info.store_limit is not None:
            current = tracker.max_offload_tokens
            tracker.max_offload_tokens = info.store_limit if current is None else min(current, info.store_limit)
        return tracker

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        tracker = self._get_or_create_request_tracker(request)
        info = self.prefixshare.requests.get(request.request_id)
        if tracker.state == LMCacheMPRequestState.PREFETCHING and tracker.lookup_started_at is None:
            # what the engine's own prefix cache holds, reported in cached_token_stats even when no lookup runs
            # (LMCache sets it after a lookup; the bypasses below return before one)
            tracker.num_vllm_hit_tokens = num_computed_tokens
            if self._load_mode == "never":
                tracker.state = LMCacheMPRequestState.BYPASS_LMCACHE
            elif not self.prefixshare.store_available() or not self._server_ready():
                # The store is down (known, or found now): neither look up nor store (each would wait out the
                # timeout; a store RPC to a dead server blocks the engine step for two RPC timeouts).
                tracker.state = LMCacheMPRequestState.BYPASS_LMCACHE
                tracker.max_offload_tokens = 0
                self.prefixshare.fallback(info, "store_down")
            else:
                decision = self._cost_before_lookup(request, tracker, num_computed_tokens)
                if decision == "recompute":
                    # Recomputing is predicted faster than even the largest possible hit: no lookup, nothing locked.
                    tracker.state = LMCacheMPRequestState.BYPASS_LMCACHE
                    self._cost_fallback(info)
                    return 0, False
                if decision == "local":
                    # The engine's own prefix cache holds every chunk a lookup could return: skip the round trip;
                    # those chunks were stored when this engine computed (or loaded) them: not again.
                    chunk = self.scheduler_adapter.lmcache_tokens_per_chunk
                    tracker.state = LMCacheMPRequestState.BYPASS_LMCACHE
                    tracker.num_stored_tokens = num_computed_tokens // chunk * chunk
                    self._present[request.request_id] = tracker.num_stored_tokens
                    return 0, False
        # LMCache's connector bypasses itself (recompute) when the engine reports a failed load.
        failed_load = (
            tracker.state == LMCacheMPRequestState.READY
            and request.num_computed_tokens == 0
            and tracker.num_lmcache_hit_tokens > 0
        )
        # LMCache's connector stamps lookup_started_at on the first call and clears it when the answer comes;
        # an answer on that first call leaves no stamp, so remember when this call began.
        started = tracker.lookup_started_at or time.monotonic()
        matched, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if failed_load:
            self.prefixshare.fallback(info, "load_failed")
        elif (matched == 0 and info is not None and info.fallback is None and info.lookup_s is None
              and not getattr(self.scheduler_adapter, "is_healthy", True)):
            # LMCache answers 0 when its heartbeat lost the server during the lookup (a hung server): that is
            # a fallback, not a miss; and storing this request would stall the engine step on the same server.
            tracker.max_offload_tokens = 0
            self.prefixshare.fallback(info, "store_down")
            return matched, is_async
        if matched is None:
            waited = time.monotonic() - started
            deadline = self._cost_deadline(request, num_computed_tokens)
            if waited > self._lookup_timeout_s or (deadline is not None and waited > deadline):
                # The store is too slow or gone: stop waiting and let the engine recompute. The server's
                # prefetch may still be running; its locks are released at request_finished.
                self.scheduler_adapter.cleanup_lookup_result(request.request_id)
                self._abandoned.add(request.request_id)
                tracker.lookup_started_at = None
                tracker.state = LMCacheMPRequestState.BYPASS_LMCACHE
                if waited > self._lookup_timeout_s:
                    # a server too slow to answer a lookup would stall the engine step that stores: don't store
                    tracker.max_offload_tokens = 0
                    self.prefixshare.fallback(info, "lookup_timeout")
                else:
                    assert self.prefixshare.cost is not None
                    self.prefixshare.cost.decide_deadline(request.request_id, tracker.num_prompt_tokens,
                                                          num_computed_tokens, waited)
                    self._cost_fallback(info)
                return 0, False
            return matched, is_async
        skipped = info is not None and (info.fallback == "cost" or request.request_id in self._present)
        if info is not None and info.lookup_s is None and not failed_load and not skipped:
            seconds = time.monotonic() - started
            self.prefixshare.lookup_done(info, matched, seconds)
            if not self._cost_after_lookup(request, tracker, num_computed_tokens, seconds, info):
                return 0, False
        return matched, is_async

    def _server_ready(self) -> bool:
        """LMCache's own heartbeat still trusts the server and its port accepts connections (~0.1 ms locally).

        Checked before each new request's lookup: a server that died since the last heartbeat (up to one
        heartbeat interval ago) is found here, so the request skips the store at once instead of looking up
        and then storing into a dead socket (each RPC waits out the load timeout)."""
        adapter = getattr(self, "scheduler_adapter", None)
        if adapter is not None and not getattr(adapter, "is_healthy", True):
            return False
        return self._mp_port.ok()  # seen open a moment ago: a burst of requests pays one connect, not one each

    # --- worker side -------------------------------------------------------------------------------------
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker_gate("RETRIEVE")
        super().start_load_kv(forward_context, **kwargs)

    def wait_for_save(self) -> None:
        self._worker_gate("STORE")
        super().wait_for_save()

    def _worker_gate(self, direction: str) -> None:
        """Before submitting stores (or retrieves) to the server, make sure it is still there.

        LMCache's worker submits a store as two synchronous RPCs; against a server that died since its last
        heartbeat each waits the full RPC timeout, inside the engine step. When the server's port refuses
        connections we clear the worker's health flag instead: LMCache then drops the stores (and reports
        dropped retrieves as failed: the engine recomputes), and its heartbeat re-registers the KV caches
        and sets the flag again as soon as the server answers (a restarted server resumes sharing)."""
        adapter = getattr(self, "worker_adapter", None)
        event = getattr(adapter, "_health_event", None)
        if event is None or not event.is_set():
            return
        try:
            metadata = self._get_connector_metadata()
        except Exception:  # noqa: BLE001 - no metadata bound: nothing to submit
            return
        if not any(getattr(m, "direction", None) == direction for m in getattr(metadata, "requests", ())):
            return
        if not port_open(self._mp_address):
            event.clear()
            self.prefixshare.log.warning("store.unreachable", side="worker", direction=direction.lower(),
                                         address=f"{self._mp_address[0]}:{self._mp_address[1]}"
                                         if self._mp_address else None,
                                         action="drop this step's transfers; resume when the server answers")

    # --- cost-aware loading (see prefixshare.adapters._cost) ------------------------------------------------
    def _cost_before_lookup(self, request: Request, tracker: Any, num_computed_tokens: int) -> str:
        """"load" (look up), "recompute" (predicted faster than the largest possible hit) or "local" (the
        engine's prefix cache already holds every chunk a lookup could return)."""
        cost = self.prefixshare.cost
        if cost is None or request.request_id in self._decided:
            return "load"
        self._decided.add(request.request_id)
        chunk = self.scheduler_adapter.lmcache_tokens_per_chunk
        aligned = tracker.num_prompt_tokens // chunk * chunk
        return cost.decide_before_lookup(request.request_id, tracker.num_prompt_tokens, num_computed_tokens,
                                         aligned).decision

    def _cost_deadline(self, request: Request, num_computed_tokens: int) -> float | None:
        cost = self.prefixshare.cost
        if cost is None:
            return None
        return cost.lookup_deadline_s(request.num_prompt_tokens, num_computed_tokens)

    def _cost_after_lookup(self, request: Request, tracker: Any, num_computed_tokens: int, seconds: float,
                           info: Any) -> bool:
        """Record the lookup; False (and the lookup's locks released) when recomputing is predicted faster
        than transferring the hit."""
        cost = self.prefixshare.cost
        if cost is None:
            return True
        hit = tracker.num_lmcache_hit_tokens
        cost.observe_lookup(hit, seconds)
        if hit <= num_computed_tokens:
            return True
        decision = cost.decide_after_lookup(request.request_id, tracker.num_prompt_tokens, num_computed_tokens,
                                            hit, seconds)
        if decision.decision == "load":
            return True
        # Release what the lookup locked on the server, exactly as LMCache does for chunks it will not
        # retrieve (update_state_after_alloc -> free_lookup_locks), then recompute; the chunks are in the
        # store already, so they are not written again.
        self.scheduler_adapter.free_lookup_locks(
            token_ids=tracker.get_token_ids(), start=0, end=hit, request_id=request.request_id,
            cache_salt=tracker.cache_salt, request_configs=tracker.request_configs,
        )
        self.scheduler_adapter.cleanup_lookup_result(request.request_id)
        tracker.num_lmcache_hit_tokens = 0
        tracker.num_stored_tokens = hit
        tracker.state = LMCacheMPRequestState.BYPASS_LMCACHE
        self._present[request.request_id] = hit
        self._cost_fallback(info)
        return False

    def _cost_fallback(self, info: Any) -> None:
        """A recompute chosen by the cost model: counted like other fallbacks, without a warning."""
        rt = self.prefixshare
        with rt._lock:
            rt.stats.fallbacks["cost"] += 1
            if info is not None:
                info.fallback, info.loaded_tokens, info.load_started = "cost", 0, None
        _metrics.fallback(rt.engine, "cost")

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        loading = any(t.state == LMCacheMPRequestState.WAITING_FOR_LOAD for t in self.request_trackers.values())
        meta = super().build_connector_meta(scheduler_output)
        if self.prefixshare.cost is not None and scheduler_output.total_num_scheduled_tokens > 0:
            # (empty steps, e.g. while a lookup is pending, are not executed and get no connector output)
            spans: list[tuple[str, int, int, int]] = []
            scheduled = scheduler_output.num_scheduled_tokens
            for new in scheduler_output.scheduled_new_reqs:
                start = new.num_computed_tokens
                spans.append((new.req_id, start, start + scheduled.get(new.req_id, 0), len(new.prompt_token_ids or ())))
            cached = scheduler_output.scheduled_cached_reqs
            for i, rid in enumerate(cached.req_ids):
                tracker = self.request_trackers.get(rid)
                start = cached.num_computed_tokens[i]
                spans.append((rid, start, start + scheduled.get(rid, 0), tracker.num_prompt_tokens if tracker else 0))
            self._steps.append((time.monotonic(), spans, loading))
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)
        cost = self.prefixshare.cost
        for request_id in getattr(connector_output, "finished_recving", None) or ():
            self.prefixshare.load_done(request_id)
            info = self.prefixshare.requests.get(request_id)
            if cost is not None and info is not None and info.load_s is not None:
                cost.observe_transfer(info.loaded_tokens, info.load_s)
        self._finish_step()

    def _finish_step(self) -> None:
        """The engine has executed the last scheduled step: time it (a prefill observation) and record the
        outcome of every request whose prefill it finished. Called from whichever comes first after the
        step: request_finished (a request that ends with its prefill) or update_connector_output."""
        cost = self.prefixshare.cost
        if cost is None or not self._steps:
            return
        # steps run one at a time here (the scheduler's output of a step comes before the next step)
        began, spans, loading = self._steps.pop()
        self._steps.clear()
        now = time.monotonic()
        prefill = [(start, min(end, prompt)) for _, start, end, prompt in spans if start < prompt]
        if prefill and len(prefill) == len(spans) and not loading:
            cost.observe_prefill(prefill, now - began)
        for rid, start, end, prompt in spans:
            if start < prompt <= end:  # this step finished the request's prefill
                info = self.prefixshare.requests.get(rid)
                cost.outcome(rid, finished_at=now, loaded_tokens=info.loaded_tokens if info else 0,
                             transfer_s=info.load_s if info else None)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._finish_step()
        tracker = self.request_trackers.get(request.request_id)
        present = max(self._present.pop(request.request_id, 0), tracker.num_lmcache_hit_tokens if tracker else 0)
        stored = max(0, tracker.num_stored_tokens - present) if tracker is not None else 0
        if request.request_id in self._abandoned and tracker is not None:
            # An abandoned lookup's prefetch has had the whole recompute to settle: release its locks now
            # (the server releases exactly what it locked, or nothing while the prefetch still runs).
            self._abandoned.discard(request.request_id)
            chunk = self.scheduler_adapter.lmcache_tokens_per_chunk
            end = tracker.num_prompt_tokens // chunk * chunk
            if end > 0:
                self.scheduler_adapter.free_lookup_locks(
                    token_ids=tracker.get_token_ids(), start=0, end=end, request_id=request.request_id,
                    cache_salt=tracker.cache_salt, request_configs=tracker.request_configs,
                )
        self._decided.discard(request.request_id)
        if self.prefixshare.cost is not None:
            self.prefixshare.cost.forget(request.request_id)
        result = super().request_finished(request, block_ids)
        self.prefixshare.finish(request.request_id, stored)
        return result

    # --- both sides --------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        self.prefixshare.publish(force=True)
        if self.prefixshare.cost is not None:
            self.prefixshare.cost.save(force=True)
        super().shutdown()
