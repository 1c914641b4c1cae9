"""What prefixshare knows of an SGLang engine's configuration: its backend's name, where its settings travel,
and what the fingerprint reads from ``ServerArgs`` (no engine start)."""

from __future__ import annotations

from typing import Any

from prefixshare.fingerprint import EngineSettings

#: the radix-cache backend SGLang selects with ``--radix-cache-backend``
BACKEND = "prefixshare"
#: the environment variable that carries the policy and instance name into SGLang's scheduler process
ENV_CONFIG = "PREFIXSHARE_SGLANG"


def engine_settings(server_args: Any) -> EngineSettings:
    import sglang

    version = ".".join(sglang.__version__.split(".")[:2])
    device = str(getattr(server_args, "device", None) or "cuda")
    kv_dtype = str(getattr(server_args, "kv_cache_dtype", "auto") or "auto")
    if kv_dtype == "auto":
        dtype = str(getattr(server_args, "dtype", "auto") or "auto")
        kv_dtype = "auto" if dtype == "auto" else {"half": "float16", "float": "float32"}.get(dtype, dtype)
    return EngineSettings(
        engine="sglang",
        engine_version=version,
        # engine and version in the label: no other engine's objects are proven byte-identical to these
        kv_layout=f"sglang-{version}/{device}/paged",
        kv_dtype=kv_dtype,
        block_size=int(getattr(server_args, "page_size", 1) or 1),
        tp=int(getattr(server_args, "tp_size", 1) or 1),
        pp=int(getattr(server_args, "pp_size", 1) or 1),
    )


def tokenizer_dir(server_args: Any) -> str | None:
    """The tokenizer directory when it is not the model's own (what the fingerprint digests separately)."""
    tok = getattr(server_args, "tokenizer_path", None)
    return tok if tok and tok != server_args.model_path else None
