"""The engine KV-layout label: how the bytes of one object LMCache stores are ordered, not which engine wrote it.

LMCache's multiprocess server stores one object per chunk, copied out of the engine's paged KV cache. Its
element order depends on the format LMCache detects in the engine's KV tensors, and on nothing else (the
block layout of a backend -- vLLM's NHD on CUDA, HND on CPU -- is normalised away by LMCache's copy):

=================  =====================================================  =========================================
order              the object's elements                                 engine KV formats (LMCache's names)
=================  =====================================================  =========================================
``L,T,H,KV,D``     per layer, per token, per head: K's D values, then V's  fused K|V per head: vLLM >= 0.32
                                                                           (``NL_X_NB_BS_NH_CS``, ``NL_X_NB_NH_BS_CS``)
``KV,L,T,H,D``     every layer's K, then every layer's V                  split K/V: SGLang's K and V buffers
                                                                           (``NL_X_NB_BS_NH_HS`` with 2L tensors),
                                                                           vLLM's 5-D layouts (``NL_X_TWO_NB_...``)
``L,T,C``          one latent vector per layer and token                  MLA
=================  =====================================================  =========================================

The label is ``lmcache-<major.minor>/<device>/<order>``. Two engines share KV exactly when their labels are
equal (the fingerprint leaves the engine's name out when a label is declared), so an SGLang replica and a vLLM
replica with a split-K/V layout share, and vLLM 0.32 (fused) and SGLang do not: their bytes differ.
``tests/test_format.py`` proves each row with LMCache's own copy routine on synthetic KV on CPU, and
``tests/gpu/`` on CUDA. The device stays in the label because objects copied on different devices have not
been proven identical.

The namespace must be known before any KV exists (the scheduler never sees the KV tensors), so each adapter
derives the order from the engine's configuration (:func:`expected_order`) and checks it against the format
LMCache detects when the worker registers its KV (:func:`verify_registered`): a difference stops the engine
with both formats named, rather than storing bytes under a label that does not describe them.
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib import metadata
from typing import Any

from prefixshare.errors import FingerprintError

FUSED = "L,T,H,KV,D"
SPLIT = "KV,L,T,H,D"
LATENT = "L,T,C"
ORDERS = (FUSED, SPLIT, LATENT)


def lmcache_series() -> str:
    """``lmcache-<major.minor>`` of the installed LMCache (its copy routines define the stored format)."""
    try:
        version = metadata.version("lmcache")
    except metadata.PackageNotFoundError:
        return "lmcache"
    return "lmcache-" + ".".join(version.split(".")[:2])


def layout_label(device: str, order: str) -> str:
    """The engine KV-layout label of objects in ``order`` copied from a ``device`` KV cache."""
    if order not in ORDERS:
        raise ValueError(f"unknown stored-object order {order!r}; one of {', '.join(ORDERS)}")
    return f"{lmcache_series()}/{device}/{order}"


def label_order(label: str) -> str | None:
    """The order a label declares (``None`` for labels of another form)."""
    order = label.rsplit("/", 1)[-1]
    return order if order in ORDERS else None


def expected_order(*, mla: bool, fused: bool) -> str:
    """The order of objects copied from MLA latent KV, K|V fused per head, or split K and V -- whether those
    facts come from an engine's configuration or from the ``KVFormatSpec`` LMCache detects.

    Split formats all give ``KV,L,T,H,D``: a ``[2, L, T, H*D]`` object for two planes per layer, a
    ``[2L, T, H*D]`` one for SGLang's K buffers followed by its V buffers -- the same bytes."""
    if mla:
        return LATENT
    return FUSED if fused else SPLIT


def registered_order(kv_caches: Mapping[str, Any], layout_hints: Mapping[str, Any] | None, engine: str) -> tuple[str, str]:
    """(order, LMCache's format name) of the KV tensors a worker registers, as LMCache's copy routines see them."""
    from lmcache.utils import EngineType
    from lmcache.v1.gpu_connector.kv_format.specs.registry import get_spec_class
    from lmcache.v1.multiprocess.transfer_context.base import compute_kv_layout

    engine_type = EngineType.SGLANG if engine == "sglang" else EngineType.VLLM
    fmt = compute_kv_layout(dict(kv_caches), dict(layout_hints or {}), engine_type)[4]
    spec = get_spec_class(fmt)
    return expected_order(mla=bool(spec.is_mla), fused=bool(spec.is_fused_packed)), str(getattr(fmt, "name", fmt))


def check_registered(label: str, kv_caches: Mapping[str, Any], layout_hints: Mapping[str, Any] | None,
                     engine: str) -> str:
    """Raise :class:`~prefixshare.errors.FingerprintError` when the registered KV's order is not the label's.

    Returns the order found. Labels without a declared order (``"unknown"``, user-set ones) are not checked."""
    declared = label_order(label)
    found, fmt = registered_order(kv_caches, layout_hints, engine)
    if declared is not None and found != declared:
        raise FingerprintError(
            f"the KV this {engine} worker registers is {fmt} (stored objects ordered {found}), but its "
            f"namespace was derived for {declared} ({label}); storing under that label would mix formats. "
            "This is a prefixshare bug: please report it with the engine version and attention backend")
    return found


def verify_registered(runtime: Any, kv_caches: Mapping[str, Any], layout_hints: Mapping[str, Any] | None,
                      engine: str) -> str:
    """:func:`check_registered` for a connector's runtime (its fingerprint's label), logged as
    ``engine.kv_format``; returns the order found."""
    label = runtime.fingerprint.engine.kv_layout
    order = check_registered(label, kv_caches, layout_hints, engine)
    runtime.log.info("engine.kv_format", layout=label, order=order, tensors=len(kv_caches))
    return order
