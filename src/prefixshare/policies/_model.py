"""The typed Policy: where KV bytes rest, what is admitted, how long a load may take.

One object replaces LMCache's two config surfaces (YAML/env for the in-process engine; CLI flags plus
per-adapter JSON for the MP server). It renders both (see :mod:`prefixshare.policies._render`), and every
invalid value is reported with its field path and a fix (see :mod:`prefixshare.policies._errors`).
"""

from __future__ import annotations

import re
from pathlib import Path

from typing import Any, Literal

from pydantic_core import PydanticCustomError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from prefixshare.errors import _MISSING, FieldProblem, PolicyError
from prefixshare.policies._errors import prefixed, problems_from, to_policy_error
from prefixshare.policies._load import parse_policy_file, parse_policy_text, resolve_presets
from prefixshare.policies._render import legacy_config, server_argv
from prefixshare.policies._rules import Rule, rule_from_config
from prefixshare.tiers import TierConfig, known_tiers, problem, tier_class

_STRICT = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class L1Settings(BaseModel):
    """The MP server's CPU memory tier (every chunk passes through it)."""

    model_config = _STRICT

    size_gb: float = Field(1.0, gt=0, description="CPU memory the server reserves for KV chunks")
    eviction: Literal["LRU", "ARC", "IsolatedLRU", "noop"] = "LRU"
    trigger_watermark: float = Field(0.8, gt=0, le=1)
    eviction_ratio: float = Field(0.2, gt=0, le=1)


class ServerSettings(BaseModel):
    """Where the node's LMCache MP server listens and how engines talk to it."""

    model_config = _STRICT

    host: str = "127.0.0.1"
    port: int = Field(5555, gt=0, lt=65536, description="ZMQ port engines connect to")
    http_host: str = "127.0.0.1"
    http_port: int = Field(5556, gt=0, lt=65536, description="health, status and metrics")
    #: engine_driven is what CPU engines use; lmcache_driven is the CUDA path; auto serves both.
    transfer_mode: Literal["auto", "engine_driven", "lmcache_driven"] = "auto"
    shm_name: str | None = Field(
        "auto", description="shared memory between the node's engines and the server (the server's L1 lives in "
        "it; KV is copied in place instead of pickled through the socket): 'auto' = a segment "
        "named after the port, turned off with a warning when /dev/shm cannot hold l1.size_gb; a name; or null "
        "(off)")
    #: blake3 and sha256_cbor are deterministic across processes; 'builtin' (Python hash) is not.
    hash_algorithm: Literal["blake3", "sha256_cbor"] = "blake3"
    max_workers: int = Field(1, gt=0)
    start_timeout_s: float = Field(60.0, gt=0, description="how long to wait for the server to be healthy")
    extra_args: list[str] = Field(default_factory=list, description="appended verbatim to the server argv")

    @field_validator("shm_name")
    @classmethod
    def _shm_name(cls, value: str | None) -> str | None:
        if value in (None, "", "auto"):
            return value or None
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,100}", value):
            raise problem("is not a usable shared-memory name",
                          "use letters, digits, '.', '_' and '-' (at most 100), 'auto', or null to turn it off")
        return value

    @property
    def shm_segment(self) -> str | None:
        """The ``--shm-name`` the server gets (None: shared memory off)."""
        if self.shm_name == "auto":
            return f"prefixshare-{self.port}"
        return self.shm_name

    @model_validator(mode="after")
    def _ports(self) -> ServerSettings:
        if self.port == self.http_port and self.host == self.http_host:
            raise problem(
                f"port and http_port are both {self.port}", "give the HTTP endpoint its own port, e.g. port + 1"
            )
        return self

    @property
    def url(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.http_host}:{self.http_port}"


class LoadSettings(BaseModel):
    """How long a load may take before the engine recomputes instead."""

    model_config = _STRICT

    timeout_s: float = Field(2.0, gt=0, le=600, description="bound on one request's KV lookup + load")
    #: auto: load when the store is predicted faster than prefill; always / never force a choice.
    mode: Literal["auto", "always", "never"] = "always"


class StoreSettings(BaseModel):
    """How an engine's KV reaches the node's server."""

    model_config = _STRICT

    defer: bool = Field(
        True, description="copy a step's KV into the server after the step has returned its tokens (the "
        "engine keeps the blocks until the copy is done), so a miss's first token does not wait for the "
        "store; false: inside the step, so a response implies its prefix is in the node's server. Applies "
        "where LMCache's own copy is synchronous (CPU engines); accelerator paths are asynchronous already")


