"""Shared filesystem tier: one file per chunk under ``base_path`` (a local disk or an NFS mount).

Several MP servers pointed at one directory share every chunk (a lookup is a file-exists check), so
this is the first tier to try: no extra service, and it scales to a home cluster on NFS.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from prefixshare.tiers._base import LegacyRemote, TierConfig, problem

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

#: the server-side adapter that writes and checks integrity data (imported by LMCache's MP server only)
CHECKED_ADAPTER = ("prefixshare.server.plugins.fs", "CheckedFSL2Adapter")


class FsTier(TierConfig):
    type: Literal["fs"] = "fs"
    summary = "a directory, local or on a shared mount (NFS); several servers on one directory share chunks"

    # ``create`` comes first so that base_path's validator can see it.
    create: bool = Field(False, description="create base_path (mode 0750) when the server starts")
    base_path: str = Field(description="absolute directory that holds one file per chunk")
    read_ahead_size: int | None = Field(None, gt=0, description="bytes read ahead per file")
    use_odirect: bool = Field(False, description="bypass the page cache (O_DIRECT)")
    relative_tmp_dir: str | None = Field(None, description="in-progress writes, relative to base_path")
    integrity: Literal["xxh3", "blake3", "none"] = Field(
        "xxh3", description="xxh3 or blake3: every chunk carries a digest checked on load, a damaged chunk is "
        "never loaded (xxh3, XXH3-128: a quarter of a memory copy's cost; blake3: as costly as the copy; both "
        "detect damage, neither forgery — that is key_env's); a server loads chunks under either; none: "
        "LMCache's plain fs adapter (no check)")
    key_env: str | None = Field(
        None, description="name of an environment variable holding a 32-byte key (64 hex digits) that every "
        "server of this store holds: digests become keyed (blake3's keyed hash, whatever integrity names), so "
        "only a key holder can write chunks others load (the key itself never goes in the policy)")
    accept_key_envs: list[str] = Field(
        default_factory=list, description="further key variables accepted for reading, during a key rotation "
        "(docs/tiers.md: 'Keyed integrity')")
    io_threads: int = Field(
        4, ge=1, le=64, description="chunks of one request hashed and written, or read and checked, at once "
        "(integrity checked; each chunk is hashed in the thread that moves it)")
    fsync: bool = Field(
        False, description="fsync each chunk before it is published: chunks survive a power loss, at the "
        "medium's sync speed (without it, as LMCache's fs adapter: a chunk is published when it reaches the "
        "page cache; a crash can lose recent chunks, never publish a torn one)")

    @field_validator("base_path", mode="before")
    @classmethod
    def _expand(cls, value: Any) -> Any:
        if isinstance(value, str | os.PathLike):
            return os.path.expandvars(os.path.expanduser(os.fspath(value)))
        return value

    @field_validator("base_path")
    @classmethod
    def _absolute_existing(cls, value: str, info: ValidationInfo) -> str:
        if not value:
            raise problem("is empty", "set it to an absolute directory, e.g. /mnt/nfs/prefixshare")
        if not os.path.isabs(value):
            raise problem("is not an absolute path", f"use an absolute path, e.g. {os.path.abspath(value)}")
        path = Path(os.path.normpath(value))
        if path.exists() and not path.is_dir():
            raise problem("exists but is not a directory", "point base_path at a directory")
        if not path.exists() and not info.data.get("create", False):
            raise problem("does not exist", "create it or set create: true")
        return str(path)

    @field_validator("relative_tmp_dir")
    @classmethod
    def _relative(cls, value: str | None) -> str | None:
        if value is not None and (os.path.isabs(value) or ".." in Path(value).parts):
            raise problem("must be a relative path inside base_path", "use e.g. '.tmp'")
        return value

    @field_validator("key_env")
    @classmethod
    def _env_name(cls, value: str | None) -> str | None:
        if value is not None and not _ENV_NAME.fullmatch(value):
            raise problem("is not an environment variable name", "name the variable, e.g. PREFIXSHARE_STORE_KEY "
                          "(the key itself never goes in the policy)")
        return value

    @field_validator("accept_key_envs")
    @classmethod
    def _env_names(cls, value: list[str]) -> list[str]:
        for name in value:
            if not _ENV_NAME.fullmatch(name):
                raise problem(f"{name!r} is not an environment variable name",
                              "name the variables, e.g. [PREFIXSHARE_STORE_KEY_OLD]")
        return value

    @model_validator(mode="after")
    def _keys_need_integrity(self) -> FsTier:
        if self.key_env is not None and self.integrity == "none":
            raise problem("key_env needs integrity checks (integrity: none writes no digest to key)",
                          "set integrity: xxh3 (the default), or drop key_env")
        if self.integrity == "none" and ("io_threads" in self.model_fields_set or self.fsync):
            raise problem("io_threads and fsync are settings of the checked adapter (integrity: none is LMCache's "
                          "plain fs adapter, which writes one chunk at a time and never fsyncs)",
                          "set integrity: xxh3 (the default), or drop io_threads / fsync")
        if self.accept_key_envs and self.key_env is None:
            raise problem("accept_key_envs without key_env: keys are accepted only by a keyed store",
                          "set key_env to the key new chunks are written under")
        return self

    @model_validator(mode="after")
    def _odirect_needs_plain(self) -> FsTier:
        if self.use_odirect and self.integrity != "none":
            raise problem("use_odirect cannot be combined with integrity checks (the digest trailer breaks "
                          "O_DIRECT's block alignment)", "set integrity: none to use O_DIRECT, or drop use_odirect")
        return self

    def server_config(self) -> dict[str, Any]:
        cfg = super().server_config()
        if self.integrity == "none":
            return cfg
        params = {k: cfg.pop(k) for k in list(cfg) if k in self._adapter_fields()}
        if self.key_env is not None:
            params.update(key_env=self.key_env, accept_key_envs=list(self.accept_key_envs))
        params.update(io_threads=self.io_threads, fsync=self.fsync, digest=self.integrity)
        module, cls = CHECKED_ADAPTER
        return {**cfg, "type": "plugin", "module_path": module, "class_name": cls, "adapter_params": params}

    def _adapter_fields(self) -> dict[str, Any]:
        return {
            "base_path": self.base_path,
            "read_ahead_size": self.read_ahead_size,
            "use_odirect": self.use_odirect or None,
            "relative_tmp_dir": self.relative_tmp_dir,
        }

    def legacy(self) -> LegacyRemote:
        # The in-process engine's fs connector needs a host:port placeholder (``fs:///path`` is rejected).
        notes = ["the in-process engine's fs connector writes and loads chunks without integrity checks"]
        return LegacyRemote(remote_url=f"fs://localhost:0{self.base_path}",
                            notes=notes if self.integrity != "none" else [])

    def prepare(self) -> None:
        path = Path(self.base_path)
        if not path.exists():
            path.mkdir(mode=0o750, parents=True, exist_ok=True)
        if not path.is_dir():
            raise NotADirectoryError(f"fs tier: {self.base_path} exists but is not a directory (a store that is "
                                     "unmounted or replaced?); point base_path at a directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError(f"fs tier: {self.base_path} is not writable by this user")

    def probe(self, timeout_s: float = 0.25) -> str | None:
        path = Path(self.base_path)
        if not path.is_dir():
            return f"{self.base_path} is not a directory"
        if not os.access(path, os.R_OK | os.W_OK | os.X_OK):
            return f"{self.base_path} is not readable and writable by this user"
        return None

    def describe(self) -> str:
        return f"fs:{self.base_path}" + (f" (keyed: ${self.key_env})" if self.key_env else "")
