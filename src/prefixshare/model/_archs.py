"""Architectures the generator builds: the config class, the tokenizer's special tokens and chat template.

``llama`` is the generator's original model (``<s>``-prefixed prompts, a small role-token template).
``qwen3`` follows the Qwen3 family: ``Qwen3ForCausalLM`` (per-head q/k RMS norms), no BOS token, ChatML
turns (``<|im_start|>role ... <|im_end|>``) and a Jinja template that honours ``enable_thinking=False`` the
way Qwen3's does (an empty ``<think>`` block after the generation prompt).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from prefixshare.model._shapes import (
    BOS,
    EOS,
    PAD,
    QWEN3_EOS,
    QWEN3_PAD,
    QWEN3_SPECIAL_TOKENS,
    ROLE_TOKENS,
    SPECIAL_TOKENS,
    UNK,
)

#: Llama chat template: ``<s>``, then ``<|role|>\ncontent</s>\n`` per message, then ``<|assistant|>\n`` as
#: the generation prompt.
LLAMA_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{- raise_exception('unsupported role: ' + message['role']) -}}"
    "{%- endif -%}"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)

#: Qwen3-style template: ChatML turns; with ``enable_thinking=False`` the generation prompt is followed by an
#: empty thinking block, as Qwen3's own template does.
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{- raise_exception('unsupported role: ' + message['role']) -}}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)


@dataclass(frozen=True)
class Arch:
    """What differs between the generated architectures, apart from the numbers in their shapes.

    ``special_tokens`` get ids ``0..n-1`` in this order; ``bos``/``eos``/``pad``/``unk`` name some of them
    (``None``: the tokenizer has no such token). ``extra`` are the other specials (role and thinking
    markers), kept whole by the tokenizer.
    """

    config_class: str
    model_class: str
    special_tokens: tuple[str, ...]
    bos: str | None
    eos: str
    pad: str
    unk: str | None
    extra: tuple[str, ...]
    chat_template: str
    weights_dtype: str


ARCHS: Mapping[str, Arch] = MappingProxyType({
    "llama": Arch(
        config_class="LlamaConfig", model_class="LlamaForCausalLM", special_tokens=SPECIAL_TOKENS,
        bos=BOS, eos=EOS, pad=PAD, unk=UNK, extra=ROLE_TOKENS,
        chat_template=LLAMA_CHAT_TEMPLATE, weights_dtype="float32",
    ),
    "qwen3": Arch(
        config_class="Qwen3Config", model_class="Qwen3ForCausalLM", special_tokens=QWEN3_SPECIAL_TOKENS,
        bos=None, eos=QWEN3_EOS, pad=QWEN3_PAD, unk=None,
        extra=tuple(t for t in QWEN3_SPECIAL_TOKENS if t not in (QWEN3_EOS, QWEN3_PAD)),
        chat_template=QWEN3_CHAT_TEMPLATE, weights_dtype="bfloat16",
    ),
})
