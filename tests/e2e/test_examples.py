"""Every script in examples/ runs in its quick mode, so none of them can rot."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from e2e.common import SHIM_ENV

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


pytestmark = pytest.mark.usefixtures("module_cache_dir")


def run_example(name: str, *args: str, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run([sys.executable, str(EXAMPLES / name), *args, "--quick"], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", **(env or {})})
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def test_every_example_is_tested() -> None:
    tested = {"attach_vllm.py", "attach_sglang.py", "prewarm_folder.py", "two_replicas.py", "vllm_serve.py"}
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested


@pytest.mark.engine
@pytest.mark.server
def test_vllm_serve_prints_the_command_and_serves_with_it() -> None:
    out = run_example("vllm_serve.py", "--run")
    assert "PrefixShareConnector" in out and "--kv-transfer-config" in out and "LMCACHE_TRACK_USAGE=false" in out
    stats = {line.split(":")[0]: line for line in out.splitlines() if line.startswith("request ")}
    assert set(stats) == {"request 1", "request 2"}, out
    # the second request's prefix is in the replica's own cache: the stats the HTTP answer carries say so
    assert "'num_vllm_cached_tokens': 0," not in stats["request 2"], out


@pytest.mark.engine
@pytest.mark.server
def test_attach_in_application_code() -> None:
    out = run_example("attach_vllm.py")
    assert "request 2:" in out and "stored" in out


@pytest.mark.engine
@pytest.mark.server
def test_attach_sglang_in_application_code() -> None:
    out = run_example("attach_sglang.py", env=SHIM_ENV)  # SGLang's CPU engine needs the sgl_kernel stand-in
    assert "warm: 1 warmed" in out and "stored" in out
    # each question's prompt starts with the warmed manual: its whole stored prefix is cached
    cached = [int(line.split("prompt tokens,")[1].split("cached")[0]) for line in out.splitlines() if "cached" in line]
    assert len(cached) == 2 and all(c >= 256 for c in cached), out


@pytest.mark.engine
@pytest.mark.server
def test_prewarm_a_folder() -> None:
    out = run_example("prewarm_folder.py")
    assert "faq.md" in out and "second run: 2 of 2 skipped" in out


@pytest.mark.engine
@pytest.mark.server
def test_two_replicas_on_one_store() -> None:
    out = run_example("two_replicas.py")
    assert "same answer: True" in out
    loaded = int(out.split("replica b:")[1].split("prompt tokens,")[1].split("loaded")[0])
    assert loaded > 0
