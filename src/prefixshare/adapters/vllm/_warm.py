"""warm's view of a running ``vllm.LLM`` with prefixshare's connector (see :class:`~prefixshare.adapters._warm.WarmEngine`)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from prefixshare._log import get_logger
from prefixshare.adapters._warm import PrefillRequest, PrefillResult, check_published, kv_bytes_per_token
from prefixshare.adapters.vllm._settings import CONNECTOR, engine_settings, model_dirs
from prefixshare.errors import PrefixShareError
from prefixshare.keys import engine_fingerprint

if TYPE_CHECKING:  # pragma: no cover
    from prefixshare.fingerprint import Fingerprint
    from prefixshare.share import PrefixShare


class VllmEngine:
    """A running ``vllm.LLM`` with prefixshare's connector."""

    kind = "vllm"

    def __init__(self, ps: PrefixShare, llm: Any) -> None:
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
    def engine(self) -> Any:
        """The engine this wraps (as ``SglangEngine.engine``; ``PrefixShare.warm_engine`` keys its cache by it)."""
        return self.llm

    @property
    def tokenizer(self) -> Any:
        return self.llm.get_tokenizer()

    @property
    def max_model_len(self) -> int:
        return int(self.vllm_config.model_config.max_model_len)

    def model_dir(self) -> str:
        return model_dirs(self.vllm_config)[0]

    def fingerprint(self) -> Fingerprint:
        """The fingerprint the engine's connector namespaces the store with (computed the same way)."""
        if self._fp is None:
            model_dir, tok_dir = model_dirs(self.vllm_config)
            self._fp = engine_fingerprint(self.ps.policy, model_dir, engine_settings(self.vllm_config),
                                          tokenizer_dir=tok_dir)
            check_published(self.ps, self._fp)
        return self._fp

    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.model_dir(), self.fingerprint())

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
                                              logprobs=req.top_logprobs or None,
                                              extra_args={"kv_transfer_params": dict(req.kv_transfer_params)}))
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return [_result(out, req.top_logprobs) for out, req in zip(outputs, requests, strict=True)]

    def reset_prefix_cache(self) -> bool:
        return reset_vllm_prefix_cache(self.llm)


def _result(out: Any, top_logprobs: int) -> PrefillResult:
    cached = int(out.num_cached_tokens or 0)
    if not top_logprobs:
        return PrefillResult(cached)
    comp = out.outputs[0]
    first = int(comp.token_ids[0]) if comp.token_ids else None
    top = comp.logprobs[0] if comp.logprobs else {}
    return PrefillResult(cached, first, {int(t): float(lp.logprob) for t, lp in top.items()})


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
