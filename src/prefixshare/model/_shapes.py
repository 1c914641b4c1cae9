"""Model shapes: the config fields of each (architecture, size) this package can generate.

Llama shapes (:data:`SHAPES`) use ``head_dim`` 64 and fp32 weights. Qwen3 shapes (:data:`QWEN3_SHAPES`) keep
the head geometry of the Qwen3 dense models users serve (8 KV heads x head dim 128, 16 query heads, q/k norms,
rope theta 1e6, bf16) with few layers, so a layout or dtype mistake that only shows at that geometry shows
here. vLLM's CPU attention backend supports head dims 32, 64, 80, 96, 112, 128... All shapes use
``initializer_range`` 0.3: with Hugging Face's default of 0.02 a random model emits one repeated token
whatever the context, which would hide a wrong KV-cache load.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from prefixshare.plan import DTYPE_BYTES

#: Tokenizer size; ``config.vocab_size`` is set from the trained tokenizer and checked to equal this.
VOCAB_SIZE = 4096

#: Special tokens, in id order (ids 0..6). ``<|system|>``, ``<|user|>`` and ``<|assistant|>`` are used by
#: the chat template.
UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (UNK, BOS, EOS, PAD, *ROLE_TOKENS)

#: Qwen3's special tokens, in id order: no BOS and no UNK; a turn ends with ``<|im_end|>`` (the EOS of Qwen3's
#: instruct models), padding is ``<|endoftext|>``.
QWEN3_PAD, QWEN3_EOS = "<|endoftext|>", "<|im_end|>"
QWEN3_SPECIAL_TOKENS = (QWEN3_PAD, "<|im_start|>", QWEN3_EOS, "<think>", "</think>")

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


_QWEN3_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "head_dim": 128,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "hidden_act": "silu",
    "initializer_range": 0.3,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "use_sliding_window": False,
    "dtype": "bfloat16",
    "bos_token_id": None,
    "eos_token_id": QWEN3_SPECIAL_TOKENS.index(QWEN3_EOS),
    "pad_token_id": QWEN3_SPECIAL_TOKENS.index(QWEN3_PAD),
}

_QWEN3_SIZES: dict[str, dict[str, int]] = {
    # Qwen3-8B's attention (16 of its 32 query heads, all 8 KV heads, head dim 128) on a narrow residual.
    "tiny": {"hidden_size": 512, "num_hidden_layers": 3, "intermediate_size": 1024, "max_position_embeddings": 4096},
    "demo": {"hidden_size": 1024, "num_hidden_layers": 6, "intermediate_size": 2048,
             "max_position_embeddings": 8192},
}

#: Qwen3 shape name -> the ``Qwen3Config`` keyword arguments of that shape (read-only).
QWEN3_SHAPES: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {name: MappingProxyType({**size, **_QWEN3_COMMON}) for name, size in _QWEN3_SIZES.items()}
)

#: Architecture -> its shapes.
ARCH_SHAPES: Mapping[str, Mapping[str, Mapping[str, Any]]] = MappingProxyType({"llama": SHAPES, "qwen3": QWEN3_SHAPES})



def shape_fields(shape: str, arch: str = "llama") -> Mapping[str, Any]:
    """The config fields of ``shape`` of ``arch``; ``KeyError`` naming the choices when there is none."""
    shapes = ARCH_SHAPES.get(arch)
    if shapes is None:
        raise KeyError(f"unknown architecture {arch!r}; choose one of: {', '.join(ARCH_SHAPES)}")
    if shape not in shapes:
        raise KeyError(f"unknown {arch} shape {shape!r}; choose one of: {', '.join(shapes)}")
    return shapes[shape]


def parameter_count(shape: str, arch: str = "llama") -> int:
    """Number of weights of ``shape``, computed from its fields (no torch needed)."""
    f = shape_fields(shape, arch)
    hidden, inter, head_dim = f["hidden_size"], f["intermediate_size"], f["head_dim"]
    q = f["num_attention_heads"] * head_dim
    kv = f["num_key_value_heads"] * head_dim
    per_layer = hidden * q + 2 * hidden * kv + q * hidden + 3 * hidden * inter + 2 * hidden
    if arch == "qwen3":
        per_layer += 2 * head_dim  # q_norm and k_norm, one weight per head dim shared by all heads
    embeddings = f["vocab_size"] * hidden * (1 if f["tie_word_embeddings"] else 2)
    return int(f["num_hidden_layers"] * per_layer + embeddings + hidden)


def kv_bytes_per_token(shape: str, dtype_bytes: int | None = None, arch: str = "llama") -> int:
    """Bytes of K and V one token occupies across all layers (in the shape's own dtype by default)."""
    f = shape_fields(shape, arch)
    width = DTYPE_BYTES[f["dtype"]] if dtype_bytes is None else dtype_bytes
    return int(f["num_hidden_layers"] * f["num_key_value_heads"] * f["head_dim"] * 2 * width)
