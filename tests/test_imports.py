"""`import prefixshare` stays light, and every import runs downhill through the layers of docs/architecture.md:
no cycles, no import of another package's private module, no string-named import that hides an uphill edge."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import prefixshare

HEAVY = ("torch", "vllm", "sglang", "lmcache", "transformers", "numpy")
ROOT = Path(prefixshare.__file__).parent


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


# Layers, lowest first (docs/architecture.md): a module may import only from its own layer or a lower one.
LAYERS = [
    {"errors", "_log", "_paths", "_metrics", "_files", "_units", "_version", "_env", "_net", "_lazy", "_native"},
    {"plan", "tiers"},
    {"fingerprint", "policies"},
    {"keys"},
    {"runtime", "server", "model"},
    {"adapters"},
    {"warm", "verify"},
    {"share"},
    {"store", "bench", "demo"},
    {"cli"},
]


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "prefixshare" and len(parts) >= 2 else None


def _layer(module: str) -> int | None:
    pkg = _package(module)
    return next((i for i, layer in enumerate(LAYERS) if pkg in layer), None)


def _exists(module: str) -> bool:
    rel = Path(*module.split(".")[1:])
    return (ROOT / rel).with_suffix(".py").is_file() or (ROOT / rel / "__init__.py").is_file()


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    lazy: bool  # inside a function: runs at call time, but is an edge all the same

    def __str__(self) -> str:
        return f"{self.source}:{self.line} -> {self.target}" + (" (inside a function)" if self.lazy else "")


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """Nodes under ``if TYPE_CHECKING:`` (annotations only: no import at run time)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            out |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return out


def _edges() -> Iterator[Edge]:
    """Every prefixshare import of every prefixshare module: module level and inside functions, plus the
    dotted names a module hands to ``importlib.import_module`` or keeps as a lazy registry's ``"module:Attr"``.
    ``from a import b`` is an edge to ``a.b`` when that is a module, else to ``a``. Imports under ``if TYPE_CHECKING:`` are left out."""
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        module = ".".join(("prefixshare", *(parts[:-1] if parts[-1] == "__init__" else parts)))
        tree = ast.parse(path.read_text())
        typing_only = _type_checking_nodes(tree)
        lazy = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
                for n in ast.walk(f)}
        uses_importlib = "importlib" in path.read_text()
        imported_by_name = {id(arg) for call in ast.walk(tree) if isinstance(call, ast.Call)
                            and getattr(call.func, "attr", getattr(call.func, "id", None)) == "import_module"
                            for arg in call.args}
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    targets.append(sub if _exists(sub) else node.module)
            elif isinstance(node, ast.Import):
                targets += [a.name for a in node.names]
            elif uses_importlib and isinstance(node, ast.Constant) and isinstance(node.value, str):
                # a lazy registry's "module:Attr", or a module name handed to import_module
                name, colon, _ = node.value.partition(":")
                if (colon or id(node) in imported_by_name) and name.startswith("prefixshare.") and _exists(name):
                    targets.append(name)
            for target in targets:
                if target.split(".")[0] == "prefixshare" and target != module:
                    yield Edge(module, target, getattr(node, "lineno", 0), id(node) in lazy)


def test_imports_flow_one_way() -> None:
    """No module imports from a layer above its own (a lazy import included: it is the same dependency)."""
    uphill = [str(e) for e in _edges()
              if (own := _layer(e.source)) is not None and (to := _layer(e.target)) is not None and to > own]
    assert not uphill, "\n".join(uphill)


def test_no_module_imports_the_top_level_package() -> None:
    """``prefixshare/__init__`` is the public API above everything: nothing inside imports it (the version is
    ``prefixshare._version``)."""
    offenders = [str(e) for e in _edges() if e.target == "prefixshare"]
    assert not offenders, "\n".join(offenders)


def test_no_import_of_another_packages_private_module() -> None:
    """``prefixshare.X._y`` (or ``prefixshare.X.Y._z``) is imported only from inside ``prefixshare.X``; other
    packages use what ``prefixshare.X`` exports. Top-level private modules (``prefixshare._log``, ...) are the
    shared base layer."""
    offenders = []
    for e in _edges():
        parts = e.target.split(".")
        private = any(p.startswith("_") for p in parts[2:])
        if private and _package(e.source) != parts[1] and e.source != "prefixshare":
            offenders.append(str(e))
    assert not offenders, "\n".join(offenders)


def test_no_import_cycles() -> None:
    """The module graph (every import, lazy ones included) has no cycle; a package's ``__init__`` importing its
    own modules is downhill, a module importing its package's ``__init__`` back is a cycle."""
    graph: dict[str, set[str]] = {}
    for e in _edges():
        graph.setdefault(e.source, set()).add(e.target)
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_every_package_is_in_a_layer() -> None:
    packages = {p.name if p.is_dir() else p.stem for p in ROOT.iterdir()
                if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.stem != "__init__")}
    assert packages == set().union(*LAYERS)


#: no function in src/ runs longer than this (docs/architecture.md: one function, one job)
MAX_FUNCTION_LINES = 80


def test_no_long_functions() -> None:
    long = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "\n".join(long)


# Modules that only LMCache's MP server imports (through its "plugin" L2 adapter type, by dotted path): they
# import LMCache (and their store's client) at top level, so no prefixshare module may import them at module
# level (a function that already imports LMCache lazily — the benchmark driving an adapter — may).
SERVER_ONLY = {"prefixshare.server.plugins.mooncake", "prefixshare.server.plugins.fs", "prefixshare.bench._throttle"}


def test_server_only_adapter_modules_are_never_imported_by_prefixshare() -> None:
    offenders = [str(e) for e in _edges() if not e.lazy and e.target in SERVER_ONLY and e.source not in SERVER_ONLY]
    assert not offenders, offenders
