"""What prefixshare knows of an SGLang engine's configuration: its backend's name, where its settings travel,
and what the fingerprint reads from ``ServerArgs`` (no engine start)."""

from __future__ import annotations

from typing import Any

from prefixshare.adapters._format import expected_order, layout_label
from prefixshare.fingerprint import EngineSettings
from prefixshare.plan import PlanError, shape_from_config

#: the radix-cache backend SGLang selects with ``--radix-cache-backend``
BACKEND = "prefixshare"
#: the environment variable that carries the policy and instance name into SGLang's scheduler process
ENV_CONFIG = "PREFIXSHARE_SGLANG"


def _mla(model_path: str) -> bool:
    """Whether the model uses multi-head latent attention, as ``plan`` reads its config (False when unreadable)."""
    try:
        return shape_from_config(model_path).is_mla
    except PlanError:
        return False


def kv_layout(server_args: Any) -> str:
    """The label of the objects LMCache stores from SGLang's KV (see :mod:`prefixshare.adapters._format`).

    SGLang keeps K and V in separate buffers per layer (MLA models: one latent buffer), registered with LMCache
    as every K buffer, then every V buffer: stored objects are ordered ``KV,L,T,H,D``. The backend checks the
    label against the registered KV (:func:`prefixshare.adapters._format.check_registered`)."""
    device = str(getattr(server_args, "device", None) or "cuda")
    return layout_label(device, expected_order(mla=_mla(str(server_args.model_path)), fused=False))


def engine_settings(server_args: Any) -> EngineSettings:
    import sglang

    version = ".".join(sglang.__version__.split(".")[:2])
    kv_dtype = str(getattr(server_args, "kv_cache_dtype", "auto") or "auto")
    if kv_dtype == "auto":
        dtype = str(getattr(server_args, "dtype", "auto") or "auto")
        kv_dtype = "auto" if dtype == "auto" else {"half": "float16", "float": "float32"}.get(dtype, dtype)
    return EngineSettings(
        engine="sglang",
        engine_version=version,
        kv_layout=kv_layout(server_args),
        kv_dtype=kv_dtype,
        block_size=int(getattr(server_args, "page_size", 1) or 1),
        tp=int(getattr(server_args, "tp_size", 1) or 1),
        pp=int(getattr(server_args, "pp_size", 1) or 1),
    )


def tokenizer_dir(server_args: Any) -> str | None:
    """The tokenizer directory when it is not the model's own (what the fingerprint digests separately)."""
    tok = getattr(server_args, "tokenizer_path", None)
    return tok if tok and tok != server_args.model_path else None
