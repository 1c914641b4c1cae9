"""Admission policies: which prefixes are stored in the shared KV store.

Rules are small callables composed with ``&``, ``|`` and ``~``::

    from prefixshare.policies import AdmissionRequest, Frequency, MinTokens, Pinned, TenantAllow

    rule = MinTokens(256) & (Pinned("manual-*") | Frequency(2, "1h")) & ~TenantAllow("guest")
    decision = rule(AdmissionRequest(prompt_tokens=1200, document_id="manual-3", tenant="acme"))
    bool(decision), decision.reason   # (True, "min_tokens: 1200 >= 256; pinned: doc 'manual-*'; ...")

and have a config form (``rule.to_config()`` / :func:`rule_from_config`) used in policy YAML files.
This package imports only the standard library and :mod:`prefixshare.errors` (logging is lazy).
"""

from prefixshare.policies._rules import (
    TTL,
    AdmissionRequest,
    AllOf,
    Always,
    AnyOf,
    ByteBudget,
    Decision,
    Frequency,
    MinTokens,
    Never,
    Not,
    Pinned,
    Rule,
    TenantAllow,
    rule_from_config,
)
from prefixshare.policies._units import parse_duration, parse_size

__all__ = [
    "TTL",
    "AdmissionRequest",
    "AllOf",
    "Always",
    "AnyOf",
    "ByteBudget",
    "Decision",
    "Frequency",
    "MinTokens",
    "Never",
    "Not",
    "Pinned",
    "Rule",
    "TenantAllow",
    "parse_duration",
    "parse_size",
    "rule_from_config",
]
