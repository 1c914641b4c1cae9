"""Shared fixtures: free ports, an isolated cache dir, structlog reset, and the raw MP client."""

from __future__ import annotations

import os
import socket
import tempfile
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))  # `helpers` is importable from every test module

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Every engine process the tests start (replicas, warm, verify, examples) inherits this. vLLM's sampler
# compiles its logprob-rank count (vllm/v1/sample/ops/logprobs.py, torch.compile with inductor on CPU) on a
# process's first request with logprobs: 2.0-2.5 s per engine process on our CPU machines. Run eager,
# the count is the same integer, so greedy ids and logprobs are identical (checked on the tiny model: the
# same 12 ids and logprobs bit for bit with and without). `make bench` does not run under this file: its
# engines keep the default.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
# Session-wide: module-scoped fixtures (servers, replicas) run before function-scoped ones, and nothing a
# test starts may write into the user's ~/.cache/prefixshare.
os.environ["PREFIXSHARE_CACHE_DIR"] = tempfile.mkdtemp(prefix="prefixshare-test-cache-")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Never touch the user's ~/.cache/prefixshare from tests."""
    monkeypatch.setenv("PREFIXSHARE_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "ps-cache"))


@pytest.fixture(autouse=True)
def _reset_structlog() -> Iterator[None]:
    yield
    import structlog

    structlog.reset_defaults()


@pytest.fixture(scope="session")
def cli() -> typer.Typer:
    """The real ``prefixshare`` app with every command registered."""
    from prefixshare.cli import _register_all, app

    _register_all()
    return app


def run_mp_client(mode: str, url: str, model: str = "probe/tiny-llama", salt: str = "", timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run the raw MP client in a fresh process (a fresh 'replica')."""
    args = [sys.executable, str(TESTS / "helpers" / "mp_client.py"), mode, url, model]
    if salt:
        args.append(salt)
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env={**os.environ})
