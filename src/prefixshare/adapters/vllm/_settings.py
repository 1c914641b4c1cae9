"""What prefixshare knows of a vLLM engine's configuration: the connector's name, and what the fingerprint
reads from a vLLM config (no engine start, no CUDA)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

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
    """How a stored object's bytes are laid out: engine and version, device type and KV layout.

    The engine and its version are part of the label because no other engine's stored objects have
    been proven byte-identical to vLLM's (tests/e2e/test_cross_engine.py compares them bit by bit).
    """
    import vllm

    try:
        from vllm.platforms import current_platform

        device = current_platform.device_type
    except Exception:  # noqa: BLE001
        device = "unknown"
    try:
        from vllm.v1.attention.backends.utils import get_kv_cache_layout

        layout = get_kv_cache_layout()
    except Exception:  # noqa: BLE001
        layout = "default"
    version = ".".join(vllm.__version__.split(".")[:2])
    return f"vllm-{version}/{device}/{layout}"


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
