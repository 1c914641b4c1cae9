"""Local model generator for tests, the demo and benchmarks (no network, no downloads).

:func:`create_model` writes a Hugging Face-layout directory with a small random-weight model and a
byte-level BPE tokenizer trained offline on synthetic text, both determined by ``(arch, shape, seed)``:
``arch="llama"`` (``LlamaForCausalLM``, fp32) or ``arch="qwen3"`` (``Qwen3ForCausalLM`` with Qwen3-8B's head
geometry, bf16, a ChatML Jinja template). vLLM and SGLang load it like any local model::

    from prefixshare.model import ensure_model, document_text

    path = ensure_model("/tmp/models/tiny", shape="tiny", seed=0)
    qwen = ensure_model("/tmp/models/qwen3-tiny", shape="tiny", arch="qwen3")
    prompt = document_text(2000, seed=1)   # long deterministic English-like document

Importing this package is cheap: torch and transformers are imported only while building (``model``
extra: ``pip install 'prefixshare[model]'``).
"""

from __future__ import annotations

from prefixshare.model._archs import ARCHS, QWEN3_CHAT_TEMPLATE
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
from prefixshare.model._shapes import (
    ARCH_SHAPES,
    QWEN3_SHAPES,
    SHAPES,
    SPECIAL_TOKENS,
    VOCAB_SIZE,
    kv_bytes_per_token,
    parameter_count,
    shape_fields,
)
from prefixshare.model._text import document_text

__all__ = [
    "ARCHS",
    "ARCH_SHAPES",
    "CHAT_TEMPLATE",
    "GENERATOR_VERSION",
    "MANIFEST",
    "QWEN3_CHAT_TEMPLATE",
    "QWEN3_SHAPES",
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
    "shape_fields",
]
