"""Every use of SGLang's and LMCache's internals by the SGLang backend, in one place.

The backend subclasses SGLang's LMCache tree cache and reaches into state that SGLang and LMCache keep for
themselves: the per-request "already in the store" mark of LMCache's SGLang connector, its store-completion
hook, and the tree cache's prefetch bookkeeping. A new SGLang or LMCache version that renames one of these
breaks here, not across the backend.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def submitted_tokens(connector: Any) -> dict[str, int]:
    """LMCache's per-request count of leading tokens already in the store (a lookup found them, or this
    request stored them); a store of a request starts there."""
    return connector._store_submitted_tokens  # type: ignore[no-any-return]


def on_store_completed(connector: Any, callback: Callable[[Any, bool], None]) -> None:
    """Call ``callback(operation, ok)`` whenever LMCache reports a store operation finished."""
    complete = connector.complete_store

    def complete_store(operation: Any, *args: Any, **kwargs: Any) -> bool:
        ok = complete(operation, *args, **kwargs)
        callback(operation, ok)
        return ok

    connector.complete_store = complete_store


def drop_prefetch(cache: Any, rid: str, handle: Any) -> None:
    """Forget a request's store lookup in the tree cache: SGLang computes the prompt itself."""
    cache._external_flows.pop(rid, None)
    cache.prefetch_loaded_tokens_by_reqid[handle] = 0
    cache.prefetch_loaded_storage_start_by_reqid.pop(handle, None)


def external_flow(cache: Any, rid: str) -> Any:
    """The tree cache's record of a request's store lookup (None when it has none)."""
    return cache._external_flows.get(rid)


def registered_kv(connector: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(KV tensors, layout hints) as LMCache's SGLang connector registers them with the MP server."""
    return dict(getattr(connector, "_kv_caches", None) or {}), {"kv_list_layout": "unified"}


def store_copies_on_threads_that_end(connector: Any) -> bool:
    """Run LMCache's store copies (its transfer context's ``_commit_executor``, a thread pool whose threads live
    as long as the engine) each on a thread that ends with the copy, same order and same concurrency (see
    :mod:`prefixshare.adapters._threads`: a long-lived thread's OpenMP pool slows every later prefill). False
    when this LMCache's context has no such executor (nothing to change)."""
    from concurrent.futures import ThreadPoolExecutor

    from prefixshare.adapters._threads import ThreadPerTaskExecutor

    context = getattr(connector, "_transfer_ctx", None)
    executor = getattr(context, "_commit_executor", None)
    if not isinstance(executor, ThreadPoolExecutor):
        return isinstance(executor, ThreadPerTaskExecutor)
    context._commit_executor = ThreadPerTaskExecutor(executor._max_workers,  # type: ignore[union-attr]
                                                     thread_name_prefix="prefixshare-sglang-store-copy")
    executor.shutdown(wait=False)  # it has run nothing yet: the engine is still being built
    return True
