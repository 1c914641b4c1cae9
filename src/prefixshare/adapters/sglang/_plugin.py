"""prefixshare inside SGLang's scheduler: a radix-cache backend named ``prefixshare``.

SGLang loads this module through its ``sglang.srt.plugins`` entry point in every process it starts; the
scheduler then builds the tree cache with ``--radix-cache-backend prefixshare``. The backend is SGLang's
LMCache MP tree cache plus what prefixshare enforces (see :mod:`prefixshare.runtime`):

* **namespace** — the model name the MP server sees is ``prefixshare-<fingerprint>``;
* **admission** — the policy's rules decide whether a request's KV is stored;
* **bounded loads** — a store lookup that outlives the policy's load timeout is abandoned (recompute);
* **stats** — counters and structured events for :meth:`PrefixShare.stats`;
* **cost-aware loading** (``load.mode: auto``) — a prefix is looked up and loaded only when that is predicted
  faster than computing it (:mod:`prefixshare.runtime._cost`); the prefill rate comes from the time between
  a request becoming ready (lookup answered) and SGLang checkpointing its computed prefix.

The backend itself is :class:`~prefixshare.adapters.sglang._backend.PrefixShareRadixCache` (it imports SGLang,
so it is imported only when SGLang builds the tree cache); this module is the entry point SGLang loads.

Its settings come from the environment the engine was started with (``PREFIXSHARE_SGLANG``: JSON with the
policy and the instance name), which SGLang's processes inherit.
"""

from __future__ import annotations

from typing import Any

from prefixshare.adapters.sglang._settings import BACKEND, ENV_CONFIG

__all__ = ["BACKEND", "ENV_CONFIG", "build_tree_cache", "register"]


def register() -> None:
    """SGLang plugin entry point: make the ``prefixshare`` radix-cache backend available (cheap, idempotent)."""
    from sglang.srt.mem_cache.registry import register_radix_cache_backend, registered_radix_cache_backends

    if BACKEND not in registered_radix_cache_backends():
        register_radix_cache_backend(BACKEND, build_tree_cache)


def build_tree_cache(ctx: Any) -> Any:
    """Radix-cache factory (SGLang's registry calls it in the scheduler process)."""
    from prefixshare.adapters.sglang._backend import build_tree_cache as build

    return build(ctx)
