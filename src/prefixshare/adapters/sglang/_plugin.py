"""prefixshare inside SGLang's scheduler: a radix-cache backend named ``prefixshare``.

SGLang loads this module through its ``sglang.srt.plugins`` entry point in every process it starts; the
scheduler then builds the tree cache with ``--radix-cache-backend prefixshare``. The backend is SGLang's
LMCache MP tree cache plus what prefixshare enforces (see :mod:`prefixshare.adapters._runtime`):

* **namespace** — the model name the MP server sees is ``prefixshare-<fingerprint>``;
* **admission** — the policy's rules decide whether a request's KV is stored;
* **bounded loads** — a store lookup that outlives the policy's load timeout is abandoned (recompute);
* **stats** — counters and structured events for :meth:`PrefixShare.stats`.

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


def build_tree_cache(ctx: Any) -> Any:
    """Radix-cache factory (SGLang's registry calls it in the scheduler process)."""
    from sglang.srt.mem_cache.storage.lmcache.lmcache_unified_radix_cache import LMCacheUnifiedRadixCache
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.runtime_context import get_memory

    from prefixshare.adapters._runtime import ConnectorRuntime
    from prefixshare.adapters.sglang._requests import parse_rid

    memory = get_memory()
    if not memory.enable_lmcache:
        raise RuntimeError("radix_cache_backend='prefixshare' needs enable_lmcache=True (use PrefixShare.attach or "
                           "the flags `prefixshare sglang-args` prints)")
    extra = json.loads(os.environ.get(ENV_CONFIG, "{}"))
    sa = ctx.server_args
    tokenizer = getattr(sa, "tokenizer_path", None)
    runtime = ConnectorRuntime(
        extra, model_dir=sa.model_path, tokenizer_dir=tokenizer if tokenizer and tokenizer != sa.model_path else None,
        settings=engine_settings(sa), role="scheduler",
    )

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
            if not runtime.store_available():
                runtime.fallback(info, "store_down")
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
                runtime.lookup_done(info, loaded, time.monotonic() - info.lookup_started)
                info.lookup_started = None
            return done

        def _submit_store(self, req: Any, token_ids: list[int]) -> Any:
            info = runtime.begin(req.rid, list(req.origin_input_ids or token_ids), parse_rid(req.rid))
            if not info.admitted or not runtime.store_available():
                return None
            if info.store_limit is not None:
                limit = info.store_limit - info.store_limit % runtime.policy.chunk_size
                token_ids = list(token_ids)[:limit]
                if not token_ids:
                    return None
            info.stored_tokens = max(info.stored_tokens, len(token_ids) - len(token_ids) % runtime.policy.chunk_size)
            return super()._submit_store(req, token_ids)

        def on_release(self, req: Any, *, checkpointed: bool) -> None:
            super().on_release(req, checkpointed=checkpointed)
            info = runtime.requests.get(req.rid)
            if info is not None and req.finished():
                runtime.load_done(req.rid)
                runtime.finish(req.rid, max(0, info.stored_tokens - info.loaded_tokens))

    components = [ComponentType.FULL]
    if ctx.is_hybrid_swa:
        components.append(ComponentType.SWA)
    if ctx.is_hybrid_ssm:
        components.append(ComponentType.MAMBA)
    ctx.params.tree_components = tuple(components)
    return PrefixShareRadixCache(
        ctx.params,
        model_config=_ModelConfigView(ctx.model_config, runtime.namespace),
        tp_size=ctx.tp_size,
        tp_rank=ctx.tp_rank,
        lmcache_config_file=memory.lmcache_config_file,
        forward_stream=ctx.tp_worker.model_runner.forward_stream,
    )
