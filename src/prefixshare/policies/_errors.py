"""Turn pydantic's validation errors into prefixshare's: a field path, the bad value and a fix."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

from prefixshare.errors import FieldProblem, PolicyError
from prefixshare.errors import _MISSING as MISSING


def format_loc(loc: Sequence[str | int]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "(policy)"


def _model_at(root: type[BaseModel], loc: Sequence[str | int], data: Any) -> type[BaseModel] | None:
    """The model class that owns the field at ``loc`` (walking lists and tiers), for 'did you mean'."""
    from prefixshare.tiers import tier_class

    model: type[BaseModel] | None = root
    node = data
    for part in loc[:-1]:
        if model is None:
            return None
        if isinstance(part, int):
            node = node[part] if isinstance(node, list) and part < len(node) else None
            if isinstance(node, dict) and isinstance(node.get("type"), str):
                try:
                    model = tier_class(node["type"])
                except KeyError:
                    return None
            continue
        field = model.model_fields.get(part)
        node = node.get(part) if isinstance(node, dict) else None
        if field is None:
            return None
        ann = field.annotation
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
        if part == "l2":
            model = model or root  # placeholder until the list index resolves the tier
    return model


def _fix_for(err: dict[str, Any], root: type[BaseModel], data: Any) -> str:
    kind = err["type"]
    loc = err["loc"]
    ctx = err.get("ctx") or {}
    if kind == "prefixshare":
        return str(ctx.get("fix", ""))
    if kind == "missing":
        return f"add '{loc[-1]}' (it is required)"
    if kind == "extra_forbidden":
        owner = _model_at(root, loc, data)
        known = sorted(owner.model_fields) if owner is not None else []
        close = difflib.get_close_matches(str(loc[-1]), known, n=1)
        if close:
            return f"did you mean '{close[0]}'? known fields: {', '.join(known)}"
        return f"remove it; known fields: {', '.join(known)}" if known else "remove it"
    if kind == "literal_error":
        return f"use one of {ctx.get('expected', '')}"
    bounds = {"greater_than": ("gt", "greater than"), "greater_than_equal": ("ge", "at least"),
              "less_than": ("lt", "less than"), "less_than_equal": ("le", "at most")}
    if kind in bounds:
        key, words = bounds[kind]
        return f"use a value {words} {ctx.get(key)}"
    if kind.endswith("_parsing") or kind.endswith("_type"):
        return f"write a value of the right type ({kind.split('_')[0]})"
    return ""


def _clean_message(err: dict[str, Any]) -> str:
    if err["type"] == "prefixshare":
        return str((err.get("ctx") or {}).get("message", err["msg"]))
    if err["type"] == "extra_forbidden":
        return "is not a known field"
    msg = str(err["msg"]).replace("Input should", "should").replace("Value error, ", "")
    return msg[0].lower() + msg[1:] if msg else msg


def prefixed(problems: list[FieldProblem], prefix: str) -> list[FieldProblem]:
    return [FieldProblem(f"{prefix}.{p.loc}" if p.loc != "(policy)" else prefix, p.value, p.message, p.fix) for p in problems]


def problems_from(exc: ValidationError, root: type[BaseModel], data: Any) -> list[FieldProblem]:
    problems: list[FieldProblem] = []
    for err in exc.errors(include_url=False):
        loc = tuple(err["loc"])
        if err["type"] == "prefixshare_nested":
            problems.extend(err["ctx"]["problems"])
            continue
        value = err.get("input", MISSING)
        if err["type"] in {"missing"} or isinstance(value, dict):
            value = MISSING
        problems.append(FieldProblem(format_loc(loc), value, _clean_message(err), _fix_for(err, root, data)))
    return problems


def to_policy_error(exc: ValidationError, root: type[BaseModel], data: Any, source: str | None) -> PolicyError:
    return PolicyError(problems_from(exc, root, data), source=source)
