"""prefixshare: share the KV cache of stable prefixes across vLLM and SGLang replicas.

The public API is small and explicit; everything is imported on first use, so ``import prefixshare``
is fast and needs none of torch, vLLM, SGLang or LMCache::

    from prefixshare import Policy
    policy = Policy.from_preset("single-node", chunk_size=256)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefixshare import _native
from prefixshare._lazy import lazy_exports
from prefixshare._version import __version__

# Every process that imports prefixshare (the MP server, each engine, the CLI) sees a package whose native
# library cannot load here (Mooncake's, without the RDMA verbs library) as not installed: see _native.
_native.install()

# public name -> module that defines it (imported lazily by __getattr__)
_EXPORTS: dict[str, str] = {
    "Policy": "prefixshare.policies",
    "PrefixShare": "prefixshare.share",
    "LMCacheServer": "prefixshare.server",
    "EngineSettings": "prefixshare.fingerprint",
    "Fingerprint": "prefixshare.fingerprint",
    "compute_fingerprint": "prefixshare.fingerprint",
    "diff": "prefixshare.fingerprint",
    "AdmissionRequest": "prefixshare.policies",
    "MinTokens": "prefixshare.policies",
    "Pinned": "prefixshare.policies",
    "Frequency": "prefixshare.policies",
    "TTL": "prefixshare.policies",
    "ByteBudget": "prefixshare.policies",
    "TenantAllow": "prefixshare.policies",
    "plan": "prefixshare.plan",
    "warm": "prefixshare.warm",
    "prompt_for": "prefixshare.warm",
    "Template": "prefixshare.warm",
    "PrefixShareError": "prefixshare.errors",
    "PolicyError": "prefixshare.errors",
    "IncompatibleError": "prefixshare.errors",
    "ServerError": "prefixshare.errors",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # pragma: no cover
    from prefixshare.errors import IncompatibleError, PolicyError, PrefixShareError, ServerError
    from prefixshare.fingerprint import EngineSettings, Fingerprint, compute_fingerprint, diff
    from prefixshare.plan import plan
    from prefixshare.warm import Template, prompt_for, warm
    from prefixshare.policies import TTL, AdmissionRequest, ByteBudget, Frequency, MinTokens, Pinned, TenantAllow
    from prefixshare.share import PrefixShare
    from prefixshare.policies import Policy
    from prefixshare.server import LMCacheServer


__getattr__ = lazy_exports(__name__, _EXPORTS, globals())


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
