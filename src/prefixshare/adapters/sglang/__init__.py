"""SGLang adapter: engine kwargs, server flags, per-request settings and ``attach``.

SGLang runs prefixshare inside its scheduler through a radix-cache backend (``_backend``) that it
discovers through the ``sglang.srt.plugins`` entry point (``_plugin``); this module prepares the engine's
arguments and environment. Also here: the per-request settings SGLang carries (``_requests``), what the
fingerprint reads from ``ServerArgs`` (``_settings``), warm's view of a running engine (``_warm``), and every
use of SGLang's and LMCache's internals (``_compat``). Nothing here imports SGLang at module import time.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import yaml

from prefixshare._env import LMCACHE_QUIET
from prefixshare._paths import run_dir
from prefixshare.adapters.sglang._requests import parse_rid, request_kwargs
from prefixshare.adapters.sglang._settings import BACKEND, ENV_CONFIG
from prefixshare.adapters.sglang._warm import SglangEngine
from prefixshare.errors import FieldProblem, PolicyError, PrefixShareError
from prefixshare.keys import KEY_INSTANCE, KEY_POLICY, KEY_POLICY_FILE
from prefixshare.policies import Policy

ENGINE_ENV = LMCACHE_QUIET


def lmcache_config(policy: Policy) -> dict[str, Any]:
    """The LMCache client config SGLang reads (MP server address; every RPC bounded by the load timeout)."""
    return {
        "mp_host": f"tcp://{policy.server.host}",
        "mp_port": policy.server.port,
        "chunk_size": policy.chunk_size,
        "extra_config": {
            "lmcache.mp.mq_timeout": policy.load.timeout_s,
            "lmcache.mp.heartbeat_interval": 1.0,
        },
    }


def write_lmcache_config(policy: Policy, instance: str) -> Path:
    path = run_dir() / f"sglang-lmcache-{instance}.yaml"
    path.write_text(yaml.safe_dump(lmcache_config(policy), sort_keys=False))
    path.chmod(0o600)
    return path


def runtime_env(policy: Policy, *, instance: str, policy_file: str | None = None) -> dict[str, str]:
    config: dict[str, Any] = {KEY_INSTANCE: instance}
    if policy_file is not None:
        config[KEY_POLICY_FILE] = str(Path(policy_file).resolve())
    else:
        config[KEY_POLICY] = policy.to_dict()
    return {**ENGINE_ENV, ENV_CONFIG: json.dumps(config)}


def check_engine_kwargs(policy: Policy, kwargs: dict[str, Any]) -> None:
    """Refuse engine settings that conflict with the policy, before an engine is started."""
    problems: list[FieldProblem] = []
    backend = kwargs.get("radix_cache_backend")
    if backend not in (None, BACKEND):
        problems.append(FieldProblem("engine.radix_cache_backend", backend, "selects another prefix cache",
                                     "remove it: prefixshare selects its own backend"))
    if kwargs.get("disable_radix_cache"):
        problems.append(FieldProblem("engine.disable_radix_cache", True, "turns prefix caching off; shared "
                                     "prefixes need it", "remove disable_radix_cache"))
    page = kwargs.get("page_size")
    if page is not None and policy.chunk_size % int(page):
        problems.append(FieldProblem("engine.page_size", page, f"does not divide the policy's chunk_size "
                                     f"{policy.chunk_size}", f"use a page size that divides {policy.chunk_size}"))
    if kwargs.get("enable_lmcache") is False:
        problems.append(FieldProblem("engine.enable_lmcache", False, "turns the shared store off",
                                     "remove enable_lmcache=False"))
    if problems:
        raise PolicyError(problems, source="engine arguments vs policy")


def engine_kwargs(policy: Policy, *, instance: str, **kwargs: Any) -> dict[str, Any]:
    """``sglang.Engine(**kwargs)`` keyword arguments wired to prefixshare (the environment comes separately:
    :func:`runtime_env`)."""
    check_engine_kwargs(policy, kwargs)
    out = dict(kwargs)
    out.update(enable_lmcache=True, radix_cache_backend=BACKEND,
               lmcache_config_file=str(write_lmcache_config(policy, instance)))
    return out


def serve_args(policy: Policy, model: str, *, policy_file: str, instance: str = "sglang-serve") -> tuple[list[str], dict[str, str]]:
    """The ``python -m sglang.launch_server`` command line and environment for a server replica."""
    config = write_lmcache_config(policy, instance)
    argv = ["python", "-m", "sglang.launch_server", "--model-path", model, "--enable-lmcache",
            "--lmcache-config-file", str(config), "--radix-cache-backend", BACKEND]
    return argv, runtime_env(policy, instance=instance, policy_file=policy_file)


def _kwargs_from_server_args(args: Any) -> dict[str, Any]:
    """The Engine keyword arguments a ServerArgs differs from the defaults by (0.5.23's ServerArgs is a msgspec
    Struct; older ones are dataclasses)."""
    names = getattr(args, "__struct_fields__", None)
    if names is None:
        names = [f.name for f in dataclasses.fields(args)]
    defaults = type(args)(model_path=args.model_path)
    return {name: getattr(args, name) for name in names
            if name == "model_path" or getattr(args, name) != getattr(defaults, name)}


def attach(policy: Policy, engine: Any, *, instance: str) -> Any:
    """Start a ``sglang.Engine`` from ServerArgs or a dict of Engine kwargs, wired to prefixshare.

    SGLang starts its scheduler in child processes: call this under ``if __name__ == "__main__":``.
    """
    import sglang

    if isinstance(engine, sglang.Engine):
        raise PrefixShareError(
            "a running sglang.Engine cannot be rewired; pass its ServerArgs (or a dict of Engine keyword "
            "arguments) to ps.attach(...)"
        )
    from sglang.srt.server_args import ServerArgs

    if isinstance(engine, ServerArgs):
        kwargs = _kwargs_from_server_args(engine)
    elif isinstance(engine, dict):
        kwargs = dict(engine)
    else:
        raise PrefixShareError(f"cannot attach to {type(engine).__name__}: pass ServerArgs or a dict of Engine kwargs")
    kwargs = engine_kwargs(policy, instance=instance, **kwargs)
    os.environ.update(runtime_env(policy, instance=instance))
    return sglang.Engine(**kwargs)


__all__ = ["BACKEND", "SglangEngine", "attach", "check_engine_kwargs", "engine_kwargs", "lmcache_config", "parse_rid",
           "request_kwargs", "runtime_env", "serve_args"]
