"""What prefixshare knows of a vLLM engine's configuration: the connector's name, and what the fingerprint
reads from a vLLM config (no engine start, no CUDA)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from prefixshare.adapters._format import expected_order, layout_label
from prefixshare.errors import FingerprintError
from prefixshare.fingerprint import EngineSettings

if TYPE_CHECKING:  # pragma: no cover
    from vllm.config import VllmConfig

#: the connector vLLM loads (``kv_connector``) and its module path (``kv_connector_module_path``)
CONNECTOR = "PrefixShareConnector"
CONNECTOR_MODULE = "prefixshare.adapters.vllm.connector"


def _local_dir(name: str, revision: str | None) -> str:
    if os.path.isdir(name):
        return name
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(name, revision=revision, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure means: not available locally
        raise FingerprintError(
            f"cannot fingerprint {name!r}: it is neither a directory nor in the local Hugging Face cache ({exc})"
        ) from None


def model_dirs(vllm_config: VllmConfig) -> tuple[str, str | None]:
    """Directories of the weights and of the tokenizer (None when it is the weights' directory)."""
    mc = vllm_config.model_config
    model = _local_dir(mc.model, getattr(mc, "revision", None))
    tokenizer = getattr(mc, "tokenizer", None) or mc.model
    tok_dir = None if tokenizer == mc.model else _local_dir(tokenizer, getattr(mc, "tokenizer_revision", None))
    return model, tok_dir


def kv_layout(vllm_config: VllmConfig) -> str:
    """The label of the objects LMCache stores from this engine's KV (see :mod:`prefixshare.adapters._format`).

    Derived from the configuration, before any KV exists: vLLM >= 0.32 keeps K and V fused in each head
    (``[blocks, block, heads, 2 x head dim]`` on every device), MLA models one latent vector per token. The
    worker checks the label against the KV it registers (:func:`prefixshare.adapters._format.check_registered`).
    """
    import vllm

    try:
        from vllm.platforms import current_platform

        device = str(current_platform.device_type or "unknown")
    except Exception:  # noqa: BLE001
        device = "unknown"
    major, minor = (int(x) for x in vllm.__version__.split(".")[:2])
    mla = bool(getattr(vllm_config.model_config, "use_mla", False))
    return layout_label(device, expected_order(mla=mla, fused=(major, minor) >= (0, 32)))


def engine_settings(vllm_config: VllmConfig) -> EngineSettings:
    import vllm

    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    cache_dtype = str(getattr(cc, "cache_dtype", "auto"))
    kv_dtype = str(mc.dtype).removeprefix("torch.") if cache_dtype == "auto" else cache_dtype
    return EngineSettings(
        engine="vllm",
        engine_version=".".join(vllm.__version__.split(".")[:2]),
        kv_layout=kv_layout(vllm_config),
        kv_dtype=kv_dtype,
        block_size=cc.block_size,
        tp=pc.tensor_parallel_size,
        pp=pc.pipeline_parallel_size,
    )
