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
  than recomputing the prefix (see :mod:`prefixshare.runtime._cost`); the prefill-rate estimate comes from
  this scheduler's own step timings (``build_connector_meta`` -> ``update_connector_output``).

Both sides build the same namespace from the connector's extra config alone.

The connector is one class because vLLM instantiates one class per role; its work is split by role, as vLLM's
own connectors do: the scheduler process delegates to :class:`SchedulerSide`, each worker to
:class:`WorkerSide`. The hook methods below only forward to LMCache's connector and to the side of their role.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from lmcache.integration.vllm.lmcache_mp_connector import LMCacheMPConnector
from lmcache.integration.vllm.lmcache_mp_metadata import LMCacheMPRequestState

from prefixshare.adapters._format import verify_registered
from prefixshare.adapters.vllm import _compat
from prefixshare.adapters.vllm._deferred import DeferredStores
from prefixshare.adapters.vllm._settings import engine_settings, model_dirs
from prefixshare.runtime import ConnectorRuntime, PortCheck, RequestInfo

if TYPE_CHECKING:  # pragma: no cover
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.request import Request

#: LMCache MP connector settings we default (users may override them in the extra config)
HEARTBEAT_S = 1.0
#: how long one lookup call may wait for the server's answer inside a scheduler pass, and all of a step's
#: lookup calls together: a miss (or a hit already in the server's memory) is answered in ~1.5 ms, where
#: waiting for the next passes costs two engine steps (30-50 ms measured on a CPU engine); a hit still being
#: read from L2 is polled at later steps as before
PROBE_WAIT_S = 0.005
PROBE_STEP_BUDGET_S = 0.010
PROBE_POLL_S = 0.0002
#: the lookup pump's longest wait on one answer before it looks at every pending lookup again
PUMP_WAIT_S = 0.05
#: the pump's pause when a lookup has no answer to wait on: the server said its prefetch still runs, and the
#: next check asks again (LMCache's scheduler asks once per engine pass)
PUMP_POLL_S = 0.002
_BYPASS = LMCacheMPRequestState.BYPASS_LMCACHE


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
        address = _mp_address(extra)
        # a late ping under load is not a lost server: its own deadline, two misses before degrading (LMCache
        # drops every store in flight when it degrades); a refused port still degrades at once
        _compat.patient_heartbeat(log=self.prefixshare.log, address=address)
        super().__init__(vllm_config, role, kv_cache_config)
        for side in ("scheduler_adapter", "worker_adapter"):
            adapter = getattr(self, side, None)
            if adapter is not None:
                adapter.model_name = self.prefixshare.namespace
        self.scheduler_side = SchedulerSide(self, address) if role_name == "scheduler" else None
        self.worker_side = WorkerSide(self, address) if role_name == "worker" else None

    # --- scheduler role: LMCache's connector, then SchedulerSide ---------------------------------------------
    def _get_or_create_request_tracker(self, request: Request) -> Any:
        fresh = request.request_id not in self.request_trackers
        tracker = super()._get_or_create_request_tracker(request)
        if self.scheduler_side is not None:
            self.scheduler_side.on_tracker(request, tracker, fresh)
        return tracker

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        side = self.scheduler_side
        assert side is not None
        tracker = self._get_or_create_request_tracker(request)
        bypass = side.before_lookup(request, tracker, num_computed_tokens)
        if bypass is not None:
            return bypass
        failed_load = side.load_failed(request, tracker)
        # LMCache's connector stamps lookup_started_at on the first call and clears it when the answer comes;
        # an answer on that first call leaves no stamp, so remember when this call began.
        started = tracker.lookup_started_at or time.monotonic()
        matched, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        wait = side.probe_wait()
        while matched is None and wait.more():
            # LMCache's lookup is three round trips (lookup, its acknowledgement, the prefetch status), one per
            # scheduler pass; a server answers a miss in about a millisecond, so wait that long in this pass
            # instead of two more engine steps (see SchedulerSide.probe_wait)
            matched, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        return side.after_lookup(request, tracker, num_computed_tokens, started, failed_load, matched, is_async)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        side = self.scheduler_side
        if side is not None:
            side.probe_budget_s = PROBE_STEP_BUDGET_S  # a new scheduler step
        # only steps that compute tokens are timed (on_step_scheduled); while lookups are pending the engine
        # steps with nothing scheduled, dozens of times per request, and needs no scan of every tracker
        loading = side is not None and scheduler_output.total_num_scheduled_tokens > 0 and side.loading()
        meta = super().build_connector_meta(scheduler_output)
        if side is not None:
            side.on_step_scheduled(scheduler_output, loading)
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)
        if self.scheduler_side is not None:
            self.scheduler_side.on_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        side = self.scheduler_side
        stored = side.before_request_finished(request) if side is not None else 0
        tracker = self.request_trackers.get(request.request_id)
        store_salt = getattr(tracker, "cache_salt", None)
        result = super().request_finished(request, block_ids)
        info = self.prefixshare.finish(request.request_id, stored)
        if self.prefixshare.sampler is not None and info is not None and info.loaded_tokens > 0:
            outputs = request.output_token_ids
            self.prefixshare.sample_hit(
                info, request.prompt_token_ids or [], cache_salt=getattr(request, "cache_salt", None),
                store_salt=store_salt, first_token=int(outputs[0]) if len(outputs) else None,
                params=getattr(request, "kv_transfer_params", None),
                lora=getattr(request, "lora_request", None) is not None)
        return result

    # --- worker role: WorkerSide's gate, then LMCache's connector ---------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        if self.worker_side is not None:
            self.worker_side.check_format(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        side = self.worker_side
        if side is None:
            super().start_load_kv(forward_context, **kwargs)
            return
        side.gate("RETRIEVE")
        with side.submitting("RETRIEVE"):
            super().start_load_kv(forward_context, **kwargs)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.worker_side is not None:
            self.worker_side.before_get_finished()
        return super().get_finished(finished_req_ids)

    def wait_for_save(self) -> None:
        side = self.worker_side
        if side is None:
            super().wait_for_save()
            return
        side.gate("STORE")
        side.defer_stores()
        with side.submitting("STORE"):
            super().wait_for_save()

    # --- both roles -----------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self.scheduler_side is not None and self.scheduler_side.pump is not None:
            self.scheduler_side.pump.stop()
        if self.worker_side is not None:
            self.worker_side.drain()  # queued stores reach the server before the worker unregisters
        self.prefixshare.publish(force=True)
        if self.prefixshare.cost is not None:
            self.prefixshare.cost.save(force=True)
        super().shutdown()


class SchedulerSide:
    """prefixshare's work in vLLM's scheduler process, around LMCache's scheduler adapter.

    Per request: admission and store salt (:meth:`on_tracker`); before a lookup, the gates that skip the store
    (load mode, the store's health, the cost model; :meth:`before_lookup`); after it, the fallbacks (failed
    load, lost server, a lookup that outlives the load timeout or the cost deadline) and the lookup's
    bookkeeping (:meth:`after_lookup`); per engine step, the prefill timings the cost model learns from.
    """

    def __init__(self, connector: PrefixShareConnector, address: tuple[str, int] | None) -> None:
        self.connector = connector
        self.runtime: ConnectorRuntime = connector.prefixshare
        self.lmcache = connector.scheduler_adapter
        #: the MP server's request port, seen open a moment ago (a burst of requests pays one connect)
        self.port = PortCheck(address)
        self.lookup_timeout_s = self.runtime.policy.load.timeout_s
        #: cost-aware loading: scheduler steps in flight (start, spans, had a load), requests decided on,
        #: chunks a bypassed lookup found in the store (not re-stored, not counted as stored by us),
        #: lookups abandoned while running (their locks are released once the server has settled them)
        self.steps: deque[tuple[float, list[tuple[str, int, int, int]], bool]] = deque(maxlen=64)
        #: what this scheduler step may still spend waiting for lookup answers (see probe_wait)
        self.probe_budget_s = PROBE_STEP_BUDGET_S
        self.decided: set[str] = set()
        self.present: dict[str, int] = {}
        self.abandoned: set[str] = set()
        #: advances lookups as their answers arrive (None: this LMCache's adapter cannot be shared; then each
        #: lookup advances one round trip per scheduler pass, as in LMCache)
        lock = threading.RLock()
        self.pump = LookupPump(self.lmcache, lock, self.runtime.log) if _compat.serialize_lookups(
            self.lmcache, lock) else None
        #: a pending lookup's deadline, computed on its first pending step (the engine steps dozens of times
        #: while one lookup runs; the estimates it is computed from do not change meanwhile)
        self.deadlines: dict[str, float | None] = {}

    @property
    def chunk(self) -> int:
        return int(self.lmcache.lmcache_tokens_per_chunk)

    # --- a request's identity -------------------------------------------------------------------------------
    def on_tracker(self, request: Request, tracker: Any, fresh: bool) -> None:
        """Admission and store salt, when LMCache makes a request's tracker (again, after a preemption)."""
        rt = self.runtime
        new = request.request_id not in rt.requests
        if not (fresh or new):
            return  # called on every scheduler step: a known request's tracker is already set up
        lora = getattr(request, "lora_request", None)
        lora_id = rt.lora_id(getattr(lora, "lora_name", None), getattr(lora, "lora_path", None)
                             ) if lora is not None else None
        if new:
            info = rt.begin(request.request_id, request.prompt_token_ids or [],
                            getattr(request, "kv_transfer_params", None), lora_name=lora_id,
                            request_salt=tracker.cache_salt)
        else:
            # a preempted request's tracker is rebuilt: keep the decision and salt taken at admission
            info = rt.requests[request.request_id]
        tracker.cache_salt = rt.salt(info, tracker.cache_salt, lora_id) or ""
        if not info.admitted:
            tracker.max_offload_tokens = 0
        elif new and info.store_limit is not None:
            current = tracker.max_offload_tokens
            tracker.max_offload_tokens = info.store_limit if current is None else min(current, info.store_limit)

    # --- before the lookup ----------------------------------------------------------------------------------
    def before_lookup(self, request: Request, tracker: Any, num_computed_tokens: int) -> tuple[int, bool] | None:
        """On a request's first lookup call: skip the store when the policy, its health or the cost model says
        so. Returns the connector's answer when the lookup is skipped, None to look up."""
        if tracker.state != LMCacheMPRequestState.PREFETCHING or tracker.lookup_started_at is not None:
            return None
        info = self.runtime.requests.get(request.request_id)
        # what the engine's own prefix cache holds, reported in cached_token_stats even when no lookup runs
        # (LMCache sets it after a lookup; the bypasses below return before one)
        tracker.num_vllm_hit_tokens = num_computed_tokens
        mode = self.runtime.load_mode(info)
        if mode == "never":
            # No lookup (answered here: LMCache's answer to a bypassed tracker would be counted as a lookup that
            # missed, and fed to the cost model as a 0 s lookup); the decision is recorded, not asked.
            tracker.state = _BYPASS
            self.cost_before_lookup(request, tracker, num_computed_tokens, mode)
            return 0, False
        if not self.runtime.store_available() or not self.server_ready():
            # The store is down (known, or found now): neither look up nor store (each would wait out the
            # timeout; a store RPC to a dead server blocks the engine step for two RPC timeouts).
            tracker.state = _BYPASS
            tracker.max_offload_tokens = 0
            self.runtime.fallback(info, "store_down")
            return None
        decision = self.cost_before_lookup(request, tracker, num_computed_tokens, mode)
        if decision == "recompute":
            # Recomputing is predicted faster than even the largest possible hit: no lookup, nothing locked.
            tracker.state = _BYPASS
            self.runtime.cost_fallback(info)
            return 0, False
        if decision == "local":
            # The engine's own prefix cache holds every chunk a lookup could return: skip the round trip;
            # those chunks were stored when this engine computed (or loaded) them: not again.
            tracker.state = _BYPASS
            tracker.num_stored_tokens = num_computed_tokens // self.chunk * self.chunk
            self.present[request.request_id] = tracker.num_stored_tokens
            return 0, False
        return None

    def server_ready(self) -> bool:
        """LMCache's own heartbeat still trusts the server and its port accepts connections (~0.1 ms locally).

        Checked before each new request's lookup: a server that died since the last heartbeat (up to one
        heartbeat interval ago) is found here, so the request skips the store at once instead of looking up
        and then storing into a dead socket (each RPC waits out the load timeout)."""
        if not getattr(self.lmcache, "is_healthy", True):
            return False
        return self.port.ok()

    @staticmethod
    def load_failed(request: Request, tracker: Any) -> bool:
        """The engine reported this request's load as failed (LMCache's connector then bypasses itself: the
        engine recomputes)."""
        return (tracker.state == LMCacheMPRequestState.READY and request.num_computed_tokens == 0
                and tracker.num_lmcache_hit_tokens > 0)

    def probe_wait(self) -> _ProbeWait:
        """A bounded wait for the answer of a lookup just asked: at most ``PROBE_WAIT_S`` for this call and what
        is left of this step's ``PROBE_STEP_BUDGET_S``."""
        return _ProbeWait(self)

    # --- after LMCache's lookup call --------------------------------------------------------------------------
    def after_lookup(self, request: Request, tracker: Any, num_computed_tokens: int, started: float,
                     failed_load: bool, matched: int | None, is_async: bool) -> tuple[int | None, bool]:
        """LMCache's answer, after prefixshare's fallbacks and bookkeeping."""
        info = self.runtime.requests.get(request.request_id)
        if failed_load:
            self.runtime.fallback(info, "load_failed")
        elif (matched == 0 and info is not None and info.fallback is None and info.lookup_s is None
              and not getattr(self.lmcache, "is_healthy", True)):
            # LMCache answers 0 when its heartbeat lost the server during the lookup (a hung server): that is
            # a fallback, not a miss; and storing this request would stall the engine step on the same server.
            tracker.max_offload_tokens = 0
            self.runtime.fallback(info, "store_down")
            return matched, is_async
        if matched is None:  # the lookup is still running
            if self.abandon_if_late(request, tracker, num_computed_tokens, started, info):
                return 0, False
            if self.pump is not None:
                self.pump.watch(request.request_id)
            return matched, is_async
        skipped = info is not None and (info.fallback == "cost" or request.request_id in self.present)
        if info is not None and info.lookup_s is None and not failed_load and not skipped:
            seconds = time.monotonic() - started
            self.runtime.lookup_done(info, matched, seconds)
            if not self.cost_after_lookup(request, tracker, num_computed_tokens, seconds, info):
                return 0, False
        return matched, is_async

    def abandon_if_late(self, request: Request, tracker: Any, num_computed_tokens: int, started: float,
                        info: RequestInfo | None) -> bool:
        """A lookup that outlives the load timeout (or the cost model's deadline) is abandoned: the engine
        recomputes. The server's prefetch may still be running; its locks are released at request_finished."""
        waited = time.monotonic() - started
        rid = request.request_id
        if rid in self.deadlines:
            deadline = self.deadlines[rid]
        else:
            deadline = self.deadlines[rid] = self.cost_deadline(request, num_computed_tokens)
        unreachable = (self.runtime.store_unreachable(started)
                       if waited > self.runtime.STALL_PROBE_AFTER_S else None)
        if (unreachable is None and waited <= self.lookup_timeout_s
                and (deadline is None or waited <= deadline)):
            return False
        self.lmcache.cleanup_lookup_result(request.request_id)
        if self.pump is not None:
            self.pump.forget(request.request_id)
        self.abandoned.add(request.request_id)
        tracker.lookup_started_at = None
        tracker.state = _BYPASS
        if unreachable is not None:
            # a partition in the middle of the load: not a slow store (nothing learnt), and nothing stored into it
            tracker.max_offload_tokens = 0
            self.runtime.mark_down(f"a lookup pending {waited:.2f} s", found=unreachable)
            self.runtime.fallback(info, "store_down")
        elif waited > self.lookup_timeout_s:
            # a server too slow to answer a lookup would stall the engine step that stores: don't store
            tracker.max_offload_tokens = 0
            if self.runtime.cost is not None:
                # the store is at least this slow for this size: learnt, so a calibrated model recomputes such
                # prompts once the store's health check passes again instead of waiting out the timeout again
                self.runtime.cost.observe_timeout(tracker.num_prompt_tokens // self.chunk * self.chunk, waited,
                                                  num_computed_tokens)
            self.runtime.fallback(info, "lookup_timeout")
        else:
            assert self.runtime.cost is not None
            self.runtime.cost.decide_deadline(request.request_id, tracker.num_prompt_tokens, num_computed_tokens,
                                              waited)
            self.runtime.cost_fallback(info)
        return True

    # --- cost-aware loading (see prefixshare.runtime._cost) ---------------------------------------------------
    def cost_before_lookup(self, request: Request, tracker: Any, num_computed_tokens: int, mode: str) -> str:
        """"load" (look up), "recompute" (predicted faster than the largest possible hit) or "local" (the
        engine's prefix cache already holds every chunk a lookup could return)."""
        cost = self.runtime.cost
        if cost is None or request.request_id in self.decided:
            return "load"
        self.decided.add(request.request_id)
        aligned = tracker.num_prompt_tokens // self.chunk * self.chunk
        return cost.decide_before_lookup(request.request_id, tracker.num_prompt_tokens, num_computed_tokens,
                                         aligned, mode).decision

    def cost_deadline(self, request: Request, num_computed_tokens: int) -> float | None:
        cost = self.runtime.cost
        if cost is None:
            return None
        mode = self.runtime.load_mode(self.runtime.requests.get(request.request_id))
        return cost.lookup_deadline_s(request.num_prompt_tokens, num_computed_tokens, mode)

    def cost_after_lookup(self, request: Request, tracker: Any, num_computed_tokens: int, seconds: float,
                          info: RequestInfo | None) -> bool:
        """Record the lookup; False (and the lookup's locks released) when recomputing is predicted faster
        than transferring the hit."""
        cost = self.runtime.cost
        if cost is None:
            return True
        hit = tracker.num_lmcache_hit_tokens
        cost.observe_lookup(hit, seconds)
        if hit <= num_computed_tokens:
            return True
        decision = cost.decide_after_lookup(request.request_id, tracker.num_prompt_tokens, num_computed_tokens,
                                            hit, seconds, self.runtime.load_mode(info))
        if decision.decision == "load":
            return True
        # Release what the lookup locked on the server, exactly as LMCache does for chunks it will not
        # retrieve (update_state_after_alloc -> free_lookup_locks), then recompute; the chunks are in the
        # store already, so they are not written again.
        self.free_locks(request, tracker, hit)
        self.lmcache.cleanup_lookup_result(request.request_id)
        tracker.num_lmcache_hit_tokens = 0
        tracker.num_stored_tokens = hit
        tracker.state = _BYPASS
        self.present[request.request_id] = hit
        self.runtime.cost_fallback(info)
        return False

    def free_locks(self, request: Request, tracker: Any, end: int) -> None:
        self.lmcache.free_lookup_locks(token_ids=tracker.get_token_ids(), start=0, end=end,
                                       request_id=request.request_id, cache_salt=tracker.cache_salt,
                                       request_configs=tracker.request_configs)

    # --- engine steps: the cost model's prefill observations -----------------------------------------------
    def loading(self) -> bool:
        trackers = self.connector.request_trackers.values()
        return any(t.state == LMCacheMPRequestState.WAITING_FOR_LOAD for t in trackers)

    def on_step_scheduled(self, scheduler_output: Any, loading: bool) -> None:
        """Remember what a scheduled step computes, to time it when its output comes."""
        if self.runtime.cost is None or scheduler_output.total_num_scheduled_tokens <= 0:
            return  # (empty steps, e.g. while a lookup is pending, are not executed and get no connector output)
        spans: list[tuple[str, int, int, int]] = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            start = new.num_computed_tokens
            spans.append((new.req_id, start, start + scheduled.get(new.req_id, 0), len(new.prompt_token_ids or ())))
        cached = scheduler_output.scheduled_cached_reqs
        trackers = self.connector.request_trackers
        for i, rid in enumerate(cached.req_ids):
            tracker = trackers.get(rid)
            start = cached.num_computed_tokens[i]
            spans.append((rid, start, start + scheduled.get(rid, 0), tracker.num_prompt_tokens if tracker else 0))
        self.steps.append((time.monotonic(), spans, loading))

    def on_connector_output(self, connector_output: Any) -> None:
        cost = self.runtime.cost
        for request_id in getattr(connector_output, "finished_recving", None) or ():
            self.runtime.load_done(request_id)
            info = self.runtime.requests.get(request_id)
            if cost is not None and info is not None and info.load_s is not None:
                cost.observe_transfer(info.loaded_tokens, info.load_s)
        self.finish_step()

    def finish_step(self) -> None:
        """The engine has executed the last scheduled step: time it (a prefill observation) and record the
        outcome of every request whose prefill it finished. Called from whichever comes first after the
        step: request_finished (a request that ends with its prefill) or update_connector_output."""
        cost = self.runtime.cost
        if cost is None or not self.steps:
            return
        # steps run one at a time here (the scheduler's output of a step comes before the next step)
        began, spans, loading = self.steps.pop()
        self.steps.clear()
        now = time.monotonic()
        prefill = [(start, min(end, prompt)) for _, start, end, prompt in spans if start < prompt]
        if prefill and len(prefill) == len(spans) and not loading:
            cost.observe_prefill(prefill, now - began)
        for rid, start, end, prompt in spans:
            if start < prompt <= end:  # this step finished the request's prefill
                info = self.runtime.requests.get(rid)
                cost.outcome(rid, finished_at=now, loaded_tokens=info.loaded_tokens if info else 0,
                             transfer_s=info.load_s if info else None)

    # --- the end of a request -------------------------------------------------------------------------------
    def before_request_finished(self, request: Request) -> int:
        """Settle what the request left (an abandoned lookup's locks, cost decisions); the tokens it stored."""
        self.finish_step()
        rid = request.request_id
        tracker = self.connector.request_trackers.get(rid)
        present = max(self.present.pop(rid, 0), tracker.num_lmcache_hit_tokens if tracker else 0)
        stored = max(0, tracker.num_stored_tokens - present) if tracker is not None else 0
        if rid in self.abandoned and tracker is not None:
            # An abandoned lookup's prefetch has had the whole recompute to settle: release its locks now
            # (the server releases exactly what it locked, or nothing while the prefetch still runs).
            self.abandoned.discard(rid)
            end = tracker.num_prompt_tokens // self.chunk * self.chunk
            if end > 0:
                self.free_locks(request, tracker, end)
        self.decided.discard(rid)
        self.deadlines.pop(rid, None)
        if self.pump is not None:
            self.pump.forget(rid)
        if self.runtime.cost is not None:
            self.runtime.cost.forget(rid)
        return stored


class LookupPump:
    """Advances the scheduler's pending lookups as their answers arrive, in a thread of its own.

    LMCache's scheduler adapter moves a lookup one round trip further (the LOOKUP's acknowledgement, then the
    prefetch status query and its answer) only when the scheduler asks for the request's result, once per
    engine pass; under load a pass computes other requests' tokens for tens to hundreds of milliseconds, so a
    miss waited two or three passes before its prefill could start. The pump asks as soon as an answer is in
    (it waits on the answers' futures, no busy loop), so the next pass finds the result. The adapter's lookup
    methods hold ``lock`` (:func:`._compat.serialize_lookups`); the pump forgets a request the scheduler
    abandoned or finished, and never decides anything: it only asks what the scheduler would ask."""

    def __init__(self, adapter: Any, lock: Any, log: Any) -> None:
        self.adapter, self.lock, self.log = adapter, lock, log
        self.pending: set[str] = set()
        self.cv = threading.Condition()
        self.thread: threading.Thread | None = None
        self.stopped = False

    def watch(self, request_id: str) -> None:
        with self.cv:
            if request_id in self.pending or self.stopped:
                return
            self.pending.add(request_id)
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="prefixshare-lookups", daemon=True)
                self.thread.start()
            self.cv.notify()

    def forget(self, request_id: str) -> None:
        with self.cv:
            self.pending.discard(request_id)

    def stop(self) -> None:
        with self.cv:
            self.stopped = True
            self.pending.clear()
            self.cv.notify()

    def _run(self) -> None:
        while True:
            with self.cv:
                while not self.pending and not self.stopped:
                    self.cv.wait()
                if self.stopped:
                    return
                ids = list(self.pending)
            waiting: list[Any] = []
            for rid in ids:
                try:
                    with self.lock:
                        done = self.adapter.check_lookup_result(rid) is not None
                        futures = [] if done else _compat.lookup_futures(self.adapter, rid)
                except Exception as exc:  # noqa: BLE001 - the scheduler's own call meets the same error and decides
                    self.log.warning("lookup.pump_failed", request_id=rid, error=str(exc))
                    done, futures = True, []
                if done:
                    self.forget(rid)
                waiting += futures
            if waiting:
                waiting[0].wait(PUMP_WAIT_S)  # the oldest answer; whatever else arrived is seen right after
            else:
                time.sleep(PUMP_POLL_S)


