"""Whether the node's LMCache MP server holds a prefix's chunks, asked of the server itself: works on every tier.

warm asks the server, not a tier: ``POST /cache/prefetches`` (LMCache's *warm prefetch*, on the server's HTTP
port) takes token ids and resolves them to object keys exactly as an engine's lookup does: the server's own
chunk hashing (chunk size, hash algorithm), every KV rank of the world size the engine registered, every
object group, the request's cache salt; it looks them up in the server's memory (L1) and in every L2 tier,
and ``GET /cache/prefetches/{id}`` answers how many it holds. fs, resp, valkey, s3, mooncake_store,
nixl_store alike: each tier answers through its own adapter's lookup.

The keys are the engine's: the model name is the fingerprint namespace the connector stores under, the world
size is read from the server's ``/status`` (the registrations of the engines attached to it, under that
namespace), the salt is the store salt warm prefilled with.

**Side effects.** LMCache's MP server has no read-only existence check (its listing, ``GET /cache/objects``,
is implemented by the S3 adapter only), so this is a load: a chunk an L2 tier holds but the server's memory
does not is read into L1, where it stays (retained and unpinned: no lock and no session to release, evicted
as usual). Nothing is written to a tier. The engines' own request, ``LOOKUP`` on the ZMQ port, does the same
load, and also read-locks the chunks for a retrieve and opens a session, which warm would have to release
(``FREE_LOOKUP_LOCKS``, ``END_SESSION``); it also counts only the hit prefix, not every object.

**What a yes means.** The server answers for its memory and its tiers together: a chunk still in L1 counts
even if its L2 write failed, and replicas on other nodes read only the L2 tiers. A directory (fs) tier is
therefore checked on its directory instead (see :func:`prefixshare.warm._warm._wait_for_chunks`); the
server's answer is what other tiers get. A prefix whose KV is larger than the server's L1 cannot be held
there at once; it is reported unverified, not missing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import httpx

PREFETCHES = "/cache/prefetches"
#: how long one HTTP call may take at most (the overall deadline bounds it too)
CALL_TIMEOUT_S = 10.0
#: polls of one lookup job: the first after this many seconds, each 1.5x the last, at most POLL_MAX_S
POLL_FIRST_S = 0.002
POLL_MAX_S = 0.1


class LookupUnavailable(Exception):  # noqa: N818 - a condition, not a failure of the check
    """The server cannot answer (no such request, not reachable, no engine of this namespace registered...).

    ``str(exc)`` says why, in words for the report."""


@dataclass(frozen=True)
class Held:
    """The server's answer for one prefix: ``found`` of ``total`` object keys (chunks x ranks x groups)."""

    found: int
    total: int
    #: complete chunks the server hashed the prefix into
    chunks: int

    @property
    def complete(self) -> bool:
        return self.total > 0 and self.found >= self.total


def registered_world_sizes(status: dict[str, Any], model_name: str) -> set[int]:
    """World sizes the engines registered with the server under ``model_name`` (``/status``: CPU engines under
    ``non_cuda_context_meta``, CUDA ones under ``cache_context_meta``)."""
    sizes: set[int] = set()
    for section in ("non_cuda_context_meta", "cache_context_meta"):
        metas = status.get(section)
        if not isinstance(metas, dict):
            continue
        for meta in metas.values():
            if isinstance(meta, dict) and meta.get("model_name") == model_name:
                size = meta.get("world_size")
                if isinstance(size, int) and size > 0:
                    sizes.add(size)
    return sizes


def l1_capacity(status: dict[str, Any]) -> int | None:
    """Bytes of the server's memory tier (L1), from ``/status``; None when it does not say."""
    sm = status.get("storage_manager")
    caps = sm.get("l1_capacity_bytes_by_backend") if isinstance(sm, dict) else None
    if not isinstance(caps, dict) or not caps:
        return None
    total = sum(v for v in caps.values() if isinstance(v, int))
    return total or None


def http_client(url: str, timeout_s: float, transport: httpx.BaseTransport | None = None) -> httpx.Client:
    """A client for the server's HTTP port. A plain ``http://`` URL gets no TLS context: building one (the CA
    bundle) costs 25-40 ms, on every warm() call."""
    return httpx.Client(timeout=timeout_s, transport=transport, verify=not url.startswith("http://"))


def _detail(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:300]
    if isinstance(body, dict) and "detail" in body:
        return str(body["detail"])[:300]
    return str(body)[:300]


