"""Shared pieces of the fault suite: a step-driven replica whose pauses the test acts in, the documents every
module uses, and comparisons with the cold engine (see tests/faults/conftest.py for the session fixtures)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from e2e.common import hf_greedy, parse_events, same_output  # noqa: F401 - hf_greedy: re-exported
from faults._matrix import SLACK_S  # noqa: F401 - re-exported: the tests' tolerance, stated on the page

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "_replica.py"
#: every prompt of the suite: name -> (seed, tokens); 640 tokens = 10 chunks of 64
DOCS: dict[str, tuple[int, int]] = {name: (40 + i, 640) for i, name in enumerate("abcdefghijkl")}
WARMUP = "warmup"  # the first request of a process is slow (kernels, allocations): never timed
DOCS[WARMUP] = (39, 100)


def gen(name: str, ids: list[int], *, reset: bool = True, **extra: Any) -> dict[str, Any]:
    return {"op": "generate", "name": name, "ids": ids, "reset": reset, **extra}


def pause(name: str) -> dict[str, Any]:
    return {"op": "pause", "name": name}


def run_steps(work: Path, name: str, model: Path, policy: Any, steps: list[dict[str, Any]],
              actions: dict[str, Callable[[], Any]] | None = None, *, timeout: float = 600,
              engine: dict[str, Any] | None = None, wait: bool = True) -> Any:
    """Run a replica; at each pause call ``actions[name]()`` (in this process), then let the replica go on.

    Returns its result (``results`` per step, final ``stats``, ``events`` = structured log lines, ``actions`` =
    what each action returned). With ``wait=False`` returns a handle whose ``.result()`` does the same."""
    handle = _Running(work, name, model, policy, steps, actions or {}, timeout, engine or {})
    return handle.result() if wait else handle


class _Running:
    def __init__(self, work: Path, name: str, model: Path, policy: Any, steps: list[dict[str, Any]],
                 actions: dict[str, Callable[[], Any]], timeout: float, engine: dict[str, Any]) -> None:
        self.control = work / f"{name}.control"
        self.control.mkdir(parents=True, exist_ok=True)
        spec = {"model": str(model), "policy": policy.to_dict() if policy is not None else None,
                "instance": f"{name}-{os.getpid()}", "steps": steps, "control": str(self.control),
                "engine": engine}
        path = work / f"{name}.json"
        path.write_text(json.dumps(spec))
        self.name, self.work, self.actions, self.timeout = name, work, actions, timeout
        self.out = open(work / f"{name}.stdout", "w")  # noqa: SIM115 - closed in result()
        self.err = open(work / f"{name}.stderr", "w")  # noqa: SIM115
        env = {**os.environ, "PREFIXSHARE_LOG_JSON": "1", "PREFIXSHARE_LOG_LEVEL": "INFO"}
        self.started = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, str(SCRIPT), str(path)], stdout=self.out, stderr=self.err,
                                     env=env, start_new_session=True)
        self.done: dict[str, Any] = {}

    def poll_pauses(self) -> None:
        for ready in sorted(self.control.glob("*.ready")):
            pname = ready.name[: -len(".ready")]
            if pname in self.done:
                continue
            action = self.actions.get(pname)
            self.done[pname] = action() if action is not None else None
            (self.control / f"{pname}.go").write_text("go")

    def result(self) -> dict[str, Any]:
        try:
            while self.proc.poll() is None:
                if time.monotonic() - self.started > self.timeout:
                    os.killpg(self.proc.pid, 9)
                    raise AssertionError(f"replica {self.name} ran past {self.timeout} s")
                self.poll_pauses()
                time.sleep(0.05)
        finally:
            self.out.close()
            self.err.close()
        stdout = (self.work / f"{self.name}.stdout").read_text()
        stderr = (self.work / f"{self.name}.stderr").read_text()
        line = next((ln for ln in stdout.splitlines() if ln.startswith("RESULT ")), None)
        assert line, f"replica {self.name} failed (rc {self.proc.returncode}):\n{stderr[-4000:]}"
        result = json.loads(line[len("RESULT "):])
        events = parse_events(stderr + stdout)
        unreset = [r["name"] for r in result["results"] if r.get("reset_ok") is False]
        assert not unreset, f"replica {self.name} could not clear its own prefix cache before {unreset}"
        result["events"] = events
        result["actions"] = self.done
        result["by_name"] = {r["name"]: r for r in result["results"]}
        return result


def delta(before: dict[str, Any] | None, after: dict[str, Any] | None, key: str, sub: str | None = None) -> int:
    """How much a stats counter grew between two steps' snapshots."""
    def get(s: dict[str, Any] | None) -> int:
        if not s:
            return 0
        value = s.get(key, 0)
        return int(value.get(sub, 0)) if sub is not None else int(value or 0)
    return get(after) - get(before)


