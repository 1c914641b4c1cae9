"""Sampled verification, the connector's half: which store hits are set aside to be checked later.

A connector never recomputes on the request path. When a request that loaded KV from the store finishes,
:class:`HitSampler` decides (``verify.sample``, deterministic per request id, at most ``verify.max_per_minute``
and ``verify.max_pending``) whether to keep it; a kept hit becomes one JSON file, a :class:`VerifyTask`, in
this node's run directory (``<run>/verify/<instance>/<token>.json``). The checking half
(:mod:`prefixshare.verify`) runs later, against the same replica (in its process, or over its HTTP API), and
removes each file it has judged.

A verification replays the request twice with ``kv_transfer_params["prefixshare.verify"] = <token>``. The
replica's connector then finds the task by its token (:func:`find_task`: only in its own instance's
directory, only for the very same prompt) and keys the replay's lookup with the original request's store
salt, while the engine's own ``cache_salt`` is a fresh one, so neither replay can be served by the engine's
prefix cache and no cache has to be emptied on a busy replica. The token is a capability: 96 random bits
that only readers of this node's run directory know, and it opens nothing but the replay of a prompt the
replica already served; an unknown token, or another prompt, is recomputed and stores nothing.

The files hold prompt token ids (the replica's own requests, on its own node): they are private files
(0o640 in 0o750 directories, written atomically) and only JSON is read back.
"""

from __future__ import annotations

import json
import re
import secrets
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import blake3

from prefixshare._files import write_private_atomic
from prefixshare._paths import run_dir

TASK_FORMAT = "prefixshare-verify-task/1"
_MAX_TASK_BYTES = 8 * 1024 * 1024

#: the default largest first-token log-probability difference that passes, by KV dtype. A load changes the
#: order of a few float reductions (float32: ~1e-5 measured), a lower precision more; a foreign or damaged KV
#: moves log-probabilities by whole units.
TOLERANCE_BY_DTYPE = {"float32": 1e-3, "float16": 0.05, "bfloat16": 0.1}
FP8_TOLERANCE = 0.25


def default_tolerance(kv_dtype: str) -> float:
    if kv_dtype.startswith("fp8") or "float8" in kv_dtype:
        return FP8_TOLERANCE
    return TOLERANCE_BY_DTYPE.get(kv_dtype, TOLERANCE_BY_DTYPE["bfloat16"])


@dataclass(frozen=True)
class VerifyTask:
    """A store hit set aside for verification: what it takes to run the request again, loaded and cold."""

    instance: str
    namespace: str
    request_id: str
    token_ids: list[int]
    #: tokens the request loaded from the store (not from the engine's own prefix cache)
    loaded_tokens: int
    #: the request's own salt as the engine saw it (what a replay passes again) and its store keys' salt
    cache_salt: str | None = None
    store_salt: str | None = None
    #: prefixshare's per-request settings (document id, tenant, prefix tokens) as the request carried them
    params: dict[str, Any] = field(default_factory=dict)
    #: the first token the request was answered with (None: not known to the connector)
    first_token: int | None = None
    kv_dtype: str = "auto"
    sampled_at: float = 0.0
    #: the task's name and the replay's capability (see the module's docstring); made by :func:`new_token`
    token: str = ""
    format: str = TASK_FORMAT

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> VerifyTask:
        """A task from its file; anything but a well-formed task raises ValueError (never trusted as is)."""
        raw = json.loads(data)
        if not isinstance(raw, dict) or raw.get("format") != TASK_FORMAT:
            raise ValueError("not a prefixshare verify task")
        ids = raw.get("token_ids")
        if not isinstance(ids, list) or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise ValueError("token_ids is not a list of token ids")
        loaded = raw.get("loaded_tokens")
        if not isinstance(loaded, int) or not 0 < loaded <= len(ids):
            raise ValueError("loaded_tokens is out of range")
        if raw.setdefault("params", {}) is None:
            raw["params"] = {}
        if not isinstance(raw["params"], dict):
            raise ValueError("params is not a mapping")
        known = set(cls.__dataclass_fields__)
        task = cls(**{k: v for k, v in raw.items() if k in known})
        for name in ("instance", "namespace", "request_id", "token"):
            if not isinstance(getattr(task, name), str):
                raise ValueError(f"{name} is not a string")
        for name in ("cache_salt", "store_salt"):
            if getattr(task, name) is not None and not isinstance(getattr(task, name), str):
                raise ValueError(f"{name} is not a string")
        if not _TOKEN.match(task.token):
            raise ValueError("token is not a verify task token")
        return task


