"""The Policy and its parts: where KV rests, which prefixes are admitted, how long a load may take.

One package for everything a policy file says:

* :class:`Policy` (``_model``): the typed model, its YAML form, presets (``preset: NAME`` + overrides,
  ``_load``), field-level errors (``_errors``) and its renderings for LMCache (``_render``: the MP server's
  argv, the in-process engine's config);
* the admission rules (``_rules``): small callables composed with ``&``, ``|`` and ``~``::

      from prefixshare.policies import AdmissionRequest, Frequency, MinTokens, Pinned, TenantAllow

      rule = MinTokens(256) & (Pinned("manual-*") | Frequency(2, "1h")) & ~TenantAllow("guest")
      decision = rule(AdmissionRequest(prompt_tokens=1200, document_id="manual-3", tenant="acme"))
      bool(decision), decision.reason   # (True, "min_tokens: 1200 >= 256; pinned: doc 'manual-*'; ...")

  with a config form (``rule.to_config()`` / :func:`rule_from_config`) used in policy YAML files.

The rules need only the standard library, so importing this package is light; the model and its loaders
(pydantic, YAML) are imported on first use of one of their names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefixshare._lazy import lazy_exports
from prefixshare._units import parse_duration, parse_size
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

if TYPE_CHECKING:  # pragma: no cover
    from prefixshare.policies._load import list_presets, preset_text
    from prefixshare.policies._model import (
        FingerprintSettings,
        L1Settings,
        LoadSettings,
        Policy,
        ServerSettings,
        StoreSettings,
        VerifySettings,
        load_policy_file,
        policy_from_mapping,
    )
    from prefixshare.policies._render import (
        SERVER_MODULE,
        legacy_config,
        legacy_yaml,
        resolve_secrets,
        server_argv,
        server_env,
    )

#: names of the model and its loaders -> the module that defines them (imported on first use)
_LAZY: dict[str, str] = {
    **dict.fromkeys(["list_presets", "preset_text"], "prefixshare.policies._load"),
    **dict.fromkeys(["FingerprintSettings", "L1Settings", "LoadSettings", "Policy", "ServerSettings",
                     "StoreSettings", "VerifySettings", "load_policy_file", "policy_from_mapping"], "prefixshare.policies._model"),
    **dict.fromkeys(["SERVER_MODULE", "legacy_config", "legacy_yaml", "resolve_secrets", "server_argv", "server_env"],
                    "prefixshare.policies._render"),
}


__getattr__ = lazy_exports(__name__, _LAZY, globals())

__all__ = [
    "SERVER_MODULE",
    "TTL",
    "AdmissionRequest",
    "AllOf",
    "Always",
    "AnyOf",
    "ByteBudget",
    "Decision",
    "FingerprintSettings",
    "Frequency",
    "L1Settings",
    "LoadSettings",
    "MinTokens",
    "Never",
    "Not",
    "Pinned",
    "Policy",
    "Rule",
    "ServerSettings",
    "StoreSettings",
    "TenantAllow",
    "VerifySettings",
    "legacy_config",
    "legacy_yaml",
    "list_presets",
    "load_policy_file",
    "parse_duration",
    "parse_size",
    "policy_from_mapping",
    "preset_text",
    "rule_from_config",
    "resolve_secrets",
    "server_argv",
    "server_env",
]
