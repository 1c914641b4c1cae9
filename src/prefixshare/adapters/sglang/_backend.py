"""The ``prefixshare`` radix-cache backend: SGLang's LMCache MP tree cache plus what prefixshare enforces.

This module imports SGLang: only SGLang's scheduler process imports it, when it builds the tree cache
(:func:`build_tree_cache`, through :mod:`prefixshare.adapters.sglang._plugin`). What the backend keeps of its
own lives in :class:`~prefixshare.adapters.sglang._state.BackendState` (no SGLang needed), and every reach into
SGLang's or LMCache's internals goes through :mod:`prefixshare.adapters.sglang._compat`.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from sglang.srt.mem_cache.storage.lmcache.lmcache_unified_radix_cache import LMCacheUnifiedRadixCache
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.runtime_context import get_memory

from prefixshare.adapters._format import verify_registered
from prefixshare.adapters.sglang import _compat
from prefixshare.adapters.sglang._requests import parse_rid
from prefixshare.adapters.sglang._settings import ENV_CONFIG, engine_settings, tokenizer_dir
from prefixshare.adapters.sglang._state import BackendState
from prefixshare.keys import REQ_LOAD
from prefixshare.runtime import ConnectorRuntime, RequestInfo


class _ModelConfigView:
    """SGLang's model config with one field changed: the model path the MP server keys objects by."""

    def __init__(self, inner: Any, model_path: str) -> None:
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "model_path", model_path)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class PrefixShareRadixCache(LMCacheUnifiedRadixCache):
    """SGLang's LMCache MP tree cache, namespaced by fingerprint and governed by a Policy."""

    def __init__(self, params: Any, *, runtime: ConnectorRuntime, **kwargs: Any) -> None:
        self.prefixshare = runtime
        self.state = BackendState(runtime)
        #: store operations in flight: their chunk keys, remembered once LMCache reports the store done
        self._pending_keys: dict[tuple[str, int], list[tuple[str, bytes]]] = {}
        self._storing: set[str] = set()  # requests that submitted a store (their mark is no lookup's)
        super().__init__(params, **kwargs)
        _compat.on_store_completed(self.lmcache_connector, self._store_completed)
        _compat.store_copies_on_threads_that_end(self.lmcache_connector)
        tensors, hints = _compat.registered_kv(self.lmcache_connector)
        if tensors:  # the namespace's layout label must describe the KV LMCache copies from
            verify_registered(runtime, tensors, hints, "sglang")

    # --- lookup (prefetch from the store) ---------------------------------------------------------------
    def prefetch_from_storage(self, request: Any, last_host_node_id: Any, new_input_tokens: list[int],
                              *args: Any, **kwargs: Any) -> None:
        runtime, rid = self.prefixshare, request.rid
        params = parse_rid(rid)
        mode = params.get(REQ_LOAD) or runtime.policy.load.mode
        if mode == "never":
            return None
        matched = list(kwargs.get("matched_prefix_tokens") or [])
        info = runtime.begin(rid, matched + list(new_input_tokens), params)
        if not self.state.store_reachable():
            runtime.fallback(info, "store_down")
            return None
        n = len(matched) + len(new_input_tokens)
        if self.state.start_timing(rid, n, len(matched)):
            chunk = runtime.policy.chunk_size
            decision = runtime.cost.decide_before_lookup(  # type: ignore[union-attr]
                rid, n, len(matched), n // chunk * chunk, mode).decision
            if decision == "recompute":
                runtime.cost_fallback(info)
                return None
            if decision == "local":
                return None
        info.lookup_started = time.monotonic()
        return super().prefetch_from_storage(request, last_host_node_id, new_input_tokens, *args, **kwargs)

    def check_prefetch_progress(self, handle: Any) -> bool:
        runtime, rid = self.prefixshare, handle.rid
        flow = _compat.external_flow(self, rid)
        info = runtime.requests.get(rid)
        if flow is not None and flow.total_hit is None and info is not None and info.lookup_started is not None:
            waited = time.monotonic() - info.lookup_started
            timing = self.state.timing.get(rid)
            deadline = None
            if runtime.cost is not None and timing is not None:
                deadline = runtime.cost.lookup_deadline_s(timing["prompt"], timing["done"], runtime.load_mode(info))
            if waited > runtime.policy.load.timeout_s:
                # The store is too slow or gone: stop waiting; SGLang computes the prompt itself.
                _compat.drop_prefetch(self, rid, handle)
                info.lookup_started = None
                if runtime.cost is not None and timing is not None:
                    # the store is at least this slow for this size (learnt: see CostModel.observe_timeout)
                    chunk = runtime.policy.chunk_size
                    runtime.cost.observe_timeout(timing["prompt"] // chunk * chunk, waited, timing["done"])
                runtime.fallback(info, "lookup_timeout")
                return True
            if deadline is not None and waited > deadline:
                # the cost model's bound (mode auto): recomputing is predicted faster than waiting on
                _compat.drop_prefetch(self, rid, handle)
                info.lookup_started = None
                runtime.cost.decide_deadline(rid, timing["prompt"], timing["done"], waited)  # type: ignore[union-attr]
                runtime.cost_fallback(info)
                return True
        done = super().check_prefetch_progress(handle)
        if done and info is not None and info.lookup_started is not None:
            loaded = int(self.prefetch_loaded_tokens_by_reqid.get(handle, 0) or 0)
            seconds = time.monotonic() - info.lookup_started
            runtime.lookup_done(info, loaded, seconds)
            info.lookup_started = None
            self._cost_after_lookup(handle, rid, info, loaded, seconds)
        return done

    def _cost_after_lookup(self, handle: Any, rid: str, info: RequestInfo, loaded: int, seconds: float) -> None:
        """Record the lookup; when transferring the hit is predicted slower than computing it, release the
        lookup's locks (as SGLang does for hits its own cache covers) and compute instead."""
        cost, timing = self.prefixshare.cost, self.state.timing.get(rid)
        if cost is None or timing is None:
            return
        timing["ready"] = time.monotonic()
        flow = _compat.external_flow(self, rid)
        local = timing["done"]
        cost.observe_lookup(local + loaded, seconds)
        if loaded <= 0 or flow is None or flow.total_hit is None:
            return
        d = cost.decide_after_lookup(rid, timing["prompt"], local, local + loaded, seconds)
        if d.decision == "load":
            return
        chunk = self.lmcache_connector.chunk_size
        start = min(flow.total_hit, flow.local_hit_tokens // chunk * chunk)  # super() released [0, start)
        if flow.total_hit > start:
            self.lmcache_connector.free_lookup_locks(rid, start=start, end=flow.total_hit)
        _compat.drop_prefetch(self, rid, handle)
        self.prefixshare.cost_fallback(info)

    # --- load and compute ---------------------------------------------------------------------------------
    def init_load_back(self, params: Any) -> Any:
        result = super().init_load_back(params)
        req = getattr(params, "req", None)
        timing = self.state.timing.get(req.rid) if req is not None else None
        if timing is not None and result and result[0]:
            timing["transfer_from"] = time.monotonic()
            timing["loaded"] = int(result[0])
        return result

    def checkpoint(self, req: Any, *, up_to: int, **kwargs: Any) -> None:
        self.state.observe_checkpoint(req.rid, up_to)
        super().checkpoint(req, up_to=up_to, **kwargs)

    # --- store --------------------------------------------------------------------------------------------
    def _submit_store(self, req: Any, token_ids: list[int]) -> Any:
        runtime = self.prefixshare
        info = runtime.begin(req.rid, list(req.origin_input_ids or token_ids), parse_rid(req.rid))
        if not info.admitted or not self.state.store_reachable():
            return None
        chunk = runtime.policy.chunk_size
        if info.store_limit is not None:
            token_ids = token_ids[:info.store_limit - info.store_limit % chunk]  # a slice keeps SGLang's key type
            if not token_ids:
                return None
        connector, submitted = self.lmcache_connector, self.state.submitted
        keys = submitted.digests(token_ids, connector.build_cache_salt(req.cache_salt, req.extra_key))
        sent = _compat.submitted_tokens(connector)
        if req.rid not in self._storing and sent.get(req.rid, 0):
            submitted.add(keys[: sent[req.rid] // chunk])  # this request's lookup found them in the store
        self._storing.add(req.rid)
        known = submitted.known(keys) * chunk
        if known > sent.get(req.rid, 0):
            sent[req.rid] = known  # sent before (by this engine, for an earlier request): not again
        start = sent.get(req.rid, 0)
        result = super()._submit_store(req, token_ids)
        end = sent.get(req.rid, 0)
        if end > start:
            # remembered once the store succeeds (see _store_completed); counted as stored now
            pending = self._pending_keys
            pending[(req.rid, end)] = keys[: end // chunk]
            while len(pending) > 4096:  # operations never completed (aborted requests): forget the oldest
                pending.pop(next(iter(pending)))
            info.stored_tokens += end - start
        return result

    def _store_completed(self, operation: Any, ok: bool) -> None:
        """Remember a store's chunks when LMCache reports it done (a failed one is sent again next time)."""
        keys = self._pending_keys.pop((operation.request_id, operation.end), None)
        if ok and keys:
            self.state.submitted.add(keys)

    # --- the end of a request -------------------------------------------------------------------------------
    def on_release(self, req: Any, *, checkpointed: bool) -> None:
        super().on_release(req, checkpointed=checkpointed)
        if not req.finished():
            return
        runtime = self.prefixshare
        info = runtime.requests.get(req.rid)
        self.state.forget(req.rid)
        self._storing.discard(req.rid)
        if info is not None:
            runtime.load_done(req.rid)
            runtime.finish(req.rid, info.stored_tokens)


def build_tree_cache(ctx: Any) -> PrefixShareRadixCache:
    """Radix-cache factory (SGLang's registry calls it in the scheduler process)."""
    memory = get_memory()
    if not memory.enable_lmcache:
        raise RuntimeError("radix_cache_backend='prefixshare' needs enable_lmcache=True (use PrefixShare.attach or "
                           "the flags `prefixshare sglang-args` prints)")
    extra = json.loads(os.environ.get(ENV_CONFIG, "{}"))
    sa = ctx.server_args
    runtime = ConnectorRuntime(extra, model_dir=sa.model_path, tokenizer_dir=tokenizer_dir(sa),
                               settings=engine_settings(sa), role="scheduler")
    components = [ComponentType.FULL]
    if ctx.is_hybrid_swa:
        components.append(ComponentType.SWA)
    if ctx.is_hybrid_ssm:
        components.append(ComponentType.MAMBA)
    ctx.params.tree_components = tuple(components)
    return PrefixShareRadixCache(
        ctx.params,
        runtime=runtime,
        model_config=_ModelConfigView(ctx.model_config, runtime.namespace),
        tp_size=ctx.tp_size,
        tp_rank=ctx.tp_rank,
        lmcache_config_file=memory.lmcache_config_file,
        forward_stream=ctx.tp_worker.model_runner.forward_stream,
    )
