"""Fixtures every end-to-end module shares (one instance per module: each module has its own stores)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.common import build_models


@pytest.fixture(scope="module")
def work(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])


@pytest.fixture(scope="module")
def models(work: Path) -> dict[str, Path]:
    return build_models(work)


@pytest.fixture(scope="module")
def module_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The top-level conftest isolates the cache dir per test; modules whose module-scoped fixtures (servers,
    replicas) use it too take this one, with ``pytest.mark.usefixtures("module_cache_dir")``."""
    patch = pytest.MonkeyPatch()
    patch.setenv("PREFIXSHARE_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "ps-cache"))
    yield
    patch.undo()
