"""The fingerprint data model: frozen, JSON-serialisable pydantic models grouped by topic."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue

from prefixshare.fingerprint._canonical import digest_of

#: Bumped whenever the meaning of a field changes; part of every digest.
SCHEMA_VERSION = 1

WeightsMode = Literal["content", "headers"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelInfo(_Frozen):
    """Shape of the model as far as KV is concerned, read from ``config.json``.

    For multimodal configs the language-model values come from the nested ``text_config`` (or
    ``llm_config`` / ``language_config``). Keys missing from the config are ``None``.
    ``config_digest`` covers all of ``config.json`` except volatile bookkeeping keys
    (``_name_or_path``, ``transformers_version``...), so fields not listed here are covered too.
    """

    architectures: tuple[str, ...] | None = None
    model_type: str | None = None
    num_hidden_layers: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_size: int | None = None
    num_attention_heads: int | None = None
    rope_theta: float | None = None
    rope_scaling: JsonValue = None
    max_position_embeddings: int | None = None
    sliding_window: JsonValue = None
    torch_dtype: str | None = None
    config_digest: str


class WeightFile(_Frozen):
    """One weight file: path relative to the model directory (``/`` separated), size and digest.

    ``digest`` is the blake3 of the bytes in ``content`` mode, of the safetensors header and size in
    ``headers`` mode (``None`` there for formats whose header is not parsed: only the size counts).
    """

    path: str
    size: int
    digest: str | None = None


class WeightsInfo(_Frozen):
    """Identity of the weights. ``digest`` combines every file's path, size and digest.

    ``revision`` is the Hugging Face commit when known. In ``content`` mode the bytes are the identity
    and the revision is informational only (not part of :attr:`Fingerprint.digest`, so a copy of the
    same files without a revision still matches); in ``headers`` mode it is part of the identity.
    """

    mode: WeightsMode
    digest: str
    files: tuple[WeightFile, ...]
    revision: str | None = None


class TokenizerInfo(_Frozen):
    """Identity of the tokenizer: files digest, special tokens and chat template digest.

    ``digest`` covers the tokenizer files present (``files``); ``tokenizer_config.json`` is hashed as
    canonical JSON without volatile keys and without its chat template, which is tracked on its own by
    ``chat_template_digest`` (``None`` when the model has no chat template).
    """

    digest: str
    files: tuple[str, ...] = ()
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    chat_template_digest: str | None = None


class LoraInfo(_Frozen):
    """A LoRA adapter the engine serves: its name and a digest of its files (not its path)."""

    name: str
    digest: str


class EngineInfo(_Frozen):
    """The engine settings with ``kv_dtype`` resolved and LoRA paths replaced by digests."""

    engine: str
    engine_version: str | None = None
    kv_layout: str
    kv_dtype: str
    block_size: int | None = None
    chunk_size: int
    tp: int = 1
    pp: int = 1
    lora: tuple[LoraInfo, ...] = ()


class Fingerprint(_Frozen):
    """Everything that decides whether KV written by one replica can be used by another.

    Two replicas may share KV exactly when their :attr:`digest` values are equal; :func:`diff`
    explains, field by field, why two fingerprints differ.
    """

    schema_version: int = Field(default=SCHEMA_VERSION)
    model: ModelInfo
    weights: WeightsInfo
    tokenizer: TokenizerInfo
    engine: EngineInfo
    tenant: str | None = None

    def identity(self) -> dict[str, Any]:
        """The fields that make up :attr:`digest`, as plain JSON data.

        Identical to :meth:`model_dump` in JSON mode, except that ``weights.revision`` is blanked in
        ``content`` mode (the bytes already identify the weights), and the engine's name and version are
        blanked when it declares its KV layout (the layout is what decides whether bytes are usable).
        """
        data = self.model_dump(mode="json")
        if self.weights.mode == "content":
            data["weights"]["revision"] = None
        if self.engine.kv_layout != "unknown":
            # The stored bytes are described by the layout, not by the program that wrote them: two engines
            # that declare the same layout share KV (adapters put engine and version into layouts they
            # cannot prove canonical). With an unknown layout the engine and its version must match.
            data["engine"]["engine"] = None
            data["engine"]["engine_version"] = None
        return data

    @property
    def digest(self) -> str:
        """blake3 of the canonical JSON of :meth:`identity`, as 32 hex characters (128 bits).

        Canonical JSON sorts keys, uses compact separators and one spelling per number, so the
        digest is identical across processes, hosts and ``PYTHONHASHSEED`` values.
        """
        return digest_of(self.identity(), domain="prefixshare-fingerprint")

    @property
    def short(self) -> str:
        """First 12 hex characters of :attr:`digest`, for namespacing keys and directory names."""
        return self.digest[:12]

    def to_json(self, *, indent: int | None = None) -> str:
        """Serialise to JSON; :meth:`from_json` gives back an equal fingerprint with the same digest."""
        return self.model_dump_json(indent=indent)

    @classmethod
    def from_json(cls, data: str | bytes) -> Fingerprint:
        """Parse a fingerprint written by :meth:`to_json`."""
        return cls.model_validate_json(data)

    def __hash__(self) -> int:
        return hash(self.digest)
