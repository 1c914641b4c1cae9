"""Lifecycle of the node's LMCache MP server: start from a Policy, health-wait, reuse, stop.

Several engines on one node share one server: :meth:`LMCacheServer.start` first asks the configured
HTTP port whether a server is already there and, if its configuration is compatible with the policy
(chunk size, hash, transfer mode, L2 tiers), reuses it instead of starting a second one. Only a server
this object started is stopped by :meth:`LMCacheServer.stop`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
from tenacity import RetryError, Retrying, retry_if_result, stop_after_delay, wait_fixed

from prefixshare._log import get_logger
from prefixshare._native import NATIVE_HINTS
from prefixshare._net import connect_error
from prefixshare._paths import run_dir
from prefixshare.errors import ServerError
from prefixshare.policies import Policy, server_argv, server_env
from prefixshare.server.plugins.integrity import tier_keyring
from prefixshare.tiers import require_client

_LIKELY_CAUSES: tuple[tuple[str, str], ...] = (
    ("address already in use", "a port of the policy is taken by another process: change server.port / server.http_port"),
    ("Address already in use", "a port of the policy is taken by another process: change server.port / server.http_port"),
    ("requires --l1-size-gb and --eviction-policy", "l1 settings are incomplete"),
    ("No module named", "a Python module the server needs is missing (see the log line above); install the tier's extra"),
    ("[Errno 17] File exists", "an fs tier's base_path is a file, not a directory (a store that is unmounted or "
     "replaced?): LMCache creates the directory at start; until the server starts, its replicas recompute"),
    ("[Errno 20] Not a directory", "a parent of an fs tier's base_path is a file, not a directory"),
    ("--l2-adapter", "LMCache rejected an l2 tier's settings (see the log line above)"),
    ("Permission denied", "the server cannot write a path of the policy (check l2 base_path permissions)"),
    ("Cannot allocate memory", "l1.size_gb is larger than the memory available"),
)


#: the server's file-creation mask: LMCache writes chunk files with open()'s default mode (0o666 & ~umask,
#: so 0o644 under the usual 022): KV of every tenant readable by every local user. With 027 its files are
#: 0o640 and its directories 0o750 (owner and group: the nodes' service accounts), nothing for others.
SERVER_UMASK = 0o027


#: where POSIX shared memory lives, and the prefix LMCache gives its L1 pool segment
SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "lmcache_l1_pool_"


def shm_path(segment: str | None) -> Path | None:
    """The file of the server's shared-memory L1 pool (None when shared memory is off)."""
    if not segment:
        return None
    bare = segment.lstrip("/")
    return SHM_DIR / (bare if bare.startswith(SHM_PREFIX) else SHM_PREFIX + bare)


def _tcp_open(host: str, port: int, timeout: float = 0.2) -> bool:
    return connect_error(host, port, timeout) is None


def _tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])


#: the loader's message for a native library it cannot load: "ImportError: libX.so.1: cannot open shared object
#: file ..." (missing), "... file too short" (damaged or emptied), "... wrong ELF class"
_MISSING_LIBRARY = re.compile(r"ImportError: ([^\s:]*\.so[\w.]*): ")


def _likely_cause(log: str) -> str:
    missing = _MISSING_LIBRARY.search(log)
    if missing is not None:
        library = missing.group(1)
        hint = f"; {NATIVE_HINTS['mooncake']}" if "ibverbs" in library else ""
        return (f"the native library {library} cannot be loaded on this host (see the traceback above for who "
                f"needs it){hint}")
    for needle, cause in _LIKELY_CAUSES:
        if needle in log:
            return cause
    return "see the log above"


