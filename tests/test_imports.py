"""`import prefixshare` stays light: no torch, engines or LMCache, and no import cycles in the layers."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

HEAVY = ("torch", "vllm", "sglang", "lmcache", "transformers", "numpy")


def _fresh(code: str) -> str:
    return subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True,
                          check=True).stdout


def test_import_prefixshare_loads_nothing_heavy() -> None:
    out = _fresh("import sys, json, prefixshare; print(json.dumps(sorted(sys.modules)))")
    loaded = json.loads(out.strip().splitlines()[-1])
    assert not [m for m in loaded if m.split(".")[0] in HEAVY]


def test_public_api_resolves_lazily_without_engines() -> None:
    code = (
        "import sys, json, prefixshare as p\n"
        "names = {n: type(getattr(p, n)).__name__ for n in p.__all__}\n"
        "print(json.dumps([sorted(names), sorted(m for m in sys.modules if m.split('.')[0] in %r)]))" % (HEAVY,)
    )
    names, heavy = json.loads(_fresh(code).strip().splitlines()[-1])
    assert "Policy" in names and "compute_fingerprint" in names
    assert heavy == []


# Layers, lowest first: a module may import only from its own layer or a lower one.
LAYERS = [
    {"errors", "_log", "_paths", "_metrics", "_files"},
    {"policies", "plan"},
    {"tiers", "fingerprint"},
    {"policy"},
    {"server"},
    {"adapters", "model"},
    {"warm", "store", "bench", "demo"},
    {"cli"},
]


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "prefixshare" or len(parts) < 2:
        return None
    for i, layer in enumerate(LAYERS):
        if parts[1] in layer:
            return i
    return None


def _module_level_imports() -> Iterator[tuple[str, list[str]]]:
    """Every prefixshare module with what it imports at module level (imports inside functions are lazy: not
    listed). ``from a import b`` lists ``a`` and ``a.b`` (b may be a module)."""
    import ast
    from pathlib import Path

    import prefixshare

    root = Path(prefixshare.__file__).parent
    for path in root.rglob("*.py"):
        module = "prefixshare." + ".".join(path.relative_to(root).with_suffix("").parts)
        tree = ast.parse(path.read_text())
        lazy = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
                for n in ast.walk(f)}
        names: list[str] = []
        for node in ast.walk(tree):
            if id(node) in lazy:
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names += [a.name for a in node.names]
        yield module, names


def test_imports_flow_one_way() -> None:
    violations = []
    for module, names in _module_level_imports():
        own = _layer(module)
        if own is None:
            continue
        for target in names:
            layer = _layer(target)
            if layer is not None and layer > own:
                violations.append(f"{module} imports {target}")
    assert not violations, violations


# Modules that only LMCache's MP server imports (through its "plugin" L2 adapter type, by dotted path): they
# import LMCache (and their store's client) at top level, so no prefixshare module may import them at module
# level (a function that already imports LMCache lazily — the benchmark driving an adapter — may).
SERVER_ONLY = {"prefixshare.tiers._mooncake_adapter", "prefixshare.tiers._fs_adapter", "prefixshare.bench._throttle"}


def test_server_only_adapter_modules_are_never_imported_by_prefixshare() -> None:
    offenders = [module for module, names in _module_level_imports()
                 if module not in SERVER_ONLY and SERVER_ONLY & set(names)]
    assert not offenders, offenders
