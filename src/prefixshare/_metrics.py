"""Metrics hooks called by the connectors' runtime (engine processes) and by warm.

The functions here are the stable interface. Their bodies record Prometheus metrics (``prometheus_client``)
when metrics are enabled and return at once otherwise, so the request path pays one global lookup:

* ``PREFIXSHARE_METRICS_PORT=9400`` enables metrics and serves them on that port (``/metrics``), started
  once per process on the first hook call. When the port is taken (several engine processes on one
  node), the next free port up to +15 is used and logged (``metrics.exporter``).
* ``PREFIXSHARE_METRICS=1`` (or :func:`enable`) records into prometheus_client's default registry without
  an exporter, for applications that already expose it (vLLM's ``/metrics`` serves the default registry).

Metric names (every one labelled by ``engine``):

=========================================== ========= =========================================
``prefixshare_lookups_total``                counter   store lookups answered
``prefixshare_lookup_seconds``               histogram lookup latency
``prefixshare_hit_tokens_total``             counter   tokens a lookup found in the store
``prefixshare_loaded_tokens_total``          counter   tokens loaded into the engine's KV cache
``prefixshare_loaded_bytes_total``           counter   KV bytes loaded
``prefixshare_load_seconds``                 histogram load latency (lookup answer -> KV in place)
``prefixshare_stored_tokens_total``          counter   tokens handed to the store
``prefixshare_stored_bytes_total``           counter   KV bytes handed to the store
``prefixshare_fallbacks_total``              counter   recomputes instead of loads, by ``reason``
``prefixshare_admission_decisions_total``    counter   by ``decision`` (admitted/refused) and ``reason``
``prefixshare_warm_documents_total``         counter   documents warmed (prefilled and verified)
``prefixshare_warm_tokens_total``            counter   prefix tokens warmed
``prefixshare_warm_bytes_total``             counter   KV bytes warmed
``prefixshare_warm_progress_ratio``          gauge     progress of the running warm (0..1, by tokens)
``prefixshare_verify_total``                 counter   sampled store hits by ``verdict`` (sampled, dropped,
                                                       ok, mismatch, unverifiable)
=========================================== ========= =========================================
"""

from __future__ import annotations

import os
import threading
from typing import Any

PORT_ENV = "PREFIXSHARE_METRICS_PORT"
ENABLE_ENV = "PREFIXSHARE_METRICS"
_PORT_TRIES = 16

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

_lock = threading.Lock()
_resolved = False
_m: _Metrics | None = None
#: the port the exporter of this process listens on (None: no exporter)
exporter_port: int | None = None


class _Metrics:
    """The metric objects, created once per process in ``registry``."""

    def __init__(self, registry: Any = None) -> None:
        from prometheus_client import REGISTRY, Counter, Gauge, Histogram

        reg = registry if registry is not None else REGISTRY
        kw: dict[str, Any] = {"registry": reg}
        self.lookups = Counter("prefixshare_lookups", "Store lookups answered", ["engine"], **kw)
        self.lookup_s = Histogram("prefixshare_lookup_seconds", "Store lookup latency", ["engine"],
                                  buckets=_LATENCY_BUCKETS, **kw)
        self.hit_tokens = Counter("prefixshare_hit_tokens", "Tokens a lookup found in the store", ["engine"], **kw)
        self.loaded_tokens = Counter("prefixshare_loaded_tokens", "Tokens loaded into the engine's KV cache",
                                     ["engine"], **kw)
        self.loaded_bytes = Counter("prefixshare_loaded_bytes", "KV bytes loaded from the store", ["engine"], **kw)
        self.load_s = Histogram("prefixshare_load_seconds", "Load latency (lookup answer to KV in place)",
                                ["engine"], buckets=_LATENCY_BUCKETS, **kw)
        self.stored_tokens = Counter("prefixshare_stored_tokens", "Tokens handed to the store", ["engine"], **kw)
        self.stored_bytes = Counter("prefixshare_stored_bytes", "KV bytes handed to the store", ["engine"], **kw)
        self.fallbacks = Counter("prefixshare_fallbacks", "Loads abandoned for a recompute", ["engine", "reason"],
                                 **kw)
        self.admission = Counter("prefixshare_admission_decisions", "Admission decisions",
                                 ["engine", "decision", "reason"], **kw)
        self.warm_documents = Counter("prefixshare_warm_documents", "Documents warmed", ["engine"], **kw)
        self.warm_tokens = Counter("prefixshare_warm_tokens", "Prefix tokens warmed", ["engine"], **kw)
        self.warm_bytes = Counter("prefixshare_warm_bytes", "KV bytes warmed", ["engine"], **kw)
        self.warm_ratio = Gauge("prefixshare_warm_progress_ratio", "Progress of the running warm, by tokens",
                                ["engine"], **kw)
        self.stores_lost = Counter("prefixshare_stores_lost", "Stores an engine made that never reached the node's "
                                   "server", ["engine", "reason"], **kw)
        self.verify = Counter("prefixshare_verify", "Sampled verification of store hits", ["engine", "verdict"],
                              **kw)
        # warm_progress reports cumulative values per run; counters take the increments
        self.warm_last: dict[str, tuple[int, int, int]] = {}


