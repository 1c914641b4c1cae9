"""Session fixtures of the fault suite: one tiny model, its documents, and a cold engine's answers to all of
them (one engine process for the whole suite; every module compares with it)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.common import document_ids
from faults._common import DOCS, WARMUP, gen, run_steps
from faults._matrix import commit, run_id


def pytest_configure(config: pytest.Config) -> None:
    """One run id (and commit) for the whole pytest session, exported as PREFIXSHARE_FAULT_RUN before any test
    records: every row of this session, tests/e2e/test_tiers.py's included, carries the same one."""
    run_id()
    commit()


@pytest.fixture(scope="session")
def suite_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="session")
def model(suite_dir: Path) -> Path:
    from prefixshare.model import create_model

    return create_model(suite_dir / "model", shape="tiny", seed=0)


@pytest.fixture(scope="session")
def docs(model: Path) -> dict[str, list[int]]:
    return {name: document_ids(model, seed, n) for name, (seed, n) in DOCS.items()}


@pytest.fixture(scope="session")
def cold(suite_dir: Path, model: Path, docs: dict[str, list[int]]) -> dict[str, Any]:
    """A cold engine (no prefixshare) answering every document once (after a warm-up request)."""
    names = [WARMUP, *[n for n in DOCS if n != WARMUP]]
    out = run_steps(suite_dir, "cold", model, None, [gen(n, docs[n]) for n in names])
    return out["by_name"]


@pytest.fixture(scope="module")
def work(request: pytest.FixtureRequest, suite_dir: Path) -> Path:
    path = suite_dir / request.module.__name__.rsplit(".", 1)[-1]
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="module", autouse=True)
def _module_cache_dir(suite_dir: Path) -> Iterator[None]:
    """conftest isolates the cache dir per test; module fixtures (servers, replicas) run before that."""
    patch = pytest.MonkeyPatch()
    patch.setenv("PREFIXSHARE_CACHE_DIR", str(suite_dir / "ps-cache"))
    yield
    patch.undo()
