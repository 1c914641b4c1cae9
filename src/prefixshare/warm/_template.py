"""Templates place a document exactly where later prompts have it, so warmed prefixes are hit.

A prompt is ``prefix(document) + question(question)``. The prefix — everything up to and including the
document — is tokenized on its own and the question part on its own, and the two id lists are
concatenated: the prefix's token ids are then the same bit for bit in the warm request and in every
prompt built by :func:`~prefixshare.warm.prompt_for`, whatever the question (tokenizing the joined text
would let BPE merge across the boundary and change the last prefix tokens).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import blake3

from prefixshare.errors import PrefixShareError

DOCUMENT = "{document}"
QUESTION = "{question}"
_DOC_SENTINEL = "\x00PREFIXSHARE-DOCUMENT\x00"
_Q_SENTINEL = "\x00PREFIXSHARE-QUESTION\x00"


class TemplateError(PrefixShareError, ValueError):
    """A template cannot place documents (placeholder missing or repeated, no chat template...)."""


@dataclass(frozen=True)
class Template:
    """Where a document sits in prompts.

    ``prefix`` holds ``{document}`` exactly once (text before it — a system prompt, an instruction — and
    after it belong to the shared prefix); ``question`` holds ``{question}`` exactly once and follows the
    prefix. ``add_special_tokens`` lets the tokenizer add its own (BOS) at the start of the prefix.

    ``Template.chat(system=...)`` uses the model's chat template instead: the document opens the user turn,
    the question follows it after ``separator``, and the generation prompt ends the prompt.
    """

    prefix: str = DOCUMENT
    question: str = "\n\n" + QUESTION
    add_special_tokens: bool = True
    #: set by Template.chat: render with the tokenizer's chat template
    use_chat_template: bool = False
    chat_system: str | None = None
    separator: str = "\n\n"

    def __post_init__(self) -> None:
        if not self.use_chat_template:
            if self.prefix.count(DOCUMENT) != 1:
                raise TemplateError(f"a template's prefix must contain {DOCUMENT} exactly once: {self.prefix!r}")
            if self.question.count(QUESTION) != 1:
                raise TemplateError(f"a template's question part must contain {QUESTION} exactly once: "
                                    f"{self.question!r}")

    @classmethod
    def chat(cls, system: str | None = None, *, separator: str = "\n\n") -> Template:
        """The model's own chat template: ``[system], user: document + separator + question``, then the
        generation prompt."""
        return cls(use_chat_template=True, chat_system=system, separator=separator, add_special_tokens=False)

    def resolve(self, tokenizer: Any) -> Template:
        """A plain template equivalent to this one for ``tokenizer`` (chat templates are rendered once)."""
        if not self.use_chat_template:
            return self
        messages = []
        if self.chat_system is not None:
            messages.append({"role": "system", "content": self.chat_system})
        messages.append({"role": "user", "content": _DOC_SENTINEL + self.separator + _Q_SENTINEL})
        apply = getattr(tokenizer, "apply_chat_template", None)
        if apply is None:
            raise TemplateError("this tokenizer has no chat template; use Template(prefix=..., question=...)")
        try:
            rendered = apply(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 - jinja / missing template errors of any kind
            raise TemplateError(f"the model's chat template cannot render a system + user turn: {exc}") from None
        if rendered.count(_DOC_SENTINEL) != 1 or rendered.count(_Q_SENTINEL) != 1:
            raise TemplateError("the model's chat template does not keep the user message verbatim; "
                                "use Template(prefix=..., question=...)")
        doc_at = rendered.index(_DOC_SENTINEL) + len(_DOC_SENTINEL)
        head, tail = rendered[:doc_at], rendered[doc_at:]
        return Template(
            prefix=_escape(head).replace(_escape(_DOC_SENTINEL), DOCUMENT),
            question=_escape(tail).replace(_escape(_Q_SENTINEL), QUESTION),
            add_special_tokens=False,
        )

    def prefix_text(self, document: str) -> str:
        before, after = self.prefix.split(DOCUMENT)
        return _unescape(before) + document + _unescape(after)

    def question_text(self, question: str) -> str:
        before, after = self.question.split(QUESTION)
        return _unescape(before) + question + _unescape(after)

    @property
    def digest(self) -> str:
        """Identifies what the template adds around documents (recorded in the registry)."""
        data = {"prefix": self.prefix, "question": self.question, "special": self.add_special_tokens,
                "chat": self.use_chat_template, "system": self.chat_system, "separator": self.separator}
        return blake3.blake3(json.dumps(data, sort_keys=True).encode()).hexdigest()[:32]


# Rendered chat text may itself contain "{document}" / "{question}": escape braces we did not put there.
_ESC = {"{": "\x01LB\x01", "}": "\x01RB\x01"}


def _escape(text: str) -> str:
    return text.replace("{", _ESC["{"]).replace("}", _ESC["}"])


def _unescape(text: str) -> str:
    return text.replace(_ESC["{"], "{").replace(_ESC["}"], "}")


def as_template(prefix: Template | str | None) -> Template:
    """``None`` -> the document alone; a string -> ``Template(prefix=string)``; a Template as is."""
    if prefix is None:
        return Template()
    if isinstance(prefix, Template):
        return prefix
    if isinstance(prefix, str):
        return Template(prefix=prefix)
    raise TemplateError(f"prefix must be a Template or a string with {DOCUMENT}, got {type(prefix).__name__}")


def encode(tokenizer: Any, text: str, *, special: bool) -> list[int]:
    """Token ids of ``text`` (HF-style tokenizers, vLLM's wrappers included)."""
    return list(tokenizer.encode(text, add_special_tokens=special))


def prefix_ids(tokenizer: Any, template: Template, document: str) -> list[int]:
    return encode(tokenizer, template.prefix_text(document), special=template.add_special_tokens)


def question_ids(tokenizer: Any, template: Template, question: str) -> list[int]:
    return encode(tokenizer, template.question_text(question), special=False)


def tokens_digest(ids: list[int]) -> str:
    """blake3 of token ids (little-endian u32), 32 hex: the registry's prefix digest (persisted: its bytes must not
    change; ``token_bytes`` packs exactly what ``array('I', ids).tobytes()`` did on little-endian machines)."""
    from prefixshare.keys import token_bytes

    return blake3.blake3(token_bytes(ids)).hexdigest()[:32]
