"""Explain, field by field and in plain words, why two fingerprints differ."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, JsonValue

from prefixshare.errors import IncompatibleError
from prefixshare.fingerprint._canonical import abbrev, canonical_json
from prefixshare.fingerprint._types import Fingerprint


class Difference(BaseModel):
    """One differing field: dotted ``field`` path (``engine.kv_dtype``), both values, and a message."""

    model_config = ConfigDict(frozen=True)

    field: str
    a: JsonValue
    b: JsonValue
    message: str

    def __str__(self) -> str:
        return self.message


def diff(a: Fingerprint, b: Fingerprint) -> list[Difference]:
    """Every field in which ``a`` and ``b`` differ; empty iff the digests match.

    Differences come grouped (schema, tenant, engine, model, weights, tokenizer), fields in their
    declaration order within a group; ``Difference.a`` is the value in ``a``, ``.b`` the one in ``b``.

    Fields are compared as they enter :attr:`Fingerprint.digest` (see :meth:`Fingerprint.identity`),
    so ``diff(a, b) == []`` exactly when ``a.digest == b.digest``.
    """
    left, right = _flatten(a.identity()), _flatten(b.identity())
    out: list[Difference] = []
    paths = [*left, *(p for p in right if p not in left)]  # declaration order within each group
    for path in sorted(paths, key=_group_rank):
        va, vb = left.get(path), right.get(path)
        if canonical_json(va) == canonical_json(vb):  # exactly what the digest sees
            continue
        out.append(Difference(field=path, a=va, b=vb, message=_message(path, va, vb, a, b)))
    return out


def check_compatible(a: Fingerprint, b: Fingerprint) -> None:
    """Raise :class:`~prefixshare.errors.IncompatibleError` listing every difference, if any."""
    differences = diff(a, b)
    if differences:
        raise IncompatibleError(d.message for d in differences)


# -- internals -------------------------------------------------------------------------------------

_GROUP_ORDER = ("schema_version", "tenant", "engine", "model", "weights", "tokenizer")


def _group_rank(path: str) -> int:
    head = path.split(".", 1)[0]
    return _GROUP_ORDER.index(head) if head in _GROUP_ORDER else len(_GROUP_ORDER)


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts become dotted paths; lists and scalars are leaves."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and path not in _LEAF_DICTS:
            flat.update(_flatten(value, path + "."))
        else:
            flat[path] = value
    return flat


#: Dict-valued fields compared as one value (their keys are config details, not fingerprint fields).
_LEAF_DICTS = frozenset({"model.rope_scaling", "model.sliding_window"})


def _show(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _quoted(value: Any) -> str:
    return "unset" if value is None else repr(value)


def _files_message(a: Fingerprint, b: Fingerprint, *_: Any) -> str:
    fa = {f.path: f for f in a.weights.files}
    fb = {f.path: f for f in b.weights.files}
    parts: list[str] = []
    if only := sorted(fa.keys() - fb.keys()):
        parts.append("only in a: " + ", ".join(only))
    if only := sorted(fb.keys() - fa.keys()):
        parts.append("only in b: " + ", ".join(only))
    same_mode = a.weights.mode == b.weights.mode
    for path in sorted(fa.keys() & fb.keys()):
        x, y = fa[path], fb[path]
        if x.size != y.size:
            parts.append(f"{path} size {x.size} vs {y.size} bytes")
        elif same_mode and x.digest != y.digest:
            what = "content" if a.weights.mode == "content" else "header"
            parts.append(f"{path} {what} {abbrev(x.digest)} vs {abbrev(y.digest)}")
    return "weights differ: " + ("; ".join(parts) if parts else "file digests computed in different modes")


def _lora_message(a: Fingerprint, b: Fingerprint, *_: Any) -> str:
    la = {x.name: x.digest for x in a.engine.lora}
    lb = {x.name: x.digest for x in b.engine.lora}
    parts: list[str] = []
    if only := sorted(la.keys() - lb.keys()):
        parts.append("only in a: " + ", ".join(only))
    if only := sorted(lb.keys() - la.keys()):
        parts.append("only in b: " + ", ".join(only))
    for name in sorted(la.keys() & lb.keys()):
        if la[name] != lb[name]:
            parts.append(f"adapter {name!r} files {abbrev(la[name])} vs {abbrev(lb[name])}")
    return "engine LoRA adapters differ: " + "; ".join(parts)


_Formatter = Callable[[Fingerprint, Fingerprint, Any, Any], str]

_MESSAGES: dict[str, _Formatter] = {
    "schema_version": lambda a, b, x, y: (
        f"fingerprint schema version differs: {x} vs {y} (written by different prefixshare versions)"
    ),
    "tenant": lambda a, b, x, y: f"tenant differs: {_quoted(x)} vs {_quoted(y)}",
    "engine.kv_layout": lambda a, b, x, y: f"engine KV layout differs: {x} vs {y}",
    "engine.lora": _lora_message,
    "model.config_digest": lambda a, b, x, y: f"model config.json differs (config digest {abbrev(x)} vs {abbrev(y)})",
    "weights.mode": lambda a, b, x, y: (
        f"weights identity mode differs: {x} vs {y} (digests from different modes never match)"
    ),
    "weights.digest": lambda a, b, x, y: (
        f"weights differ ({a.weights.mode if a.weights.mode == b.weights.mode else 'weights'} digest "
        f"{abbrev(x)} vs {abbrev(y)})"
    ),
    "weights.files": _files_message,
    "weights.revision": lambda a, b, x, y: f"weights revision differs: {_show(x)} vs {_show(y)}",
    "tokenizer.digest": lambda a, b, x, y: f"tokenizer differs: tokenizer files digest {abbrev(x)} vs {abbrev(y)}",
    "tokenizer.files": lambda a, b, x, y: (
        f"tokenizer differs: files {', '.join(x or []) or 'none'} vs {', '.join(y or []) or 'none'}"
    ),
    "tokenizer.chat_template_digest": lambda a, b, x, y: (
        f"tokenizer differs: chat template digest {abbrev(x) if x else 'none'} vs {abbrev(y) if y else 'none'}"
    ),
}


def _message(path: str, x: Any, y: Any, a: Fingerprint, b: Fingerprint) -> str:
    if formatter := _MESSAGES.get(path):
        return formatter(a, b, x, y)
    group, _, name = path.partition(".")
    if group == "tokenizer" and name.endswith("_token"):
        return f"tokenizer differs: {name.removesuffix('_token')} token {_quoted(x)} vs {_quoted(y)}"
    if group == "model":
        return f"model config differs: {name} {_show(x)} vs {_show(y)}"
    return f"{path}: {_show(x)} vs {_show(y)}"
