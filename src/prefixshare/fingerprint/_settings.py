"""The engine-side half of a fingerprint: how a replica is configured to produce KV bytes."""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

#: Spellings of the same KV dtype, mapped to one canonical name.
_DTYPE_ALIASES: dict[str, str] = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "f16": "float16",
    "half": "float16",
    "float16": "float16",
    "fp32": "float32",
    "f32": "float32",
    "float": "float32",
    "float32": "float32",
    "fp8": "fp8",
    "fp8_e4m3": "fp8_e4m3",
    "fp8_e4m3fn": "fp8_e4m3",
    "float8_e4m3fn": "fp8_e4m3",
    "fp8_e5m2": "fp8_e5m2",
    "float8_e5m2": "fp8_e5m2",
}


def normalise_dtype(value: str) -> str:
    """Canonical spelling of a dtype name: ``"torch.bfloat16"``, ``"bf16"`` -> ``"bfloat16"``.

    Unknown names are lower-cased and kept, so that they still compare equal to themselves.
    """
    name = value.strip().lower()
    name = name.removeprefix("torch.")
    return _DTYPE_ALIASES.get(name, name)


class EngineSettings(BaseModel):
    """How an engine replica stores KV; everything here changes which KV bytes it can reuse.

    ``kv_layout`` is a canonical, engine-supplied description of how KV bytes are laid out in a
    stored object, for example ``"vllm-cpu/fused-kv:[blocks,kv_heads,block,2*head_dim]"`` or
    ``"sglang/split-kv:token-major"``. Two replicas only share KV when their layouts are the same
    string; the default ``"unknown"`` matches only other ``"unknown"`` layouts, so set it.

    ``kv_dtype="auto"`` is resolved to the model's ``torch_dtype`` when a fingerprint is computed;
    if the engine serves at another dtype (``--dtype``), pass the resolved dtype explicitly.

    ``lora`` lists ``(name, path)`` pairs of the LoRA adapters the engine serves; the fingerprint
    keeps each name with a digest of the adapter's files (never the path, which is host-specific).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    engine: str = Field(description='Engine name: "vllm", "sglang" or another engine.')
    engine_version: str | None = Field(default=None, description="Engine version, when known.")
    kv_layout: str = Field(default="unknown", description="Canonical description of the KV byte layout.")
    kv_dtype: str = Field(default="auto", description='KV cache dtype; "auto" means the model dtype.')
    block_size: int | None = Field(default=None, gt=0, description="Engine KV block (page) size in tokens.")
    chunk_size: int = Field(default=256, gt=0, description="LMCache chunk size in tokens.")
    tp: int = Field(default=1, ge=1, description="Tensor-parallel degree.")
    pp: int = Field(default=1, ge=1, description="Pipeline-parallel degree.")
    lora: tuple[tuple[str, str], ...] = Field(default=(), description="LoRA adapters as (name, path).")
    tenant: str | None = Field(default=None, description="Tenant whose KV must stay separate.")

    @field_validator("engine")
    @classmethod
    def _engine(cls, value: str) -> str:
        name = value.strip().lower()
        if not name:
            raise ValueError("engine name must not be empty")
        return name

    @field_validator("kv_layout")
    @classmethod
    def _layout(cls, value: str) -> str:
        layout = value.strip()
        if not layout:
            raise ValueError('kv_layout must not be empty (use "unknown" when it is not known)')
        return layout

    @field_validator("kv_dtype")
    @classmethod
    def _dtype(cls, value: str) -> str:
        if not value.strip():
            raise ValueError('kv_dtype must not be empty (use "auto" for the model dtype)')
        return normalise_dtype(value)

    @field_validator("lora", mode="before")
    @classmethod
    def _lora(cls, value: Any) -> Any:
        if isinstance(value, dict):
            value = list(value.items())
        if not isinstance(value, (list, tuple)):
            return value
        pairs = []
        for item in value:
            if isinstance(item, (list, tuple)) and len(item) == 2:
                name, path = item
                pairs.append((name, os.fspath(path) if isinstance(path, os.PathLike) else path))
            else:
                pairs.append(item)
        names = [p[0] for p in pairs if isinstance(p, tuple)]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"LoRA adapter names must be unique; repeated: {', '.join(map(str, duplicates))}")
        return tuple(pairs)
