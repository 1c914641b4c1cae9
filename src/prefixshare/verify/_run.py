"""Checking sampled store hits: each prompt replayed loaded from the store and recomputed, then compared."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from prefixshare import _metrics
from prefixshare._log import get_logger
from prefixshare.adapters import PrefillRequest, PrefillResult
from prefixshare.errors import PrefixShareError
from prefixshare.keys import REQ_LOAD, REQ_VERIFY
from prefixshare.policies import Policy
from prefixshare.runtime import VerifyTask, add_verdicts, default_tolerance, pending_tasks, read_task
from prefixshare.verify._compare import Comparison, compare
from prefixshare.verify._quarantine import Quarantined, quarantine

if TYPE_CHECKING:  # pragma: no cover
    from prefixshare.share import PrefixShare

VERDICTS = ("ok", "mismatch", "unverifiable")


class Replayer(Protocol):
    """What a verification needs of the replica that served the hits: run prompts (with per-request settings,
    an engine cache salt and the first token's log-probabilities), and empty its own prefix cache."""

    kind: str

    def prefill(self, requests: list[PrefillRequest]) -> list[PrefillResult]: ...

    def reset_prefix_cache(self) -> Any: ...


@dataclass
class Check:
    """The verdict on one sampled hit."""

    request_id: str
    verdict: str  # "ok", "mismatch" or "unverifiable"
    reason: str = ""
    tokens: int = 0
    loaded_tokens: int = 0
    #: tokens the verification's own load found in the store (vs what the request had loaded)
    reloaded_tokens: int = 0
    comparison: Comparison | None = None
    quarantined: Quarantined | None = None
    #: after a mismatch: whether the replica's own prefix cache was emptied of the loaded blocks
    engine_cache_reset: bool | None = None
    document_id: str | None = None
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "document_id": self.document_id, "verdict": self.verdict,
                "reason": self.reason, "tokens": self.tokens, "loaded_tokens": self.loaded_tokens,
                "reloaded_tokens": self.reloaded_tokens,
                "comparison": self.comparison.to_dict() if self.comparison else None,
                "quarantined": self.quarantined.to_dict() if self.quarantined else None,
                "engine_cache_reset": self.engine_cache_reset, "seconds": round(self.seconds, 3)}


@dataclass
class VerifyReport:
    checks: list[Check] = field(default_factory=list)
    #: sampled hits still waiting (the limit or the time budget was reached)
    pending: int = 0

    def count(self, verdict: str) -> int:
        return sum(1 for c in self.checks if c.verdict == verdict)

    @property
    def ok(self) -> bool:
        return self.count("mismatch") == 0

    @property
    def verdict(self) -> str:
        """"mismatch" when any check found one, "ok" when some passed and none failed, "none" when nothing was
        checked, else "unverifiable"."""
        if not self.checks:
            return "none"
        if self.count("mismatch"):
            return "mismatch"
        return "ok" if self.count("ok") else "unverifiable"

    def summary(self) -> str:
        return (f"{self.verdict}: verified {len(self.checks)} store hits: {self.count('ok')} ok, "
                f"{self.count('mismatch')} mismatched (quarantined), {self.count('unverifiable')} unverifiable; "
                f"{self.pending} pending")

    def to_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "checked": len(self.checks), "ok": self.count("ok"),
                "mismatch": self.count("mismatch"), "unverifiable": self.count("unverifiable"),
                "pending": self.pending, "checks": [c.to_dict() for c in self.checks]}


def check_task(engine: Replayer, policy: Policy, task: VerifyTask) -> Check:
    """Replay ``task``'s prompt twice on the replica that served it: loaded from the store (keyed as the
    request was, through the task's token) and recomputed without it. Each replay has a fresh engine cache
    salt, so the replica's prefix cache serves neither, and nothing has to be emptied before. The first
    token's log-probabilities are compared; on a mismatch the chunks the request loaded are quarantined and
    the replica's prefix cache is emptied (what the bad load left there must not answer again)."""
    started = time.monotonic()
    settings = policy.verify
    tolerance = settings.tolerance or default_tolerance(task.kv_dtype)
    check = Check(task.request_id, "unverifiable", tokens=len(task.token_ids), loaded_tokens=task.loaded_tokens,
                  document_id=task.params.get("prefixshare.document_id"))
    base = {**task.params, REQ_VERIFY: task.token}
    nonce = secrets.token_hex(8)
    load = engine.prefill([PrefillRequest(task.token_ids, {**base, REQ_LOAD: "always"}, f"verify-{nonce}-load",
                                          top_logprobs=settings.top_logprobs)])[0]
    check.reloaded_tokens = load.cached_tokens
    if load.cached_tokens < task.loaded_tokens:
        check.reason = (f"the store no longer holds what the request loaded ({load.cached_tokens} of "
                        f"{task.loaded_tokens} tokens found): evicted, collected or quarantined since")
        return _done(check, started)
    cold = engine.prefill([PrefillRequest(task.token_ids, {**base, REQ_LOAD: "never"}, f"verify-{nonce}-cold",
                                          top_logprobs=settings.top_logprobs)])[0]
    if cold.cached_tokens:
        check.reason = f"the recompute was not cold ({cold.cached_tokens} tokens came from a cache)"
        return _done(check, started)
    check.comparison = compare(load, cold, tolerance)
    if check.comparison.ok:
        check.verdict = "ok"
        return _done(check, started)
    check.verdict, check.reason = "mismatch", check.comparison.reason
    details = {**check.comparison.to_dict(), "original_token": task.first_token}
    check.quarantined = quarantine(policy, task, details)
    check.engine_cache_reset = engine.reset_prefix_cache() is not False
    return _done(check, started)


