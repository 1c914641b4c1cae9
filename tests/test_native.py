"""A host without the RDMA verbs library, with Mooncake installed (the venv's ``mooncake`` extra): the node's server
and an engine-side LMCache client still work for an fs policy; a mooncake policy is refused before start, naming
the library and the fix; a server that dies of a missing library says which.

Where the library is installed (CI installs it for the mooncake tier's tests), it is hidden from the test's
processes only: a private mount namespace with ``/dev/null`` bound over it. Without it the control (LMCache
imported without prefixshare) must fail, which shows the library really is out of reach."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import TESTS, free_port

pytestmark = pytest.mark.server

LIBRARY = "libibverbs.so.1"


def _library_path() -> str | None:
    """The real path of the verbs library the dynamic loader would use, or None where it is not installed."""
    out = subprocess.run(["/sbin/ldconfig", "-p"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        if line.strip().startswith(LIBRARY) and "=>" in line:
            return os.path.realpath(line.split("=>", 1)[1].strip())
    return None


def _without_library(code: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh Python that cannot load the verbs library."""
    argv = [sys.executable, "-c", code]
    real = _library_path()
    if real is not None:
        if os.geteuid() != 0 or shutil.which("unshare") is None:
            pytest.skip(f"{LIBRARY} is installed and hiding it needs root and unshare(1)")
        argv = ["unshare", "-m", "--propagation", "private", "sh", "-c",
                f'mount --bind /dev/null "{real}" && exec "$0" "$@"', *argv]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env={**os.environ},
                          cwd=str(TESTS))


def test_lmcache_alone_cannot_import_its_transfer_channels_there() -> None:
    """The control: the fault is real (LMCache's own import dies of the missing library)."""
    proc = _without_library("import lmcache.v1.distributed.transfer_channel")
    assert proc.returncode != 0 and LIBRARY in proc.stderr, proc.stderr[-2000:]


def test_the_server_and_an_engine_side_client_work_without_the_library(tmp_path: Path) -> None:
    store = tmp_path / "store"
    code = textwrap.dedent(f"""
        import json, pathlib, subprocess, sys
        from prefixshare.errors import NativeLibraryError
        from prefixshare.policies import Policy
        from prefixshare.server import LMCacheServer

        def policy(l2):
            return Policy.build(chunk_size=32, l1={{"size_gb": 0.1}}, l2=l2,
                                server={{"port": {free_port()}, "http_port": {free_port()}, "start_timeout_s": 90}})

        out = {{}}
        try:
            LMCacheServer(policy([{{"type": "mooncake_store", "master_server_addr": "127.0.0.1:1",
                                     "metadata_server": "http://127.0.0.1:2/metadata"}}])).start()
            out["mooncake"] = "started"
        except NativeLibraryError as exc:
            out["mooncake"] = str(exc)
        with LMCacheServer(policy([{{"type": "fs", "base_path": {str(store)!r}, "create": True}}]),
                           log_path=pathlib.Path({str(tmp_path / "server.log")!r})) as server:
            out["healthy"] = server.healthy()
            # an engine-side LMCache client in a fresh process that imports prefixshare first, as engines do
            client = ("import prefixshare, runpy, sys; sys.argv = sys.argv[1:]; "
                      "runpy.run_path(sys.argv[0], run_name='__main__')")
            for mode in ("store", "fetch"):
                p = subprocess.run([sys.executable, "-c", client, {str(TESTS / "helpers" / "mp_client.py")!r},
                                    mode, server.url, "probe/tiny-llama"], capture_output=True, text=True,
                                   timeout=120)
                out[mode] = (p.returncode, p.stdout if p.returncode == 0 else p.stdout + p.stderr[-1500:])
        print(json.dumps(out))
    """)
    proc = _without_library(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["healthy"] is True, out
    # a mooncake policy is refused before any process starts, with the library and the fix named
    assert LIBRARY in out["mooncake"] and "apt-get install libibverbs1" in out["mooncake"], out
    store_rc, store_out = out["store"]
    retrieve_rc, retrieve_out = out["fetch"]
    assert store_rc == 0 and retrieve_rc == 0, out
    # the retrieve in a second process hit every chunk the first stored and got the same bytes back
    assert "STORE ok = True" in store_out, out
    assert "hit_chunks=" in retrieve_out and "bytes_equal = True" in retrieve_out, out
    got, total = (int(x) for x in retrieve_out.split("hit_chunks=", 1)[1].split()[0].split("/"))
    assert got == total > 0, out
    assert any(store.rglob("*")), "nothing reached the fs tier"


def test_a_server_that_dies_of_a_missing_library_names_it() -> None:
    from prefixshare.server._process import _likely_cause

    log = ("  File \".../mooncake_te_impl.py\", line 10, in <module>\n    from mooncake.engine import TransferEngine\n"
           "ImportError: libibverbs.so.1: cannot open shared object file: No such file or directory\n")
    cause = _likely_cause(log)
    assert "libibverbs.so.1" in cause and "apt-get install libibverbs1" in cause, cause
    other = _likely_cause("ImportError: libfoo.so.3: cannot open shared object file: No such file or directory")
    assert "libfoo.so.3" in other and "libibverbs" not in other, other
    emptied = _likely_cause("ImportError: /lib/x86_64-linux-gnu/libibverbs.so.1: file too short")
    assert "libibverbs.so.1" in emptied and "apt-get install libibverbs1" in emptied, emptied
