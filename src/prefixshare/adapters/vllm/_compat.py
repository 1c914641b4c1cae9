"""Every use of vLLM's and LMCache's internals by the vLLM adapter, in one place.

* :func:`worker_health_event` — LMCache's worker adapter keeps its server-health flag in a private event;
  the connector's worker side clears it to drop a step's transfers to a dead server.
* :func:`registered_kv` — the KV tensors and layout hints as LMCache's connector registers them (after its
  KV-cache-group edits), for the stored-format check.
* :func:`sync_store_context` — LMCache's worker adapter keeps its transfer context in ``transfer_ctx`` and
  rebuilds it when a restarted server is re-registered; the synchronous engine-driven context (CPU engines)
  is the one whose stores the connector defers (:mod:`prefixshare.adapters.vllm._deferred`).
* :func:`engine_driven_store`, :func:`single_group_block_ids`, :func:`lmcache_gather` — the three steps of
  LMCache's synchronous store (reserve the server's chunk buffers, fill them, commit) and the pieces of its
  context they need, for the store whose fill :mod:`prefixshare.adapters.vllm._store_copy` makes itself.
* :func:`apply` — a guarded fix for one vLLM 0.32 bug that breaks in-process engines once LMCache is imported.
* :func:`serialize_lookups`, :func:`lookup_futures` — LMCache's scheduler adapter advances a lookup (LOOKUP,
  its acknowledgement, the prefetch status query and its answer) only when the scheduler asks for its result,
  one step per engine pass; prefixshare's lookup pump (:class:`prefixshare.adapters.vllm.connector.LookupPump`)
  asks from a thread of its own as each answer arrives, so the adapter's lookup bookkeeping is serialized and
  the pump waits on the answers' futures.
* :func:`patient_heartbeat` — LMCache's ``HeartbeatThread`` waits one interval for a ping and calls the server
  unhealthy after one late answer (then the worker drops its in-flight stores); prefixshare's subclass gives a
  ping its own deadline and degrades after consecutive misses.

Verified against LMCache 0.5.6 (``lmcache.integration.vllm.vllm_multi_process_adapter``: ``HeartbeatThread``'s
``_req_client`` (its ``ping(instance_id)`` returns a future with ``wait`` / ``result``), ``_health_event``,
``_interval``, ``_instance_id``, ``_recover_callback``, ``stop_requested``; both adapters construct
``HeartbeatThread`` by its module name when they start it; ``LMCacheMPSchedulerAdapter``'s
``maybe_submit_lookup_request``, ``check_lookup_result``, ``cleanup_lookup_result``, ``end_session`` and the
dicts they share, ``_unacked_lookups`` (request id -> an ack with ``futures``: url -> future) and
``_lookup_status`` (request id -> url -> (future, submitted at)), ``_nonblocking_lookup_status``).

The bug:
With ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` vLLM's ``triton_utils.dispatcher._rebind_kernels`` calls
``vars()`` on every loaded module's globals; numba's llvmlite keeps an object whose ``vars()`` is not a
dict, and engine start fails with ``AttributeError: '_lib_fn_wrapper' object has no attribute 'get'``.
We shadow ``vars`` in that one module so such objects count as having no attributes; every other object
behaves as before. Multiprocess engines (vLLM's default) never hit this path.
"""

from __future__ import annotations

import builtins
import time
from typing import Any

#: how long a heartbeat ping may take before it counts as missed (LMCache: the heartbeat interval, 1 s here):
#: a loaded server answers a ping behind the lookups and stores queued on the same socket and worker pool
PING_DEADLINE_S = 5.0
#: consecutive missed pings before the server counts as unhealthy (LMCache: one). A server that died is found
#: sooner by the port check before each request and each step's transfers, a hung one by the RPC timeouts of
#: its lookups and stores; the heartbeat is the last word, so it waits for a second miss.
PINGS_MISSED_TO_DEGRADE = 2
#: how often a ping waiting for its answer checks that the server's port still accepts connections
PING_SLICE_S = 0.25


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


#: the scheduler adapter's methods that read and write its lookup bookkeeping
LOOKUP_METHODS = ("maybe_submit_lookup_request", "check_lookup_result", "cleanup_lookup_result", "end_session")


