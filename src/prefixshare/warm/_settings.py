"""Engine settings for one-off warm engines (CLI, demo, examples): what tests use on CPU, overridable.

Warming writes KV under the engine's fingerprint, so the settings that enter it — dtype (KV dtype), block
size, the model — must be those of the replicas that will read it. The rest (eager mode, in-process
engine) only changes how fast the warm engine starts.
"""

from __future__ import annotations

import os
from typing import Any

from prefixshare._env import VLLM_QUIET
from prefixshare.policies import Policy

#: environment for a quiet in-process vLLM engine (set only where the user has not)
ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # in-process: ~3 s start instead of ~35 s
    "HF_HUB_OFFLINE": "1",
    **VLLM_QUIET,
    "TOKENIZERS_PARALLELISM": "false",
}
QUIET_ENV = {"VLLM_LOGGING_LEVEL": "ERROR", "VLLM_LOGGING_STREAM": "ext://sys.stderr",
             "LMCACHE_LOG_LEVEL": "WARNING"}


#: KV cache of a one-off engine on a CPU host, GiB (vLLM's CPU default reserves most of the host's memory)
CPU_KV_CACHE_GB = "2"


def apply_engine_env(*, quiet: bool = True, engine: str = "vllm") -> None:
    for key, value in {**ENGINE_ENV, **(QUIET_ENV if quiet else {})}.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KV_CACHE_GB)  # read by vLLM's CPU backend only
    if engine == "sglang" and not _cuda():
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")  # SGLang's CPU engine (set before it is imported)


def _cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:  # pragma: no cover - the engines bring torch
        return False


def default_block_size(chunk_size: int) -> int:
    """The largest of 128, 64, 32, 16 that divides the chunk size (vLLM CPU wants a multiple of 32)."""
    for size in (128, 64, 32, 16):
        if chunk_size % size == 0:
            return size
    return chunk_size


def default_dtype() -> str:
    """float32 on CPU hosts (2-3x faster than bf16 on AVX2 for vLLM's CPU backend), else the model's."""
    return "auto" if _cuda() else "float32"


def vllm_engine_kwargs(
    policy: Policy,
    model: str,
    *,
    dtype: str | None = None,
    block_size: int | None = None,
    max_model_len: int | None = None,
    eager: bool = True,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments for a warm/demo engine (before PrefixShare adds its connector)."""
    kwargs: dict[str, Any] = {
        "model": model,
        "dtype": dtype or default_dtype(),
        "block_size": block_size or default_block_size(policy.chunk_size),
        "enforce_eager": eager,
        "enable_prefix_caching": True,
        "seed": 0,
    }
    if max_model_len:
        kwargs["max_model_len"] = max_model_len
    extra = dict(extra or {})
    if int(extra.get("tensor_parallel_size", 1)) == 1 and int(extra.get("pipeline_parallel_size", 1)) == 1:
        kwargs["distributed_executor_backend"] = "uni"
    kwargs.update(extra)
    return kwargs


#: SGLang's CPU engine: the attention backend and page size it runs with, and a bounded KV pool
SGLANG_CPU = {"device": "cpu", "attention_backend": "torch_native", "disable_cuda_graph": True, "page_size": 16,
              "mem_fraction_static": 0.3, "max_total_tokens": 16384}


def sglang_engine_kwargs(
    policy: Policy,
    model: str,
    *,
    dtype: str | None = None,
    block_size: int | None = None,
    max_model_len: int | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``sglang.Engine`` keyword arguments for a warm engine (before PrefixShare adds its radix-cache backend).

    ``block_size`` is SGLang's ``page_size``; it enters the fingerprint, so it must be the replicas' (default:
    16 on CPU hosts, SGLang's own elsewhere)."""
    kwargs: dict[str, Any] = {"model_path": model, "dtype": dtype or default_dtype(), "random_seed": 0,
                              "log_level": "warning"}
    if not _cuda():
        kwargs.update(SGLANG_CPU)
    if block_size:
        kwargs["page_size"] = block_size
    if max_model_len:
        kwargs["context_length"] = max_model_len
        if "max_total_tokens" in kwargs:
            kwargs["max_total_tokens"] = max(kwargs["max_total_tokens"], 2 * max_model_len)
    kwargs.update(extra or {})
    return kwargs