class FingerprintSettings(BaseModel):
    """How the compatibility fingerprint identifies the model."""

    model_config = _STRICT

    #: content: digest of every weight byte (once per file, cached); headers: tensor names, shapes and
    #: file sizes only — faster on huge checkpoints, but two checkpoints of equal shape collide.
    weights: Literal["content", "headers"] = "content"
    revision: str | None = Field(None, description="model revision (commit) when known")
    #: where replicas record the fingerprints they write under (manifests), so a replica that cannot read a
    #: store explains why, field by field: any fsspec URL (a shared directory, s3://bucket/prefix with s3fs...).
    #: Default: the first fs tier's directory. Stores without one (Redis, Valkey, Mooncake, S3) need it for the
    #: explanation; without it an incompatible replica still loads nothing, but does not say why.
    manifests: str | None = Field(None, description="fsspec URL for fingerprint manifests (default: the fs tier)")

    @field_validator("manifests")
    @classmethod
    def _manifests_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        value = value.strip()
        scheme, sep, _ = value.partition("://")
        if not sep:
            if not value.startswith("/"):
                raise ValueError(f"{value!r} is a relative path; give an absolute directory or a URL (s3://...)")
            return value
        from fsspec.registry import known_implementations, registry

        if scheme not in registry and scheme not in known_implementations:
            raise ValueError(f"{value!r}: no filesystem for the scheme {scheme!r}; use a directory or a URL fsspec "
                             "knows (file://, s3://, gs://, memory://...)")
        return value


class VerifySettings(BaseModel):
    """Sampled verification of store hits (off by default).

    A fraction of the requests that loaded KV from the store is set aside; later, off the request path
    (``PrefixShare.verify()`` when the engine is idle, or ``prefixshare verify``), the replica runs each prompt
    twice, loaded from the store and recomputed without it, and compares the first token's log-probabilities.
    A mismatch quarantines the chunks, so the next request recomputes. This catches what no fingerprint field
    can: two checkpoints of one shape under ``fingerprint.weights: headers``, a kernel or driver change.
    """

    model_config = _STRICT

    sample: float = Field(0.0, ge=0, le=1, description="fraction of store hits to verify (0: off, 1: every hit)")
    max_per_minute: float = Field(6.0, gt=0, le=6000, description="at most this many hits are set aside per "
                                  "minute and engine (each costs one load and one recompute later)")
    max_pending: int = Field(64, gt=0, le=10000, description="hits waiting for verification at most; more are "
                             "dropped (counted as verify.dropped)")
    top_logprobs: int = Field(5, ge=1, le=20, description="log-probabilities compared per run")
    tolerance: float | None = Field(None, gt=0, le=10, description="largest difference of a first-token "
                                    "log-probability that passes; default by KV dtype: float32 1e-3, float16 "
                                    "0.05, bfloat16 0.1, fp8 0.25")

    @property
    def enabled(self) -> bool:
        return self.sample > 0


