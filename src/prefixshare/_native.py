"""Optional packages whose native library may be missing on a host: they count as not installed there.

LMCache imports Mooncake's transfer engine wherever it is installed (the ``mooncake`` extra), in the MP server
and in every engine, and tolerates only ``ModuleNotFoundError`` for ``mooncake`` itself. Mooncake's extension
modules link the RDMA verbs library (``libibverbs.so.1``), which most hosts do not have: the ``ImportError``
from the loader then stops the server and the engines, whatever tiers the policy names.

:func:`install` (run by ``import prefixshare``; it imports nothing) puts a finder in front of ``sys.meta_path``
for the packages in :data:`NATIVE_HINTS`: it finds their modules exactly as the finders behind it do, and where
the loader cannot load a module's native library it raises ``ModuleNotFoundError`` for the package, with the
library and the fix in the message, and logs it once (``native.unavailable``, at info: a host without RDMA
is ordinary). Everything that tolerates the package's absence (LMCache's transfer channels) then runs without
it; a tier that needs it fails before the server starts, with the same message (:func:`native_problem`, used
by ``tiers.require_client``). A module whose library loads is imported unchanged.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import threading
from types import ModuleType
from typing import Any

#: package -> what its native part links and how an operator brings it
NATIVE_HINTS: dict[str, str] = {
    "mooncake": "Mooncake's transfer engine links the RDMA verbs library: install it (Debian/Ubuntu: apt-get "
    "install libibverbs1; RHEL/Fedora: dnf install libibverbs), or uninstall mooncake-transfer-engine where "
    "no mooncake_store tier is used",
}

_lock = threading.Lock()
#: package -> the first native load failure seen in this process (its message)
_failed: dict[str, str] = {}


def _unavailable(package: str, fullname: str, exc: ImportError) -> ModuleNotFoundError:
    first = False
    with _lock:
        if package not in _failed:
            _failed[package] = f"{fullname}: {exc}"
            first = True
    if first:
        from prefixshare._log import get_logger

        get_logger("prefixshare.native").info(
            "native.unavailable", package=package, module=fullname, error=str(exc)[:300],
            effect=f"{package} counts as not installed in this process", fix=NATIVE_HINTS[package])
    error = ModuleNotFoundError(f"{fullname} cannot load its native library ({exc}); {NATIVE_HINTS[package]}",
                                name=package)
    error.__cause__ = exc
    return error


class _GuardedLoader(importlib.abc.Loader):
    """The real loader, with a failure to load a native library turned into ``ModuleNotFoundError``."""

    def __init__(self, loader: Any, package: str, fullname: str) -> None:
        self.loader, self.package, self.fullname = loader, package, fullname

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        spec.loader = self.loader  # the module's own loader from here on (reloads, resources, __loader__)
        try:
            return self.loader.create_module(spec)
        except ModuleNotFoundError:
            raise
        except ImportError as exc:
            raise _unavailable(self.package, self.fullname, exc) from exc

    def exec_module(self, module: ModuleType) -> None:  # pragma: no cover - create_module hands the spec back
        self.loader.exec_module(module)


class _NativeGuard(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> Any:
        package = fullname.partition(".")[0]
        if package not in NATIVE_HINTS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _GuardedLoader(spec.loader, package, fullname)
                return spec
        return None


_GUARD = _NativeGuard()


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (idempotent; imports nothing)."""
    if not any(isinstance(f, _NativeGuard) for f in sys.meta_path):
        sys.meta_path.insert(0, _GUARD)


def native_problem(module: str) -> str | None:
    """Import ``module`` (a package of :data:`NATIVE_HINTS`, or a submodule) and say why its native part cannot
    load here, with the fix; None when it loads (or is not such a package). A module that is not installed at
    all is ``tiers.require_client``'s to report."""
    package = module.partition(".")[0]
    if package not in NATIVE_HINTS:
        return None
    install()
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if package in _failed:
            return str(exc)
        return None
    except ImportError as exc:  # pragma: no cover - the guard turns these into ModuleNotFoundError
        return f"{module} cannot load its native library ({exc}); {NATIVE_HINTS[package]}"
    return None
