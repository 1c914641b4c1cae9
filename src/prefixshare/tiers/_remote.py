"""Object store and transfer-engine tiers: S3, Mooncake Store, NIXL."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from prefixshare.policies import parse_size
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


class MooncakeStoreTier(TierConfig):
    type: Literal["mooncake_store"] = "mooncake_store"
    summary = "Mooncake Store: a distributed KV store over a transfer engine (TCP or RDMA)"
    requires_module = "mooncake.store"
    requires_extra = "mooncake"

    master_server_address: str = Field(description="host:port of mooncake_master's RPC port")
    metadata_server: str = Field(description="e.g. http://host:port/metadata (the master's HTTP metadata)")
    local_hostname: str = "127.0.0.1"
    protocol: Literal["tcp", "rdma"] = "tcp"
    device_name: str = Field("", description="RDMA device(s), e.g. mlx5_0; empty for tcp")
    global_segment_size: int = Field(4 * 2**30, gt=0, description="bytes this node contributes")
    local_buffer_size: int = Field(1 * 2**30, gt=0, description="bytes of local transfer buffer")
    num_workers: int = Field(4, gt=0)

    _sizes = field_validator("global_segment_size", "local_buffer_size", mode="before")(_size)

    @field_validator("master_server_address")
    @classmethod
    def _addr(cls, value: str) -> str:
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise problem("is not host:port", "e.g. 127.0.0.1:50051")
        return value

    def _adapter_fields(self) -> dict[str, Any]:
        # Everything but num_workers is forwarded verbatim to Mooncake's setup (its own key names).
        return {
            "master_server_address": self.master_server_address,
            "metadata_server": self.metadata_server,
            "local_hostname": self.local_hostname,
            "protocol": self.protocol,
            "rdma_devices": self.device_name or None,
            "global_segment_size": self.global_segment_size,
            "local_buffer_size": self.local_buffer_size,
            "num_workers": self.num_workers,
        }

    def adapter_config(self) -> dict[str, Any]:
        cfg = super().adapter_config()
        # LMCache forwards unknown keys to Mooncake as setup keys; keep only Mooncake's and LMCache's own.
        cfg.pop("shared", None)
        cfg.pop("persist_enabled", None)
        return cfg

    def legacy(self) -> LegacyRemote:
        return LegacyRemote(
            remote_url=f"mooncakestore://{self.master_server_address}/",
            extra_config={
                "local_hostname": self.local_hostname,
                "metadata_server": self.metadata_server,
                # The in-process engine reads this key; the documented master_server_address is ignored
                # there (silent 90 s of retries, then nothing stored).
                "mooncake_master_server_addr": self.master_server_address,
                "protocol": self.protocol,
                "device_name": self.device_name,
                "global_segment_size": self.global_segment_size,
                "local_buffer_size": self.local_buffer_size,
            },
        )

    def probe(self, timeout_s: float = 0.25) -> str | None:
        host, _, port = self.master_server_address.rpartition(":")
        return tcp_probe(host, int(port), timeout_s)

    def describe(self) -> str:
        return f"mooncake_store:{self.master_server_address}"


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