#: ``<time in ns, 20 digits>-<96 random bits>``: names sort oldest first, and cannot be guessed
_TOKEN = re.compile(r"^[0-9]{20}-[0-9a-f]{24}$")


def new_token() -> str:
    return f"{time.time_ns():020d}-{secrets.token_hex(12)}"


def pending_dir(instance: str) -> Path:
    """Where an instance's connectors leave the hits they sampled."""
    return run_dir() / "verify" / _safe(instance)


def _safe(name: str) -> str:
    if name and all(c.isalnum() or c in "._-" for c in name) and len(name) <= 100 and not name.startswith("."):
        return name
    return "_" + blake3.blake3(name.encode()).hexdigest()[:32]


def pending_tasks(instance: str) -> list[Path]:
    """The instance's sampled hits waiting to be verified, oldest first."""
    try:
        return sorted(p for p in pending_dir(instance).iterdir() if p.suffix == ".json")
    except OSError:  # none yet (or unreadable: nothing to verify, and sampling must not fail a request)
        return []


def read_task(path: Path) -> VerifyTask:
    with open(path, "rb") as fh:
        data = fh.read(_MAX_TASK_BYTES + 1)
    if len(data) > _MAX_TASK_BYTES:
        raise ValueError(f"{path.name} is larger than a verify task can be")
    task = VerifyTask.from_json(data)
    if path.stem != task.token:
        raise ValueError(f"{path.name} holds the task {task.token}")
    return task


def task_path(instance: str, token: str) -> Path | None:
    """Where the task of ``token`` is kept (None: not a token)."""
    return pending_dir(instance) / f"{token}.json" if isinstance(token, str) and _TOKEN.match(token) else None


def find_task(instance: str, token: Any, token_ids: Any) -> VerifyTask | None:
    """The task a replay names, when it is one of ``instance``'s and the replay's prompt is the task's own
    (else None: the replay is refused)."""
    path = task_path(instance, token)
    if path is None:
        return None
    try:
        task = read_task(path)
    except (OSError, ValueError):
        return None
    return task if task.instance == instance and list(token_ids) == task.token_ids else None


class HitSampler:
    """Which finished store hits are kept for verification: ``sample`` of them (by a digest of the request id,
    so a replay decides alike), at most ``max_per_minute`` (a token bucket) and ``max_pending`` waiting."""

    def __init__(self, sample: float, max_per_minute: float, max_pending: int, instance: str) -> None:
        self.sample = sample
        self.rate = max_per_minute / 60.0
        self.capacity = max(1.0, max_per_minute)
        self.max_pending = max_pending
        self.instance = instance
        self._tokens = self.capacity
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def chosen(self, request_id: str) -> bool:
        """Whether the request falls in the sampled fraction (no rate or queue bound applied)."""
        if self.sample >= 1.0:
            return True
        draw = int.from_bytes(blake3.blake3(request_id.encode()).digest()[:8], "big") / 2.0 ** 64
        return draw < self.sample

    def admit(self) -> str | None:
        """None when one more hit may be kept now; else why not ('rate', 'pending')."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.capacity, self._tokens + (now - self._last) * self.rate)
            self._last = now
            if self._tokens < 1.0:
                return "rate"
            if len(pending_tasks(self.instance)) >= self.max_pending:
                return "pending"
            self._tokens -= 1.0
            return None

    def keep(self, task: VerifyTask) -> Path:
        return keep_task(task)


def keep_task(task: VerifyTask) -> Path:
    """Write the task where the checking half (and the replica's connector) find it; atomic: a reader never
    sees half a task."""
    path = task_path(task.instance, task.token)
    if path is None:
        raise ValueError(f"not a verify task token: {task.token!r}")
    write_private_atomic(path, task.to_json(), stop=run_dir(), fsync=False)
    return path
