"""Test-only: the environment every replica helper sets before it imports an engine (in-process vLLM with a
small CPU KV cache, nothing fetched, no usage reporting or banners, quiet tokenizers). Values the caller set win."""

from __future__ import annotations

import os

ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # in-process: ~3 s engine start
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "LMCACHE_TRACK_USAGE": "false",
    "LMCACHE_DISABLE_BANNER": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def set_engine_env() -> None:
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)


def engine_kwargs(kind: str, model: str, **overrides: object) -> dict:
    """The engine arguments the warm helpers run a tiny model with: SGLang's CPU engine as
    tests/helpers/sglang_replica.py runs it, or in-process vLLM; ``overrides`` win."""
    if kind == "sglang":
        base: dict = {"model_path": model, "device": "cpu", "attention_backend": "torch_native",
                      "disable_cuda_graph": True, "page_size": 16, "dtype": "float32", "mem_fraction_static": 0.3,
                      "max_total_tokens": 16384, "context_length": 2048, "log_level": "warning", "random_seed": 0}
    else:
        base = {"model": model, "dtype": "float32", "enforce_eager": True, "distributed_executor_backend": "uni",
                "block_size": 32, "max_model_len": 2048, "seed": 0}
    return {**base, **overrides}
