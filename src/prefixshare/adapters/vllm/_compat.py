"""Every use of vLLM's and LMCache's internals by the vLLM adapter, in one place.

* :func:`worker_health_event` — LMCache's worker adapter keeps its server-health flag in a private event;
  the connector's worker side clears it to drop a step's transfers to a dead server.
* :func:`registered_kv` — the KV tensors and layout hints as LMCache's connector registers them (after its
  KV-cache-group edits), for the stored-format check.
* :func:`sync_store_context` — LMCache's worker adapter keeps its transfer context in ``transfer_ctx`` and
  rebuilds it when a restarted server is re-registered; the synchronous engine-driven context (CPU engines)
  is the one whose stores the connector defers (:mod:`prefixshare.adapters.vllm._deferred`).
* :func:`apply` — a guarded fix for one vLLM 0.32 bug that breaks in-process engines once LMCache is imported.

The bug:
With ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` vLLM's ``triton_utils.dispatcher._rebind_kernels`` calls
``vars()`` on every loaded module's globals; numba's llvmlite keeps an object whose ``vars()`` is not a
dict, and engine start fails with ``AttributeError: '_lib_fn_wrapper' object has no attribute 'get'``.
We shadow ``vars`` in that one module so such objects count as having no attributes; every other object
behaves as before. Multiprocess engines (vLLM's default) never hit this path.
"""

from __future__ import annotations

import builtins
from typing import Any


def _safe_vars(obj: Any) -> Any:
    namespace = builtins.vars(obj)
    return namespace if hasattr(namespace, "get") else {}


def apply() -> bool:
    """Install the fix if vLLM has the affected module; True when installed."""
    try:
        import vllm.triton_utils.dispatcher as dispatcher
    except ImportError:
        return False
    if getattr(dispatcher, "vars", None) is not _safe_vars:
        dispatcher.vars = _safe_vars  # type: ignore[attr-defined]
    return True


def worker_health_event(worker_adapter: Any) -> Any:
    """LMCache's worker-side health flag (a ``threading.Event``: set while the server answers), or None."""
    return getattr(worker_adapter, "_health_event", None)


def registered_kv(connector: Any, kv_caches: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(KV tensors, layout hints) exactly as ``LMCacheMPConnector.register_kv_caches`` hands them on."""
    from lmcache.integration.vllm.kv_cache_group_edits import apply_kv_cache_group_edits
    from lmcache.integration.vllm.utils import vllm_layout_hints

    hints = vllm_layout_hints(getattr(connector, "_vllm_config", None))
    edited = apply_kv_cache_group_edits(getattr(connector, "_kv_cache_config", None), kv_caches, layout_hints=hints)
    return dict(edited), dict(hints or {})


def sync_store_context(worker_adapter: Any) -> Any:
    """The worker adapter's transfer context when its stores run synchronously inside the engine step (LMCache's
    ``EngineDrivenTransferContext`` exactly, not its asynchronous or accelerator-driven subclasses), else None."""
    context = getattr(worker_adapter, "transfer_ctx", None)
    if context is None:
        return None
    from lmcache.v1.multiprocess.transfer_context import EngineDrivenTransferContext

    return context if type(context) is EngineDrivenTransferContext else None


def set_transfer_context(worker_adapter: Any, context: Any) -> None:
    worker_adapter.transfer_ctx = context
