"""Model shapes: just enough of a model's config to know how many KV bytes one token costs.

A KV cache entry's size depends only on the attention geometry (layers, KV heads, head dim, or the
MLA latent width) and the element dtype, never on the weights. So planning reads a Hugging Face
``config.json`` (or a dict of one, or a shipped shape file) and nothing else: no torch, no
transformers, no download. That keeps ``prefixshare plan`` usable on a laptop before anything is
installed or fetched.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from prefixshare.plan._errors import PlanError

if TYPE_CHECKING:  # pragma: no cover
    from importlib.resources.abc import Traversable  # Python >= 3.11 (annotations only)

AttentionKind = Literal["mha", "gqa", "mqa", "mla"]

# Canonical dtype name -> bytes per element. "fp8" is vLLM's generic spelling (e4m3 on most GPUs).
DTYPE_BYTES: Mapping[str, int] = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}

# Every spelling we accept (lower-cased, "torch." stripped) -> canonical name. Covers vLLM/SGLang
# ``--kv-cache-dtype`` values and the ``torch_dtype`` strings found in HF configs.
_DTYPE_ALIASES: Mapping[str, str] = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "fp8": "fp8",
    "float8": "fp8",
    "fp8_e4m3": "fp8_e4m3",
    "fp8_e4m3fn": "fp8_e4m3",
    "float8_e4m3fn": "fp8_e4m3",
    "float8_e4m3": "fp8_e4m3",
    "fp8_e5m2": "fp8_e5m2",
    "float8_e5m2": "fp8_e5m2",
}

# Multimodal and wrapper configs keep the language model's geometry one level down.
_NESTED_KEYS = ("text_config", "llm_config", "language_config")

# HF spelling first; older or non-HF spellings after it. Only the first is named in error messages
# as "the" key, the rest as alternatives.
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
_HEAD_KEYS = ("num_attention_heads", "n_head")
_KV_HEAD_KEYS = ("num_key_value_heads", "num_kv_heads")
_HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model")

# The layer type that keeps a full-length KV cache; any other value means our figure is an upper bound.
_FULL_ATTENTION_LAYER = "full_attention"


def normalize_dtype(name: str) -> str:
    """Return the canonical dtype name (``bfloat16``, ``fp8_e4m3``...) for any accepted spelling.

    Raises :class:`PlanError` naming the accepted spellings, because a silently wrong byte width
    would make every number in the plan wrong by 2x or 4x.
    """
    key = str(name).strip().lower().removeprefix("torch.")
    try:
        return _DTYPE_ALIASES[key]
    except KeyError:
        accepted = ", ".join(["auto", *sorted(_DTYPE_ALIASES)])
        raise PlanError(f"unknown dtype {name!r}; use one of: {accepted}") from None


def bytes_per_element(dtype: str) -> int:
    """Bytes one KV element takes in ``dtype`` (any accepted spelling)."""
    return DTYPE_BYTES[normalize_dtype(dtype)]


@dataclass(frozen=True)
class ModelShape:
    """The attention geometry that determines KV cache size, plus a little context for reports.

    Regular attention (MHA/GQA/MQA) stores two planes, K and V, each ``num_kv_heads * head_dim``
    wide. MLA (DeepSeek V2/V3 style) stores ONE compressed latent plane per token per layer,
    ``kv_lora_rank + qk_rope_head_dim`` wide: the K/V heads are re-expanded from it at attention
    time, so counting K and V separately would overstate the cache several times over.

    ``dtype`` is the model's activation dtype, which is what ``kv_dtype="auto"`` resolves to in
    vLLM and SGLang. It may be ``None`` when a config does not say; then callers must pass an
    explicit ``kv_dtype``.
    """

    name: str
    num_layers: int
    dtype: str | None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    num_attention_heads: int | None = None
    hidden_size: int | None = None
    model_type: str | None = None
    architectures: tuple[str, ...] = ()
    max_position_embeddings: int | None = None
    sliding_window: int | None = None
    source: str = ""
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        label = f"shape {self.name!r}"
        _require_positive(self.num_layers, "num_layers", label)
        if self.dtype is not None:
            object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        if self.kv_lora_rank is not None:
            _require_positive(self.kv_lora_rank, "kv_lora_rank", label)
            _require_positive(self.qk_rope_head_dim, "qk_rope_head_dim", label)
        else:
            _require_positive(self.num_kv_heads, "num_kv_heads", label)
            _require_positive(self.head_dim, "head_dim", label)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def attention(self) -> AttentionKind:
        """``mla``, ``mqa`` (one KV head), ``mha`` (KV heads == query heads) or ``gqa``."""
        if self.is_mla:
            return "mla"
        if self.num_kv_heads == 1:
            return "mqa"
        if self.num_attention_heads is not None and self.num_kv_heads == self.num_attention_heads:
            return "mha"
        return "gqa"

    @property
    def kv_planes(self) -> int:
        """2 for K and V; 1 for MLA's single latent plane."""
        return 1 if self.is_mla else 2

    @property
    def plane_width(self) -> int:
        """Elements in one plane for one token in one layer."""
        if self.is_mla:
            assert self.kv_lora_rank is not None and self.qk_rope_head_dim is not None
            return self.kv_lora_rank + self.qk_rope_head_dim
        assert self.num_kv_heads is not None and self.head_dim is not None
        return self.num_kv_heads * self.head_dim

    @property
    def elements_per_token_per_layer(self) -> int:
        return self.plane_width * self.kv_planes

    def resolve_kv_dtype(self, kv_dtype: str = "auto") -> str:
        """Canonical KV dtype: ``auto`` means the model dtype, as it does in vLLM and SGLang."""
        if str(kv_dtype).strip().lower() == "auto":
            if self.dtype is None:
                raise PlanError(
                    f"shape {self.name!r} does not say its dtype (no torch_dtype in the config); "
                    "pass an explicit KV dtype such as bf16 or fp8"
                )
            return self.dtype
        return normalize_dtype(kv_dtype)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict: the stored fields plus the derived geometry, so scripts need no arithmetic."""
        return {
            "name": self.name,
            "source": self.source,
            "model_type": self.model_type,
            "architectures": list(self.architectures),
            "attention": self.attention,
            "num_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_size": self.hidden_size,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "kv_planes": self.kv_planes,
            "elements_per_token_per_layer": self.elements_per_token_per_layer,
            "dtype": self.dtype,
            "max_position_embeddings": self.max_position_embeddings,
            "sliding_window": self.sliding_window,
            "notes": list(self.notes),
        }


def kv_bytes_per_token(shape: ModelShape, kv_dtype: str = "auto") -> int:
    """Bytes of KV cache one token occupies across all layers.

    ``layers * kv_heads * head_dim * 2 (K and V) * bytes per element``; for MLA
    ``layers * (kv_lora_rank + qk_rope_head_dim) * bytes per element``. Every layer is counted as
    full attention, which is exact for the shipped shapes and an upper bound for sliding-window or
    hybrid models (see :attr:`ModelShape.notes`).
    """
    return shape.num_layers * shape.elements_per_token_per_layer * DTYPE_BYTES[shape.resolve_kv_dtype(kv_dtype)]


# --------------------------------------------------------------------------------------------------
# Shipped shapes
# --------------------------------------------------------------------------------------------------


def shapes_dir() -> Traversable:
    """Where the shipped shape files live: package data, so it works from a checkout and a wheel alike."""
    return resources.files("prefixshare.plan").joinpath("shapes")


def list_shapes() -> list[str]:
    """Names of the shipped shapes (``qwen3-8b``, ``tiny``...), sorted."""
    return sorted(
        entry.name.removesuffix(".json")
        for entry in shapes_dir().iterdir()
        if entry.is_file() and entry.name.endswith(".json")
    )


def _shipped(name: str) -> Traversable | None:
    key = name.strip().lower().removesuffix(".json")
    if not key or "/" in key or "\\" in key:
        return None
    candidate = shapes_dir().joinpath(f"{key}.json")
    return candidate if candidate.is_file() else None


# --------------------------------------------------------------------------------------------------
# Local Hugging Face cache (read only, never the network)
# --------------------------------------------------------------------------------------------------


def _hf_hub_roots() -> list[Path]:
    roots: list[Path] = []
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            roots.append(Path(os.environ[var]).expanduser())
    if os.environ.get("HF_HOME"):
        roots.append(Path(os.environ["HF_HOME"]).expanduser() / "hub")
    roots.append(Path("~/.cache/huggingface/hub").expanduser())
    return roots


def _hf_cached_config(repo_id: str) -> Path | None:
    """``config.json`` of ``org/name`` if it is already in the local HF cache (``refs/main`` first)."""
    parts = repo_id.strip().split("/")
    if len(parts) != 2 or not all(parts):
        return None
    for root in _hf_hub_roots():
        repo_dir = root / f"models--{parts[0]}--{parts[1]}"
        ref = repo_dir / "refs" / "main"
        if ref.is_file():
            candidate = repo_dir / "snapshots" / ref.read_text().strip() / "config.json"
            if candidate.is_file():
                return candidate
        snapshots = sorted(
            (p for p in (repo_dir / "snapshots").glob("*/config.json") if p.is_file()),
            key=lambda p: p.stat().st_mtime,
            reverse=True,
        )
        if snapshots:
            return snapshots[0]
    return None


# --------------------------------------------------------------------------------------------------
# Config parsing
# --------------------------------------------------------------------------------------------------


def _read_json(text: str, where: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlanError(f"{where}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict):
        raise PlanError(f"{where}: expected a JSON object (a config.json), got {type(data).__name__}")
    return data


def _read_path(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise PlanError(f"{path}: cannot read ({exc.strerror or exc})") from None
    return _read_json(text, str(path))


def shape_from_config(source: str | os.PathLike[str] | Mapping[str, Any], *, name: str | None = None) -> ModelShape:
    """Build a :class:`ModelShape` from whatever a user has at hand.

    ``source`` may be, in the order tried:

    * a mapping: an already-loaded ``config.json``;
    * a path to a ``config.json`` (or any JSON config file), or to a model directory containing one;
    * the name of a shipped shape (see :func:`list_shapes`), e.g. ``"qwen3-8b"``;
    * a Hugging Face repo id (``"Qwen/Qwen3-8B"``) whose config is already in the local HF cache,
      or whose last component names a shipped shape. Nothing is downloaded.

    ``name`` overrides the shape's display name. Raises :class:`PlanError` with a one-line reason
    when the source cannot be found or the config lacks a key the arithmetic needs.
    """
    if isinstance(source, Mapping):
        label_name = name or _name_from_mapping(source)
        return _parse_config(source, name=label_name, source="dict")

    text = os.fspath(source)
    path = Path(text).expanduser()
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise PlanError(f"{path}: directory has no config.json")
        return _parse_config(_read_path(config), name=name or path.resolve().name, source=str(config))
    if path.is_file():
        stem = path.resolve().parent.name if path.name == "config.json" else path.stem
        return _parse_config(_read_path(path), name=name or stem, source=str(path))

    shipped = _shipped(text)
    if shipped is not None:
        key = shipped.name.removesuffix(".json")
        return _parse_config(
            _read_json(shipped.read_text(encoding="utf-8"), f"shipped shape {key}"),
            name=name or key,
            source=f"shipped:{key}",
        )

    if text.count("/") == 1 and not text.startswith((".", "/", "~")):
        cached = _hf_cached_config(text)
        if cached is not None:
            return _parse_config(_read_path(cached), name=name or text, source=str(cached))
        by_basename = _shipped(text.split("/")[1])
        if by_basename is not None:
            return shape_from_config(by_basename.name.removesuffix(".json"), name=name)

    looks_like_path = text.endswith(".json") or os.sep in text or text.startswith((".", "~"))
    if looks_like_path:
        raise PlanError(f"{text}: no such file or directory")
    raise PlanError(
        f"unknown model or shape {text!r}: not a file or directory, not a shipped shape "
        f"({', '.join(list_shapes())}), and not a model in the local Hugging Face cache"
    )


def _name_from_mapping(config: Mapping[str, Any]) -> str:
    for key in ("_name_or_path", "name"):
        value = config.get(key)
        if isinstance(value, str) and value.strip():
            return value.strip().rstrip("/").split("/")[-1]
    model_type = config.get("model_type")
    return str(model_type) if model_type else "config"


def _text_part(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The mapping holding the language model's geometry: the config itself, or a nested text config."""
    current = config
    for _ in range(3):  # wrappers nest at most a couple of levels (e.g. omni -> thinker -> text)
        if any(current.get(k) is not None for k in _LAYER_KEYS):
            return current
        nested = next((current[k] for k in _NESTED_KEYS if isinstance(current.get(k), Mapping)), None)
        if nested is None:
            return current
        current = nested
    return current