def serialize_lookups(adapter: Any, lock: Any) -> bool:
    """Every call of the adapter's lookup methods holds ``lock`` (a re-entrant lock), so a second thread may
    advance lookups. False (and nothing changed) when this LMCache's adapter lacks one of them or its
    bookkeeping: the scheduler then advances lookups alone, as LMCache does."""
    if not all(callable(getattr(adapter, name, None)) for name in LOOKUP_METHODS) or not (
            isinstance(getattr(adapter, "_unacked_lookups", None), dict)
            and isinstance(getattr(adapter, "_lookup_status", None), dict)):
        return False
    if getattr(adapter, "_nonblocking_lookup_status", None) is not True:
        return False  # lmcache.mp.nonblocking_lookup_status false: a check waits for answers, holding the lock
    for name in LOOKUP_METHODS:
        original = getattr(adapter, name)
        if getattr(original, "__prefixshare_locked__", False):
            continue

        def locked(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            with lock:
                return _original(*args, **kwargs)

        locked.__prefixshare_locked__ = True  # type: ignore[attr-defined]
        setattr(adapter, name, locked)
    return True


def lookup_futures(adapter: Any, request_id: str) -> list[Any]:
    """The unanswered futures of a request's lookup (its acknowledgements, else its status queries); call with
    the lock :func:`serialize_lookups` installed held. Each has ``wait(timeout)``."""
    ack = adapter._unacked_lookups.get(request_id)
    if ack is not None:
        return [f for f in ack.futures.values() if not f.query()]
    return [f for f, _ in adapter._lookup_status.get(request_id, {}).values() if not f.query()]


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


def engine_driven_store(context: Any) -> tuple[Any, Any, bool] | None:
    """(LMCache's engine-driven server context, this worker's instance id, whether the registered KV is vLLM's
    CPU layout, ``NL x [blocks, kv_heads, block, 2 * head]`` by LMCache's own detection) of a registered
    ``EngineDrivenTransferContext`` exactly, or None (another context, one not registered yet, or one without
    the attributes :func:`lmcache_gather` passes on)."""
    from lmcache.lmcache_native import EngineKVFormat
    from lmcache.v1.multiprocess.transfer_context import EngineDrivenTransferContext

    if type(context) is not EngineDrivenTransferContext:
        return None
    driven = getattr(context, "_engine_driven_context", None)
    instance = getattr(context, "_instance_id", None)
    if driven is None or instance is None or not all(hasattr(driven, m) for m in ("prepare_store", "commit_store")):
        return None
    if not all(hasattr(context, a) for a in ("_layout_hints", "_engine_kv_format", "_engine_type")):
        return None
    head_major = getattr(EngineKVFormat, "NL_X_NB_NH_BS_CS", None)
    return driven, instance, head_major is not None and context._engine_kv_format == head_major


def single_group_block_ids(block_ids: Any) -> list[int]:
    """The flat block ids of a store (LMCache's engine-driven transfer takes one KV-cache group)."""
    from lmcache.v1.multiprocess.transfer_context.worker_transfer import _single_group_block_ids

    return list(_single_group_block_ids(block_ids))


def lmcache_gather(context: Any, kv_caches: dict[str, Any], block_ids: list[int], blocks_in_chunk: int, out: Any,
                   chunk_indices: Any) -> Any:
    """LMCache's own fill of a store's chunk buffers, with the arguments its context passes."""
    from lmcache.v1.multiprocess.transfer_context.worker_transfer import gather_paged_kv_to_cpu

    return gather_paged_kv_to_cpu(kv_caches, block_ids, blocks_in_chunk, layout_hints=context._layout_hints,
                                  engine_kv_format=context._engine_kv_format, out=out, chunk_indices=chunk_indices,
                                  engine_type=context._engine_type)



def patient_heartbeat(deadline_s: float = PING_DEADLINE_S, misses: int = PINGS_MISSED_TO_DEGRADE,
                      log: Any = None, address: tuple[str, int] | None = None) -> bool:
    """Replace LMCache's vLLM ``HeartbeatThread`` (the class its adapters look up when they start their heartbeat)
    with one that waits ``deadline_s`` for each ping, not its interval, and clears the adapter's health flag only
    after ``misses`` consecutive pings went unanswered; a miss before that is logged (``server.ping_missed``) and
    changes nothing. Everything else is LMCache's cycle: the stop check, the recovery callback on the
    unhealthy -> healthy edge (a flag cleared elsewhere recovers at the next answered ping, as before), its log
    lines. Patience is for a server that answers late: where ``address`` (the server's TCP port) refuses a
    connection the server is gone, and the flag is cleared at once, without a ping (a ping sent to a dead server
    would wait out its deadline even after a restart). True when installed (idempotent: the first installation's
    settings stay; a later ``address`` is taken)."""
    try:
        from lmcache.integration.vllm import vllm_multi_process_adapter as adapter
        from lmcache.v1.periodic_thread import ThreadRunSummary
    except ImportError:
        return False
    base = getattr(adapter, "HeartbeatThread", None)
    if base is None:
        return False
    if getattr(base, "prefixshare_patient", False):
        if address is not None:
            base.prefixshare_address = address
        return True

    class PatientHeartbeat(base):  # type: ignore[misc, valid-type]
        prefixshare_patient = True
        prefixshare_deadline_s = deadline_s
        prefixshare_misses = misses
        prefixshare_missed = 0  # consecutive pings unanswered
        prefixshare_address = address

        def _execute(self) -> Any:
            return _patient_cycle(self, adapter, ThreadRunSummary, log)

    adapter.HeartbeatThread = PatientHeartbeat
    return True


def _server_gone(address: tuple[str, int] | None) -> bool:
    """The server's TCP port refuses connections (nothing listens: not a slow server, a gone one)."""
    from prefixshare._net import connect_error

    return address is not None and isinstance(connect_error(address[0], address[1], timeout=0.5),
                                              ConnectionRefusedError)


def _ping(beat: Any, deadline: float) -> bool:
    """One ping of ``beat``'s server, answered within ``deadline``. The wait is in slices: a server whose port
    refuses meanwhile ends it at once, counted as the last allowed miss (a ping sent before a restart is never
    answered by the new server)."""
    try:
        future = beat._req_client.ping(beat._instance_id)
        end = time.monotonic() + deadline
        while not future.wait(min(PING_SLICE_S, max(0.0, end - time.monotonic()))):
            if time.monotonic() >= end or beat.stop_requested:
                return False
            if _server_gone(beat.prefixshare_address):
                beat.prefixshare_missed = beat.prefixshare_misses - 1
                return False
        return bool(future.result(timeout=0))
    except Exception:  # noqa: BLE001 - as LMCache's send_ping: any failure is an unanswered ping
        return False


def _patient_cycle(beat: Any, adapter: Any, summary: Any, log: Any) -> Any:
    """One heartbeat cycle of :func:`patient_heartbeat`'s thread ``beat``; LMCache's cycle past the ping."""
    was_healthy = beat._health_event.is_set()
    deadline = max(beat._interval, beat.prefixshare_deadline_s)
    if _server_gone(beat.prefixshare_address):
        healthy = False
        beat.prefixshare_missed = beat.prefixshare_misses  # no patience for a server that is not there
    else:
        healthy = _ping(beat, deadline)
        beat.prefixshare_missed = 0 if healthy else beat.prefixshare_missed + 1
    if beat.stop_requested:
        return summary(success=True, message="stop requested; skipping health update")
    if not healthy and was_healthy and beat.prefixshare_missed < beat.prefixshare_misses:
        if log is not None:
            log.warning("server.ping_missed", missed=beat.prefixshare_missed, deadline_s=deadline,
                        degrade_after=beat.prefixshare_misses, effect="the server still counts as healthy; "
                        "nothing dropped")
        return summary(success=True, message="healthy (a ping missed)")
    if healthy and not was_healthy and beat._recover_callback is not None:
        adapter.logger.warning("LMCache server is healthy again, triggering recovery callback")
        healthy = beat._recover_callback()
    if healthy:
        beat._health_event.set()
        if not was_healthy:
            adapter.logger.warning("LMCache server is healthy again — resuming normal operation")
    else:
        beat._health_event.clear()
        if was_healthy:
            adapter.logger.warning("LMCache server is unhealthy — entering degraded mode")
    return summary(success=True, message="healthy" if healthy else "unhealthy")
