"""L2 tiers: where KV bytes rest behind the MP server's CPU L1.

Tiers are resolved by name through a registry of ``"module:Class"`` strings, imported on first use
(fsspec's registry style), so a policy naming ``valkey`` does not import anything of S3's, and a third
party can add a tier with :func:`register_tier`. :func:`require_client` checks a tier's optional client
library and raises an error that names the pip extra to install.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util

from prefixshare._native import native_problem
from prefixshare.errors import MissingExtraError, NativeLibraryError
from prefixshare.tiers._base import EvictionSettings, LegacyRemote, TierConfig, problem

_REGISTRY: dict[str, str] = {
    "fs": "prefixshare.tiers._fs:FsTier",
    "resp": "prefixshare.tiers._kv_servers:RespTier",
    "valkey": "prefixshare.tiers._kv_servers:ValkeyTier",
    "s3": "prefixshare.tiers._remote:S3Tier",
    "mooncake_store": "prefixshare.tiers._remote:MooncakeStoreTier",
    "nixl_store": "prefixshare.tiers._remote:NixlStoreTier",
}
_LOADED: dict[str, type[TierConfig]] = {}


def register_tier(name: str, target: str | type[TierConfig], *, replace: bool = False) -> None:
    """Register a tier config class (or a lazy ``"module:Class"`` path) under ``name``."""
    if name in _REGISTRY and not replace:
        raise ValueError(f"tier {name!r} is already registered (pass replace=True to override)")
    if isinstance(target, str):
        _REGISTRY[name] = target
        _LOADED.pop(name, None)
    else:
        _REGISTRY[name] = f"{target.__module__}:{target.__qualname__}"
        _LOADED[name] = target


def known_tiers() -> list[str]:
    return sorted(_REGISTRY)


def tier_class(name: str) -> type[TierConfig]:
    """The config class registered under ``name``; KeyError with the known names (and a guess)."""
    if name in _LOADED:
        return _LOADED[name]
    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, _REGISTRY, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise KeyError(f"unknown tier type {name!r}{hint} known: {', '.join(known_tiers())}")
    module_name, _, attr = _REGISTRY[name].partition(":")
    cls = getattr(importlib.import_module(module_name), attr)
    _LOADED[name] = cls
    return cls


def require_client(tier: TierConfig) -> None:
    """Raise MissingExtraError if the tier's optional client library is not installed, NativeLibraryError if it
    is but cannot load its native library on this host (Mooncake's without the RDMA verbs library)."""
    module = tier.requires_module
    if module is None:
        return
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        raise MissingExtraError(f"the {tier.type!r} tier", module, tier.requires_extra or tier.type)
    reason = native_problem(module)
    if reason is not None:
        raise NativeLibraryError(f"the {tier.type!r} tier cannot be used on this host: {reason}")


from prefixshare.tiers._base import read_secret

__all__ = [
    "EvictionSettings",
    "LegacyRemote",
    "TierConfig",
    "known_tiers",
    "problem",
    "read_secret",
    "register_tier",
    "require_client",
    "tier_class",
]
