"""prefixshare inside SGLang's scheduler: a radix-cache backend named ``prefixshare``.

SGLang loads this module through its ``sglang.srt.plugins`` entry point in every process it starts; the
scheduler then builds the tree cache with ``--radix-cache-backend prefixshare``. The backend is SGLang's
LMCache MP tree cache plus what prefixshare enforces (see :mod:`prefixshare.adapters._runtime`):

* **namespace** — the model name the MP server sees is ``prefixshare-<fingerprint>``;
* **admission** — the policy's rules decide whether a request's KV is stored;
* **bounded loads** — a store lookup that outlives the policy's load timeout is abandoned (recompute);
* **stats** — counters and structured events for :meth:`PrefixShare.stats`;
* **cost-aware loading** (``load.mode: auto``) — a prefix is looked up and loaded only when that is predicted
  faster than computing it (:mod:`prefixshare.adapters._cost`); the prefill rate comes from the time between
  a request becoming ready (lookup answered) and SGLang checkpointing its computed prefix.

Its settings come from the environment the engine was started with (``PREFIXSHARE_SGLANG``: JSON with the
policy and the instance name), which SGLang's processes inherit.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

BACKEND = "prefixshare"
ENV_CONFIG = "PREFIXSHARE_SGLANG"


def register() -> None:
    """SGLang plugin entry point: make the ``prefixshare`` radix-cache backend available (cheap, idempotent)."""
    from sglang.srt.mem_cache.registry import register_radix_cache_backend, registered_radix_cache_backends

    if BACKEND not in registered_radix_cache_backends():
        register_radix_cache_backend(BACKEND, build_tree_cache)


class _ModelConfigView:
    """SGLang's model config with one field changed: the model path the MP server keys objects by."""

    def __init__(self, inner: Any, model_path: str) -> None:
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "model_path", model_path)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class SubmittedChunks:
    """Chunk prefixes this engine already sent to the store, keyed by (salt, digest of the tokens up to the chunk's
    end); a bounded LRU.

    SGLang re-sends a request's whole prefix when its own radix tree held it (no lookup ran, so LMCache does not
    know the store has it): every question on a warm document would copy the document's KV to the server again
    and count it as stored again (bytes, byte budgets). The vLLM connector skips the same case ("local").
    """

    def __init__(self, chunk_size: int, limit: int = 1 << 16) -> None:
        from collections import OrderedDict

        self.chunk_size = chunk_size
        self.limit = limit
        self._seen: OrderedDict[tuple[str, bytes], None] = OrderedDict()

    def digests(self, token_ids: Any, salt: str) -> list[tuple[str, bytes]]:
        """One key per full chunk: a rolling blake3 over the token ids (each key covers every token before it)."""
        import blake3

        from prefixshare.adapters._runtime import token_bytes

        keys = []
        digest = b""
        for end in range(self.chunk_size, len(token_ids) + 1, self.chunk_size):
            digest = blake3.blake3(digest + token_bytes(token_ids[end - self.chunk_size:end])).digest()[:16]
            keys.append((salt, digest))
        return keys

    def known(self, keys: list[tuple[str, bytes]]) -> int:
        """How many leading chunks were sent already."""
        n = 0
        for key in keys:
            if key not in self._seen:
                break
            self._seen.move_to_end(key)
            n += 1
        return n

    def add(self, keys: list[tuple[str, bytes]]) -> None:
        for key in keys:
            self._seen[key] = None
            self._seen.move_to_end(key)
        while len(self._seen) > self.limit:
            self._seen.popitem(last=False)


def engine_settings(server_args: Any) -> Any:
    import sglang

    from prefixshare.fingerprint import EngineSettings

    version = ".".join(sglang.__version__.split(".")[:2])
    device = str(getattr(server_args, "device", None) or "cuda")
    kv_dtype = str(getattr(server_args, "kv_cache_dtype", "auto") or "auto")
    if kv_dtype == "auto":
        dtype = str(getattr(server_args, "dtype", "auto") or "auto")
        kv_dtype = "auto" if dtype == "auto" else {"half": "float16", "float": "float32"}.get(dtype, dtype)
    return EngineSettings(
        engine="sglang",
        engine_version=version,
        # engine and version in the label: no other engine's objects are proven byte-identical to these
        kv_layout=f"sglang-{version}/{device}/paged",
        kv_dtype=kv_dtype,
        block_size=int(getattr(server_args, "page_size", 1) or 1),
        tp=int(getattr(server_args, "tp_size", 1) or 1),
        pp=int(getattr(server_args, "pp_size", 1) or 1),
    )


def tokenizer_dir(server_args: Any) -> str | None:
    """The tokenizer directory when it is not the model's own (what the fingerprint digests separately)."""
    tok = getattr(server_args, "tokenizer_path", None)
    return tok if tok and tok != server_args.model_path else None


