"""The wheel users install: built from this tree, installed into a fresh Python 3.12 environment, run there.

LMCache pulls torch and CUDA wheels (GBs), so the wheel is installed without dependencies plus prefixshare's
own light ones (pyproject's ``dependencies`` without LMCache; at the lock's versions on 3.12, as pip resolves
them on 3.10): the commands that need no engine must work without LMCache, and a missing package-data file or
an undeclared import fails here.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: the versions users run that the dev lock (3.11) does not: the newest a typical GPU image has, and the oldest
#: requires-python admits
PYTHONS = ["3.12", "3.10"]


def _python(version: str) -> Path | None:
    """pyenv's interpreter for ``version`` (the bare pythonX.Y shim refuses unless that version is selected)."""
    try:
        root = subprocess.run(["pyenv", "root"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    found = sorted(Path(root, "versions").glob(f"{version}.*/bin/python{version}"))
    return found[-1] if found else None


def _light_requirements() -> list[str]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return [d for d in deps if not re.match(r"lmcache\b", d)]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dist = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(ROOT)],
                   check=True, timeout=300)
    [built] = dist.glob("prefixshare-*.whl")
    return built


@pytest.fixture(scope="module", params=PYTHONS)
def venv(request: pytest.FixtureRequest, wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    version = request.param
    python = _python(version)
    if python is None:
        if os.environ.get("CI"):
            pytest.fail(f"no Python {version} under `pyenv root` on this CI machine")
        pytest.skip(f"no Python {version} under `pyenv root`")
    venv = tmp_path_factory.mktemp(f"py{version}") / "venv"
    subprocess.run([str(python), "-m", "venv", str(venv)], check=True, timeout=120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "--no-deps", str(wheel)], check=True, timeout=300)
    # the dev lock's versions where they install (some of them need Python >= 3.11); on 3.10 what pyproject's
    # ranges resolve to, as a user's pip would pick
    lock = ["-c", str(ROOT / "requirements" / "lock-cpu.txt")] if version != "3.10" else []
    subprocess.run([*pip, *lock, *_light_requirements()], check=True, timeout=600)
    return venv


def _run(venv: Path, *args: str, stdin: str | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON"))}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run([str(venv / "bin" / "prefixshare"), *args], input=stdin, capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=120)


def test_the_wheel_runs_without_an_engine(venv: Path, tmp_path: Path) -> None:
    python = venv / "bin" / "python"
    version = subprocess.run([str(python), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    assert version in PYTHONS and version in str(venv)
    # installed from the wheel (not this checkout), and without LMCache or torch
    where = subprocess.run([str(python), "-c", "import prefixshare; print(prefixshare.__file__)"],
                           capture_output=True, text=True, check=True, cwd=tmp_path).stdout
    assert str(venv) in where and str(ROOT) not in where
    missing = subprocess.run([str(python), "-c", "import importlib.util as u; print([m for m in "
                              "('lmcache', 'torch', 'vllm') if u.find_spec(m)])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    assert missing == "[]"

    helped = _run(venv, "--help")
    assert helped.returncode == 0 and "plan" in helped.stdout and "policy" in helped.stdout, helped.stderr

    planned = _run(venv, "plan", "qwen3-8b", "--tokens", "4096", "--json")
    assert planned.returncode == 0, planned.stderr
    assert "147456" in planned.stdout.replace(",", "")  # the shipped shape (package data) was found

    store = tmp_path / "store"
    store.mkdir()
    starter = _run(venv, "policy", "init", "--preset", "single-node", "--store", str(store))
    assert starter.returncode == 0, starter.stderr
    checked = _run(venv, "policy", "validate", "-", stdin=starter.stdout)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    bad = _run(venv, "policy", "validate", "-", stdin=starter.stdout + "\nchunk_size: -1\n")
    assert bad.returncode == 2 and "chunk_size" in bad.stdout + bad.stderr

    from prefixshare.model import create_model  # the dev environment builds the model (torch)

    model = create_model(tmp_path / "m", shape="tiny", seed=0)
    fp = _run(venv, "fingerprint", str(model), "--engine", "vllm", "--json")
    assert fp.returncode == 0, fp.stderr
    here = subprocess.run([sys.executable, "-c", "from prefixshare.cli import main; main()", "fingerprint",
                           str(model), "--engine", "vllm", "--json"], capture_output=True, text=True, check=True)
    assert _digest(fp.stdout) == _digest(here.stdout)  # the same identity on 3.12 as in the dev environment
    shutil.rmtree(model, ignore_errors=True)


def _digest(out: str) -> str:
    import json

    return str(json.loads(out)["digest"])
