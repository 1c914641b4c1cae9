"""The fault matrix: every fault test records what it did and what it saw, one row per fault.

Rows are appended (JSON lines) to ``$PREFIXSHARE_FAULT_RESULTS`` or ``build/faults/results.jsonl`` under the
repository root; ``docs/reliability.md`` is rendered from ONE run's rows (``python tests/faults/render.py
--write``, which also copies those rows to ``docs/reliability.jsonl``), so the page shows what one run of the
suite measured, never hand-written figures. Record only after the test's assertions passed: a row is a claim
that the behaviour held. Every numeric cell must be something the test observed (the connector's counters,
answers compared with a cold engine's, wall times), never a literal.

Each row carries the run it belongs to (``run_id``: one per pytest session, shared through the environment
variable ``PREFIXSHARE_FAULT_RUN`` with everything started from it, created on first use when absent), the
commit it ran on (``git rev-parse HEAD``, ``-dirty`` when the tree had changes; ``unknown`` outside git) and
when it was recorded.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
AREAS = ("store down", "corruption", "compatibility", "isolation and exposure", "concurrency", "under load",
         "network", "resource limits", "bad input")
ENGINES = ("vllm", "sglang", "none")
RUN_ENV = "PREFIXSHARE_FAULT_RUN"
COMMIT_ENV = "PREFIXSHARE_FAULT_COMMIT"
#: machine noise the tests allow on top of a latency budget (2 shared CPU cores, other engines running beside);
#: the page marks rows against the budget itself and states this tolerance separately
SLACK_S = 1.0
#: the connector's counters: measured for rows that ran an engine, absent (None) for rows that did not
COUNTERS = ("requests", "hits", "fallbacks", "tokens_loaded")


def results_path() -> Path:
    return Path(os.environ.get("PREFIXSHARE_FAULT_RESULTS", ROOT / "build" / "faults" / "results.jsonl"))


def run_id() -> str:
    """This run's id (sortable by start time); created, and exported to child processes, when absent."""
    value = os.environ.get(RUN_ENV)
    if not value:
        value = f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{secrets.token_hex(3)}"
        os.environ[RUN_ENV] = value
    return value


def commit() -> str:
    """The commit the run started on (fixed once per run: the tree may change while it runs)."""
    value = os.environ.get(COMMIT_ENV)
    if not value:
        value = _git_commit()
        os.environ[COMMIT_ENV] = value
    return value


def _git_commit() -> str:
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain"], capture_output=True, text=True,
                               timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head.stdout.strip() + ("-dirty" if dirty.returncode != 0 or dirty.stdout.strip() else "")


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass
class Row:
    area: str  #: one of AREAS
    fault: str  #: what was broken, e.g. "MP server killed between two requests"
    behaviour: str  #: what the product did, one sentence, e.g. "recomputed; output identical to a cold engine"
    engine: str = "vllm"  #: vllm | sglang | none (store tools, policy loading: no engine ran)
    tier: str = "fs"
    #: the connector's counters over the requests served while the fault was present (or right after it), from
    #: its stats (tests/faults/_common.py ``counters``); None where no engine ran
    requests: int | None = None
    hits: int | None = None  #: of those, requests whose lookup found KV in the store
    fallbacks: int | None = None  #: of those, requests the connector recomputed (store_down, lookup_timeout, ...)
    tokens_loaded: int | None = None  #: tokens those requests loaded from the store
    identical_to_cold: bool | None = None  #: every answer equal (greedy ids + logprobs) to a cold engine's
    max_added_latency_s: float | None = None  #: worst request time minus the cold time of the same prompt
    budget_s: float | None = None  #: the bound the added latency is held to (the policy's load timeout)
    corrupt_detected: int = 0  #: damaged objects detected (rejected on load, or reported by doctor)
    extra: dict[str, Any] = field(default_factory=dict)  #: what else was observed (the fault itself, above all)
    run_id: str = ""  #: the pytest session that recorded it (set by record())
    commit: str = ""  #: the commit it ran on (set by record())
    recorded_at: str = ""  #: UTC, ISO 8601 (set by record())

    def __post_init__(self) -> None:
        if self.area not in AREAS:
            raise ValueError(f"area {self.area!r} is not one of {AREAS}")

    @property
    def real_engine(self) -> bool:
        return self.engine != "none"

    @property
    def over_budget(self) -> bool:
        return (self.max_added_latency_s is not None and self.budget_s is not None
                and self.max_added_latency_s > self.budget_s)

    def check(self) -> None:
        """What record() refuses: an unknown engine, engine rows without the connector's counters, counters on
        rows that ran no engine."""
        if self.engine not in ENGINES:
            raise ValueError(f"engine {self.engine!r} is not one of {ENGINES}")
        given = {name: getattr(self, name) for name in COUNTERS}
        if self.real_engine:
            missing = [name for name in ("requests", "hits", "fallbacks") if given[name] is None]
            if missing:
                raise ValueError(f"row {self.fault!r} ran {self.engine} but does not say its measured {missing}")
        else:
            present = [name for name, value in given.items() if value is not None]
            if present:
                raise ValueError(f"row {self.fault!r} ran no engine but gives connector counters {present}; "
                                 "put what it counted in extra")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Row:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def record(row: Row) -> None:
    row.check()
    row.run_id, row.commit, row.recorded_at = run_id(), commit(), now()
    path = results_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(asdict(row), sort_keys=True) + "\n")


def load_raw(path: Path | None = None) -> list[dict[str, Any]]:
    path = path or results_path()
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def load(path: Path | None = None) -> list[Row]:
    return [Row.from_dict(d) for d in load_raw(path)]
