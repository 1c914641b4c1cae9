"""The Policy: one typed object for where KV rests, what is admitted and how long a load may take."""

from prefixshare.policy._load import list_presets, load_policy_file, policy_from_mapping, preset_text
from prefixshare.policy._model import FingerprintSettings, L1Settings, LoadSettings, Policy, ServerSettings
from prefixshare.policy._render import legacy_config, legacy_yaml, server_argv, server_env

__all__ = [
    "FingerprintSettings",
    "L1Settings",
    "LoadSettings",
    "Policy",
    "ServerSettings",
    "legacy_config",
    "legacy_yaml",
    "list_presets",
    "load_policy_file",
    "policy_from_mapping",
    "preset_text",
    "server_argv",
    "server_env",
]