class ServerLookup:
    """Asks one MP server (its HTTP endpoint) whether it holds prefixes of one namespace."""

    def __init__(self, http_url: str, model_name: str, world_size: int, l1_bytes: int | None,
                 client: httpx.Client) -> None:
        self.http_url = http_url.rstrip("/")
        self.model_name = model_name
        self.world_size = world_size
        self.l1_bytes = l1_bytes
        self._client = client

    @classmethod
    def open(cls, http_url: str, model_name: str, *, timeout_s: float = CALL_TIMEOUT_S,
             transport: httpx.BaseTransport | None = None) -> ServerLookup:
        """Read the server's ``/status`` for the world size of ``model_name``'s registration.

        Raises :class:`LookupUnavailable` when the server does not answer, or no engine (or engines of
        several world sizes) registered under ``model_name``."""
        url = http_url.rstrip("/")
        client = http_client(url, min(timeout_s, CALL_TIMEOUT_S), transport)
        try:
            response = client.get(url + "/status")
        except httpx.HTTPError as exc:
            client.close()
            raise LookupUnavailable(f"the server at {url} does not answer ({type(exc).__name__}: {exc})") from exc
        if response.status_code != 200:
            client.close()
            raise LookupUnavailable(f"the server at {url} answers /status with HTTP {response.status_code}: "
                                    f"{_detail(response)}")
        try:
            status = response.json()
        except ValueError as exc:
            client.close()
            raise LookupUnavailable(f"the server at {url} answers /status with no JSON") from exc
        sizes = registered_world_sizes(status if isinstance(status, dict) else {}, model_name)
        if not sizes:
            client.close()
            raise LookupUnavailable(f"no engine is registered with the server at {url} under the namespace "
                                    f"{model_name} (its /status lists none), so it cannot resolve the keys")
        if len(sizes) > 1:
            client.close()
            raise LookupUnavailable(f"engines of several world sizes ({sorted(sizes)}) are registered under "
                                    f"{model_name}; which one stored the prefix is unknown")
        return cls(url, model_name, sizes.pop(), l1_capacity(status if isinstance(status, dict) else {}), client)

    def close(self) -> None:
        self._client.close()

    def held(self, token_ids: list[int], salt: str, deadline: float) -> Held:
        """How many of the prefix's object keys the server holds (L1 or an L2 tier); loads those only an L2
        tier holds into L1 (see the module docstring). Raises :class:`LookupUnavailable`."""
        body = {"model_name": self.model_name, "world_size": self.world_size, "token_ids": list(token_ids),
                "cache_salt": salt}
        response = self._call("post", PREFETCHES, deadline, json=body)
        if response.status_code in (404, 405):
            raise LookupUnavailable(f"this LMCache server has no token lookup (POST {PREFETCHES} answers HTTP "
                                    f"{response.status_code}); LMCache 0.5.6 has it")
        if response.status_code != 202:
            raise LookupUnavailable(f"the server refuses the lookup (POST {PREFETCHES}: HTTP "
                                    f"{response.status_code}: {_detail(response)})")
        submitted = response.json()
        if submitted.get("status") == "noop" or "request_id" not in submitted:
            return Held(0, 0, int(submitted.get("chunks") or 0))
        chunks = int(submitted.get("chunks") or 0)
        path = f"{PREFETCHES}/{submitted['request_id']}"
        delay = POLL_FIRST_S
        while True:
            response = self._call("get", path, deadline)
            if response.status_code != 200:
                raise LookupUnavailable(f"the server lost the lookup (GET {path}: HTTP {response.status_code}: "
                                        f"{_detail(response)})")
            status = response.json()
            if status.get("status") == "completed":
                return Held(int(status.get("found_keys") or 0), int(status.get("total_keys") or 0), chunks)
            left = deadline - time.monotonic()
            if left <= 0:
                raise LookupUnavailable("the server's lookup did not finish before the verify timeout")
            time.sleep(min(delay, left))
            delay = min(delay * 1.5, POLL_MAX_S)

    def _call(self, method: str, path: str, deadline: float, **kwargs: Any) -> httpx.Response:
        timeout = min(max(deadline - time.monotonic(), 0.5), CALL_TIMEOUT_S)
        try:
            return self._client.request(method.upper(), self.http_url + path, timeout=timeout, **kwargs)
        except httpx.HTTPError as exc:
            raise LookupUnavailable(f"the server at {self.http_url} does not answer {method.upper()} {path} "
                                    f"({type(exc).__name__}: {exc})") from exc
