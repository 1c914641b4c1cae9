"""Model shapes: the ``LlamaConfig`` fields of each size this package can generate.

All shapes use ``head_dim`` 64 (vLLM's CPU attention backend supports head dims 32, 64, 80, 96, 112, 128...),
fp32 weights and ``initializer_range`` 0.3: with Hugging Face's default of 0.02 a random model emits one
repeated token whatever the context, which would hide a wrong KV-cache load.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

#: Tokenizer size; ``config.vocab_size`` is set from the trained tokenizer and checked to equal this.
VOCAB_SIZE = 4096

#: Special tokens, in id order (ids 0..6). ``<|system|>``, ``<|user|>`` and ``<|assistant|>`` are used by
#: the chat template.
UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (UNK, BOS, EOS, PAD, *ROLE_TOKENS)

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "head_dim": 64,
    "hidden_act": "silu",
    "initializer_range": 0.3,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "dtype": "float32",
    "bos_token_id": SPECIAL_TOKENS.index(BOS),
    "eos_token_id": SPECIAL_TOKENS.index(EOS),
    "pad_token_id": SPECIAL_TOKENS.index(PAD),
}

_SIZES: dict[str, dict[str, int]] = {
    "tiny": {
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 512,
        "max_position_embeddings": 4096,
    },
    "demo": {
        "hidden_size": 512,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "intermediate_size": 1408,
        "max_position_embeddings": 8192,
    },
    "bench": {
        "hidden_size": 1024,
        "num_hidden_layers": 12,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "intermediate_size": 2816,
        "max_position_embeddings": 16384,
    },
}

#: Shape name -> the ``LlamaConfig`` keyword arguments of that shape (read-only; copy with ``dict(...)``).
SHAPES: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {name: MappingProxyType({**size, **_COMMON}) for name, size in _SIZES.items()}
)


def parameter_count(shape: str) -> int:
    """Number of weights of ``shape``, computed from its fields (no torch needed)."""
    f = SHAPES[shape]
    hidden, inter, head_dim = f["hidden_size"], f["intermediate_size"], f["head_dim"]
    q = f["num_attention_heads"] * head_dim
    kv = f["num_key_value_heads"] * head_dim
    per_layer = hidden * q + 2 * hidden * kv + q * hidden + 3 * hidden * inter + 2 * hidden
    embeddings = f["vocab_size"] * hidden * (1 if f["tie_word_embeddings"] else 2)
    return int(f["num_hidden_layers"] * per_layer + embeddings + hidden)


def kv_bytes_per_token(shape: str, dtype_bytes: int = 4) -> int:
    """Bytes of K and V one token occupies across all layers (fp32 by default)."""
    f = SHAPES[shape]
    return int(f["num_hidden_layers"] * f["num_key_value_heads"] * f["head_dim"] * 2 * dtype_bytes)
