"""Key-value server tiers: Valkey (cluster-aware client) and any RESP (Redis protocol) server.

Secrets never live in a policy file: the policy names the environment variable that holds the password.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from prefixshare.tiers._base import LegacyRemote, TierConfig, problem, read_secret, resp_ping


def _host_port(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise problem("is not host:port", "write it as host:port, e.g. 127.0.0.1:6379")
    return value


class RespTier(TierConfig):
    type: Literal["resp"] = "resp"
    summary = "a Redis-protocol server (Redis, Valkey, KeyDB, Dragonfly) through LMCache's RESP client"

    host: str
    port: int = Field(gt=0, lt=65536)
    username: str = ""
    password_env: str | None = Field(None, description="environment variable holding the password")
    num_workers: int = Field(8, gt=0)
    max_capacity_gb: float = Field(0, ge=0, description="0 = unlimited")

    def _adapter_fields(self) -> dict[str, Any]:
        # The password reaches the server through LMCACHE_RESP_PASSWORD (server_env), not argv.
        return {
            "host": self.host,
            "port": self.port,
            "username": self.username or None,
            "num_workers": self.num_workers,
            "max_capacity_gb": self.max_capacity_gb or None,
        }

    def server_env(self) -> dict[str, str]:
        secret = read_secret(self.password_env)
        return {"LMCACHE_RESP_PASSWORD": secret} if secret else {}

    def legacy(self) -> LegacyRemote:
        return LegacyRemote(remote_url=f"redis://{self.host}:{self.port}")

    def probe(self, timeout_s: float = 0.25) -> str | None:
        return resp_ping(self.host, self.port, timeout_s)

    def describe(self) -> str:
        return f"resp:{self.host}:{self.port}"


class ValkeyTier(TierConfig):
    type: Literal["valkey"] = "valkey"
    summary = "Valkey (standalone or cluster) through the valkey-glide client"
    requires_module = "glide_sync"
    requires_extra = "valkey"

    startup_nodes: list[str] = Field(min_length=1, description="host:port of one or more nodes")
    cluster_mode: bool = False
    username: str = ""
    password_env: str | None = Field(None, description="environment variable holding the password")
    key_prefix: str = ""
    database_id: int | None = Field(None, ge=0)
    tls: bool = False
    request_timeout_s: float = Field(5.0, gt=0)
    connection_timeout_s: float = Field(10.0, gt=0)
    ttl_s: int | None = Field(None, gt=0, description="expire keys after this many seconds")
    num_workers: int = Field(8, gt=0)
    max_capacity_gb: float = Field(0, ge=0, description="0 = unlimited")

    @field_validator("startup_nodes", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        return [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else value

    @field_validator("startup_nodes")
    @classmethod
    def _nodes(cls, value: list[str]) -> list[str]:
        return [_host_port(v) for v in value]

    @field_validator("key_prefix", "username")
    @classmethod
    def _no_at(cls, value: str) -> str:
        if "@" in value:
            raise problem("must not contain '@'", "remove the '@' (LMCache uses it as a key separator)")
        return value

    @model_validator(mode="after")
    def _cluster(self) -> ValkeyTier:
        if len(self.startup_nodes) > 1 and not self.cluster_mode:
            # LMCache would silently use only the first node.
            raise problem(
                f"lists {len(self.startup_nodes)} startup_nodes without cluster_mode",
                "set cluster_mode: true, or list one node",
            )
        return self

    def secret_fields(self) -> tuple[str, ...]:
        return ("password",)

    def _adapter_fields(self) -> dict[str, Any]:
        return {
            "startup_nodes": ",".join(self.startup_nodes),
            "cluster_mode": self.cluster_mode,
            "username": self.username or None,
            # The valkey adapter has no environment fallback: the password must travel in its config.
            "password": read_secret(self.password_env),
            "key_prefix": self.key_prefix or None,
            "database_id": self.database_id,
            "tls_enable": self.tls,
            "request_timeout": self.request_timeout_s,
            "connection_timeout": self.connection_timeout_s,
            "ttl_seconds": self.ttl_s,
            "num_workers": self.num_workers,
            "max_capacity_gb": self.max_capacity_gb or None,
        }

    def legacy(self) -> LegacyRemote:
        host, _, port = self.startup_nodes[0].rpartition(":")
        return LegacyRemote(
            remote_url=f"redis://{host}:{port}",
            notes=["the in-process engine's valkey:// connector stores nothing with save_unfull_chunk; "
                   "redis:// is rendered instead"],
        )

    def probe(self, timeout_s: float = 0.25) -> str | None:
        reasons = []
        for node in self.startup_nodes:
            host, _, port = node.rpartition(":")
            reason = resp_ping(host, int(port), timeout_s)
            if reason is None:
                return None  # a cluster answers through any node
            reasons.append(reason)
        return "; ".join(reasons)

    def describe(self) -> str:
        return f"valkey:{','.join(self.startup_nodes)}"
