"""Compatibility fingerprints: namespace every cached KV byte by what produced it.

A :class:`Fingerprint` captures everything that decides whether KV written by one engine replica can
be loaded by another: the model shape (``config.json``), the weights (content digest, or the weaker
safetensors-headers digest), the tokenizer and chat template, the engine's KV layout, dtype, block
and chunk sizes, parallelism and LoRA adapters, and the tenant. Its :attr:`Fingerprint.digest` is
stable across processes and hosts; :func:`diff` explains a mismatch field by field, and manifests
written beside the store (:func:`write_manifest`) let any replica explain why it cannot read what
another one wrote (:func:`explain`).

Importing this package is cheap: it never imports torch, transformers, lmcache or an engine.
"""

from __future__ import annotations

from prefixshare.fingerprint._compute import TOKENIZER_FILES, WEIGHT_SUFFIXES, compute_fingerprint, lora_digest
from prefixshare.fingerprint._diff import Difference, check_compatible, diff
from prefixshare.fingerprint._digests import CACHE_ENV, DigestCache, default_cache_dir
from prefixshare.fingerprint._manifest import (
    MANIFEST_DIR,
    CorruptManifest,
    Manifest,
    ManifestList,
    explain,
    load_manifest,
    read_manifests,
    write_manifest,
)
from prefixshare.fingerprint._settings import EngineSettings
from prefixshare.fingerprint._types import (
    SCHEMA_VERSION,
    EngineInfo,
    Fingerprint,
    LoraInfo,
    ModelInfo,
    TokenizerInfo,
    WeightFile,
    WeightsInfo,
    WeightsMode,
)

__all__ = [
    "CACHE_ENV",
    "MANIFEST_DIR",
    "SCHEMA_VERSION",
    "TOKENIZER_FILES",
    "WEIGHT_SUFFIXES",
    "CorruptManifest",
    "Difference",
    "DigestCache",
    "EngineInfo",
    "EngineSettings",
    "Fingerprint",
    "LoraInfo",
    "Manifest",
    "ManifestList",
    "ModelInfo",
    "TokenizerInfo",
    "WeightFile",
    "WeightsInfo",
    "WeightsMode",
    "check_compatible",
    "compute_fingerprint",
    "default_cache_dir",
    "diff",
    "explain",
    "load_manifest",
    "lora_digest",
    "read_manifests",
    "write_manifest",
]