def counters(run: dict[str, Any], first: str, last: str | None = None) -> dict[str, Any]:
    """The connector's counters over the steps ``first`` .. ``last`` (inclusive, in run order) of a replica run,
    from its per-step stats snapshots: ``requests``, ``hits`` (lookups that found KV), ``fallbacks`` (every
    reason, broken down in ``fallback_reasons``), ``tokens_loaded``, ``tokens_stored``, ``admitted``."""
    results = run["results"]
    names = [r["name"] for r in results]
    i, j = names.index(first), names.index(last or first)
    assert i <= j, (first, last)
    before = next((r["stats"] for r in reversed(results[:i]) if r.get("stats")), None)
    after = next((r["stats"] for r in reversed(results[: j + 1]) if r.get("stats")), None)
    assert after is not None, f"no stats snapshot up to {last or first!r}: the replica ran without prefixshare"
    reasons = {k: v - (before or {}).get("fallbacks", {}).get(k, 0) for k, v in after.get("fallbacks", {}).items()}
    reasons = {k: v for k, v in reasons.items() if v}
    out = {key: delta(before, after, key) for key in ("requests", "hits", "tokens_loaded", "tokens_stored",
                                                      "admitted")}
    out.update(fallbacks=sum(reasons.values()), fallback_reasons=reasons)
    return out


def row_counters(c: dict[str, Any]) -> dict[str, int]:
    """The part of :func:`counters` a Row holds (``Row(..., **row_counters(c))``)."""
    return {k: c[k] for k in ("requests", "hits", "fallbacks", "tokens_loaded")}


def log_since(path: Path, offset: int) -> str:
    """What a (server) log gained since ``offset`` bytes."""
    with path.open("rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def process_state(pid: int) -> str | None:
    """The kernel's state letter of a process (R, S, D, T = stopped, Z = zombie ...), None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def wait_state(pid: int, state: str, timeout_s: float) -> str | None:
    """Poll :func:`process_state` until it is ``state`` (a signal is delivered asynchronously) or ``timeout_s``
    passed; returns the last state seen."""
    deadline = time.monotonic() + timeout_s
    while (seen := process_state(pid)) != state and time.monotonic() < deadline:
        time.sleep(0.01)
    return seen


def identical(got: dict[str, Any], cold: dict[str, Any]) -> bool:
    return same_output(got, cold)


def added_latency(got: dict[str, Any], cold: dict[str, Any], cold_all: dict[str, Any] | None = None) -> float:
    """Request time minus the cold engine's time for the same prompt. With ``cold_all`` (every cold answer),
    the baseline is the fastest cold request of the same length instead: on a loaded machine one cold timing
    can be seconds off, and the fastest one is the conservative baseline (it only makes the added latency
    larger)."""
    base = cold["seconds"]
    if cold_all:
        same = [c["seconds"] for c in cold_all.values() if c.get("prompt_tokens") == got.get("prompt_tokens")]
        base = min(same, default=base)
    return round(got["seconds"] - base, 3)
