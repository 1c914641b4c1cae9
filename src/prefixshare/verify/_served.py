"""A ``vllm serve`` replica as verification replays it: its OpenAI-compatible HTTP API.

Replays go to ``POST /v1/completions`` with the prompt's token ids, one generated token, the first token's
log-probabilities (as token ids: ``return_tokens_as_token_ids``), the replay's ``cache_salt`` and
``kv_transfer_params`` (the verify token, the load mode, and LMCache's ``cached_token_stats``, which says how
many prompt tokens the replica did not compute). After a mismatch the replica's own prefix cache is emptied
through ``POST /reset_prefix_cache``, a route ``vllm serve`` has only with ``VLLM_SERVER_DEV_MODE=1``; without
it the report says so (the quarantined chunks are gone from the store either way; the replica's copy of the
bad blocks then lives until its prefix cache evicts them or it restarts).
"""

from __future__ import annotations

from typing import Any

import httpx

from prefixshare.adapters import PrefillRequest, PrefillResult
from prefixshare.errors import PrefixShareError

_TOKEN_PREFIX = "token_id:"


class ServedReplica:
    """A running ``vllm serve`` replica with prefixshare's connector, reached at ``url``."""

    kind = "vllm"

    def __init__(self, url: str, *, api_key: str | None = None, timeout_s: float = 300.0,
                 model: str | None = None, transport: httpx.BaseTransport | None = None) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(timeout=timeout_s, headers=headers, transport=transport)
        self.model = model or self._served_model()

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> ServedReplica:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _served_model(self) -> str:
        try:
            response = self.client.get(self.url + "/v1/models", timeout=10.0)
            response.raise_for_status()
            return str(response.json()["data"][0]["id"])
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            raise PrefixShareError(f"the replica at {self.url} does not list its model (GET /v1/models: {exc}); "
                                   "give the URL of a running vllm serve (e.g. http://127.0.0.1:8000)") from None

    def prefill(self, requests: list[PrefillRequest]) -> list[PrefillResult]:
        return [self._one(req) for req in requests]

    def _one(self, req: PrefillRequest) -> PrefillResult:
        body: dict[str, Any] = {
            "model": self.model, "prompt": list(req.token_ids), "max_tokens": 1, "temperature": 0.0,
            "logprobs": req.top_logprobs or None, "return_tokens_as_token_ids": True,
            "kv_transfer_params": {**req.kv_transfer_params, "cached_token_stats": True},
        }
        if req.cache_salt:
            body["cache_salt"] = req.cache_salt
        try:
            response = self.client.post(self.url + "/v1/completions", json=body)
        except httpx.HTTPError as exc:
            raise PrefixShareError(f"the replica at {self.url} did not answer a replay ({exc})") from None
        if response.status_code != 200:
            raise PrefixShareError(f"the replica at {self.url} refused a replay: HTTP {response.status_code}: "
                                   f"{response.text[:300]}")
        return parse_completion(response.json())

    def reset_prefix_cache(self) -> bool:
        """Empty the replica's prefix cache; False when it cannot be (no dev routes, or blocks in use)."""
        try:
            response = self.client.post(self.url + "/reset_prefix_cache", timeout=30.0)
        except httpx.HTTPError:
            return False
        if response.status_code != 200:
            return False
        try:
            return bool(response.json().get("success", True))
        except ValueError:
            return True  # older releases answer an empty 200


def _token_id(text: Any) -> int:
    if not isinstance(text, str) or not text.startswith(_TOKEN_PREFIX):
        raise PrefixShareError(f"the replica returned token {text!r}, not a token id: is it vllm serve?")
    return int(text[len(_TOKEN_PREFIX):])


def parse_completion(data: dict[str, Any]) -> PrefillResult:
    """A completion's prompt tokens not computed, first token and its log-probabilities."""
    choice = (data.get("choices") or [{}])[0]
    logprobs = choice.get("logprobs") or {}
    tokens = logprobs.get("tokens") or []
    top = (logprobs.get("top_logprobs") or [None])[0] or {}
    first = _token_id(tokens[0]) if tokens else None
    stats = (data.get("kv_transfer_params") or {}).get("cached_token_stats")
    if isinstance(stats, dict):
        cached = int(stats.get("num_vllm_cached_tokens") or 0) + int(stats.get("num_lmcache_extra_cached_tokens") or 0)
    else:
        details = (data.get("usage") or {}).get("prompt_tokens_details") or {}
        if "cached_tokens" not in details:
            raise PrefixShareError("the replica reports neither LMCache's cached_token_stats nor cached prompt tokens: "
                                   "is prefixshare's connector attached (prefixshare vllm-args)?")
        cached = int(details.get("cached_tokens") or 0)
    return PrefillResult(cached, first, {_token_id(t): float(lp) for t, lp in top.items()} if top else None)
