"""Per-request prefixshare settings for SGLang, carried in the request id and the cache salt.

SGLang passes only a few request fields down to its scheduler, where the shared store is used: the
request id (``rid``, free-form, must be unique) and ``cache_salt`` (part of every cache key, in SGLang's
own radix tree as in the store). A tenant therefore becomes the cache salt — tenants are separated in
the replica's local cache too — and the document id / store limit travel in the request id.
"""

from __future__ import annotations

import uuid
from typing import Any
from urllib.parse import quote, unquote

from prefixshare.keys import LOAD_MODES, REQ_DOCUMENT, REQ_LOAD, REQ_PREFIX_TOKENS, REQ_STORE, REQ_TENANT, store_salt

_PREFIX = "ps|"


def request_kwargs(*, document_id: str | None = None, tenant: str | None = None, prefix_tokens: int | None = None,
                   store: bool | None = None, cache_salt: str | None = None,
                   load: str | None = None) -> dict[str, Any]:
    """Keyword arguments for ``sglang.Engine.generate`` (or fields of a ``/generate`` request body).

    ``load``: this request's load mode (``always``, ``never`` or ``auto``), else the policy's ``load.mode``.

    The request's ``cache_salt`` is the tenant's salt joined with ``cache_salt`` when both are given (the same
    store key a vLLM request with that tenant and salt gets)."""
    fields = []
    if document_id is not None:
        fields.append(f"doc={quote(document_id, safe='')}")
    if tenant is not None:
        fields.append(f"tenant={quote(tenant, safe='')}")
    if prefix_tokens is not None:
        fields.append(f"prefix={int(prefix_tokens)}")
    if store is False:
        fields.append("store=0")
    if load is not None:
        if load not in LOAD_MODES:
            raise ValueError(f"load={load!r}: use one of {', '.join(LOAD_MODES)}")
        fields.append(f"load={load}")
    out: dict[str, Any] = {"rid": _PREFIX + "|".join([*fields, uuid.uuid4().hex])}
    salt = store_salt(tenant, cache_salt)
    if salt:
        out["cache_salt"] = salt
    return out


def parse_rid(rid: str) -> dict[str, Any]:
    """The prefixshare settings a request id carries (empty for other ids)."""
    if not isinstance(rid, str) or not rid.startswith(_PREFIX):
        return {}
    params: dict[str, Any] = {}
    for part in rid[len(_PREFIX):].split("|"):
        key, sep, value = part.partition("=")
        if not sep:
            continue
        if key == "doc":
            params[REQ_DOCUMENT] = unquote(value)
        elif key == "tenant":
            params[REQ_TENANT] = unquote(value)
        elif key == "prefix" and value.isdigit():
            params[REQ_PREFIX_TOKENS] = int(value)
        elif key == "store" and value == "0":
            params[REQ_STORE] = False
        elif key == "load" and value in LOAD_MODES:
            params[REQ_LOAD] = value
    return params
