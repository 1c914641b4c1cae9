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
