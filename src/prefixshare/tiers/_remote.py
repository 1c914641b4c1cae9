"""Object store and transfer-engine tiers: S3, Mooncake Store, NIXL."""

from __future__ import annotations

from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from prefixshare._units import parse_size
from prefixshare.tiers._base import LegacyRemote, TierConfig, problem, tcp_probe


def _size(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return parse_size(value)
        except ValueError as exc:
            raise problem(str(exc), "write a size such as 4GB, 512MiB or a number of bytes") from None
    return value


class S3Tier(TierConfig):
    type: Literal["s3"] = "s3"
    summary = "an S3-compatible object store (one object per chunk)"
    requires_module = None  # LMCache's S3 client is built into its wheel

    endpoint: str = Field(description="bucket.host, e.g. my-bucket.s3.us-east-1.amazonaws.com")
    region: str
    num_io_threads: int = Field(64, gt=0)
    prefer_http2: bool = True
    disable_tls: bool = False
    max_capacity_gb: float = Field(0, ge=0, description="0 = unlimited")
    #: Credentials always come from the environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or the
    #: instance role); they are never written into a policy, a manifest, argv or a log.

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, value: str) -> str:
        bare = value.removeprefix("s3://")
        if "." not in bare or bare.startswith(".") or "/" in bare:
            raise problem(
                "is not bucket.host",
                "write the bucket as a virtual host, e.g. my-bucket.s3.us-east-1.amazonaws.com",
            )
        return bare

    def _adapter_fields(self) -> dict[str, Any]:
        return {
            "s3_endpoint": self.endpoint,
            "s3_region": self.region,
            "s3_num_io_threads": self.num_io_threads,
            "s3_prefer_http2": self.prefer_http2,
            "disable_tls": self.disable_tls or None,
            "max_capacity_gb": self.max_capacity_gb or None,
        }

    def legacy(self) -> LegacyRemote:
        return LegacyRemote(
            remote_url=f"s3://{self.endpoint}",
            extra_config={"s3_region": self.region, "s3_num_io_threads": self.num_io_threads},
            notes=["the last, partial chunk of a prompt is not retrievable from S3: only full chunks load"],
        )

    def probe(self, timeout_s: float = 0.25) -> str | None:
        host = self.endpoint.split("/", 1)[0]
        name, _, port = host.rpartition(":")
        if not port.isdigit():
            name, port = host, "80" if self.disable_tls else "443"
        return tcp_probe(name, int(port), timeout_s)

    def describe(self) -> str:
        return f"s3:{self.endpoint}"


#: the L2 adapter LMCache's MP server loads for the mooncake_store tier (through its "plugin" type); only the
#: server process imports that module.
MOONCAKE_ADAPTER_MODULE = "prefixshare.server.plugins.mooncake"
MOONCAKE_ADAPTER_CLASS = "MooncakeStoreL2Adapter"
#: keys for the master's address that Mooncake ignores silently (then ~90 s of retries, and nothing stored)
_WRONG_MASTER_KEYS = ("master_server_address", "mooncake_master_server_addr")


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


