"""The base every L2 tier config derives from.

A tier config is a small pydantic model that knows three renderings of itself:

* :meth:`TierConfig.server_config` — the JSON object LMCache's MP server takes in ``--l2-adapter``
  (field names are LMCache's own, so the server's parser is the final judge; tests call it);
* :meth:`TierConfig.legacy` — the ``remote_url`` + ``extra_config`` of LMCache's in-process engine, for
  users on the CUDA in-process path (``None`` where that path has no equivalent);
* :meth:`TierConfig.redacted` — the adapter config with secrets masked, for logs and ``policy render``.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic_core import PydanticCustomError

SECRET_MASK = "***"


def problem(message: str, fix: str = "") -> PydanticCustomError:
    """A validation error whose message and fix prefixshare shows verbatim (see policy._errors)."""
    return PydanticCustomError("prefixshare", "{message}", {"message": message, "fix": fix})


class EvictionSettings(BaseModel):
    """Per-tier eviction inside LMCache (optional; without it the tier grows until gc)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    policy: Literal["LRU", "ARC", "IsolatedLRU", "noop"] = "LRU"
    trigger_watermark: float = Field(0.8, gt=0, le=1)
    eviction_ratio: float = Field(0.2, gt=0, le=1)


class LegacyRemote(BaseModel):
    """What a tier becomes in the in-process engine config: one remote URL plus extra_config keys."""

    model_config = ConfigDict(frozen=True)

    remote_url: str
    extra_config: dict[str, Any] = Field(default_factory=dict)
    notes: list[str] = Field(default_factory=list)


class TierConfig(BaseModel):
    """Fields shared by every L2 tier."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: registry name; each subclass narrows it to a Literal
    type: str
    #: optional Python module the tier's client needs, and the pip extra that installs it
    requires_module: ClassVar[str | None] = None
    requires_extra: ClassVar[str | None] = None
    #: one sentence for ``policy init`` and docs
    summary: ClassVar[str] = ""
    #: True when several MP servers (nodes) reach the same bytes through this tier
    shares_across_nodes: ClassVar[bool] = True

    eviction: EvictionSettings | None = None
    persist: bool = Field(True, description="keep data when the server stops")

    # --- renderings -------------------------------------------------------------------------
    def _adapter_fields(self) -> dict[str, Any]:  # pragma: no cover - abstract
        raise NotImplementedError

    def server_config(self) -> dict[str, Any]:
        """The ``--l2-adapter`` JSON object for LMCache's MP server (secrets included)."""
        cfg: dict[str, Any] = {"type": self.lmcache_type()}
        cfg.update({k: v for k, v in self._adapter_fields().items() if v is not None})
        if self.shares_across_nodes:
            cfg["shared"] = True
        cfg["persist_enabled"] = self.persist
        if self.eviction is not None:
            cfg["eviction"] = {
                "eviction_policy": self.eviction.policy,
                "trigger_watermark": self.eviction.trigger_watermark,
                "eviction_ratio": self.eviction.eviction_ratio,
            }
        return cfg

    def secret_fields(self) -> tuple[str, ...]:
        return ()

    def redacted(self) -> dict[str, Any]:
        cfg = self.server_config()
        for key in self.secret_fields():
            if cfg.get(key):
                cfg[key] = SECRET_MASK
        return cfg

    def lmcache_type(self) -> str:
        return self.type

    def legacy(self) -> LegacyRemote | None:
        """The in-process engine equivalent, or None where that path has none."""
        return None

    def server_env(self) -> dict[str, str]:
        """Environment variables the MP server process needs for this tier (e.g. credentials)."""
        return {}

    def prepare(self) -> None:
        """Side effects before a server uses the tier (e.g. create a directory). Idempotent."""

    def probe(self, timeout_s: float = 0.25) -> str | None:
        """A cheap reachability check (no retries): None when the tier answers, else why not.

        Used by the connectors' health gate (skip a dead tier instead of waiting out a timeout on every
        request) and by ``prefixshare doctor``. The default has nothing to check."""
        return None

    def describe(self) -> str:
        return f"{self.type}"


def resp_ping(host: str, port: int, timeout_s: float) -> str | None:
    """None if a Redis-protocol server answers PING within the timeout (a frozen server accepts TCP
    connections but never answers, so a connect alone proves nothing)."""
    import socket

    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as conn:
            conn.settimeout(timeout_s)
            conn.sendall(b"*1\r\n$4\r\nPING\r\n")
            reply = conn.recv(64)
    except OSError as exc:
        return f"{host}:{port} does not answer PING ({exc.strerror or exc})"
    # +PONG, or an error such as -NOAUTH: either way the server is alive and answering
    return None if reply[:1] in (b"+", b"-") else f"{host}:{port} answered PING with {reply[:20]!r}"


def tcp_probe(host: str, port: int, timeout_s: float) -> str | None:
    """None if a TCP connection to host:port opens within the timeout, else the reason."""
    from prefixshare._net import connect_error

    exc = connect_error(host, port, timeout_s)
    return None if exc is None else f"{host}:{port} unreachable ({exc.strerror or exc})"


def read_secret(env_name: str | None) -> str | None:
    """Secrets live in the environment, never in a policy file; the policy names the variable."""
    if not env_name:
        return None
    return os.environ.get(env_name)
