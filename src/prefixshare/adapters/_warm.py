"""The seam between warming and an inference engine: tokenizer, context length, fingerprint, prefill.

:class:`WarmEngine` is all :func:`~prefixshare.warm.warm` and :func:`~prefixshare.warm.prompt_for` need. Each
engine adapter implements it next to the rest of its engine knowledge (``adapters/vllm/_warm.py``,
``adapters/sglang/_warm.py``); :func:`prefixshare.warm.engine_for` picks one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from prefixshare._log import get_logger

if TYPE_CHECKING:  # pragma: no cover
    from prefixshare.fingerprint import Fingerprint
    from prefixshare.share import PrefixShare


@dataclass(frozen=True)
class PrefillRequest:
    """Prefill ``token_ids`` and store their KV (nothing is decoded beyond the one token prefill yields)."""

    token_ids: list[int]
    kv_transfer_params: dict[str, Any]
    cache_salt: str | None = None
    #: also return the first token and the log-probabilities of the ``top_logprobs`` likeliest (verification)
    top_logprobs: int = 0


@dataclass(frozen=True)
class PrefillResult:
    #: prompt tokens the engine did not compute (loaded from the store or its local prefix cache)
    cached_tokens: int
    #: the greedy first token, and ``{token id: log-probability}`` of the likeliest (with ``top_logprobs``)
    first_token: int | None = None
    logprobs: dict[int, float] | None = None


@runtime_checkable
class WarmEngine(Protocol):
    """What warming needs from an engine."""

    kind: str

    @property
    def tokenizer(self) -> Any: ...

    @property
    def max_model_len(self) -> int: ...

    def fingerprint(self) -> Fingerprint: ...

    def kv_bytes_per_token(self) -> int: ...

    def prefill(self, requests: list[PrefillRequest]) -> list[PrefillResult]: ...

    def reset_prefix_cache(self) -> None: ...


def check_published(ps: PrefixShare, fp: Fingerprint) -> None:
    published = ps.stats().get("fingerprint")
    if published and published != fp.digest:
        get_logger(__name__).warning(
            "warm.fingerprint_mismatch", computed=fp.short, connector=str(published)[:12],
            message="the connector published another fingerprint than warm computed; verification "
                    "may report missing chunks")


def kv_bytes_per_token(model_dir: str, fp: Fingerprint) -> int:
    from prefixshare.plan import kv_bytes_per_token, shape_from_config

    return kv_bytes_per_token(shape_from_config(Path(model_dir) / "config.json"), fp.engine.kv_dtype)