def _done(check: Check, started: float) -> Check:
    check.seconds = time.monotonic() - started
    return check


def verify_tasks(engine: Replayer, policy: Policy, instance: str, *, limit: int | None = None,
                 budget_s: float | None = None, paths: list[Path] | None = None) -> VerifyReport:
    """Verify ``instance``'s set-aside hits (or ``paths``), oldest first, through the replica ``engine`` that
    served them; stops after ``limit`` hits or ``budget_s`` seconds (the rest stay pending)."""
    report = VerifyReport()
    paths = pending_tasks(instance) if paths is None else paths
    deadline = time.monotonic() + budget_s if budget_s is not None else None
    for i, path in enumerate(paths):
        if (limit is not None and i >= limit) or (deadline is not None and time.monotonic() > deadline):
            report.pending = len(paths) - i
            break
        report.checks.append(_check_file(engine, policy, instance, path))
    return report


def verify_pending(ps: PrefixShare, engine: Any = None, *, limit: int | None = None,
                   budget_s: float | None = None) -> VerifyReport:
    """Verify the store hits this instance's connectors set aside (``verify.sample``), oldest first, through
    ``engine`` (default: the engine attached last); see :func:`verify_tasks`.

    Call it when the engine is idle: each hit costs one load and one recompute of its prompt. A mismatch
    quarantines the chunks the request loaded (see :mod:`prefixshare.verify._quarantine`), empties the
    engine's prefix cache and logs ``store.verify_mismatch``."""
    warm_engine = ps.warm_engine(engine)
    if warm_engine.kind != "vllm":
        raise PrefixShareError(f"sampled verification runs on vLLM engines; {warm_engine.kind} replicas do not set "
                               "hits aside yet")
    return verify_tasks(warm_engine, ps.policy, ps.instance, limit=limit, budget_s=budget_s)


def _check_file(engine: Replayer, policy: Policy, instance: str, path: Path) -> Check:
    log = get_logger("prefixshare.verify", instance=instance)
    try:
        task = read_task(path)
    except (OSError, ValueError) as exc:
        log.warning("verify.bad_task", path=str(path), error=str(exc))
        path.unlink(missing_ok=True)
        return Check(path.stem, "unverifiable", reason=f"unreadable task: {exc}")
    try:
        check = check_task(engine, policy, task)
    finally:
        path.unlink(missing_ok=True)  # judged (or the replica failed on it): never replayed again
    judged(engine.kind, instance, check, task.namespace)
    return check


def judged(engine: str, instance: str, check: Check, namespace: str) -> None:
    """Count, export and log one verdict."""
    add_verdicts(instance, {check.verdict: 1})
    _metrics.verify(engine, check.verdict)
    fields = {"request_id": check.request_id, "document_id": check.document_id, "namespace": namespace,
              "tokens": check.tokens, "loaded_tokens": check.loaded_tokens, "seconds": round(check.seconds, 3)}
    log = get_logger("prefixshare.verify", instance=instance)
    if check.verdict == "mismatch":
        log.error("store.verify_mismatch", reason=check.reason, **fields,
                  quarantined=check.quarantined.to_dict() if check.quarantined else None,
                  engine_cache_reset=check.engine_cache_reset,
                  action="the chunks the request loaded are quarantined; later requests recompute them")
    else:
        (log.warning if check.verdict == "unverifiable" else log.info)(
            "verify.checked", verdict=check.verdict, reason=check.reason or None,
            max_diff=check.comparison.to_dict()["max_diff"] if check.comparison else None, **fields)
