"""Cost-aware loading: load a prefix from the store only when that is predicted faster than recomputing it.

A cache hit can be *slower* than a recompute (a file-backed hit measured at 2.45 s against a 1.7 s full
prefill). Every connector therefore keeps running estimates of

* the engine's **prefill cost** ``cost(n) = a*n + b*n^2`` seconds for the first ``n`` tokens of a prompt
  (attention makes it grow faster than linearly; computing tokens ``h..n`` costs ``cost(n) - cost(h)``),
  fitted from the engine's own step timings;
* the store's **lookup** time ``l0 + bytes/l_bw`` (on LMCache's MP server a lookup also prefetches the hit
  chunks from L2 into the server's memory, so this is where a slow store shows);
* the **transfer** time ``t0 + bytes/t_bw`` (server memory -> the engine's KV cache).

Each is an exponentially weighted least-squares fit (an EWMA of the fit's sufficient statistics, so recent
observations dominate) with non-negative coefficients. Estimates are persisted per fingerprint namespace in
the run dir (``<run_dir>/cost/<namespace>.json``; the store's estimates keyed by the store's identity), so a
fresh replica starts calibrated.

Before a lookup the connector asks :meth:`CostModel.decide_before_lookup` whether loading the largest
possible hit could beat recomputing it; after the lookup (the hit size known, the L2 read already paid)
:meth:`CostModel.decide_after_lookup` asks again for the transfer alone. An uncalibrated model loads
(that is how it learns); a model that keeps choosing to recompute probes the store again now and then
(every ``PROBE_EVERY``-th decision) so that a store that became fast is noticed. Every decision is recorded
with its prediction, and the outcome (observed time to the end of the prefill) is recorded against it, in
stats (``cost`` in the connector's snapshot) and as structlog events ``load.decision`` / ``load.outcome``.

A request may force its own choice (``kv_transfer_params["prefixshare.load"]``: ``always`` or ``never``;
``auto`` follows the model); the decision is still recorded and its observations still calibrate the model.

A lookup is bounded twice in mode auto (:meth:`CostModel.lookup_deadline_s`): by ``DEADLINE_FACTOR`` times the
predicted recompute, and, while the store has never been measured with bytes, by the plan's arithmetic for the
largest possible hit (its KV bytes at ``FIRST_LOAD_GBPS`` plus the lookup latency), so a fresh replica's first
load on a slow store is not bounded only by ``load.timeout_s``. A lookup abandoned on either bound, or one that
outlives ``load.timeout_s``, is an observation (the store is at least that slow for that size); a prompt at least
as long as one that outlived ``load.timeout_s`` is recomputed without a lookup until a probe finds the store fast.

Nothing here imports an engine: the vLLM connector and the SGLang backend feed it observations.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field, fields
from typing import Any

import blake3
import structlog

from prefixshare._log import get_logger
from prefixshare._paths import run_dir

#: weight of the newest observation in every running estimate (EWMA factor)
ALPHA = 0.3
#: a lookup that took more than SHIFT_RATIO times (or less than 1/SHIFT_RATIO of) its prediction, and more than
#: SHIFT_MIN_S away from it, may say the store or its link changed (a congested or reshaped link, a store moved to
#: another medium). It is learnt at ALPHA like any other, and the estimate it was judged against is kept aside.
#: If the next lookup also lies that far from the *kept* estimate, on the same side, the change is confirmed: the
#: estimate restarts from those two lookups (the old store is forgotten), so the next decision follows the change.
#: If it does not, the first was a hiccup: the kept estimate comes back and only the second is learnt, so one slow
#: lookup never sends a healthy store into a recompute streak. Measured in tests/lab: with a confirmed change learnt
#: at a weight of 0.8, and judged against the moving estimate at 2x, a link reshaped from 0.8x to 1.25x the
#: break-even rate (a 1.56x slower load) was never detected, and auto kept loading for two of three requests
#: (regret 1.31); a 20x slower link still left the estimate 19 % short after the confirmation.
SHIFT_RATIO = 1.3
SHIFT_MIN_S = 0.05
#: a model that chose to recompute this many times in a row, and has not measured the store for PROBE_AFTER_S,
#: looks the store up once anyway (a probe: a store that became fast is noticed; its cost is amortized)
PROBE_EVERY = 16
PROBE_AFTER_S = 300.0
#: ... but while the store's estimate rests on a lookup abandoned unanswered (a deadline or load.timeout_s: only a
#: lower bound), the probe comes CENSORED_PROBE_S after that lookup whatever the streak, the wait doubling while
#: probes are abandoned too (up to PROBE_AFTER_S): a link cut and healed looks like a slow store until measured
#: (measured in tests/lab: over sshfs, whose cut no health probe sees, hits had not resumed 16 s after the heal)
CENSORED_PROBE_S = 30.0
#: a pending lookup is abandoned (recompute) after this many times the predicted recompute (mode auto)
DEADLINE_FACTOR = 2.0
#: a store never measured with bytes (no hit observed yet) is assumed this slow for a first load's deadline:
#: about a 1 GbE link's payload rate, slower than any local medium (mode auto; see lookup_deadline_s)
FIRST_LOAD_GBPS = 0.1
#: ... plus this per-lookup latency when no lookup has been measured either (a miss measures it)
FIRST_LOAD_LATENCY_S = 0.1
#: ... and never under this (a fresh server's first lookups pay one-off costs; the bound is there to cut off a
#: store seconds too slow, not to race a healthy one)
FIRST_LOAD_MIN_S = 0.5
#: prefill steps with fewer new tokens than this are not prefill observations (decode steps, overheads)
MIN_PREFILL_TOKENS = 32
#: decisions (with their outcomes) kept in stats, the newest; every one is logged (load.decision/outcome)
KEEP_DECISIONS = 16
_MB = 1e6
_VERSION = 1

_INFO: tuple[Any, bool] = (None, True)


def info_enabled() -> bool:
    """Whether structlog's configured wrapper lets INFO events through. The per-request events (decisions, outcomes,
    finished requests) ask first: a call through a logger proxy binds a logger (~3 us) even when the level then
    drops the event. Cached per configuration, so a later ``configure()`` is honoured; a wrapper that cannot say
    (structlog's stdlib wrapper, say) counts as enabled."""
    global _INFO
    wrapper = structlog.get_config()["wrapper_class"]
    cached, enabled = _INFO
    if wrapper is not cached:
        check = getattr(wrapper, "is_enabled_for", None)
        try:
            enabled = bool(check(None, logging.INFO)) if check is not None else True
        except Exception:  # noqa: BLE001 - unknown wrapper: log as before
            enabled = True
        _INFO = (wrapper, enabled)
    return enabled


class Fit:
    """``y ~= w0 * x0 + w1 * x1`` with ``w >= 0``, by exponentially weighted least squares (EWMA of X'X and X'y).

    Every estimate here has two terms (a per-call cost and a per-token cost, or a linear and a quadratic
    term), so the fit is two-dimensional and solved in closed form (it runs once per observation, on the
    request path). ``ridge`` holds each coefficient gently toward 0, so that one observation at one length
    gives a usable fit (the quadratic term stays ~0 until lengths vary).
    """

    def __init__(self, dim: int = 2, *, alpha: float = ALPHA, ridge: tuple[float, float] | None = None) -> None:
        if dim != 2:
            raise ValueError("Fit is two-dimensional")
        self.dim = dim
        self.alpha = alpha
        self.ridge = ridge or (1e-9, 1e-9)
        self.xx = [[0.0, 0.0], [0.0, 0.0]]
        self.xy = [0.0, 0.0]
        self.n = 0
        self.w: list[float] | None = None

    def observe(self, x: tuple[float, ...] | list[float], y: float, *, alpha: float | None = None) -> None:
        """One observation, weighted ``alpha`` (default: the fit's own) against everything before it."""
        if not (math.isfinite(y) and y >= 0) or any(not math.isfinite(v) for v in x):
            return
        keep = 1.0 - (self.alpha if alpha is None else alpha) if self.n else 0.0
        x0, x1 = x
        xy, (r0, r1) = self.xy, self.xx
        xy[0] = keep * xy[0] + x0 * y
        r0[0] = keep * r0[0] + x0 * x0
        r0[1] = keep * r0[1] + x0 * x1
        xy[1] = keep * xy[1] + x1 * y
        r1[0] = keep * r1[0] + x1 * x0
        r1[1] = keep * r1[1] + x1 * x1
        self.n += 1
        self.w = self._solve()

    def _solve(self) -> list[float]:
        """Non-negative least squares: the unconstrained solution if it is non-negative, else the best on a face
        (one coefficient 0, the other its 1-D least-squares value, clamped at 0)."""
        (a, b), (c, d) = self.xx
        a += self.ridge[0]
        d += self.ridge[1]
        y0, y1 = self.xy
        det = a * d - b * c
        if det > 1e-300:
            w0, w1 = (d * y0 - b * y1) / det, (a * y1 - c * y0) / det
            if w0 >= 0 and w1 >= 0:
                return [w0, w1]
        only0 = [max(0.0, y0 / a), 0.0] if a > 0 else [0.0, 0.0]
        only1 = [0.0, max(0.0, y1 / d)] if d > 0 else [0.0, 0.0]
        return only0 if self._loss(only0) <= self._loss(only1) else only1

    def _loss(self, w: list[float]) -> float:
        # w'XXw - 2 w'Xy (+ const): enough to compare candidates
        (a, b), (c, d) = self.xx
        quad = w[0] * (a * w[0] + b * w[1]) + w[1] * (c * w[0] + d * w[1])
        return quad - 2 * (w[0] * self.xy[0] + w[1] * self.xy[1])

    def predict(self, x: tuple[float, ...] | list[float]) -> float | None:
        w = self.w
        if w is None:
            return None
        return max(0.0, w[0] * x[0] + w[1] * x[1])

    def to_dict(self) -> dict[str, Any]:
        return {"n": self.n, "xx": self.xx, "xy": self.xy, "w": self.w}

    def copy(self) -> Fit:
        """An independent copy (observe() mutates the sums in place): an estimate kept aside to come back to."""
        other = Fit(self.dim, alpha=self.alpha, ridge=self.ridge)
        other.xx, other.xy = [row[:] for row in self.xx], self.xy[:]
        other.n, other.w = self.n, None if self.w is None else self.w[:]
        return other

    def load(self, data: dict[str, Any]) -> None:
        try:
            xx, xy = data["xx"], data["xy"]
            if len(xy) != 2 or any(len(row) != 2 for row in xx):
                return
            self.xx = [[float(v) for v in row] for row in xx]
            self.xy = [float(v) for v in xy]
            self.n = int(data.get("n", 0))
            self.w = self._solve() if self.n else None
        except (KeyError, TypeError, ValueError):
            return


@dataclass
class LoadDecision:
    """One load-or-recompute decision, its prediction and (later) what was observed."""

    request_id: str
    phase: str  # "before_lookup", "after_lookup", "deadline"
    decision: str  # "load", "recompute" or "local" (nothing the store could add: no lookup)
    reason: str
    mode: str
    prompt_tokens: int
    local_tokens: int
    load_tokens: int
    load_bytes: int
    predicted_load_s: float | None
    predicted_recompute_s: float | None
    #: predicted time from now to the end of the prefill along the chosen path
    predicted_s: float | None = None
    decided_at: float = field(default_factory=time.monotonic)
    observed_s: float | None = None
    observed_lookup_s: float | None = None
    observed_transfer_s: float | None = None
    loaded_tokens: int = 0

    @property
    def error(self) -> float | None:
        if self.observed_s is None or not self.predicted_s:
            return None
        return self.observed_s / self.predicted_s - 1.0

    def to_dict(self) -> dict[str, Any]:
        data = {f: getattr(self, f) for f in _FIELDS}
        for key in ("predicted_load_s", "predicted_recompute_s", "predicted_s", "observed_s", "observed_lookup_s",
                    "observed_transfer_s"):
            if data[key] is not None:
                data[key] = round(data[key], 5)
        error = self.error
        data["error"] = None if error is None else round(error, 4)
        return data


_FIELDS = [f.name for f in fields(LoadDecision) if f.name != "decided_at"]


def store_key(policy: Any) -> str:
    """The identity of the store a policy reads (its tiers and extra server arguments, not the server's address:
    servers of several nodes on one shared directory read the same store): estimates are kept per store."""
    tiers = [t.server_config() for t in getattr(policy, "l2", [])]
    ident = json.dumps([tiers, list(policy.server.extra_args)], sort_keys=True, default=str)
    return blake3.blake3(ident.encode()).hexdigest()[:16]


def _off(predicted: float | None, seconds: float) -> int:
    """+1 / -1 when ``seconds`` is far more / far less than ``predicted`` (see SHIFT_RATIO), else 0."""
    if predicted is None or abs(seconds - predicted) <= SHIFT_MIN_S:
        return 0
    return 1 if seconds > SHIFT_RATIO * predicted else -1 if seconds * SHIFT_RATIO < predicted else 0


@dataclass
class _Suspect:
    """A lookup far off its prediction, not yet confirmed by the next one (see SHIFT_RATIO)."""

    kept: Fit  #: the lookup estimate it was judged against (a copy)
    x: tuple[float, float]
    seconds: float
    off: int


class CostModel:
    """Running estimates, decisions and their outcomes for one connector (scheduler side)."""

    SAVE_INTERVAL_S = 1.0

    def __init__(self, namespace: str, *, store: str, kv_bytes_per_token: int, chunk_size: int, mode: str,
                 persist: bool = True, log: Any = None) -> None:
        self.namespace = namespace
        self.store = store
        self.kv_bytes_per_token = kv_bytes_per_token
        self.chunk_size = chunk_size
        self.mode = mode
        # prefill: seconds ~ a * (k/1e3) + b * ((end^2 - start^2)/1e6) for k = end - start new tokens
        self.prefill = Fit(2, ridge=(1e-9, 1e-6))
        # lookup and transfer: seconds ~ latency + MB / bandwidth
        self.lookup = Fit(2, ridge=(1e-9, 1e-9))
        self.transfer = Fit(2, ridge=(1e-9, 1e-9))
        #: the newest decisions with their outcomes (made dicts when a snapshot is taken, off the request path)
        self.decisions: deque[LoadDecision] = deque(maxlen=KEEP_DECISIONS)
        self.pending: dict[str, LoadDecision] = {}
        self.counts: Counter[str] = Counter()
        self.abs_errors: deque[float] = deque(maxlen=KEEP_DECISIONS)
        self._recompute_streak = 0
        #: (tokens, seconds waited) of the shortest lookup that outlived load.timeout_s (see observe_timeout)
        self._timed_out: tuple[int, float] | None = None
        self._first_prefill_seen = False
        #: the last lookup, when it took far more / far less than predicted (see SHIFT_RATIO), with the estimate it
        #: was judged against
        self._suspect: _Suspect | None = None
        #: the lookup estimate before the first of a run of timed-out lookups (see outage_over)
        self._before_timeouts: Fit | None = None
        #: when this store was last measured (a lookup observed); a model loaded from the run dir counts as
        #: measured now
        self._store_seen = time.monotonic()
        #: how long after the last lookup the next probe comes while the estimate rests on an abandoned lookup
        #: (see CENSORED_PROBE_S); None: the store's speed was measured
        self._censored_wait: float | None = None
        self._lock = threading.Lock()
        self._last_save = 0.0
        self._dirty = False
        self.log = log or get_logger("prefixshare.cost")
        self.path = run_dir() / "cost" / f"{namespace}.json" if persist else None
        #: when set (the connector's stats writer), a change only calls this: the estimates (and the decisions in the
        #: stats snapshot) are written off the request path by that writer, which calls :meth:`save` itself
        self.defer: Any = None
        self.loaded_from: str | None = None
        if self.path is not None:
            self._load()

    # --- persistence ---------------------------------------------------------------------------------
    def _load(self) -> None:
        assert self.path is not None
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return
        if data.get("version") != _VERSION:
            return
        self.prefill.load(data.get("prefill", {}))
        self.transfer.load(data.get("transfer", {}))
        self.lookup.load(data.get("stores", {}).get(self.store, {}).get("lookup", {}))
        self.loaded_from = str(self.path)

    def _changed(self, force: bool = False) -> None:
        """The estimates changed: persist them (deferred to the connector's writer thread when it has one)."""
        if self.defer is not None:
            self.defer()
        else:
            self.save(force=force)

    def save(self, force: bool = False) -> None:
        """Write the estimates to the run dir, in this thread (at most once a second unless ``force``)."""
        if self.path is None or not self._dirty:
            return
        now = time.monotonic()
        if not force and now - self._last_save < self.SAVE_INTERVAL_S:
            return
        self._last_save = now
        self._dirty = False
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                data = json.loads(self.path.read_text())
                if data.get("version") != _VERSION:
                    data = {}
            except (OSError, ValueError):
                data = {}
            with self._lock:
                data["version"] = _VERSION
                data["namespace"] = self.namespace
                data["updated_at"] = time.time()
                data["prefill"] = self.prefill.to_dict()
                data["transfer"] = self.transfer.to_dict()
                data.setdefault("stores", {})[self.store] = {"lookup": self.lookup.to_dict(), "updated_at": time.time()}
            tmp = self.path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_text(json.dumps(data))
            tmp.replace(self.path)
        except OSError as exc:
            self.log.warning("cost.save_failed", error=str(exc), path=str(self.path))

    # --- observations --------------------------------------------------------------------------------
    @staticmethod
    def _prefill_x(start: int, end: int) -> tuple[float, float]:
        return ((end - start) / 1e3, (end * end - start * start) / 1e6)

    def observe_prefill(self, spans: list[tuple[int, int]], seconds: float) -> bool:
        """One engine step that computed tokens ``start..end`` of each span in ``seconds``."""
        new = sum(max(0, e - s) for s, e in spans)
        if new < MIN_PREFILL_TOKENS or seconds <= 0:
            return False
        if not self._first_prefill_seen:
            # a fresh engine's first prefill pays one-off costs (allocations, lazy init: ~2x on CPU): not a rate
            self._first_prefill_seen = True
            return False
        x1 = sum(self._prefill_x(s, e)[0] for s, e in spans)
        x2 = sum(self._prefill_x(s, e)[1] for s, e in spans)
        with self._lock:
            self.prefill.observe((x1, x2), seconds)
            self._dirty = True
        self._changed()
        return True

    def observe_lookup(self, hit_tokens: int, seconds: float, *, censored: bool = False) -> None:
        """A lookup that returned ``hit_tokens`` in ``seconds`` (``censored``: it was abandoned after that long,
        the true time is longer)."""
        self._store_seen = time.monotonic()
        if censored:
            wait = self._censored_wait
            self._censored_wait = CENSORED_PROBE_S if wait is None else min(PROBE_AFTER_S, 2 * wait)
        elif hit_tokens:
            self._censored_wait = None  # measured: the estimate no longer rests on a lower bound
        timed_out = self._timed_out
        if not censored and timed_out is not None and hit_tokens >= timed_out[0]:
            self._timed_out = None  # a hit that long came back in time: the store is not (or no longer) that slow
        if not censored and hit_tokens:
            self._before_timeouts = None  # measured since: what came before the timeouts is no longer the state
        x = (1.0, hit_tokens * self.kv_bytes_per_token / _MB)
        with self._lock:
            shift, hiccup = None, None
            suspect, self._suspect = self._suspect, None
            judged = bool(hit_tokens) and not self._no_bytes(self.lookup)
            if judged and suspect is not None:
                baseline = suspect.kept.predict(x)
                if _off(baseline, seconds) == suspect.off:  # confirmed: the old store is forgotten
                    self.lookup = Fit(2, ridge=self.lookup.ridge)
                    self.lookup.observe(suspect.x, suspect.seconds)
                    self.lookup.observe(x, seconds, alpha=0.5)
                    shift = (suspect.off, baseline)
                else:  # the first was a hiccup: the estimate it was judged against comes back
                    self.lookup = suspect.kept
                    hiccup = suspect
            if shift is None:
                predicted = self.lookup.predict(x) if judged else None
                off = _off(predicted, seconds)
                if off:
                    self._suspect = _Suspect(self.lookup.copy(), x, seconds, off)
                # an abandoned lookup is a lower bound: the estimate is raised to it, not averaged below it (the
                # next decisions recompute until a probe; a probe answered as before forgets it, see SHIFT_RATIO)
                self.lookup.observe(x, seconds, alpha=1.0 if censored and predicted is not None and seconds > predicted
                                    else None)
            self._dirty = True
        if shift is not None:
            self.log.info("cost.store_shift", tokens=hit_tokens, seconds=round(seconds, 4),
                          predicted_s=round(shift[1] or 0.0, 4), censored=censored,
                          direction="slower" if shift[0] > 0 else "faster")
        if hiccup is not None:
            self.log.info("cost.lookup_outlier_forgotten", tokens=hit_tokens, seconds=round(seconds, 4),
                          outlier_s=round(hiccup.seconds, 4), direction="slower" if hiccup.off > 0 else "faster")
        self._changed()

    def observe_transfer(self, tokens: int, seconds: float) -> None:
        if tokens <= 0:
            return
        with self._lock:
            self.transfer.observe((1.0, tokens * self.kv_bytes_per_token / _MB), seconds)
            self._dirty = True
        self._changed()

    # --- predictions ----------------------------------------------------------------------------------
    def prefill_s(self, start: int, end: int) -> float | None:
        """Predicted seconds to compute tokens ``start..end`` (with attention over the first ``start``)."""
        if end <= start:
            return 0.0
        return self.prefill.predict(self._prefill_x(start, end))

    def lookup_s(self, tokens: int) -> float | None:
        if self.lookup.w is None or self._no_bytes(self.lookup):
            return None
        return self.lookup.predict((1.0, tokens * self.kv_bytes_per_token / _MB))

    def transfer_s(self, tokens: int) -> float | None:
        if self.transfer.w is None or self._no_bytes(self.transfer):
            return None
        return self.transfer.predict((1.0, tokens * self.kv_bytes_per_token / _MB))

    @staticmethod
    def _no_bytes(fit: Fit) -> bool:
        """True while a fit has never seen an observation with bytes (its bandwidth is unknown)."""
        return fit.xx[1][1] <= 0.0

    def calibrated(self) -> bool:
        return self.prefill.w is not None and self.lookup_s(self.chunk_size) is not None and \
            self.transfer_s(self.chunk_size) is not None

    def estimates(self) -> dict[str, Any]:
        def bw(fit: Fit) -> float | None:
            if fit.w is None or fit.w[1] <= 0:
                return None
            return round(1.0 / fit.w[1] / 1e3, 4)  # MB/s -> GB/s

        out: dict[str, Any] = {
            "prefill_observations": self.prefill.n, "lookup_observations": self.lookup.n,
            "transfer_observations": self.transfer.n,
            "lookup_latency_s": None if self.lookup.w is None else round(self.lookup.w[0], 5),
            "lookup_gbps": bw(self.lookup),
            "transfer_latency_s": None if self.transfer.w is None else round(self.transfer.w[0], 5),
            "transfer_gbps": bw(self.transfer),
        }
        for n in (1024, 4096):
            p = self.prefill_s(0, n)
            out[f"prefill_tokens_per_s_{n}"] = round(n / p, 1) if p else None
        return out

    # --- decisions --------------------------------------------------------------------------------------
    def decide_before_lookup(self, request_id: str, prompt_tokens: int, local_tokens: int,
                             lookup_tokens: int, mode: str | None = None) -> LoadDecision:
        """Before the lookup: could loading the largest possible hit (every chunk of ``lookup_tokens``) beat
        recomputing it? ``local_tokens``: what the engine's own prefix cache already holds. ``mode``: the
        request's own load mode (``prefixshare.load``), else the policy's."""
        mode = mode or self.mode
        load_tokens = max(0, lookup_tokens - local_tokens)
        recompute = self.prefill_s(local_tokens, lookup_tokens) if load_tokens else 0.0
        look, xfer = self.lookup_s(lookup_tokens), self.transfer_s(load_tokens)
        load = None if look is None else look + (xfer or 0.0)
        # the lookup alone (the store's read) may already lose: then the transfer need not be known
        known = look is not None and recompute is not None and (xfer is not None or look >= recompute)
        rest = self.prefill_s(lookup_tokens, prompt_tokens)
        if load_tokens == 0:
            choice, reason = "local", "the engine's prefix cache holds every chunk the store could return: no lookup"
        elif mode == "always":
            choice, reason = "load", "mode always"
        elif mode == "never":
            choice, reason = "recompute", "mode never"
        elif ((timed_out := self._timed_out_for(lookup_tokens)) is not None
              and self._probe_reason(confirm=False) is None):
            # a lookup this long already outlived load.timeout_s: another would wait it out, then recompute
            # (whatever the fits say: they may still be uncalibrated, or a noisy prefill may have moved them)
            load = max(load or 0.0, timed_out[1] + (recompute or 0.0))
            choice, reason = "recompute", (f"a lookup of {timed_out[0]} tokens outlived load.timeout_s "
                                           f"({timed_out[1]:.3f} s waited): another would wait it out")
        elif not known:
            choice, reason = "load", "uncalibrated: load and measure"
        elif load < recompute:  # type: ignore[operator]
            choice, reason = "load", "load predicted faster"
        elif (probe := self._probe_reason()) is not None:
            choice, reason = "load", probe
        else:
            choice, reason = "recompute", "recompute predicted faster"
        d = LoadDecision(request_id, "before_lookup", choice, reason, mode, prompt_tokens, local_tokens,
                         load_tokens, load_tokens * self.kv_bytes_per_token, load, recompute)
        if rest is not None:
            chosen = load if choice == "load" else recompute
            d.predicted_s = None if chosen is None else chosen + rest
        return self._record(d)

    def decide_after_lookup(self, request_id: str, prompt_tokens: int, local_tokens: int, hit_tokens: int,
                            lookup_s: float | None, mode: str | None = None) -> LoadDecision:
        """After the lookup answered ``hit_tokens`` (its L2 read is paid): load them, or recompute?"""
        mode = mode or self.mode
        load_tokens = max(0, hit_tokens - local_tokens)
        xfer = self.transfer_s(load_tokens)
        recompute = self.prefill_s(local_tokens, local_tokens + load_tokens)
        rest = self.prefill_s(local_tokens + load_tokens, prompt_tokens)
        if mode == "always":
            choice, reason = "load", "mode always"
        elif xfer is None or recompute is None:
            choice, reason = "load", "uncalibrated: load and measure"
        elif xfer < recompute:
            choice, reason = "load", "load predicted faster"
        else:
            choice, reason = "recompute", "recompute predicted faster than the transfer"
        d = LoadDecision(request_id, "after_lookup", choice, reason, mode, prompt_tokens, local_tokens,
                         load_tokens, load_tokens * self.kv_bytes_per_token, xfer, recompute)
        if rest is not None:
            chosen = xfer if choice == "load" else recompute
            d.predicted_s = None if chosen is None else (lookup_s or 0.0) + chosen + rest
        d.observed_lookup_s = lookup_s
        previous = self.pending.get(request_id)
        if previous is not None:
            d.decided_at = previous.decided_at
        return self._record(d)

    def lookup_deadline_s(self, prompt_tokens: int, local_tokens: int, mode: str | None = None) -> float | None:
        """How long a pending lookup may run before it is abandoned for a recompute (mode auto; None: only the
        policy's ``load.timeout_s`` bounds it). The time waited is recorded as a lower bound of the store's lookup
        time (:meth:`decide_deadline`), so the next decision avoids it.

        * ``DEADLINE_FACTOR`` times the predicted recompute, once the prefill rate is known;
        * while the store has never been measured with bytes (no hit observed: a fresh replica's first load),
          also the plan's arithmetic for the largest possible hit: its KV bytes at a conservative
          ``FIRST_LOAD_GBPS`` plus the measured lookup latency (``FIRST_LOAD_LATENCY_S`` before any lookup),
          at least ``FIRST_LOAD_MIN_S``.

        The smaller applies."""
        if (mode or self.mode) != "auto":
            return None
        candidates = []
        recompute = self.prefill_s(local_tokens, prompt_tokens)
        if recompute is not None:
            candidates.append(DEADLINE_FACTOR * recompute)
        first = self.first_load_deadline_s(prompt_tokens // self.chunk_size * self.chunk_size)
        if first is not None:
            candidates.append(first)
        return min(candidates) if candidates else None

    def first_load_deadline_s(self, lookup_tokens: int) -> float | None:
        """The plan's bound on a lookup of ``lookup_tokens`` while the store's bandwidth is unknown (None once a
        hit has been measured: then the estimates decide)."""
        if self.lookup.w is not None and not self._no_bytes(self.lookup):
            return None
        latency = self.lookup.w[0] if self.lookup.w is not None else FIRST_LOAD_LATENCY_S
        return max(FIRST_LOAD_MIN_S, latency + lookup_tokens * self.kv_bytes_per_token / (FIRST_LOAD_GBPS * 1e9))

    def decide_deadline(self, request_id: str, prompt_tokens: int, local_tokens: int, waited_s: float) -> LoadDecision:
        recompute = self.prefill_s(local_tokens, prompt_tokens)
        why = (f"over {DEADLINE_FACTOR:g}x the predicted recompute" if recompute is not None and
               waited_s > DEADLINE_FACTOR * recompute else
               f"over the first-load bound (KV bytes at {FIRST_LOAD_GBPS:g} GB/s + lookup latency)")
        d = LoadDecision(request_id, "deadline", "recompute", f"the lookup ran {waited_s:.3f} s, {why}", self.mode,
                         prompt_tokens, local_tokens, 0, 0, None, recompute,
                         predicted_s=None if recompute is None else waited_s + recompute)
        d.observed_lookup_s = waited_s
        previous = self.pending.get(request_id)
        if previous is not None:
            d.decided_at = previous.decided_at
        # a lower bound on the store's read time: keep the estimate from staying optimistic
        lookup_tokens = previous.load_tokens + previous.local_tokens if previous is not None else prompt_tokens
        self.observe_lookup(lookup_tokens, waited_s, censored=True)
        return self._record(d)

    def observe_timeout(self, lookup_tokens: int, waited_s: float, local_tokens: int = 0) -> float:
        """A lookup of ``lookup_tokens`` outlived the policy's ``load.timeout_s``: the store is at least this slow
        for that size. The observation is censored (the true time is longer), so it is learnt as the larger of
        the time waited and ``DEADLINE_FACTOR`` times the predicted recompute (when the prefill rate is known).
        It is also remembered as such: once the store's health check passes again, prompts at least that long are
        recomputed without a lookup whatever the fits predict (they may be uncalibrated, or moved by a noisy
        prefill), until a hit that long comes back in time; the probes (``PROBE_EVERY``, ``PROBE_AFTER_S``) find
        out when the store got faster. Returns the value learnt."""
        recompute = self.prefill_s(local_tokens, lookup_tokens)
        learnt = max(waited_s, DEADLINE_FACTOR * recompute) if recompute is not None else waited_s
        with self._lock:
            if self._before_timeouts is None:
                self._before_timeouts = self.lookup.copy()
        self.observe_lookup(lookup_tokens, learnt, censored=True)
        timed_out = self._timed_out
        if timed_out is None or lookup_tokens <= timed_out[0]:
            self._timed_out = (lookup_tokens, waited_s)
        with self._lock:
            self.counts["timeout:recompute"] += 1
        self.log.info("cost.lookup_timeout_observed", lookup_tokens=lookup_tokens, waited_s=round(waited_s, 4),
                      learnt_s=round(learnt, 4))
        return learnt

    def outage_over(self) -> None:
        """The store was down (its server or a tier did not answer a probe) and answers again: the lookups that
        timed out in that window said the store was unreachable, not slow. Forget them: the lookup estimate as it
        was before the first of them, and the timed-out length, so the next request looks the store up again
        (hits resume at once after a partition heals, not after the probe's streak and ``PROBE_AFTER_S``)."""
        with self._lock:
            before, self._before_timeouts = self._before_timeouts, None
            timed_out, self._timed_out = self._timed_out, None
            self._suspect = None
            self._censored_wait = None
            if before is not None:
                self.lookup = before
            self._dirty = True
        self.log.info("cost.outage_forgotten", timed_out=timed_out, restored=before is not None)
        self._changed()

    def _probe_reason(self, confirm: bool = True) -> str | None:
        """Why the store is looked up now although recomputing is predicted faster (None: no probe is due).
        ``confirm``: a far-faster lookup waiting for its confirmation counts (not for a length that outlived
        load.timeout_s: a shorter hit in time says nothing about it)."""
        suspect = self._suspect
        if confirm and suspect is not None and suspect.off < 0:
            # a lookup far faster than predicted is confirmed or forgotten by the next one (SHIFT_RATIO): without
            # this, an estimate still slow would recompute, and the store that got fast would not be measured again
            return "probe: the last lookup was far faster than predicted, the next one confirms it"
        since = time.monotonic() - self._store_seen
        if self._censored_wait is not None:
            return (f"probe: the last lookup was abandoned unanswered {since:.0f} s ago, the store is looked up once"
                    if since >= self._censored_wait else None)
        if self._recompute_streak + 1 >= PROBE_EVERY and since >= PROBE_AFTER_S:
            return (f"probe: after {PROBE_EVERY} recomputes and {PROBE_AFTER_S:g} s without a measurement, the store "
                    "is looked up once")
        return None

    def _timed_out_for(self, lookup_tokens: int) -> tuple[int, float] | None:
        """(tokens, seconds waited) of the timed-out lookup that covers a lookup of ``lookup_tokens`` (one at
        most that long), if any: until a lookup returns a hit at least that long in time."""
        timed_out = self._timed_out
        return timed_out if timed_out is not None and lookup_tokens >= timed_out[0] else None

    def _record(self, d: LoadDecision) -> LoadDecision:
        with self._lock:
            self.pending[d.request_id] = d
            self.counts[f"{d.phase}:{d.decision}"] += 1
            if d.phase == "before_lookup":
                self._recompute_streak = self._recompute_streak + 1 if d.decision == "recompute" else 0
        if info_enabled():
            self.log.info("load.decision", request_id=d.request_id, phase=d.phase, decision=d.decision, reason=d.reason,
                          mode=d.mode, prompt_tokens=d.prompt_tokens, local_tokens=d.local_tokens,
                          load_tokens=d.load_tokens, predicted_load_s=d.predicted_load_s,
                          predicted_recompute_s=d.predicted_recompute_s, predicted_s=d.predicted_s)
        return d

    def outcome(self, request_id: str, *, finished_at: float | None = None, loaded_tokens: int = 0,
                transfer_s: float | None = None) -> LoadDecision | None:
        """The request's prefill finished: record the observed time of the chosen path against its prediction."""
        with self._lock:
            d = self.pending.pop(request_id, None)
        if d is None:
            return None
        d.observed_s = (finished_at or time.monotonic()) - d.decided_at
        d.loaded_tokens = loaded_tokens
        d.observed_transfer_s = transfer_s
        error = d.error
        with self._lock:
            self.decisions.append(d)
            if error is not None:
                self.abs_errors.append(abs(error))
        if info_enabled():
            self.log.info("load.outcome", request_id=d.request_id, phase=d.phase, decision=d.decision,
                          predicted_s=d.predicted_s, observed_s=d.observed_s, error=error, loaded_tokens=loaded_tokens,
                          observed_lookup_s=d.observed_lookup_s, observed_transfer_s=transfer_s)
        # once per request: a replica that exits next leaves its estimates behind (the connector's writer thread
        # writes them within its publish interval and at exit; a bare model writes them now)
        self._changed(force=True)
        return d

    def forget(self, request_id: str) -> None:
        with self._lock:
            self.pending.pop(request_id, None)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            errors = sorted(self.abs_errors)
            return {
                "mode": self.mode,
                "store": self.store,
                "decisions": dict(self.counts),
                "median_abs_error": errors[len(errors) // 2] if errors else None,
                "estimates": self.estimates(),
                "recent": [d.to_dict() for d in self.decisions],
            }
