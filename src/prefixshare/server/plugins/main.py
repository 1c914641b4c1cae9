"""The MP server's entry point: LMCache's command line (``lmcache server ...``) with prefixshare's guards
(:mod:`prefixshare.server.plugins.guards`) installed first. ``Policy.server_argv()`` runs the server this way::

    python -m prefixshare.server.plugins.main server --port 5555 --l2-adapter '{...}' ...

Every Python thread of the server carries its Python name as its kernel name too (``/proc/<pid>/task/*/comm``,
``top -H``, ``ps -L``: the first 15 bytes), so what wakes in the server can be told apart from outside it
(``benchmarks/threads.py``).
"""

from __future__ import annotations

import threading

#: prctl(2) option that sets the calling thread's name
_PR_SET_NAME = 15


def name_native_threads() -> bool:
    """Give every Python thread started from now on its Python name as its kernel name; False where this
    Python or platform does not allow it (nothing changes then)."""
    import ctypes
    import sys

    bootstrap = getattr(threading.Thread, "_bootstrap_inner", None)
    if not sys.platform.startswith("linux") or bootstrap is None:
        return False
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return False

    def named(self: threading.Thread) -> None:
        try:
            prctl(_PR_SET_NAME, self.name.encode()[:15], 0, 0, 0)
        except Exception:  # noqa: BLE001 - a name is never worth a thread
            pass
        bootstrap(self)

    threading.Thread._bootstrap_inner = named  # type: ignore[attr-defined]
    return True


def main() -> None:
    from prefixshare._log import configure_from_environment
    from prefixshare.server.plugins import guards

    configure_from_environment()
    name_native_threads()
    guards.install()
    from lmcache.cli.main import main as lmcache_main

    lmcache_main()


if __name__ == "__main__":
    main()