def build_tree_cache(ctx: Any) -> Any:
    """Radix-cache factory (SGLang's registry calls it in the scheduler process)."""
    from sglang.srt.mem_cache.storage.lmcache.lmcache_unified_radix_cache import LMCacheUnifiedRadixCache
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.runtime_context import get_memory

    from prefixshare.adapters._reach import PortCheck
    from prefixshare.adapters._runtime import ConnectorRuntime
    from prefixshare.adapters.sglang._requests import parse_rid

    memory = get_memory()
    if not memory.enable_lmcache:
        raise RuntimeError("radix_cache_backend='prefixshare' needs enable_lmcache=True (use PrefixShare.attach or "
                           "the flags `prefixshare sglang-args` prints)")
    extra = json.loads(os.environ.get(ENV_CONFIG, "{}"))
    sa = ctx.server_args
    runtime = ConnectorRuntime(extra, model_dir=sa.model_path, tokenizer_dir=tokenizer_dir(sa),
                               settings=engine_settings(sa), role="scheduler")

    #: per request: when it became ready to compute, how far it is computed, when its load began (cost model)
    _timing: dict[str, dict[str, Any]] = {}
    #: the MP server's request port (a dead server refuses at once; LMCache notices only at its next heartbeat,
    #: and until then a lookup waits out the load timeout and a store RPC blocks the scheduler)
    mp_port = PortCheck((runtime.policy.server.host, runtime.policy.server.port))
    submitted = SubmittedChunks(runtime.policy.chunk_size)

    def _store_reachable() -> bool:
        if not runtime.store_available():
            return False
        if mp_port.ok():
            return True
        runtime.mark_down(f"the LMCache server's port {runtime.policy.server.host}:{runtime.policy.server.port} "
                          "refuses connections")
        return False

    def _cost_fallback(info: Any) -> None:
        from prefixshare import _metrics

        with runtime._lock:
            runtime.stats.fallbacks["cost"] += 1
            info.fallback, info.loaded_tokens = "cost", 0
        _metrics.fallback(runtime.engine, "cost")

    def _observe_checkpoint(rid: str, up_to: int) -> None:
        """SGLang checkpoints a request's computed prefix after each prefill chunk: time the chunk."""
        cost, timing = runtime.cost, _timing.get(rid)
        if cost is None or timing is None or up_to <= timing["done"]:
            return
        now = time.monotonic()
        start = timing["done"]
        if timing.get("transfer_from") is not None:
            # the first chunk after a load: the transfer plus computing what the load left
            loaded = timing.pop("loaded", 0)
            start += loaded
            elapsed = now - timing.pop("transfer_from")
            rest = cost.prefill_s(start, up_to) or 0.0
            cost.observe_transfer(loaded, max(0.0, elapsed - rest))
            timing["transfer_from"] = None
        elif up_to > start:
            cost.observe_prefill([(start, up_to)], now - timing["ready"])
        timing["done"], timing["ready"] = up_to, now
        if up_to >= timing["prompt"] - 1:
            info = runtime.requests.get(rid)
            cost.outcome(rid, finished_at=now, loaded_tokens=info.loaded_tokens if info else 0)

    class PrefixShareRadixCache(LMCacheUnifiedRadixCache):
        """SGLang's LMCache MP tree cache, namespaced by fingerprint and governed by a Policy."""

        prefixshare = runtime

        def prefetch_from_storage(self, request: Any, last_host_node_id: Any, new_input_tokens: list[int],
                                  *args: Any, **kwargs: Any) -> None:
            rid = request.rid
            if runtime.policy.load.mode == "never":
                return None
            matched = list(kwargs.get("matched_prefix_tokens") or [])
            info = runtime.begin(rid, matched + list(new_input_tokens), parse_rid(rid))
            if not _store_reachable():
                runtime.fallback(info, "store_down")
                return None
            cost = runtime.cost
            if cost is not None and rid not in _timing:
                n = len(matched) + len(new_input_tokens)
                chunk = runtime.policy.chunk_size
                _timing[rid] = {"ready": time.monotonic(), "done": len(matched), "prompt": n, "transfer_from": None}
                decision = cost.decide_before_lookup(rid, n, len(matched), n // chunk * chunk).decision
                if decision == "recompute":
                    _cost_fallback(info)
                    return None
                if decision == "local":
                    return None
            info.lookup_started = time.monotonic()
            return super().prefetch_from_storage(request, last_host_node_id, new_input_tokens, *args, **kwargs)

        def check_prefetch_progress(self, handle: Any) -> bool:
            rid = handle.rid
            flow = self._external_flows.get(rid)
            info = runtime.requests.get(rid)
            if flow is not None and flow.total_hit is None and info is not None and info.lookup_started is not None:
                if time.monotonic() - info.lookup_started > runtime.policy.load.timeout_s:
                    # The store is too slow or gone: stop waiting; SGLang computes the prompt itself.
                    self._external_flows.pop(rid, None)
                    self.prefetch_loaded_tokens_by_reqid[handle] = 0
                    self.prefetch_loaded_storage_start_by_reqid.pop(handle, None)
                    info.lookup_started = None
                    runtime.fallback(info, "lookup_timeout")
                    return True
            done = super().check_prefetch_progress(handle)
            if done and info is not None and info.lookup_started is not None:
                loaded = int(self.prefetch_loaded_tokens_by_reqid.get(handle, 0) or 0)
                seconds = time.monotonic() - info.lookup_started
                runtime.lookup_done(info, loaded, seconds)
                info.lookup_started = None
                self._cost_after_lookup(handle, rid, info, loaded, seconds)
            return done

        def _cost_after_lookup(self, handle: Any, rid: str, info: Any, loaded: int, seconds: float) -> None:
            """Record the lookup; when transferring the hit is predicted slower than computing it, release the
            lookup's locks (as SGLang does for hits its own cache covers) and compute instead."""
            cost, timing = runtime.cost, _timing.get(rid)
            if cost is None or timing is None:
                return
            timing["ready"] = time.monotonic()
            flow = self._external_flows.get(rid)
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
            self._external_flows.pop(rid, None)
            self.prefetch_loaded_tokens_by_reqid[handle] = 0
            self.prefetch_loaded_storage_start_by_reqid.pop(handle, None)
            _cost_fallback(info)

        def init_load_back(self, params: Any) -> Any:
            result = super().init_load_back(params)
            req = getattr(params, "req", None)
            timing = _timing.get(req.rid) if req is not None else None
            if timing is not None and result and result[0]:
                timing["transfer_from"] = time.monotonic()
                timing["loaded"] = int(result[0])
            return result

        def checkpoint(self, req: Any, *, up_to: int, **kwargs: Any) -> None:
            _observe_checkpoint(req.rid, up_to)
            super().checkpoint(req, up_to=up_to, **kwargs)

        def _submit_store(self, req: Any, token_ids: list[int]) -> Any:
            info = runtime.begin(req.rid, list(req.origin_input_ids or token_ids), parse_rid(req.rid))
            if not info.admitted or not _store_reachable():
                return None
            if info.store_limit is not None:
                limit = info.store_limit - info.store_limit % runtime.policy.chunk_size
                token_ids = token_ids[:limit]  # a slice keeps SGLang's key type (array('q') in 0.5.23)
                if not token_ids:
                    return None
            connector = self.lmcache_connector
            keys = submitted.digests(token_ids, connector.build_cache_salt(req.cache_salt, req.extra_key))
            sent = connector._store_submitted_tokens  # LMCache's per-request "already in the store" mark
            chunk = runtime.policy.chunk_size
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
                # remembered once the store succeeds (see _track_completions); counted as stored now
                pending = self._pending_keys
                pending[(req.rid, end)] = keys[: end // runtime.policy.chunk_size]
                while len(pending) > 4096:  # operations never completed (aborted requests): forget the oldest
                    pending.pop(next(iter(pending)))
                info.stored_tokens += end - start
            return result

        def _track_completions(self) -> None:
            """Remember a store's chunks when LMCache reports it done (a failed one is sent again next time)."""
            self._pending_keys: dict[tuple[str, int], list[tuple[str, bytes]]] = {}
            self._storing: set[str] = set()  # requests that submitted a store (their mark is no lookup's)
            connector = self.lmcache_connector
            complete = connector.complete_store
            pending = self._pending_keys

            def complete_store(operation: Any, *args: Any, **kwargs: Any) -> bool:
                ok = complete(operation, *args, **kwargs)
                keys = pending.pop((operation.request_id, operation.end), None)
                if ok and keys:
                    submitted.add(keys)
                return ok

            connector.complete_store = complete_store

        def on_release(self, req: Any, *, checkpointed: bool) -> None:
            super().on_release(req, checkpointed=checkpointed)
            info = runtime.requests.get(req.rid)
            if req.finished():
                _timing.pop(req.rid, None)
                if runtime.cost is not None:
                    runtime.cost.forget(req.rid)
            if req.finished():
                self._storing.discard(req.rid)
            if info is not None and req.finished():
                runtime.load_done(req.rid)
                runtime.finish(req.rid, info.stored_tokens)

    components = [ComponentType.FULL]
    if ctx.is_hybrid_swa:
        components.append(ComponentType.SWA)
    if ctx.is_hybrid_ssm:
        components.append(ComponentType.MAMBA)
    ctx.params.tree_components = tuple(components)
    cache = PrefixShareRadixCache(
        ctx.params,
        model_config=_ModelConfigView(ctx.model_config, runtime.namespace),
        tp_size=ctx.tp_size,
        tp_rank=ctx.tp_rank,
        lmcache_config_file=memory.lmcache_config_file,
        forward_stream=ctx.tp_worker.model_runner.forward_stream,
    )
    cache._track_completions()
    return cache
