"""The fault matrix: every fault test records what it did and what it saw, one row per fault.

Rows are appended (JSON lines) to ``$PREFIXSHARE_FAULT_RESULTS`` or ``build/faults/results.jsonl`` under the
repository root; ``docs/reliability.md`` is rendered from them (``python tests/faults/render.py``), so the
page shows what the suite measured, never hand-written figures. Record only after the test's assertions
passed: a row is a claim that the behaviour held.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
AREAS = ("store down", "corruption", "compatibility", "isolation and exposure", "concurrency", "resource limits",
         "bad input")


def results_path() -> Path:
    return Path(os.environ.get("PREFIXSHARE_FAULT_RESULTS", ROOT / "build" / "faults" / "results.jsonl"))


@dataclass
class Row:
    area: str  #: one of AREAS
    fault: str  #: what was broken, e.g. "MP server killed between two requests"
    behaviour: str  #: what the product did, one sentence, e.g. "recomputed; output identical to a cold engine"
    engine: str = "vllm"  #: vllm | sglang | none (store tools, policy loading)
    tier: str = "fs"
    requests: int = 0  #: requests served while the fault was present (or after it)
    hits: int = 0  #: of those, requests that loaded KV from the store
    fallbacks: int = 0  #: of those, requests that recomputed because of the fault
    identical_to_cold: bool | None = None  #: every answer equal (greedy ids + logprobs) to a cold engine's
    max_added_latency_s: float | None = None  #: worst request time minus the cold time of the same prompt
    budget_s: float | None = None  #: the bound the added latency is held to (the policy's load timeout)
    corrupt_detected: int = 0  #: damaged objects detected (rejected on load, or reported by doctor)
    extra: dict[str, Any] = field(default_factory=dict)  #: anything else worth a column in the notes

    def __post_init__(self) -> None:
        if self.area not in AREAS:
            raise ValueError(f"area {self.area!r} is not one of {AREAS}")


def record(row: Row) -> None:
    path = results_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(asdict(row), sort_keys=True) + "\n")


def load(path: Path | None = None) -> list[Row]:
    path = path or results_path()
    if not path.exists():
        return []
    return [Row(**json.loads(line)) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