def _start_exporter(port: int) -> int | None:
    from prometheus_client import start_http_server

    from prefixshare._log import get_logger

    log = get_logger(__name__)
    for candidate in range(port, port + _PORT_TRIES):
        try:
            start_http_server(candidate, addr=os.environ.get("PREFIXSHARE_METRICS_ADDR", "127.0.0.1"))
        except OSError:
            continue
        if candidate != port:
            log.warning("metrics.exporter", port=candidate, message=f"port {port} is taken; serving on {candidate}")
        else:
            log.info("metrics.exporter", port=candidate)
        return candidate
    log.warning("metrics.exporter_failed", port=port, message=f"ports {port}-{port + _PORT_TRIES - 1} are taken")
    return None


def _resolve() -> _Metrics | None:
    """First hook call of the process: decide from the environment whether metrics are on."""
    global _resolved, _m, exporter_port
    with _lock:
        if _resolved:
            return _m
        port = os.environ.get(PORT_ENV, "").strip()
        wanted = bool(port) or os.environ.get(ENABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on")
        if wanted:
            try:
                _m = _Metrics()
            except ValueError:  # already registered (a second enable in one process): keep going without
                _m = None
            if _m is not None and port:
                try:
                    exporter_port = _start_exporter(int(port))
                except ValueError:
                    from prefixshare._log import get_logger

                    get_logger(__name__).warning("metrics.bad_port", value=port)
        _resolved = True
        return _m


def _metrics() -> _Metrics | None:
    return _m if _resolved else _resolve()


def enable(registry: Any = None, *, port: int | None = None) -> None:
    """Record metrics in this process (into ``registry``, default prometheus_client's), optionally serving
    them on ``port``. Call before the first engine request; a second call does nothing."""
    global _resolved, _m, exporter_port
    with _lock:
        if _m is not None:
            return
        _m = _Metrics(registry)
        _resolved = True
        if port is not None:
            exporter_port = _start_exporter(port)


def enabled() -> bool:
    return _metrics() is not None


def _reset_for_tests() -> None:
    global _resolved, _m, exporter_port
    with _lock:
        _resolved, _m, exporter_port = False, None, None


# --- hooks ----------------------------------------------------------------------------------------------


def lookup(engine: str, seconds: float, hit_tokens: int) -> None:
    """One store lookup finished (hit_tokens = tokens the engine will load)."""
    m = _m if _resolved else _resolve()
    if m is None:
        return
    m.lookups.labels(engine).inc()
    m.lookup_s.labels(engine).observe(seconds)
    if hit_tokens > 0:
        m.hit_tokens.labels(engine).inc(hit_tokens)


def load(engine: str, seconds: float, tokens: int, nbytes: int) -> None:
    """One load from the store into the engine's KV cache finished."""
    m = _m if _resolved else _resolve()
    if m is None:
        return
    m.load_s.labels(engine).observe(seconds)
    m.loaded_tokens.labels(engine).inc(tokens)
    m.loaded_bytes.labels(engine).inc(nbytes)


def admission(engine: str, admitted: bool, reason: str) -> None:
    """An admission decision (reason: the deciding rule's name, e.g. 'min_tokens')."""
    m = _m if _resolved else _resolve()
    if m is None:
        return
    m.admission.labels(engine, "admitted" if admitted else "refused", reason).inc()


def fallback(engine: str, reason: str) -> None:
    """A load was abandoned and the engine recomputed (reason: lookup_timeout, load_failed...)."""
    m = _m if _resolved else _resolve()
    if m is None:
        return
    m.fallbacks.labels(engine, reason).inc()


def stored(engine: str, tokens: int, nbytes: int) -> None:
    """KV of a finished request was handed to the store."""
    m = _m if _resolved else _resolve()
    if m is None:
        return
    m.stored_tokens.labels(engine).inc(tokens)
    m.stored_bytes.labels(engine).inc(nbytes)


def store_lost(engine: str, reason: str) -> None:
    """A store an engine made did not reach the server (reason: server_down, rpc_failed, refused)."""
    m = _m if _resolved else _resolve()
    if m is None:
        return
    m.stores_lost.labels(engine, reason).inc()


def verify(engine: str, verdict: str) -> None:
    """A store hit was sampled for verification, dropped, or verified (ok, mismatch, unverifiable)."""
    m = _m if _resolved else _resolve()
    if m is None:
        return
    m.verify.labels(engine, verdict).inc()


def warm_progress(documents: int, tokens: int, nbytes: int, **fields: Any) -> None:
    """Warm progress (cumulative within one run: ``run`` names it; ``engine``, ``total_tokens`` optional)."""
    m = _m if _resolved else _resolve()
    if m is None:
        return
    engine = str(fields.get("engine", "unknown"))
    run = str(fields.get("run", ""))
    with _lock:
        last = m.warm_last.get(run, (0, 0, 0))
        m.warm_last[run] = (documents, tokens, nbytes)
    d_docs, d_tokens, d_bytes = documents - last[0], tokens - last[1], nbytes - last[2]
    if d_docs > 0:
        m.warm_documents.labels(engine).inc(d_docs)
    if d_tokens > 0:
        m.warm_tokens.labels(engine).inc(d_tokens)
    if d_bytes > 0:
        m.warm_bytes.labels(engine).inc(d_bytes)
    total = fields.get("total_tokens")
    if total:
        m.warm_ratio.labels(engine).set(min(1.0, tokens / float(total)))
    if fields.get("finished"):
        with _lock:
            m.warm_last.pop(run, None)
