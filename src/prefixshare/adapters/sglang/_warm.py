"""warm's view of a running ``sglang.Engine`` with prefixshare's radix-cache backend
(see :class:`~prefixshare.adapters._warm.WarmEngine`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prefixshare._log import get_logger
from prefixshare.adapters._warm import PrefillRequest, PrefillResult, check_published, kv_bytes_per_token
from prefixshare.adapters.sglang._requests import request_kwargs
from prefixshare.adapters.sglang._settings import BACKEND, engine_settings, tokenizer_dir
from prefixshare.errors import PrefixShareError
from prefixshare.keys import REQ_DOCUMENT, REQ_PREFIX_TOKENS, REQ_TENANT, engine_fingerprint

if TYPE_CHECKING:  # pragma: no cover
    from prefixshare.fingerprint import Fingerprint
    from prefixshare.share import PrefixShare


class SglangEngine:
    """A running ``sglang.Engine`` with prefixshare's radix-cache backend.

    Per-request settings travel as SGLang carries them (see :mod:`prefixshare.adapters.sglang`): the document id
    and prefix length in the request id, the tenant (and any request salt) as the request's ``cache_salt``.
    """

    kind = "sglang"

    def __init__(self, ps: PrefixShare, engine: Any) -> None:
        args = getattr(engine, "server_args", None)
        if args is None or getattr(args, "radix_cache_backend", None) != BACKEND or not getattr(args, "enable_lmcache", False):
            raise PrefixShareError(
                "this sglang.Engine was not started by PrefixShare.attach (its radix cache is not prefixshare's): "
                "warming it would store nothing; start it with ps.attach(...)"
            )
        self.ps = ps
        self.engine = engine
        self.server_args = args
        self._fp: Fingerprint | None = None

    @property
    def tokenizer(self) -> Any:
        tokenizer = getattr(self.engine.tokenizer_manager, "tokenizer", None)
        if tokenizer is None:
            raise PrefixShareError("this sglang.Engine has no tokenizer (skip_tokenizer_init?); warming needs it")
        return tokenizer

    @property
    def max_model_len(self) -> int:
        return int(self.engine.tokenizer_manager.context_len)

    def model_dir(self) -> str:
        return str(self.server_args.model_path)

    def fingerprint(self) -> Fingerprint:
        """The fingerprint the engine's radix-cache backend namespaces the store with (computed the same way)."""
        if self._fp is None:
            sa = self.server_args
            self._fp = engine_fingerprint(self.ps.policy, sa.model_path, engine_settings(sa),
                                          tokenizer_dir=tokenizer_dir(sa))
            check_published(self.ps, self._fp)
        return self._fp

    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.model_dir(), self.fingerprint())

    def prefill(self, requests: list[PrefillRequest]) -> list[PrefillResult]:
        rids: list[str] = []
        salts: list[str | None] = []
        for req in requests:
            params = req.kv_transfer_params
            kw = request_kwargs(document_id=params.get(REQ_DOCUMENT), tenant=params.get(REQ_TENANT),
                                prefix_tokens=params.get(REQ_PREFIX_TOKENS), cache_salt=req.cache_salt)
            rids.append(kw["rid"])
            salts.append(kw.get("cache_salt"))
        # max_new_tokens=1: the prefill yields its first token anyway; nothing more is decoded
        outputs = self.engine.generate(
            input_ids=[list(r.token_ids) for r in requests], rid=rids,
            cache_salt=salts if any(salts) else None,
            sampling_params=[{"max_new_tokens": 1, "temperature": 0.0} for _ in requests],
        )
        if isinstance(outputs, dict):
            outputs = [outputs]
        return [PrefillResult(int(out["meta_info"].get("cached_tokens") or 0)) for out in outputs]

    def reset_prefix_cache(self) -> None:
        """Empty the engine's own radix tree (SGLang refuses while requests run; warm runs none then)."""
        result = self.engine.flush_cache()
        if getattr(result, "success", True) is False:
            get_logger(__name__).warning("warm.reset_prefix_cache_failed", engine="sglang",
                                         message=str(getattr(result, "message", "")))