class MooncakeStoreTier(TierConfig):
    type: Literal["mooncake_store"] = "mooncake_store"
    summary = "Mooncake Store: a distributed KV store over a transfer engine (TCP or RDMA)"
    requires_module = "mooncake.store"
    requires_extra = "mooncake"

    # Field names are Mooncake's own setup keys (they reach MooncakeDistributedStore.setup verbatim).
    master_server_addr: str = Field(description="host:port of mooncake_master's RPC port")
    metadata_server: str = Field(description="http://host:port/metadata (the master's HTTP metadata server), "
                                             "etcd host:port, or P2PHANDSHAKE")
    local_hostname: str = Field("127.0.0.1", description="this node's address as the other nodes reach it")
    protocol: Literal["tcp", "rdma"] = "tcp"
    device_name: str = Field("", description="RDMA device(s), e.g. mlx5_0; empty for tcp")
    global_segment_size: int = Field(4 * 2**30, ge=0, description="bytes of memory this node's server "
                                     "contributes to the store; 0 = none (objects rest in other nodes' or "
                                     "dedicated mooncake_client processes' segments)")
    local_buffer_size: int = Field(1 * 2**30, gt=0, description="bytes of local transfer buffer")
    num_workers: int = Field(4, gt=0, description="adapter threads running Mooncake calls")
    connect_timeout_s: float = Field(10.0, gt=0, description="how long the server waits for the master at start")
    lease_ttl_s: float = Field(10.0, gt=0, le=3600, description="the master's --default_kv_lease_ttl, in "
                               "seconds (its default 10000 ms): an object read that recently cannot be removed, so "
                               "a refused delete (eviction) is retried this long (+1 s) later, up to 3 times")

    _sizes = field_validator("global_segment_size", "local_buffer_size", mode="before")(_size)

    @model_validator(mode="before")
    @classmethod
    def _master_key(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for wrong in _WRONG_MASTER_KEYS:
                if wrong in data:
                    raise problem(
                        f"'{wrong}' is not the key Mooncake reads: it would be ignored silently "
                        "(about 90 s of retries against a default master, then nothing stored)",
                        f"rename '{wrong}' to 'master_server_addr'",
                    )
        return data

    @field_validator("master_server_addr")
    @classmethod
    def _addr(cls, value: str) -> str:
        host, sep, port = value.rpartition(":")
        if "://" in value or not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise problem("is not host:port", "write the master's RPC address, e.g. 127.0.0.1:50051")
        return value

    @field_validator("metadata_server")
    @classmethod
    def _metadata(cls, value: str) -> str:
        parts = urlsplit(value)
        if "@" in parts.netloc:
            # a policy never holds secrets (and the URL would reach the server's argv)
            raise problem("contains credentials (user:password@)",
                          "remove them; give the metadata server its access control outside the URL")
        if parts.scheme in ("http", "https") and not parts.path.strip("/"):
            raise problem("has no path", "add the metadata path, e.g. http://127.0.0.1:8080/metadata")
        return value

    def _adapter_fields(self) -> dict[str, Any]:
        return {
            "module_path": MOONCAKE_ADAPTER_MODULE,
            "class_name": MOONCAKE_ADAPTER_CLASS,
            "adapter_params": {
                "master_server_addr": self.master_server_addr,
                "metadata_server": self.metadata_server,
                "local_hostname": self.local_hostname,
                "protocol": self.protocol,
                **({"rdma_devices": self.device_name} if self.device_name else {}),
                "global_segment_size": self.global_segment_size,
                "local_buffer_size": self.local_buffer_size,
                "num_workers": self.num_workers,
                "connect_timeout_s": self.connect_timeout_s,
                "lease_ttl_s": self.lease_ttl_s,
            },
        }

    def lmcache_type(self) -> str:
        return "plugin"

    def legacy(self) -> LegacyRemote:
        return LegacyRemote(
            remote_url=f"mooncakestore://{self.master_server_addr}/",
            extra_config={
                "local_hostname": self.local_hostname,
                "metadata_server": self.metadata_server,
                # The in-process engine reads this key (not Mooncake's master_server_addr, nor the documented
                # master_server_address, which it ignores silently: 90 s of retries, then nothing stored).
                "mooncake_master_server_addr": self.master_server_addr,
                "protocol": self.protocol,
                "device_name": self.device_name,
                "global_segment_size": self.global_segment_size,
                "local_buffer_size": self.local_buffer_size,
            },
            notes=["the in-process engine counts is_exist errors as hits when the master is down (false hits)"],
        )

    def probe(self, timeout_s: float = 0.25) -> str | None:
        host, port = _host_port(self.master_server_addr)
        return tcp_probe(host, port, timeout_s)

    def describe(self) -> str:
        return f"mooncake_store:{self.master_server_addr}"


class NixlStoreTier(TierConfig):
    type: Literal["nixl_store"] = "nixl_store"
    summary = "NIXL storage backends (POSIX, GDS, object); with POSIX the index is node-local"
    requires_module = "nixl"
    requires_extra = "nixl"
    shares_across_nodes = False

    backend: Literal["POSIX", "GDS", "GDS_MT", "HF3FS", "OBJ", "AZURE_BLOB"] = "POSIX"
    file_path: str = Field(description="directory for the backend's files")
    use_direct_io: bool = False
    file_size: int = Field(
        description="bytes per backing file; MUST exceed one chunk's KV bytes (see `prefixshare plan`), "
        "otherwise the store reports insufficient capacity after the first chunk",
        gt=0,
    )
    pool_size: int = Field(64, gt=0, description="number of backing files")

    _sizes = field_validator("file_size", mode="before")(_size)

    def _adapter_fields(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "backend_params": {
                "file_path": self.file_path,
                "use_direct_io": str(self.use_direct_io).lower(),
                "file_size": str(self.file_size),
            },
            "pool_size": self.pool_size,
        }

    def describe(self) -> str:
        return f"nixl_store:{self.backend}:{self.file_path}"
