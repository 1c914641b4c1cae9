"""Local model generator for tests, the demo and benchmarks (no network, no downloads).

:func:`create_model` writes a Hugging Face-layout directory with a small random-weight
``LlamaForCausalLM`` (fp32 safetensors) and a byte-level BPE tokenizer trained offline on synthetic text,
both determined by ``(shape, seed)``. vLLM and SGLang load it like any local model::

    from prefixshare.model import ensure_model, document_text

    path = ensure_model("/tmp/models/tiny", shape="tiny", seed=0)
    prompt = document_text(2000, seed=1)   # long deterministic English-like document

Importing this package is cheap: torch and transformers are imported only while building (``model``
extra: ``pip install 'prefixshare[model]'``).
"""

from __future__ import annotations

from prefixshare.model._create import (
    CHAT_TEMPLATE,
    GENERATOR_VERSION,
    MANIFEST,
    ModelError,
    ModelInfo,
    create_model,
    create_or_reuse,
    ensure_model,
    model_info,
)
from prefixshare.model._shapes import SHAPES, SPECIAL_TOKENS, VOCAB_SIZE, kv_bytes_per_token, parameter_count
from prefixshare.model._text import document_text

__all__ = [
    "CHAT_TEMPLATE",
    "GENERATOR_VERSION",
    "MANIFEST",
    "SHAPES",
    "SPECIAL_TOKENS",
    "VOCAB_SIZE",
    "ModelError",
    "ModelInfo",
    "create_model",
    "create_or_reuse",
    "document_text",
    "ensure_model",
    "kv_bytes_per_token",
    "model_info",
    "parameter_count",
]