class Policy(BaseModel):
    """Everything prefixshare needs to know to share KV across replicas.

    Build it with keywords, from YAML (:meth:`from_yaml`) or from a shipped preset
    (:meth:`from_preset`); a YAML file may name ``preset:`` and override any field of it.
    """

    model_config = _STRICT

    version: Literal[1] = 1
    name: str = "default"
    chunk_size: int = Field(256, gt=0, le=65536, description="tokens per stored chunk")
    tenant: str | None = Field(None, description="namespace of this deployment's KV (isolation)")
    l1: L1Settings = Field(default_factory=L1Settings)
    l2: list[TierConfig] = Field(default_factory=list, description="ordered L2 tiers")
    server: ServerSettings = Field(default_factory=ServerSettings)
    load: LoadSettings = Field(default_factory=LoadSettings)
    store: StoreSettings = Field(default_factory=StoreSettings)
    fingerprint: FingerprintSettings = Field(default_factory=FingerprintSettings)
    verify: VerifySettings = Field(default_factory=VerifySettings)
    #: rule config (see prefixshare.policies); None admits every prefix of at least one chunk.
    admission: Any = None

    @field_validator("l2", mode="before")
    @classmethod
    def _resolve_tiers(cls, value: Any) -> Any:
        """Validate each tier with the class its ``type`` names, keeping ``l2[i].field`` error paths."""
        if not isinstance(value, list):
            return value
        resolved: list[Any] = []
        problems: list[FieldProblem] = []
        for i, item in enumerate(value):
            if isinstance(item, TierConfig) or not isinstance(item, dict):
                resolved.append(item)
                continue
            kind = item.get("type")
            if not isinstance(kind, str):
                problems.append(FieldProblem(f"l2[{i}].type", _MISSING, "is missing", "add type: fs (or " + ", ".join(known_tiers()) + ")"))
                continue
            try:
                tier_cls = tier_class(kind)
            except KeyError as exc:
                problems.append(FieldProblem(f"l2[{i}].type", kind, "is not a known tier", str(exc.args[0]).split("; ", 1)[-1]))
                continue
            try:
                resolved.append(tier_cls.model_validate(item))
            except ValidationError as exc:
                problems.extend(prefixed(problems_from(exc, tier_cls, item), f"l2[{i}]"))
        if problems:
            raise PydanticCustomError(
                "prefixshare_nested", "{message}", {"message": "; ".join(map(str, problems)), "problems": problems}
            )
        return resolved

    @field_validator("tenant")
    @classmethod
    def _tenant(cls, value: str | None) -> str | None:
        if value is not None and (not value or any(c in value for c in "@/\\\0") or len(value) > 64):
            raise problem(
                f"{value!r} is not a valid tenant name",
                "use 1-64 characters without '@', '/', '\\' (it becomes part of every store key)",
            )
        return value

    @field_validator("admission")
    @classmethod
    def _admission(cls, value: Any) -> Any:
        if value is None or isinstance(value, Rule):
            return value
        try:
            rule_from_config(value, loc="admission")
        except PolicyError as exc:  # keep each problem's exact path (see _errors.nested)
            raise PydanticCustomError(
                "prefixshare_nested", "{message}", {"message": str(exc), "problems": exc.problems}
            ) from None
        return value

    @model_validator(mode="after")
    def _checks(self) -> Policy:
        types = [t.type for t in self.l2]
        if len(set(map(repr, self.l2))) != len(self.l2):
            raise problem(f"l2 lists the same tier twice ({types})", "remove the duplicate entry")
        return self

    # --- derived ------------------------------------------------------------------------------
    def admission_rule(self) -> Rule | None:
        """A fresh rule object (stateful rules keep their own counters per attached engine)."""
        if self.admission is None:
            return None
        if isinstance(self.admission, Rule):
            return self.admission
        return rule_from_config(self.admission, loc="admission")

    def admission_config(self) -> Any:
        if isinstance(self.admission, Rule):
            return self.admission.to_config()
        return self.admission

    @property
    def shares_across_nodes(self) -> bool:
        return any(t.shares_across_nodes for t in self.l2)

    @property
    def directories(self) -> list[Path]:
        """The local directories of the directory (fs) tiers, in tier order: what warm, inspect and gc read."""
        return [path for tier, path in self._tier_paths() if tier.type == "fs"]

    @property
    def store_root(self) -> Path | None:
        """Where manifests and the document registry live: the first tier with a directory."""
        return next((path for _, path in self._tier_paths()), None)

    @property
    def manifest_url(self) -> str | None:
        """Where fingerprint manifests live: ``fingerprint.manifests``, else the store root (None: nowhere)."""
        if self.fingerprint.manifests:
            return self.fingerprint.manifests
        root = self.store_root
        return str(root) if root is not None else None

    def _tier_paths(self) -> list[tuple[TierConfig, Path]]:
        return [(tier, Path(path)) for tier in self.l2 if (path := getattr(tier, "base_path", None))]

    # --- construction helpers -------------------------------------------------------------------
    @classmethod
    def from_yaml(cls, path: str | Path) -> Policy:
        return load_policy_file(path)

    @classmethod
    def from_text(cls, text: str, source: str = "<text>") -> Policy:
        """A policy from YAML text (what a policy file holds); ``source`` names it in error messages."""
        return policy_from_mapping(parse_policy_text(text, source), source=source)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> Policy:
        return policy_from_mapping({"preset": name, **overrides}, source=f"preset {name!r}")

    @classmethod
    def build(cls, **fields: Any) -> Policy:
        """Keyword construction with prefixshare's field-level errors (PolicyError, not pydantic's)."""
        return policy_from_mapping(fields, source=None)

    def to_dict(self) -> dict[str, Any]:
        data = self.model_dump(mode="json", exclude={"admission", "l2"})
        data["l2"] = [t.model_dump(mode="json", exclude_defaults=True) | {"type": t.type} for t in self.l2]
        data["admission"] = self.admission_config()
        return data

    def server_argv(self, *, executable: list[str] | None = None) -> list[str]:
        return server_argv(self, executable=executable)

    def legacy_config(self) -> dict[str, Any]:
        return legacy_config(self)


def policy_from_mapping(data: dict[str, Any], source: str | None = None) -> Policy:
    """A Policy from a mapping (``preset: NAME`` resolved first), with field-level errors."""
    merged = resolve_presets(data, source)
    try:
        return Policy.model_validate(merged)
    except ValidationError as exc:
        raise to_policy_error(exc, Policy, merged, source) from None


def load_policy_file(path: str | Path) -> Policy:
    data, source = parse_policy_file(path)
    return policy_from_mapping(data, source=source)
