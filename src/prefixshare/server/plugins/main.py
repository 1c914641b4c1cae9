"""The MP server's entry point: LMCache's command line (``lmcache server ...``) with prefixshare's guards
(:mod:`prefixshare.server.plugins.guards`) installed first. ``Policy.server_argv()`` runs the server this way::

    python -m prefixshare.server.plugins.main server --port 5555 --l2-adapter '{...}' ...

Every Python thread of the server carries its Python name as its kernel name too (``/proc/<pid>/task/*/comm``,
``top -H``, ``ps -L``: the first 15 bytes), so what wakes in the server can be told apart from outside it
(``benchmarks/threads.py``).

On a host without a GPU the server's ``DeviceHostFuncDispatcher`` drains GPU host-callback completions once a
second instead of every 5 ms (:func:`quiet_device_dispatcher`): there are none to drain, and its 200 wakeups a
second were most of an idle server's (197 of about 250) and nearly half its CPU (12 of 27 ms per second), taken
from the engines' cores beside it (``benchmarks/threads.py``: run ``20261207T055709Z-638016`` before, not
committed; ``20261207T060105Z-a7c226`` after, ``docs/benchmarks/threads.json``: about 48 wakeups and 12 ms a
second).

Its L1 eviction checks L1's usage when L1 takes a write or releases a read, not only once a second, and runs
before a reservation that would not fit (:mod:`prefixshare.server.plugins.eviction`): a full L1 takes new KV as
fast as it can evict, not at a fifth of its size per second, and its ``/status`` says how much of it cannot be
evicted. A chunk an engine stored that left L1 before the L2 tier's store read it is logged as a warning and
counted (:mod:`prefixshare.server.plugins.losses`), not only at LMCache's debug level.
"""

from __future__ import annotations

import threading

#: prctl(2) option that sets the calling thread's name
_PR_SET_NAME = 15
#: how often LMCache's DeviceHostFuncDispatcher drains completions on a host with no GPU (LMCache: 5 ms)
CPU_DRAIN_INTERVAL_S = 1.0


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


def quiet_device_dispatcher(interval_s: float = CPU_DRAIN_INTERVAL_S) -> bool:
    """On a host LMCache finds no accelerator on, make its ``DeviceHostFuncDispatcher`` (which dispatches the
    completions a GPU stream records with a host callback) poll every ``interval_s``; True when it did. With a
    GPU, or an LMCache without that thread, nothing changes. A completion recorded all the same would be
    dispatched up to ``interval_s`` later, not lost."""
    try:
        from lmcache.v1.multiprocess import native_completion
        from lmcache.v1.platform import get_torch_device
    except ImportError:
        return False
    if get_torch_device()[1] != "cpu":
        return False
    cls = getattr(native_completion, "DeviceHostFuncDispatcher", None)
    original = getattr(cls, "__init__", None)
    if cls is None or original is None:
        return False
    if getattr(original, "prefixshare_quiet", False):
        return True

    def __init__(self: object, drain_interval_seconds: float = interval_s) -> None:  # noqa: N807
        original(self, max(drain_interval_seconds, interval_s))

    __init__.prefixshare_quiet = True  # type: ignore[attr-defined]
    cls.__init__ = __init__
    return True


def main() -> None:
    import os
    import sys

    from prefixshare._log import configure_from_environment
    from prefixshare.policies import resolve_secrets
    from prefixshare.server.plugins import eviction, guards, losses, valkey_auth

    try:
        # a tier's password rides in this process's environment, not its command line (every local user reads
        # /proc/<pid>/cmdline); LMCache's parser reads sys.argv, the kernel's copy keeps the reference
        sys.argv = resolve_secrets(sys.argv, dict(os.environ))
    except ValueError as exc:
        sys.stderr.write(f"prefixshare server: {exc}\n")
        raise SystemExit(2) from None
    configure_from_environment()
    name_native_threads()
    quiet_device_dispatcher()
    eviction.install()
    losses.install()
    guards.install()
    valkey_auth.install()
    from lmcache.cli.main import main as lmcache_main

    lmcache_main()


if __name__ == "__main__":
    main()