def _first(config: Mapping[str, Any], keys: tuple[str, ...]) -> tuple[str, Any]:
    for key in keys:
        if config.get(key) is not None:
            return key, config[key]
    return keys[0], None


def _require_positive(value: Any, key: str, label: str) -> int:
    if value is None:
        raise PlanError(f"{label}: missing {key}")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise PlanError(f"{label}: {key} must be a positive integer, got {value!r}")
    return value


def _int(config: Mapping[str, Any], keys: tuple[str, ...], label: str, *, required: bool) -> int | None:
    key, value = _first(config, keys)
    if value is None:
        if not required:
            return None
        also = f" (also accepted: {', '.join(keys[1:])})" if len(keys) > 1 else ""
        raise PlanError(f"{label}: config is missing {keys[0]}{also}")
    return _require_positive(value, key, label)


def _parse_config(config: Mapping[str, Any], *, name: str, source: str) -> ModelShape:
    label = f"{name} ({source})" if source not in ("dict", name) else name
    text = _text_part(config)

    layers = _int(text, _LAYER_KEYS, label, required=True)
    assert layers is not None
    heads = _int(text, _HEAD_KEYS, label, required=False)
    hidden = _int(text, _HIDDEN_KEYS, label, required=False)

    raw_dtype = next(
        (c.get(k) for c in (text, config) for k in ("torch_dtype", "dtype") if c.get(k) not in (None, "auto")),
        None,
    )
    dtype = normalize_dtype(raw_dtype) if raw_dtype is not None else None

    kv_heads: int | None = None
    head_dim: int | None = None
    kv_lora_rank = _int(text, ("kv_lora_rank",), label, required=False)
    rope_dim: int | None = None
    if kv_lora_rank is not None:
        rope_dim = _int(text, ("qk_rope_head_dim",), label, required=True)
    else:
        kv_heads = _int(text, _KV_HEAD_KEYS, label, required=False)
        if kv_heads is None:  # no GQA key: every query head has its own K/V head (plain MHA)
            kv_heads = _int(text, _HEAD_KEYS, label, required=True)
        head_dim = _int(text, ("head_dim",), label, required=False)
        if head_dim is None:  # older configs: head_dim is implied by hidden_size / num_attention_heads
            if heads is None or hidden is None:
                raise PlanError(
                    f"{label}: config has no head_dim, and deriving it needs both hidden_size and num_attention_heads"
                )
            if hidden % heads:
                raise PlanError(f"{label}: hidden_size {hidden} is not divisible by num_attention_heads {heads}")
            head_dim = hidden // heads

    notes: list[str] = []
    sliding = text.get("sliding_window")
    sliding_window = sliding if isinstance(sliding, int) and not isinstance(sliding, bool) and sliding > 0 else None
    if sliding_window is not None and text.get("use_sliding_window", True) is False:
        sliding_window = None
    if sliding_window is not None:
        notes.append(
            f"config sets sliding_window={sliding_window}; every layer is counted as full attention, "
            "so sizes are an upper bound beyond the window"
        )
    layer_types = text.get("layer_types")
    if isinstance(layer_types, list) and any(t != _FULL_ATTENTION_LAYER for t in layer_types):
        kinds = ", ".join(sorted({str(t) for t in layer_types}))
        notes.append(f"config mixes layer types ({kinds}); every layer is counted as full attention (an upper bound)")

    architectures = config.get("architectures") or text.get("architectures") or ()
    max_pos = text.get("max_position_embeddings")
    return ModelShape(
        name=name,
        num_layers=layers,
        dtype=dtype,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=rope_dim,
        num_attention_heads=heads,
        hidden_size=hidden,
        model_type=str(config.get("model_type") or text.get("model_type") or "") or None,
        architectures=tuple(str(a) for a in architectures) if isinstance(architectures, list | tuple) else (),
        max_position_embeddings=max_pos if isinstance(max_pos, int) and not isinstance(max_pos, bool) else None,
        sliding_window=sliding_window,
        source=source,
        notes=tuple(notes),
    )
