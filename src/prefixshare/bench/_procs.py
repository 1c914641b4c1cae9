"""Fresh-process replicas and LMCache MP servers for the benchmarks (and the cost-aware loading tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, NoReturn

from prefixshare.errors import PrefixShareError


#: LMCache's MP server loads the throttled fs adapter from here (its "plugin" L2 adapter type)
THROTTLE_MODULE, THROTTLE_CLASS = "prefixshare.bench._throttle", "ThrottledFSL2Adapter"


def prompt_ids(n: int, seed: int) -> list[int]:
    """``n`` token ids the bench model knows (it has 4,096), from ``seed``: two prompts of one seed share their
    first tokens, so prompts meant to miss take seeds of their own."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(16, 4000) for _ in range(n)]


def cpu_seconds(pid: int) -> float:
    """A process's CPU seconds so far (user + system, its threads together)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def throttled_store_spec(base_path: str, *, chunk_delay_s: float = 0.0, read_gbps: float | None = None,
                         control_path: str | None = None, store_chunk_delay_s: float = 0.0) -> dict[str, Any]:
    """The ``--l2-adapter`` JSON object of a deliberately slow fs store on ``base_path`` (see
    :mod:`prefixshare.bench._throttle`; building the spec imports nothing of LMCache). ``control_path``: a JSON
    file the adapter reads its delay from at every load (a replica's ``throttle`` step writes it);
    ``store_chunk_delay_s``: what each chunk's write waits first."""
    params: dict[str, Any] = {"base_path": base_path, "chunk_delay_s": chunk_delay_s}
    if store_chunk_delay_s:
        params["store_chunk_delay_s"] = store_chunk_delay_s
    if read_gbps:
        params["read_gbps"] = read_gbps
    if control_path:
        params["control_path"] = control_path
    return {"type": "plugin", "module_path": THROTTLE_MODULE, "class_name": THROTTLE_CLASS, "adapter_params": params}


def set_throttle(path: str, *, chunk_delay_s: float = 0.0, read_gbps: float | None = None) -> None:
    """Write a throttled store's control file (atomically: a load never reads half of it)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"chunk_delay_s": chunk_delay_s, "read_gbps": read_gbps}, f)
    os.replace(tmp, path)


class ReplicaError(PrefixShareError):
    """A replica process failed; the message ends with the tail of its stderr."""


def run_replica(workdir: Path, name: str, spec: dict[str, Any], *, timeout_s: float = 1800,
                env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run :mod:`prefixshare.bench._replica` on ``spec`` in a fresh process; returns its result with the
    structured log events it emitted (``events``) and its wall time including start-up (``wall_s``)."""
    import time

    argv = _replica_argv(workdir, name, spec)
    full_env = {**os.environ, **(env or {})}
    started = time.perf_counter()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=full_env)
    except subprocess.TimeoutExpired as exc:
        raise ReplicaError(f"replica {name} did not finish within {timeout_s:.0f} s") from exc
    wall = time.perf_counter() - started
    (workdir / f"{name}.stderr").write_text(proc.stderr)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise ReplicaError(f"replica {name} failed (exit code {proc.returncode}); stderr ends:\n{proc.stderr[-4000:]}")
    result = json.loads(line[len("RESULT "):])
    result["events"] = parse_events(proc.stderr)
    result["wall_s"] = wall
    return result


def _replica_argv(workdir: Path, name: str, spec: dict[str, Any], command: list[str] | None = None) -> list[str]:
    """Write ``spec`` to ``workdir/name.json``; the command that runs a replica on it (``command`` + the spec's
    path; default: this interpreter running :mod:`prefixshare.bench._replica`)."""
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / f"{name}.json"
    path.write_text(json.dumps(spec))
    return [*(command or [sys.executable, "-m", "prefixshare.bench._replica"]), str(path)]


class ReplicaSession:
    """An interactive replica (:mod:`prefixshare.bench._replica` with ``"interactive": true``): started once,
    then sent steps while it stays up, so that a driver can interleave the requests of several replicas.

    Use as a context manager: ``with ReplicaSession(workdir, name, spec) as r: r.run([...])``; leaving it ends
    the replica and sets :attr:`result` (its final result, with ``events`` and ``wall_s``, as
    :func:`run_replica`). Every wait is bounded by ``timeout_s``; a replica that exits or goes silent is killed
    and raises :class:`ReplicaError` with the tail of its stderr. ``command`` runs the replica some other way
    (e.g. inside a network namespace, beside its node's server): it is given the spec's path and must speak the
    same protocol."""

    def __init__(self, workdir: Path, name: str, spec: dict[str, Any], *, timeout_s: float = 1800,
                 env: dict[str, str] | None = None, command: list[str] | None = None) -> None:
        self.name, self.timeout_s = name, timeout_s
        argv = _replica_argv(workdir, name, {**spec, "interactive": True}, command)
        self.stderr_path = workdir / f"{name}.stderr"
        self._stderr = open(self.stderr_path, "w", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                     text=True, env={**os.environ, **(env or {})})
        self.result: dict[str, Any] | None = None
        self._buffer = b""
        import time

        self._started = time.perf_counter()
        self._expect("READY")

    def _expect(self, prefix: str) -> str:
        """The next stdout line that starts with ``prefix`` (other lines are the engine's): its remainder. Reads
        the pipe's bytes itself (a buffered reader could hold the line while select() waits on the pipe)."""
        import select
        import time

        deadline = time.monotonic() + self.timeout_s
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while True:
            while b"\n" in self._buffer:
                line, self._buffer = self._buffer.split(b"\n", 1)
                text = line.decode(errors="replace")
                if text.startswith(prefix):
                    return text[len(prefix):].strip()
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self._fail(f"replica {self.name} said nothing for {self.timeout_s:.0f} s")
            data = os.read(fd, 1 << 20)
            if not data:
                self._fail(f"replica {self.name} exited (code {self.proc.wait(timeout=30)})")
            self._buffer += data

    def _fail(self, why: str) -> NoReturn:
        self.proc.kill()
        self.proc.wait(timeout=30)
        self._stderr.close()
        tail = self.stderr_path.read_text(errors="replace")[-4000:]
        raise ReplicaError(f"{why}; stderr ends:\n{tail}")

    def run(self, steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Run ``steps`` in the replica; their results, in order."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"steps": steps}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._expect("STEPS "))

    def close(self) -> dict[str, Any]:
        import time

        if self.result is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"exit": True}) + "\n")
            self.proc.stdin.flush()
            result = json.loads(self._expect("RESULT "))
            self.proc.wait(timeout=60)
            self._stderr.close()
            result["events"] = parse_events(self.stderr_path.read_text(errors="replace"))
            result["wall_s"] = time.perf_counter() - self._started
            self.result = result
        return self.result

    def __enter__(self) -> ReplicaSession:
        return self

    def __exit__(self, kind: Any, *_: Any) -> None:
        if kind is None:
            self.close()
        elif self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
            self._stderr.close()


def parse_events(text: str) -> list[dict[str, Any]]:
    """The structured (JSON) log lines in a process's output, in order; other lines are skipped."""
    events = []
    for ln in text.splitlines():
        start = ln.find("{")
        if start >= 0 and '"event"' in ln:
            try:
                events.append(json.loads(ln[start:]))
            except ValueError:
                pass
    return events
