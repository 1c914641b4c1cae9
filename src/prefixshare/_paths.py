"""Where prefixshare keeps its own files (digest cache, server state, logs, the demo's model)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "PREFIXSHARE_CACHE_DIR"


def cache_dir() -> Path:
    """``$PREFIXSHARE_CACHE_DIR``, else ``$XDG_CACHE_HOME/prefixshare``, else ``~/.cache/prefixshare``."""
    if env := os.environ.get(CACHE_ENV):
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "prefixshare"


def run_dir() -> Path:
    """Server state files and logs (created 0700: logs may name paths and hosts)."""
    path = cache_dir() / "run"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path
