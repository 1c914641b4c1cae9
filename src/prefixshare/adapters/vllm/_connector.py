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
* **stats** — counters and structured log events, published for :meth:`PrefixShare.stats`.

Both sides build the same namespace from the connector's extra config alone.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from lmcache.integration.vllm.lmcache_mp_connector import LMCacheMPConnector
from lmcache.integration.vllm.lmcache_mp_metadata import LMCacheMPRequestState

from prefixshare.adapters._runtime import ConnectorRuntime
from prefixshare.adapters.vllm._settings import engine_settings, model_dirs

if TYPE_CHECKING:  # pragma: no cover
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.request import Request

#: LMCache MP connector settings we default (users may override them in the extra config)
HEARTBEAT_S = 1.0


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
        super().__init__(vllm_config, role, kv_cache_config)
        for side in ("scheduler_adapter", "worker_adapter"):
            adapter = getattr(self, side, None)
            if adapter is not None:
                adapter.model_name = self.prefixshare.namespace
        self._lookup_timeout_s = policy.load.timeout_s
        self._load_mode = policy.load.mode

    # --- scheduler side --------------------------------------------------------------------------------
    def _get_or_create_request_tracker(self, request: Request) -> Any:
        fresh = request.request_id not in self.request_trackers
        tracker = super()._get_or_create_request_tracker(request)
        if fresh or request.request_id not in self.prefixshare.requests:
            lora = getattr(request, "lora_request", None)
            lora_name = getattr(lora, "lora_name", None) if lora is not None else None
            info = self.prefixshare.begin(
                request.request_id, request.prompt_token_ids or [], getattr(request, "kv_transfer_params", None)
            )
            tracker.cache_salt = self.prefixshare.salt(info, tracker.cache_salt, lora_name) or ""
            if not info.admitted:
                tracker.max_offload_tokens = 0
            elif info.store_limit is not None:
                current = tracker.max_offload_tokens
                tracker.max_offload_tokens = info.store_limit if current is None else min(current, info.store_limit)
        elif fresh:
            # a preempted request's tracker is rebuilt: keep the decision and salt taken at admission
            info = self.prefixshare.requests[request.request_id]
            tracker.cache_salt = self.prefixshare.salt(info, tracker.cache_salt) or ""
            if not info.admitted:
                tracker.max_offload_tokens = 0
        return tracker

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        tracker = self._get_or_create_request_tracker(request)
        info = self.prefixshare.requests.get(request.request_id)
        if tracker.state == LMCacheMPRequestState.PREFETCHING and tracker.lookup_started_at is None:
            if self._load_mode == "never":
                tracker.state = LMCacheMPRequestState.BYPASS_LMCACHE
            elif not self.prefixshare.store_available():
                # The store is known to be down: neither look up nor store (each would wait out the timeout).
                tracker.state = LMCacheMPRequestState.BYPASS_LMCACHE
                tracker.max_offload_tokens = 0
                self.prefixshare.fallback(info, "store_down")
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
        if matched is None:
            if time.monotonic() - started > self._lookup_timeout_s:
                # The store is too slow or gone: stop waiting and let the engine recompute.
                self.scheduler_adapter.cleanup_lookup_result(request.request_id)
                tracker.lookup_started_at = None
                tracker.state = LMCacheMPRequestState.BYPASS_LMCACHE
                self.prefixshare.fallback(info, "lookup_timeout")
                return 0, False
            return matched, is_async
        if info is not None and info.lookup_s is None and not failed_load:
            self.prefixshare.lookup_done(info, matched, time.monotonic() - started)
        return matched, is_async

    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)
        for request_id in getattr(connector_output, "finished_recving", None) or ():
            self.prefixshare.load_done(request_id)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        tracker = self.request_trackers.get(request.request_id)
        stored = max(0, tracker.num_stored_tokens - tracker.num_lmcache_hit_tokens) if tracker is not None else 0
        result = super().request_finished(request, block_ids)
        self.prefixshare.finish(request.request_id, stored)
        return result

    # --- both sides --------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        self.prefixshare.publish(force=True)
        super().shutdown()
