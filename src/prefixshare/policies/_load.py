"""Read policy YAML and shipped presets into plain mappings (``preset: NAME`` + overrides resolved).

Validation into a :class:`~prefixshare.policies.Policy` is the model's (``policy_from_mapping``)."""

from __future__ import annotations

import copy
import difflib
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from prefixshare.errors import FieldProblem, PolicyError

PRESET_PACKAGE = "prefixshare.policies.presets"


def list_presets() -> list[str]:
    root = resources.files(PRESET_PACKAGE)
    return sorted(p.name.removesuffix(".yaml") for p in root.iterdir() if p.name.endswith(".yaml"))


def preset_text(name: str) -> str:
    names = list_presets()
    if name not in names:
        close = difflib.get_close_matches(name, names, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise PolicyError([FieldProblem("preset", name, "is not a shipped preset", f"{hint}known: {', '.join(names)}")])
    return (resources.files(PRESET_PACKAGE) / f"{name}.yaml").read_text(encoding="utf-8")


#: fields whose value is one expression, not a mapping of settings: an override replaces them whole
_REPLACED_WHOLE = frozenset({"admission"})


def _merge(base: Any, override: Any) -> Any:
    """Deep-merge settings mappings; lists, scalars and admission rules in ``override`` replace the preset's."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for key, value in override.items():
            merge = key in base and key not in _REPLACED_WHOLE
            out[key] = _merge(base[key], value) if merge else copy.deepcopy(value)
        return out
    return copy.deepcopy(override)


def _parse_yaml(text: str, source: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise PolicyError(
            [FieldProblem("(file)", str(source), f"is not valid YAML{where}: {getattr(exc, 'problem', exc)}", "fix the syntax")],
            source=source,
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise PolicyError(
            [FieldProblem("(file)", type(data).__name__, "must be a mapping of policy fields", "start with e.g. 'chunk_size: 256'")],
            source=source,
        )
    return data


def resolve_presets(data: dict[str, Any], source: str | None) -> dict[str, Any]:
    data = dict(data)
    name = data.pop("preset", None)
    if name is None:
        return data
    if not isinstance(name, str):
        raise PolicyError([FieldProblem("preset", name, "must be a preset name", "e.g. preset: single-node")], source)
    base = _parse_yaml(preset_text(name), f"preset {name!r}")
    if "preset" in base:
        base = resolve_presets(base, f"preset {name!r}")
    return _merge(base, data)


def parse_policy_text(text: str, source: str) -> dict[str, Any]:
    """A policy's mapping from YAML text (``source`` names it in error messages, e.g. ``<stdin>``)."""
    return _parse_yaml(text, source)


def parse_policy_file(path: str | Path) -> tuple[dict[str, Any], str]:
    """A policy file's mapping and its source name (for error messages)."""
    p = Path(path)
    if not p.is_file():
        raise PolicyError([FieldProblem("(file)", str(p), "does not exist or is not a file", "check the path")])
    return _parse_yaml(p.read_text(encoding="utf-8"), str(p)), str(p)