class LMCacheServer:
    """One LMCache MP server described by a :class:`~prefixshare.policies.Policy`.

    Use as a context manager, or call :meth:`start` / :meth:`stop`. ``detach=True`` starts the server
    in its own session so it outlives this process (``prefixshare server start``).
    """

    def __init__(self, policy: Policy, *, log_path: Path | None = None, detach: bool = False,
                 launcher: list[str] | None = None) -> None:
        self.policy = policy
        self.detach = detach
        #: commands placed before the server's own argv, e.g. ["numactl", "--cpunodebind=0"] or a namespace
        #: wrapper; the server must still be the process they exec
        self.launcher = list(launcher or [])
        self.log_path = log_path or run_dir() / f"server-{policy.server.port}.log"
        self.state_path = run_dir() / f"server-{policy.server.port}.json"
        self.process: subprocess.Popen[bytes] | None = None
        self.owned = False
        self.log = get_logger(__name__, server=policy.server.url, http=policy.server.http_url)

    # --- queries ------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return self.policy.server.url

    @property
    def http_url(self) -> str:
        return self.policy.server.http_url

    def _get(self, path: str, timeout: float = 2.0) -> Any:
        response = httpx.get(self.http_url + path, timeout=timeout)
        response.raise_for_status()
        return response.json()

    def healthy(self, timeout: float = 1.0) -> bool:
        try:
            return httpx.get(self.http_url + "/healthcheck", timeout=timeout).status_code == 200
        except httpx.HTTPError:
            return False

    def status(self) -> dict[str, Any]:
        """The server's own ``/status`` document (L1 usage, object counts, L2 adapters, sessions)."""
        return self._get("/status")

    def running_config(self) -> dict[str, Any]:
        return {"config": self._get("/config"), "adapters": self._get("/config/adapters").get("adapters", [])}

    @property
    def pid(self) -> int | None:
        if self.process is not None:
            return self.process.pid
        state = self._read_state()
        return state.get("pid") if state else None

    # --- compatibility of a server already listening ----------------------------------------------
    def incompatibilities(self) -> list[str]:
        """Why the server on our port cannot serve this policy (empty when it can)."""
        running = self.running_config()
        mp = running["config"].get("mp", {})
        want = self.policy
        problems: list[str] = []
        if mp.get("chunk_size") != want.chunk_size:
            problems.append(f"chunk_size {mp.get('chunk_size')} (policy: {want.chunk_size})")
        if mp.get("hash_algorithm") not in (None, want.server.hash_algorithm):
            problems.append(f"hash_algorithm {mp.get('hash_algorithm')} (policy: {want.server.hash_algorithm})")
        mode = mp.get("supported_transfer_mode")
        if want.server.transfer_mode != "auto" and mode not in (None, "auto", want.server.transfer_mode):
            problems.append(f"transfer mode {mode} (policy: {want.server.transfer_mode})")
        types = [a.get("type_name") for a in running["adapters"] if a.get("tier", "l2") == "l2"]
        rendered = [t.server_config() for t in want.l2]
        wanted = [r["type"] for r in rendered] + _extra_l2_types(want.server.extra_args)
        if types != wanted:
            problems.append(f"L2 tiers {types} (policy: {wanted})")
        else:
            configs = running["config"].get("storage_manager", {}).get("l2_adapter_config", {}).get("adapters", [])
            for tier, spec, cfg in zip(want.l2, rendered, configs, strict=False):
                # a plugin adapter (e.g. the fs tier with integrity checks) nests its fields
                if spec["type"] == "plugin" and cfg.get("class_name") != spec["class_name"]:
                    problems.append(f"{tier.type} adapter {cfg.get('class_name')} (policy: {spec['class_name']})")
                have = cfg.get("adapter_params") or cfg
                path = getattr(tier, "base_path", None)
                if path is not None and have.get("base_path") != path:
                    problems.append(f"{tier.type} base_path {have.get('base_path')} (policy: {path})")
        return problems

    # --- lifecycle ----------------------------------------------------------------------------
    def start(self, *, reuse: bool = True) -> LMCacheServer:
        srv = self.policy.server
        if self.healthy():
            if not reuse:
                raise ServerError(f"a server is already running at {self.http_url}; stop it or use other ports")
            problems = self.incompatibilities()
            if problems:
                raise ServerError(
                    f"the LMCache server already listening on {self.url} is not compatible with this policy: "
                    + "; ".join(problems)
                    + ". Stop it (prefixshare server stop) or give this policy other ports."
                )
            self.log.info("server.reused")
            return self
        for host, port, what in ((srv.host, srv.port, "server.port"), (srv.http_host, srv.http_port, "server.http_port")):
            if _tcp_open(host, port):
                raise ServerError(f"{what} {port} on {host} is in use by a process that is not an LMCache server; "
                                  f"change {what} in the policy")
        for tier in self.policy.l2:
            require_client(tier)
            try:
                tier.prepare()
            except OSError as exc:  # the tier's path: named, with the fix, as a server error like the rest
                raise ServerError(f"l2 tier {tier.describe()} cannot be used: {exc}") from exc
            tier_keyring(tier)  # a missing or malformed store key stops the start here, named, not in its log
            # LMCache connects to remote tiers lazily: a server over an unreachable tier starts "healthy" and
            # misses forever. Say so now, naming the tier. (A launcher may give the server another network or
            # mount view than ours, e.g. its own /etc/hosts: then the server's view is the one that counts.)
            reason = None if self.launcher else tier.probe()
            if reason is not None:
                raise ServerError(f"l2 tier {tier.describe()} is unreachable: {reason}. Start it, or fix its "
                                  f"address in the policy, before starting the LMCache server")
        self._prepare_shm()
        argv = self.launcher + server_argv(self.policy)
        env = {**os.environ, **server_env(self.policy)}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log_file = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        started = time.monotonic()
        try:
            self.process = subprocess.Popen(
                argv, env=env, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, umask=SERVER_UMASK,
            )
        finally:
            log_file.close()
        self.owned = True
        self.log.info("server.starting", pid=self.process.pid, log=str(self.log_path))
        self._wait_healthy(srv.start_timeout_s)
        self._write_state(argv)
        self.log.info("server.ready", pid=self.process.pid, seconds=round(time.monotonic() - started, 2))
        return self

    def _prepare_shm(self) -> None:
        """Shared memory for engine<->server copies: the server's L1 pool lives in /dev/shm. With
        ``shm_name: auto``, a /dev/shm too small for L1 (containers default to 64 MB) turns it off with a warning
        instead of failing; a segment left by a killed server on this port is removed (no server answers here)."""
        srv = self.policy.server
        path = shm_path(srv.shm_segment)
        if path is None:
            return
        if path.exists():
            path.unlink(missing_ok=True)  # stale: we checked above that nothing listens on this port
            self.log.info("server.shm_stale_removed", segment=str(path))
        need = int(self.policy.l1.size_gb * 1e9 * 1.02)
        try:
            free = shutil.disk_usage(SHM_DIR).free
        except OSError:
            free = 0
        if free >= need:
            return
        message = (f"/dev/shm has {free / 1e9:.2f} GB free, the server's L1 needs {need / 1e9:.2f} GB in it")
        if srv.shm_name != "auto":
            raise ServerError(f"server.shm_name {srv.shm_name!r}: {message}. Enlarge /dev/shm (e.g. docker run "
                              "--shm-size), lower l1.size_gb, or set server.shm_name: null")
        self.log.warning("server.shm_disabled", reason=message, effect="engine<->server copies go through the "
                         "socket (slower loads)", fix="enlarge /dev/shm (docker --shm-size) or lower l1.size_gb")
        self.policy = self.policy.model_copy(update={"server": srv.model_copy(update={"shm_name": None})})

    def _release_shm(self) -> None:
        """Remove the shared-memory segment of a server that is gone (a killed one cannot)."""
        path = shm_path(self.policy.server.shm_segment)
        if path is not None and self.process is not None and self.process.poll() is not None:
            path.unlink(missing_ok=True)

    def _poll_ready(self) -> bool:
        """True once healthy; raises (not retried) when the process has already exited."""
        assert self.process is not None
        if self.process.poll() is not None:
            log = _tail(self.log_path)
            raise ServerError(
                f"the LMCache server exited with code {self.process.returncode} while starting.\n"
                f"likely cause: {_likely_cause(log)}\nlast lines of {self.log_path}:\n{log}"
            )
        return self.healthy(timeout=0.5)

    def _wait_healthy(self, timeout_s: float) -> None:
        retrying = Retrying(
            stop=stop_after_delay(timeout_s), wait=wait_fixed(0.2), retry=retry_if_result(lambda ready: not ready)
        )
        try:
            retrying(self._poll_ready)
        except RetryError:
            self._terminate()
            log = _tail(self.log_path)
            raise ServerError(
                f"the LMCache server did not become healthy at {self.http_url}/healthcheck "
                f"within {timeout_s:.0f} s.\nlikely cause: {_likely_cause(log)}\n"
                f"last lines of {self.log_path}:\n{log}"
            ) from None

    def stop(self, timeout_s: float = 15.0) -> None:
        """Stop the server if this object started it (a reused server keeps running)."""
        if not self.owned:
            return
        self._terminate(timeout_s)
        self._release_shm()
        self.owned = False
        self.state_path.unlink(missing_ok=True)
        self.log.info("server.stopped")

    def _terminate(self, timeout_s: float = 15.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        _signal_group(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _signal_group(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=5)

    def kill(self) -> None:
        """SIGKILL the server (fault tests: a store that dies mid-run)."""
        if self.process is not None and self.process.poll() is None:
            _signal_group(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=5)
        self._release_shm()

    # --- state file for the CLI (start in one process, stop from another) --------------------------
    def _write_state(self, argv: list[str]) -> None:
        assert self.process is not None
        state = {"pid": self.process.pid, "argv": argv, "log": str(self.log_path), "started_at": time.time(),
                 "url": self.url, "http_url": self.http_url}
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        os.chmod(tmp, 0o600)
        tmp.replace(self.state_path)

    def _read_state(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            return None

    def stop_detached(self, timeout_s: float = 15.0) -> bool:
        """Stop a server started by another process (``prefixshare server start``). True if one was stopped."""
        state = self._read_state()
        if not state:
            return False
        pid = int(state["pid"])
        if not _alive(pid):
            self.state_path.unlink(missing_ok=True)
            return False
        _signal_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _alive(pid):
            _signal_group(pid, signal.SIGKILL)
        self.state_path.unlink(missing_ok=True)
        path = shm_path(self.policy.server.shm_segment)
        if path is not None and not _alive(pid):
            path.unlink(missing_ok=True)
        return True

    def __enter__(self) -> LMCacheServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"LMCacheServer({self.url}, owned={self.owned}, pid={self.pid})"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie child of ours counts as gone
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)
        return waited == 0
    except ChildProcessError:
        return True


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _extra_l2_types(argv: list[str]) -> list[str]:
    """The types of the L2 adapters that ``server.extra_args`` adds (``--l2-adapter JSON``, after the policy's
    tiers, as the server's argv has them); an argument that is not JSON counts with the type ``?``."""
    specs: list[str] = []
    for i, arg in enumerate(argv):
        if arg == "--l2-adapter" and i + 1 < len(argv):
            specs.append(argv[i + 1])
        elif arg.startswith("--l2-adapter="):
            specs.append(arg.split("=", 1)[1])
    types: list[str] = []
    for spec in specs:
        try:
            types.append(str(json.loads(spec).get("type", "?")))
        except (ValueError, AttributeError):
            types.append("?")
    return types
