"""The seam between warming and an inference engine: tokenizer, context length, fingerprint, prefill.

:class:`WarmEngine` is all :func:`~prefixshare.warm.warm` and :func:`~prefixshare.warm.prompt_for` need.
:class:`VllmEngine` implements it for a ``vllm.LLM`` attached through :meth:`PrefixShare.attach`; another
engine (SGLang) plugs in by implementing the same five members and registering in :func:`engine_for`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from prefixshare._log import get_logger
from prefixshare.errors import PrefixShareError

if TYPE_CHECKING:  # pragma: no cover
    from prefixshare.adapters import PrefixShare
    from prefixshare.fingerprint import Fingerprint


@dataclass(frozen=True)
class PrefillRequest:
    """Prefill ``token_ids`` and store their KV (nothing is decoded beyond the one token prefill yields)."""

    token_ids: list[int]
    kv_transfer_params: dict[str, Any]
    cache_salt: str | None = None


@dataclass(frozen=True)
class PrefillResult:
    #: prompt tokens the engine did not compute (loaded from the store or its local prefix cache)
    cached_tokens: int


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


class VllmEngine:
    """A running ``vllm.LLM`` with prefixshare's connector."""

    kind = "vllm"

    def __init__(self, ps: PrefixShare, llm: Any) -> None:
        from prefixshare.adapters.vllm import CONNECTOR

        cfg = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
        kt = getattr(cfg, "kv_transfer_config", None)
        if kt is None or getattr(kt, "kv_connector", None) != CONNECTOR:
            raise PrefixShareError(
                "this vllm.LLM was not started by PrefixShare.attach (its KV connector is not prefixshare's): "
                "warming it would store nothing; start it with ps.attach(...)"
            )
        self.ps = ps
        self.llm = llm
        self.vllm_config = cfg
        self._fp: Fingerprint | None = None

    @property
    def tokenizer(self) -> Any:
        return self.llm.get_tokenizer()

    @property
    def max_model_len(self) -> int:
        return int(self.vllm_config.model_config.max_model_len)

    def model_dir(self) -> str:
        from prefixshare.adapters.vllm._settings import model_dirs

        return model_dirs(self.vllm_config)[0]

    def fingerprint(self) -> Fingerprint:
        """The fingerprint the engine's connector namespaces the store with (computed the same way)."""
        if self._fp is None:
            from prefixshare.adapters._runtime import engine_fingerprint
            from prefixshare.adapters.vllm._settings import engine_settings, model_dirs

            model_dir, tok_dir = model_dirs(self.vllm_config)
            self._fp = engine_fingerprint(self.ps.policy, model_dir, engine_settings(self.vllm_config),
                                          tokenizer_dir=tok_dir)
            _check_published(self.ps, self._fp)
        return self._fp

    def kv_bytes_per_token(self) -> int:
        return _kv_bytes_per_token(self.model_dir(), self.fingerprint())

    def prefill(self, requests: list[PrefillRequest]) -> list[PrefillResult]:
        import vllm

        prompts: list[Any] = []
        params = []
        for req in requests:
            prompt: dict[str, Any] = {"prompt_token_ids": list(req.token_ids)}
            if req.cache_salt:
                prompt["cache_salt"] = req.cache_salt
            prompts.append(prompt)
            # max_tokens=1: a prefill yields its first token anyway; nothing more is decoded
            params.append(vllm.SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                                              extra_args={"kv_transfer_params": dict(req.kv_transfer_params)}))
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return [PrefillResult(int(out.num_cached_tokens or 0)) for out in outputs]

    def reset_prefix_cache(self) -> None:
        reset_vllm_prefix_cache(self.llm)


def reset_vllm_prefix_cache(llm: Any, timeout_s: float = 10.0) -> bool:
    """Empty a ``vllm.LLM``'s local prefix cache, so the next prompts are computed or loaded from the store.

    vLLM refuses the reset while blocks are held, and a KV connector holds a finished request's blocks until
    its store completes, which the engine learns on its next step: step it (no new request) until the reset
    succeeds.
    """
    reset = getattr(llm, "reset_prefix_cache", None)
    if not callable(reset):
        return False
    deadline = time.monotonic() + timeout_s
    while True:
        if reset() is not False:
            return True
        if time.monotonic() > deadline:
            get_logger(__name__).warning("warm.reset_prefix_cache_failed", timeout_s=timeout_s)
            return False
        llm.llm_engine.step()
        time.sleep(0.01)


class SglangEngine:
    """A running ``sglang.Engine`` with prefixshare's radix-cache backend.

    Per-request settings travel as SGLang carries them (see :mod:`prefixshare.adapters.sglang`): the document id
    and prefix length in the request id, the tenant (and any request salt) as the request's ``cache_salt``.
    """

    kind = "sglang"

    def __init__(self, ps: PrefixShare, engine: Any) -> None:
        from prefixshare.adapters.sglang import BACKEND

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
            from prefixshare.adapters._runtime import engine_fingerprint
            from prefixshare.adapters.sglang._plugin import engine_settings, tokenizer_dir

            sa = self.server_args
            self._fp = engine_fingerprint(self.ps.policy, sa.model_path, engine_settings(sa),
                                          tokenizer_dir=tokenizer_dir(sa))
            _check_published(self.ps, self._fp)
        return self._fp

    def kv_bytes_per_token(self) -> int:
        return _kv_bytes_per_token(self.model_dir(), self.fingerprint())

    def prefill(self, requests: list[PrefillRequest]) -> list[PrefillResult]:
        from prefixshare.adapters._runtime import REQ_DOCUMENT, REQ_PREFIX_TOKENS, REQ_TENANT
        from prefixshare.adapters.sglang import request_kwargs

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


def _check_published(ps: PrefixShare, fp: Fingerprint) -> None:
    published = ps.stats().get("fingerprint")
    if published and published != fp.digest:
        get_logger(__name__).warning(
            "warm.fingerprint_mismatch", computed=fp.short, connector=str(published)[:12],
            message="the connector published another fingerprint than warm computed; verification "
                    "may report missing chunks")


def _kv_bytes_per_token(model_dir: str, fp: Fingerprint) -> int:
    from prefixshare.plan import kv_bytes_per_token, shape_from_config

    return kv_bytes_per_token(shape_from_config(Path(model_dir) / "config.json"), fp.engine.kv_dtype)


def engine_for(ps: PrefixShare, engine: Any = None) -> WarmEngine:
    """The :class:`WarmEngine` for ``engine`` (default: the engine attached last to ``ps``)."""
    if engine is None:
        if not ps.engines:
            raise PrefixShareError("no engine to warm with: attach one first (llm = ps.attach(...)) or pass it")
        engine = ps.engines[-1]
    if isinstance(engine, WarmEngine) and not type(engine).__module__.startswith(("vllm", "sglang")):
        return engine
    module = type(engine).__module__.split(".")[0]
    if module == "vllm":
        return VllmEngine(ps, engine)
    if module == "sglang":
        return SglangEngine(ps, engine)
    raise PrefixShareError(f"cannot warm with {type(engine).__name__}: pass the vllm.LLM or sglang.Engine returned "
                           "by ps.attach")
