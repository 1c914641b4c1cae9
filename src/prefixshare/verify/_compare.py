"""Whether a prompt's first token is the same, loaded from the store and recomputed without it."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from prefixshare.adapters import PrefillResult


@dataclass(frozen=True)
class Comparison:
    """The first-token log-probabilities of one prompt, loaded and recomputed, side by side."""

    ok: bool
    #: the largest log-probability difference over the tokens compared (inf: one run lacks a token)
    max_diff: float
    tolerance: float
    load_token: int | None
    cold_token: int | None
    #: what failed, in words ('' when ok)
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["max_diff"] = None if math.isinf(self.max_diff) else round(self.max_diff, 6)
        return out


def compare(load: PrefillResult, cold: PrefillResult, tolerance: float) -> Comparison:
    """Compare the greedy first tokens of a loaded and a cold run through their log-probabilities.

    Each run's greedy token must be among the other's top log-probabilities, with a log-probability that
    differs by at most ``tolerance``. Two tokens of almost equal probability may swap places (a near tie
    decided by the order of a float reduction): that passes, as the log-probabilities say it is a tie. Foreign or
    damaged KV moves them by whole units."""
    if load.logprobs is None or cold.logprobs is None or load.first_token is None or cold.first_token is None:
        return Comparison(False, math.inf, tolerance, load.first_token, cold.first_token,
                          "a run returned no log-probabilities")
    worst = 0.0
    reasons = []
    for name, token in (("cold", cold.first_token), ("loaded", load.first_token)):
        a, b = load.logprobs.get(token), cold.logprobs.get(token)
        if a is None or b is None:
            worst = math.inf
            missing = "loaded" if a is None else "cold"
            reasons.append(f"the {name} run's token {token} is not among the {missing} run's likeliest")
            continue
        diff = abs(a - b)
        worst = max(worst, diff)
        if diff > tolerance:
            reasons.append(f"token {token}: log-probability {a:.4f} loaded vs {b:.4f} cold (|diff| {diff:.4f} > "
                           f"{tolerance:g})")
    return Comparison(not reasons, worst, tolerance, load.first_token, cold.first_token, "; ".join(reasons))
