"""``PrefixShare``: the top floor. One object owns the node's LMCache MP server and wires engines to it.

It imports the engine adapters (:mod:`prefixshare.adapters`) and :mod:`prefixshare.warm` directly: nothing
below it imports it (they receive it as an argument).
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from prefixshare._log import get_logger
from prefixshare.adapters import sglang as sglang_adapter
from prefixshare.adapters import vllm as vllm_adapter
from prefixshare.errors import PrefixShareError, ServerError
from prefixshare.policies import Policy
from prefixshare.runtime import read_stats
from prefixshare.server import LMCacheServer
from prefixshare.warm import engine_for, prompt_for, warm


class PrefixShare:
    """Share KV of stable prefixes across engine replicas under one :class:`~prefixshare.Policy`.

    ::

        with PrefixShare("policy.yaml") as ps:
            llm = ps.attach(vllm.EngineArgs(model="/models/m", block_size=128))
            out = llm.generate(prompt, params)
            print(ps.stats())

    ``server=True`` (default) starts the node's MP server from the policy, or reuses a compatible one
    already listening; ``server=False`` expects one to be running (it is checked, not started).
    """

    def __init__(self, policy: Policy | str | Path | None = None, *, server: bool = True,
                 instance: str | None = None) -> None:
        self.policy_file: str | None = None
        if isinstance(policy, str | Path):
            self.policy_file = str(Path(policy).resolve())
            policy = Policy.from_yaml(self.policy_file)
        self.policy: Policy = policy if policy is not None else Policy.from_preset("single-node")
        self.instance = instance or f"ps-{uuid.uuid4().hex[:10]}"
        self.server = LMCacheServer(self.policy)
        self._start_server = server
        self._started = False
        self.engines: list[Any] = []
        #: warm's view of each attached engine (its fingerprint is computed once), by engine identity
        self._warm_engines: dict[int, Any] = {}
        self.log = get_logger(__name__, instance=self.instance)

    # --- server --------------------------------------------------------------------------------------
    def start(self) -> PrefixShare:
        """Make sure the policy's MP server is up and keys the same way on every replica."""
        if self._started:
            return self
        if self._start_server:
            self.server.start()
        elif not self.server.healthy():
            raise ServerError(f"no LMCache server answers at {self.server.http_url}; start it with "
                              "`prefixshare server start --policy FILE` or use PrefixShare(..., server=True)")
        else:
            problems = self.server.incompatibilities()
            if problems:
                raise ServerError("the running LMCache server does not match the policy: " + "; ".join(problems))
        self._started = True
        return self

    # --- engines -------------------------------------------------------------------------------------
    def engine_kwargs(self, *, engine: str = "vllm", **kwargs: Any) -> dict[str, Any]:
        """Engine keyword arguments wired to prefixshare, for users who build the engine themselves
        (``vllm.LLM(**kw)``; for SGLang also apply :func:`prefixshare.adapters.sglang.runtime_env`)."""
        if engine == "sglang":
            return sglang_adapter.engine_kwargs(self.policy, instance=self.instance, **kwargs)
        return vllm_adapter.engine_kwargs(self.policy, instance=self.instance, policy_file=self.policy_file, **kwargs)

    def serve_args(self, model: str, *, engine: str = "vllm", policy_file: str | None = None) -> tuple[list[str], dict[str, str]]:
        """The server command line and environment for an engine replica behind an HTTP API."""
        policy_file = policy_file or self.policy_file
        if policy_file is None:
            raise PrefixShareError("serve_args needs the policy as a file (servers read it at start): "
                                   "PrefixShare('policy.yaml') or serve_args(..., policy_file=PATH)")
        if engine == "vllm":
            return vllm_adapter.serve_args(self.policy, model, policy_file=policy_file)
        if engine == "sglang":
            return sglang_adapter.serve_args(self.policy, model, policy_file=policy_file)
        raise PrefixShareError(f"unknown engine {engine!r}; supported: vllm, sglang")

    def attach(self, engine: Any, *, engine_type: str | None = None) -> Any:
        """Start an engine wired to the shared store and return it: a running ``vllm.LLM`` for vLLM
        (EngineArgs or LLM kwargs), a ``sglang.Engine`` for SGLang (ServerArgs or Engine kwargs)."""
        kind = engine_type or _engine_kind(engine)
        self.start()
        if kind == "vllm":
            llm = vllm_adapter.attach(self.policy, engine, instance=self.instance)
        elif kind == "sglang":
            llm = sglang_adapter.attach(self.policy, engine, instance=self.instance)
        else:
            raise PrefixShareError(f"unknown engine {kind!r}; supported: vllm, sglang")
        self.engines.append(llm)
        self.log.info("engine.attached", engine=kind)
        return llm

    # --- documents -------------------------------------------------------------------------------------
    def warm(self, docs: Any, engine: Any = None, **kwargs: Any) -> Any:
        """Prefill documents once so every replica starts hot; see :func:`prefixshare.warm.warm`."""
        return warm(self, docs, engine, **kwargs)

    def prompt_for(self, doc: Any, question: str, **kwargs: Any) -> Any:
        """A prompt whose document prefix is bit for bit the warmed one; see :func:`prefixshare.warm.prompt_for`."""
        return prompt_for(self, doc, question, **kwargs)

    def warm_engine(self, engine: Any = None) -> Any:
        """warm's view of an engine (default: the one attached last), built once per engine."""
        if engine is not None and not type(engine).__module__.startswith(("vllm", "sglang")):
            return engine_for(self, engine)  # already a WarmEngine (tests, other engines)
        target = engine if engine is not None else (self.engines[-1] if self.engines else None)
        cached = self._warm_engines.get(id(target))
        if cached is None or cached.engine is not target:
            cached = self._warm_engines[id(target)] = engine_for(self, target)
        return cached

    def verify(self, engine: Any = None, *, limit: int | None = None, budget_s: float | None = None) -> Any:
        """Check the store hits this instance's engines set aside (policy ``verify.sample``): each prompt loaded
        and recomputed, compared, quarantined on a mismatch. Call it when the engine is idle; see
        :mod:`prefixshare.verify`."""
        from prefixshare.verify import verify_pending

        return verify_pending(self, engine, limit=limit, budget_s=budget_s)

    # --- observability -------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters of every engine attached under this instance (hits, tokens, bytes, latencies, refusals)."""
        return read_stats(self.instance)

    # --- lifecycle -------------------------------------------------------------------------------------
    def close(self) -> None:
        for engine in self.engines:
            # vLLM: LLM -> llm_engine -> engine_core (the LLMEngine itself has no shutdown); SGLang: Engine.shutdown
            core = getattr(getattr(engine, "llm_engine", None), "engine_core", None)
            shutdown = getattr(core, "shutdown", None) or getattr(engine, "shutdown", None)
            if callable(shutdown):
                try:
                    shutdown()
                except Exception as exc:  # noqa: BLE001 - closing must not raise over the user's own error
                    self.log.warning("engine.shutdown_failed", error=str(exc))
        self.engines.clear()
        self._warm_engines.clear()
        self.server.stop()
        self._started = False

    def __enter__(self) -> PrefixShare:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _engine_kind(engine: Any) -> str:
    module = type(engine).__module__.split(".")[0]
    if module in ("vllm", "sglang"):
        return module
    if isinstance(engine, dict):
        return "sglang" if "model_path" in engine else "vllm"
    raise PrefixShareError(f"cannot tell which engine {type(engine).__name__} is; pass engine_type='vllm' or 'sglang'")
