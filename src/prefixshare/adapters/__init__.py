"""Engine adapters: one folder per engine, each wiring a Policy into that engine through LMCache's MP server.

* :mod:`prefixshare.adapters.vllm` — engine kwargs, ``vllm serve`` flags, ``attach``, and the connector vLLM
  loads by module path (scheduler side and worker side as named parts);
* :mod:`prefixshare.adapters.sglang` — the same for SGLang, with its radix-cache backend;
* :class:`WarmEngine` — what warming needs from an engine; each adapter implements it.

Each engine's uses of its own and LMCache's internals live in that engine's ``_compat`` module. Nothing here
imports an engine at module import time. The facade that uses these, :class:`prefixshare.PrefixShare`, lives in
:mod:`prefixshare.share`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefixshare._lazy import lazy_exports

# imported on first use: the engine-neutral stored-format module (`_format`) needs nothing but LMCache
_EXPORTS = {name: "prefixshare.adapters._warm" for name in ("PrefillRequest", "PrefillResult", "WarmEngine")}
__getattr__ = lazy_exports(__name__, _EXPORTS, globals())

if TYPE_CHECKING:  # pragma: no cover
    from prefixshare.adapters._warm import PrefillRequest, PrefillResult, WarmEngine

__all__ = ["PrefillRequest", "PrefillResult", "WarmEngine"]
