"""Render a Policy into what LMCache reads: the MP server's argv and the in-process engine config.

Field names are LMCache's own; tests feed both renderings to LMCache's parsers, so a rendering that
LMCache would reject (or silently ignore) fails our suite rather than a user's deployment.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

from prefixshare._env import LMCACHE_QUIET

if TYPE_CHECKING:  # pragma: no cover
    from prefixshare.policies._model import Policy


def _fmt(value: float) -> str:
    return repr(value) if isinstance(value, float) else str(value)


#: the server's entry module: ``lmcache server`` with prefixshare's guards (prefixshare.server.plugins.guards)
SERVER_MODULE = "prefixshare.server.plugins.main"


def server_argv(policy: Policy, *, executable: list[str] | None = None, redact: bool = False) -> list[str]:
    """The full command line of ``lmcache server`` for this policy.

    ``executable`` defaults to this interpreter running :data:`SERVER_MODULE` — LMCache's CLI with
    prefixshare's guards installed first (an engine's abandoned store is discarded, not admitted) — so the
    server always comes from the same environment as prefixshare (not whichever ``lmcache`` is first on PATH).
    """
    srv, l1 = policy.server, policy.l1
    argv = list(executable) if executable is not None else [sys.executable, "-m", SERVER_MODULE]
    argv += [
        "server",
        "--host", srv.host,
        "--port", str(srv.port),
        "--chunk-size", str(policy.chunk_size),
        "--hash-algorithm", srv.hash_algorithm,
        "--max-workers", str(srv.max_workers),
        "--supported-transfer-mode", srv.transfer_mode,
        "--l1-size-gb", _fmt(l1.size_gb),
        "--eviction-policy", l1.eviction,
        "--eviction-trigger-watermark", _fmt(l1.trigger_watermark),
        "--eviction-ratio", _fmt(l1.eviction_ratio),
        "--http-host", srv.http_host,
        "--http-port", str(srv.http_port),
    ]  # fmt: skip
    if srv.shm_segment is not None:
        argv += ["--shm-name", srv.shm_segment]
    for index, tier in enumerate(policy.l2):
        cfg = tier.redacted() if redact else tier.server_config()
        for key in tier.secret_fields():
            if key in cfg and cfg[key] is not None:
                cfg[key] = {SECRET_REF: secret_env_name(index, key)}
        argv += ["--l2-adapter", json.dumps(cfg, sort_keys=True, separators=(",", ":"))]
    argv += list(srv.extra_args)
    return argv


#: a secret in an ``--l2-adapter`` argument is ``{SECRET_REF: <variable>}``: the server's environment holds it
#: (``/proc/<pid>/environ`` is readable by its owner only, ``cmdline`` by every local user) and the server's
#: entry point puts it in place before LMCache reads the argument (:func:`resolve_secrets`)
SECRET_REF = "prefixshare_secret_env"


def secret_env_name(index: int, key: str) -> str:
    """The server's environment variable holding secret ``key`` of the ``index``-th L2 tier."""
    return f"PREFIXSHARE_L2_{index}_{key.upper()}"


def server_env(policy: Policy) -> dict[str, str]:
    """Environment the server process needs: telemetry off, plus tier credentials (the secrets its command
    line refers to, see :data:`SECRET_REF`)."""
    env = dict(LMCACHE_QUIET)
    for index, tier in enumerate(policy.l2):
        env.update(tier.server_env())
        secrets = tier.secret_fields()
        if secrets:
            cfg = tier.server_config()
            env.update({secret_env_name(index, key): str(cfg[key]) for key in secrets if cfg.get(key) is not None})
    return env


def resolve_secrets(argv: list[str], environ: dict[str, str]) -> list[str]:
    """``argv`` with every secret reference in its ``--l2-adapter`` arguments replaced by the variable's value.
    Raises ValueError naming the variable when the environment lacks it."""
    out = list(argv)
    for i, arg in enumerate(out[:-1]):
        if arg != "--l2-adapter" or SECRET_REF not in out[i + 1]:
            continue
        cfg = json.loads(out[i + 1])
        for key, value in list(cfg.items()):
            if isinstance(value, dict) and set(value) == {SECRET_REF}:
                name = value[SECRET_REF]
                if name not in environ:
                    raise ValueError(f"the L2 tier's {key} is read from the server's environment variable {name}, "
                                     "which is not set")
                cfg[key] = environ[name]
        out[i + 1] = json.dumps(cfg, sort_keys=True, separators=(",", ":"))
    return out


def legacy_config(policy: Policy) -> dict[str, Any]:
    """The in-process ``LMCacheEngineConfig`` mapping (YAML keys) equivalent to this policy.

    The in-process engine has one CPU tier and at most one remote: the first L2 tier that has an
    in-process equivalent becomes ``remote_url``; what cannot be expressed is listed under the
    ``_notes`` key (not an LMCache key; strip it before writing LMCache's YAML — :func:`legacy_yaml`).
    """
    notes: list[str] = []
    cfg: dict[str, Any] = {
        "chunk_size": policy.chunk_size,
        "local_cpu": True,
        "max_local_cpu_size": policy.l1.size_gb,
        "save_unfull_chunk": False,
        # The default ('builtin') is Python's hash(): replicas only agree when every one sets the same
        # PYTHONHASHSEED. sha256_cbor is deterministic, so replicas agree by construction.
        "pre_caching_hash_algorithm": "sha256_cbor",
        "remote_serde": "naive",
    }
    remote = None
    for tier in policy.l2:
        legacy = tier.legacy()
        if legacy is None:
            notes.append(f"tier {tier.describe()} has no in-process equivalent; it is left out")
        elif remote is None:
            remote = legacy
            notes.extend(legacy.notes)
        else:
            notes.append(f"the in-process engine takes one remote; tier {tier.describe()} is left out")
    if remote is not None:
        cfg["remote_url"] = remote.remote_url
        if remote.extra_config:
            cfg["extra_config"] = dict(remote.extra_config)
    if policy.tenant:
        notes.append("tenant isolation is applied by prefixshare's connector (cache salt), not by this config")
    cfg["_notes"] = notes
    return cfg


def legacy_yaml(policy: Policy) -> str:
    import yaml

    cfg = {k: v for k, v in legacy_config(policy).items() if not k.startswith("_")}
    return yaml.safe_dump(cfg, sort_keys=False)
