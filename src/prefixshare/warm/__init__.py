"""Pre-warm documents into the shared store, and build prompts that hit them.

::

    from prefixshare import PrefixShare
    from prefixshare.warm import Template, warm, prompt_for

    with PrefixShare("policy.yaml") as ps:
        llm = ps.attach({"model": "/models/m", "block_size": 128})
        template = Template.chat(system="Answer from the manual.")
        report = warm(ps, ["docs/"], llm, prefix=template)          # prefill once, verify, record
        p = prompt_for(ps, "manual.md", "How do I rotate keys?", prefix=template, sources=["docs/"])
        llm.generate([p.engine_input()], vllm.SamplingParams(max_tokens=64,
                     extra_args={"kv_transfer_params": p.kv_transfer_params}))

SGLang alike: ``engine = ps.attach({"model_path": ...}, engine_type="sglang")``, ``warm(ps, docs, engine, ...)``,
then ``engine.generate(**p.sglang_kwargs(), sampling_params={...})``. Each engine warms its own replicas: their
KV layouts differ, so each engine's KV lives under its own fingerprint.

Layout: :mod:`._documents` (what to warm), :mod:`._template` (where documents sit in prompts),
:mod:`._chunks` (which chunk files a directory tier holds; the keys themselves are :mod:`prefixshare.keys`'),
:mod:`._lookup` (which chunks the node's MP server holds, on any tier), :mod:`._room` (how much of the server's
memory is free: warm paces its engine calls to it),
:mod:`._registry` (which documents are warm), :mod:`._engines` (which engine adapter's
:class:`~prefixshare.adapters.WarmEngine` to use), :mod:`._warm` (warm and prompt_for).
"""

from __future__ import annotations

from prefixshare.adapters import PrefillRequest, PrefillResult, WarmEngine
from prefixshare.adapters.vllm import VllmEngine
from prefixshare.keys import ChunkFile, ChunkHasher, chunk_file_name, parse_chunk_file
from prefixshare.warm._chunks import NamespaceIndex
from prefixshare.warm._documents import Document, DocumentError, resolve_documents
from prefixshare.warm._engines import engine_for
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

from prefixshare.warm._settings import ENGINE_ENV, QUIET_ENV, apply_engine_env, sglang_engine_kwargs, vllm_engine_kwargs
from prefixshare.warm._template import as_template, prefix_ids, question_ids

__all__ = [
    "ChunkFile",
    "ChunkHasher",
    "Document",
    "DocumentError",
    "DocumentRecord",
    "DocumentResult",
    "DocumentTooLongError",
    "ENGINE_ENV",
    "NamespaceIndex",
    "PrefillRequest",
    "PrefillResult",
    "Prompt",
    "QUIET_ENV",
    "REGISTRY_DIR",
    "Registry",
    "RegistryError",
    "Template",
    "TemplateError",
    "VllmEngine",
    "WarmEngine",
    "WarmError",
    "WarmProgress",
    "WarmReport",
    "apply_engine_env",
    "as_template",
    "chunk_file_name",
    "engine_for",
    "expected_salt",
    "parse_chunk_file",
    "prefix_ids",
    "prompt_for",
    "question_ids",
    "resolve_documents",
    "safe_name",
    "sglang_engine_kwargs",
    "vllm_engine_kwargs",
    "warm",
]
