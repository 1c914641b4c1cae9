"""Pre-warm documents into the shared store, and build prompts that hit them.

::

    from prefixshare import PrefixShare
    from prefixshare.warm import Template, warm, prompt_for

    with PrefixShare("policy.yaml") as ps:
        llm = ps.attach({"model": "/models/m", "block_size": 128})
        template = Template.chat(system="Answer from the manual.")
        report = warm(ps, ["docs/"], llm, prefix=template)          # prefill once, verify, record
        p = prompt_for(ps, "manual.md", "How do I rotate keys?", prefix=template)
        llm.generate([p.engine_input()], vllm.SamplingParams(max_tokens=64,
                     extra_args={"kv_transfer_params": p.kv_transfer_params}))

SGLang alike: ``engine = ps.attach({"model_path": ...}, engine_type="sglang")``, ``warm(ps, docs, engine, ...)``,
then ``engine.generate(**p.sglang_kwargs(), sampling_params={...})``. Each engine warms its own replicas: their
KV layouts differ, so each engine's KV lives under its own fingerprint.

Layout: :mod:`._documents` (what to warm), :mod:`._template` (where documents sit in prompts),
:mod:`._chunks` (the store's chunk keys and files), :mod:`._registry` (which documents are warm),
:mod:`._engines` (the engine seam), :mod:`._warm` (warm and prompt_for).
"""

from __future__ import annotations

from prefixshare.warm._chunks import (
    ChunkFile,
    ChunkHasher,
    NamespaceIndex,
    chunk_file_name,
    parse_chunk_file,
    store_dirs,
    store_root,
)
from prefixshare.warm._documents import Document, DocumentError, resolve_documents
from prefixshare.warm._engines import PrefillRequest, PrefillResult, VllmEngine, WarmEngine, engine_for
from prefixshare.warm._registry import REGISTRY_DIR, DocumentRecord, Registry, RegistryError, safe_name
from prefixshare.warm._template import Template, TemplateError
from prefixshare.warm._warm import (
    DocumentResult,
    DocumentTooLongError,
    Prompt,
    WarmError,
    WarmProgress,
    WarmReport,
    expected_salt,
    prompt_for,
    warm,
)

__all__ = [
    "REGISTRY_DIR",
    "ChunkFile",
    "ChunkHasher",
    "Document",
    "DocumentError",
    "DocumentRecord",
    "DocumentResult",
    "DocumentTooLongError",
    "NamespaceIndex",
    "PrefillRequest",
    "PrefillResult",
    "Prompt",
    "Registry",
    "RegistryError",
    "Template",
    "TemplateError",
    "VllmEngine",
    "WarmEngine",
    "WarmError",
    "WarmProgress",
    "WarmReport",
    "chunk_file_name",
    "engine_for",
    "expected_salt",
    "parse_chunk_file",
    "prompt_for",
    "resolve_documents",
    "safe_name",
    "store_dirs",
    "store_root",
    "warm",
]
