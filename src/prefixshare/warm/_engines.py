"""Which :class:`~prefixshare.adapters.WarmEngine` warms with a given engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prefixshare.adapters import WarmEngine
from prefixshare.adapters.sglang import SglangEngine
from prefixshare.adapters.vllm import VllmEngine
from prefixshare.errors import PrefixShareError

if TYPE_CHECKING:  # pragma: no cover
    from prefixshare.share import PrefixShare


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