class _ProbeWait:
    """``more()`` sleeps one poll interval and says whether to ask LMCache again; charged to the step's budget."""

    def __init__(self, side: SchedulerSide) -> None:
        self.side = side
        self.deadline = time.monotonic() + min(PROBE_WAIT_S, max(0.0, side.probe_budget_s))

    def more(self) -> bool:
        now = time.monotonic()
        if now + PROBE_POLL_S > self.deadline:
            return False
        time.sleep(PROBE_POLL_S)
        self.side.probe_budget_s -= time.monotonic() - now
        return True


class WorkerSide:
    """prefixshare's work in each vLLM worker: before submitting a step's transfers, check the server is there;
    copy a step's KV into the server after the step (policy ``store.defer``)."""

    def __init__(self, connector: PrefixShareConnector, address: tuple[str, int] | None) -> None:
        self.connector = connector
        self.address = address
        #: shared with the scheduler side's check in this process (a request pays one connect per TTL)
        self.port = PortCheck(address)
        policy = connector.prefixshare.policy
        self.stores = (DeferredStores(policy.load.timeout_s, self._store_failed, self._server_healthy,
                                      self._first_copy) if policy.store.defer else None)

    def defer_stores(self) -> None:
        """Route this step's stores through the worker's store thread (see :mod:`._deferred`) when LMCache's
        transfer context would make them inside the step; a context rebuilt after a server restart is
        wrapped at its first store."""
        if self.stores is None:
            return
        adapter = getattr(self.connector, "worker_adapter", None)
        context = _compat.sync_store_context(adapter)
        if context is not None:
            _compat.set_transfer_context(adapter, self.stores.wrap(context))
            self.connector.prefixshare.log.info(
                "store.deferring", side="worker", context=type(context).__name__,
                queued=self.stores.queued, completed=self.stores.completed, failed=self.stores.failed)

    def drain(self) -> None:
        stores = self.stores
        if stores is None:
            return
        if not stores.drain():
            self.connector.prefixshare.log.warning(
                "store.drain_timeout", side="worker", pending=stores.depth(),
                action="shut down without the stores still queued (their KV is not stored)")
        self.connector.prefixshare.log.info(
            "store.deferred", side="worker", queued=stores.queued, completed=stores.completed, failed=stores.failed,
            dropped=stores.dropped, max_depth=stores.max_depth, own_copies=stores.own_copies)

    def _first_copy(self, here: bool) -> None:
        """Say once which copy fills this worker's stores: prefixshare's one pass, or LMCache's gather (a KV layout
        :mod:`._store_copy` does not know)."""
        self.connector.prefixshare.log.info("store.copy", side="worker", by="prefixshare" if here else "lmcache")

    def _server_healthy(self) -> bool:
        event = _compat.worker_health_event(getattr(self.connector, "worker_adapter", None))
        return event is None or event.is_set()

    def before_get_finished(self) -> None:
        """Before LMCache's worker reports finished transfers: when it finds the server unhealthy it reports every
        store it tracks as finished (vLLM then frees their blocks) without sending what is not sent yet. Deferred
        stores queued by then are dropped, and the one being copied is waited for, so that none reads blocks
        vLLM has freed; without deferral, the stores LMCache drops this way are counted and logged here."""
        adapter = getattr(self.connector, "worker_adapter", None)
        if adapter is None or getattr(adapter, "is_healthy", True):
            return
        futures = getattr(adapter, "store_futures", None) or {}
        if not futures:
            return
        if self.stores is not None:
            self.stores.abandon()  # each dropped store is reported (and counted) by the queue itself
            return
        for request_id, future in list(futures.items()):
            if not future.query():
                self.connector.prefixshare.store_lost(request_id, "server_down")

    def _store_failed(self, request_id: str, reason: str, error: BaseException | None) -> None:
        """A deferred store that did not reach the server is counted and logged; one that raised (its RPC failed
        or timed out) also clears the health flag, as a failed submit does."""
        text = f"{type(error).__name__}: {error}"[:300] if error is not None else None
        self.connector.prefixshare.store_lost(request_id, reason, error=text)
        if error is None:
            return
        event = _compat.worker_health_event(getattr(self.connector, "worker_adapter", None))
        if event is not None:
            event.clear()
        self.connector.prefixshare.log.warning(
            "store.transfer_failed", side="worker", direction="store", deferred=True, request_id=request_id,
            error=text,
            action="this request's KV is not stored; later stores dropped until the server answers")

    def check_format(self, kv_caches: dict[str, Any]) -> None:
        """The namespace's layout label must describe the KV LMCache copies from; stop the engine if not."""
        tensors, hints = _compat.registered_kv(self.connector, kv_caches)
        verify_registered(self.connector.prefixshare, tensors, hints, "vllm")

    @contextlib.contextmanager
    def submitting(self, direction: str) -> Iterator[None]:
        """Submitting a step's transfers never fails the engine step.

        The port check above cannot close the race with a server that stops right after it (a restart under
        load): LMCache's submit then raises (its RPC times out) inside vLLM's forward pass, and vLLM stops the
        engine. Here a submit that raises clears the worker's health flag, as the gate does, and the step's
        transfers that were not submitted take LMCache's degraded path: stores are dropped (the KV is simply
        not stored), retrieves are reported as failed loads, which the engine recomputes
        (``kv_load_failure_policy=recompute``). The heartbeat sets the flag again when the server answers."""
        adapter = getattr(self.connector, "worker_adapter", None)
        futures = getattr(adapter, "retrieve_futures" if direction == "RETRIEVE" else "store_futures", {})
        before = {rid: id(f) for rid, f in futures.items()}
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - whatever LMCache raised, the step must go on
            event = _compat.worker_health_event(adapter)
            if adapter is None or event is None:
                raise
            event.clear()
            dropped = self._degrade(adapter, direction, futures, before)
            self.connector.prefixshare.log.warning(
                "store.transfer_failed", side="worker", direction=direction.lower(), error=f"{type(exc).__name__}: "
                f"{exc}"[:300], requests=dropped, action="stores dropped, loads recomputed; resume when the "
                "server answers")

    def _degrade(self, adapter: Any, direction: str, futures: dict[str, Any], before: dict[str, int]) -> int:
        """Submit, with the health flag cleared, the step's transfers of ``direction`` that were not submitted
        before the failure: LMCache then drops them (stores) or flags them failed (retrieves)."""
        metadata = self.connector._get_connector_metadata()
        submit = adapter.submit_retrieve_request if direction == "RETRIEVE" else adapter.submit_store_request
        dropped = 0
        for meta in getattr(metadata, "requests", ()):
            if getattr(meta, "direction", None) != direction:
                continue
            current = futures.get(meta.request_id)
            if current is not None and before.get(meta.request_id) != id(current):
                continue  # submitted in this step before the failure: it completes (or fails) on its own
            submit(meta.request_id, meta.op, None, cache_salt=meta.cache_salt, request_configs=meta.request_configs)
            dropped += 1
        return dropped

    def gate(self, direction: str) -> None:
        """Before submitting stores (or retrieves) to the server, make sure it is still there.

        LMCache's worker submits a store as two synchronous RPCs; against a server that died since its last
        heartbeat each waits the full RPC timeout, inside the engine step. When the server's port refuses
        connections we clear the worker's health flag instead: LMCache then drops the stores (and reports
        dropped retrieves as failed: the engine recomputes), and its heartbeat re-registers the KV caches
        and sets the flag again as soon as the server answers (a restarted server resumes sharing). The check
        is the scheduler side's cached one (seen open within ``SEEN_OPEN_TTL_S``: no connect), as P5's hook
        timings showed an uncached connect per transfer step costing more than the rest of the hooks."""
        event = _compat.worker_health_event(getattr(self.connector, "worker_adapter", None))
        if event is None or not event.is_set():
            return
        try:
            metadata = self.connector._get_connector_metadata()
        except Exception:  # noqa: BLE001 - no metadata bound: nothing to submit
            return
        if not any(getattr(m, "direction", None) == direction for m in getattr(metadata, "requests", ())):
            return
        if not self.port.ok():
            event.clear()
            self.connector.prefixshare.log.warning(
                "store.unreachable", side="worker", direction=direction.lower(),
                address=f"{self.address[0]}:{self.address[1]}" if self.address else None,
                action="drop this step's transfers; resume when the server answers")
