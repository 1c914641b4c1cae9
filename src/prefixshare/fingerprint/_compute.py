"""Compute a :class:`Fingerprint` from a Hugging Face style model directory and engine settings."""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from prefixshare._log import get_logger
from prefixshare.errors import FingerprintError
from prefixshare.fingerprint._canonical import blake3_hex, digest_of
from prefixshare.fingerprint._digests import DigestCache
from prefixshare.fingerprint._settings import EngineSettings, normalise_dtype
from prefixshare.fingerprint._types import (
    EngineInfo,
    Fingerprint,
    LoraInfo,
    ModelInfo,
    TokenizerInfo,
    WeightFile,
    WeightsInfo,
    WeightsMode,
)


def _logger() -> Any:
    # Resolved per call, not at import: prefixshare._log.get_logger binds (and so freezes) the
    # structlog configuration current at call time, and the CLI configures logging after imports.
    return get_logger(__name__)


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
#: Files with a weight suffix that are training artefacts, not weights an engine loads.
_NOT_WEIGHTS = frozenset({"training_args.bin", "optimizer.pt", "scheduler.pt", "optimizer.bin", "scheduler.bin"})

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
)
#: tokenizer_config.json keys that change with where/how a tokenizer was saved, not what it does.
_VOLATILE_TOKENIZER_KEYS = frozenset(
    {
        "name_or_path",
        "_name_or_path",
        "tokenizer_file",
        "special_tokens_map_file",
        "_commit_hash",
        "transformers_version",
        "chat_template",
        "auto_map",
        "processor_class",
    }
)
#: config.json keys that change with where/how a model was saved, not what it computes.
_VOLATILE_CONFIG_KEYS = frozenset(
    {
        "_name_or_path",
        "name_or_path",
        "transformers_version",
        "_commit_hash",
        "_attn_implementation",
        "_attn_implementation_autoset",
        "attn_implementation",
        "use_cache",
        "auto_map",
    }
)
#: adapter_config.json keys that name where the base model lives on some host.
_VOLATILE_ADAPTER_KEYS = frozenset({"base_model_name_or_path", "revision"})
_TEXT_CONFIG_KEYS = ("text_config", "llm_config", "language_config")
_SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")
_SHA_RE = re.compile(r"^[0-9a-f]{40}$")
_MAX_HEADER = 100 * 1024 * 1024


def compute_fingerprint(
    model_dir: str | os.PathLike[str],
    settings: EngineSettings,
    *,
    weights: WeightsMode = "content",
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    tokenizer_dir: str | os.PathLike[str] | None = None,
) -> Fingerprint:
    """Fingerprint the model in ``model_dir`` as served with ``settings``.

    ``model_dir`` is a Hugging Face style directory (``config.json``, weights, tokenizer files); a
    Hugging Face cache repository folder (``models--org--name`` with ``refs/main``) is accepted too.

    ``weights`` chooses how the weights are identified:

    * ``"content"`` (default, safe): blake3 over the bytes of every ``*.safetensors``, ``*.bin``,
      ``*.pt`` and ``*.gguf`` file. Each file is hashed once and cached by (path, size, mtime) under
      ``cache_dir`` (see :class:`~prefixshare.fingerprint.DigestCache`), so restarts are
      instant; the first run reads every byte once.
    * ``"headers"`` (weaker opt-out for very large checkpoints): only the safetensors headers (tensor
      names, dtypes, shapes, offsets) and file sizes. **Risk:** two checkpoints with the same shapes
      but different values (two fine-tunes of one base model, a re-quantisation into the same dtype)
      get the *same* weights digest, and their replicas would load each other's KV, silently
      producing wrong outputs. Use it only when every replica is known to serve the same checkpoint,
      ideally pinned by ``revision``.

    ``tokenizer_dir`` is where the tokenizer files live when the engine loads the tokenizer from
    another directory than the weights (vLLM's ``tokenizer=``); default: ``model_dir``.

    ``revision`` is the Hugging Face commit; when not given it is read from a cache snapshot path
    (``.../snapshots/<sha>/``), a ``.revision`` file, or ``huggingface-cli download --local-dir``
    metadata. Raises :class:`~prefixshare.errors.FingerprintError` naming the path of a missing or
    unreadable file.
    """
    if weights not in ("content", "headers"):
        raise FingerprintError(f"weights must be 'content' or 'headers', got {weights!r}")
    root = _resolve_model_dir(Path(model_dir).expanduser())
    config = _read_json(root / "config.json")
    model = _model_info(config, root / "config.json")
    kv_dtype = settings.kv_dtype
    if kv_dtype == "auto":
        if model.torch_dtype is None:
            raise FingerprintError(
                f"kv_dtype is 'auto' but {root / 'config.json'} has no torch_dtype; "
                "pass the engine's KV dtype explicitly (e.g. kv_dtype='bfloat16')"
            )
        kv_dtype = model.torch_dtype
    with DigestCache(cache_dir) as cache:
        weights_info = _weights_info(root, weights, cache, revision or _detect_revision(root))
        lora = tuple(_lora_info(name, path, cache) for name, path in sorted(settings.lora))
    tokenizer = _tokenizer_info(_resolve_model_dir(Path(tokenizer_dir).expanduser()) if tokenizer_dir else root)
    engine = EngineInfo(
        engine=settings.engine,
        engine_version=settings.engine_version,
        kv_layout=settings.kv_layout,
        kv_dtype=kv_dtype,
        block_size=settings.block_size,
        chunk_size=settings.chunk_size,
        tp=settings.tp,
        pp=settings.pp,
        lora=lora,
    )
    fp = Fingerprint(model=model, weights=weights_info, tokenizer=tokenizer, engine=engine, tenant=settings.tenant)
    _logger().info(
        "fingerprint_computed", model_dir=str(root), fingerprint=fp.short, weights=weights, files_hashed=cache.hashed
    )
    return fp


# -- model directory -------------------------------------------------------------------------------


def _resolve_model_dir(path: Path) -> Path:
    if not path.exists():
        raise FingerprintError(f"model directory {path} does not exist")
    if not path.is_dir():
        raise FingerprintError(f"{path} is not a directory; pass the model directory")
    if not (path / "config.json").exists() and (path / "refs" / "main").is_file():
        # A Hugging Face cache repository folder: follow refs/main to its snapshot.
        sha = _read_text(path / "refs" / "main").strip()
        snapshot = path / "snapshots" / sha
        if snapshot.is_dir():
            return snapshot
    return path


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise FingerprintError(f"{path} is missing") from None
    except OSError as exc:
        raise FingerprintError(f"cannot read {path}: {exc.strerror or exc}") from exc


def _read_text(path: Path) -> str:
    try:
        return _read_bytes(path).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FingerprintError(f"{path} is not UTF-8 text: {exc}") from exc


def _read_json(path: Path) -> Any:
    text = _read_text(path)
    try:
        return json.loads(text)
    except ValueError as exc:
        raise FingerprintError(f"{path} is not valid JSON: {exc}") from exc


def _read_json_object(path: Path) -> dict[str, Any]:
    data = _read_json(path)
    if not isinstance(data, dict):
        raise FingerprintError(f"{path} must hold a JSON object, not {type(data).__name__}")
    return data


def _detect_revision(root: Path) -> str | None:
    absolute = Path(os.path.abspath(root))
    if absolute.parent.name == "snapshots" and _SHA_RE.match(absolute.name):
        return absolute.name
    marker = root / ".revision"
    if marker.is_file():
        return _read_text(marker).strip() or None
    # huggingface-cli download --local-dir: first line of each metadata file is the commit hash.
    metadata = root / ".cache" / "huggingface" / "download" / "config.json.metadata"
    if metadata.is_file():
        first = _read_text(metadata).splitlines()[:1]
        if first and _SHA_RE.match(first[0].strip()):
            return first[0].strip()
    return None


# -- config.json -----------------------------------------------------------------------------------


def _model_info(config: Any, path: Path) -> ModelInfo:
    if not isinstance(config, dict):
        raise FingerprintError(f"{path} must hold a JSON object, not {type(config).__name__}")
    text: dict[str, Any] = next((config[k] for k in _TEXT_CONFIG_KEYS if isinstance(config.get(k), dict)), {})

    def lm(key: str) -> Any:
        # Language-model values live in the nested text config of multimodal models.
        return text[key] if key in text else config.get(key)

    dtype = config.get("torch_dtype", config.get("dtype"))
    if dtype is None:
        dtype = text.get("torch_dtype", text.get("dtype"))
    architectures = config.get("architectures")
    if isinstance(architectures, str):
        architectures = [architectures]
    model_type = config.get("model_type", text.get("model_type"))
    stable = _stable_config(config)
    for key in _TEXT_CONFIG_KEYS:
        if isinstance(stable.get(key), dict):
            stable[key] = _stable_config(stable[key])
    try:
        return ModelInfo(
            architectures=tuple(architectures) if architectures is not None else None,
            model_type=model_type,
            num_hidden_layers=lm("num_hidden_layers"),
            num_key_value_heads=lm("num_key_value_heads"),
            head_dim=lm("head_dim"),
            hidden_size=lm("hidden_size"),
            num_attention_heads=lm("num_attention_heads"),
            rope_theta=lm("rope_theta"),
            rope_scaling=lm("rope_scaling"),
            max_position_embeddings=lm("max_position_embeddings"),
            sliding_window=lm("sliding_window"),
            torch_dtype=normalise_dtype(dtype) if isinstance(dtype, str) else None,
            config_digest=digest_of(stable, domain="config"),
        )
    except (ValidationError, TypeError) as exc:
        raise FingerprintError(f"{path} has unexpected values: {exc}") from exc


def _stable_config(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` without volatile keys, with one spelling of the dtype (``dtype`` in transformers 5,
    ``torch_dtype`` before)."""
    stable = {k: v for k, v in config.items() if k not in _VOLATILE_CONFIG_KEYS}
    dtype = stable.pop("dtype", None)
    dtype = stable.pop("torch_dtype", dtype)
    if dtype is not None:
        stable["torch_dtype"] = normalise_dtype(dtype) if isinstance(dtype, str) else dtype
    return stable


# -- weights ---------------------------------------------------------------------------------------


def _iter_files(root: Path, suffixes: tuple[str, ...] | None) -> Iterator[tuple[str, Path]]:
    """Files under ``root`` as (posix relative path, path), skipping hidden entries.

    Symlinked files are followed (Hugging Face cache snapshots are made of them); symlinked
    directories are not, so a link cycle cannot make the walk endless.
    """
    try:
        for dirpath, dirnames, filenames in os.walk(root, followlinks=False, onerror=_raise_walk_error):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in filenames:
                if name.startswith("."):
                    continue
                if suffixes is not None and (not name.endswith(suffixes) or name in _NOT_WEIGHTS):
                    continue
                path = Path(dirpath) / name
                yield path.relative_to(root).as_posix(), path
    except OSError as exc:
        raise FingerprintError(f"cannot list {getattr(exc, 'filename', None) or root}: {exc.strerror or exc}") from exc


def _raise_walk_error(exc: OSError) -> None:
    raise exc


def _weights_info(root: Path, mode: WeightsMode, cache: DigestCache, revision: str | None) -> WeightsInfo:
    found = sorted(_iter_files(root, WEIGHT_SUFFIXES))
    if not found:
        raise FingerprintError(f"no weight files ({', '.join('*' + s for s in WEIGHT_SUFFIXES)}) found under {root}")
    files: list[WeightFile] = []
    for rel, path in found:
        try:
            size = path.stat().st_size
        except OSError as exc:
            raise FingerprintError(f"cannot read {path}: {exc.strerror or exc}") from exc
        if mode == "content":
            digest: str | None = cache.digest(path)
        elif rel.endswith(".safetensors"):
            digest = digest_of({"size": size, "header": _safetensors_header(path)}, domain="safetensors-header")
        else:
            digest = None  # only the size identifies a non-safetensors file in headers mode
        files.append(WeightFile(path=rel, size=size, digest=digest))
    combined = digest_of([f.model_dump() for f in files], domain=f"weights-{mode}")
    return WeightsInfo(mode=mode, digest=combined, files=tuple(files), revision=revision)


def _safetensors_header(path: Path) -> Any:
    try:
        with open(path, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) != 8:
                raise FingerprintError(f"{path} is not a safetensors file (too short)")
            (length,) = struct.unpack("<Q", prefix)
            if length > _MAX_HEADER:
                raise FingerprintError(f"{path} is not a safetensors file (header of {length} bytes)")
            raw = handle.read(length)
    except OSError as exc:
        raise FingerprintError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if len(raw) != length:
        raise FingerprintError(f"{path} is truncated (safetensors header cut short)")
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise FingerprintError(f"{path} has an invalid safetensors header: {exc}") from exc


def lora_digest(name: str, path: str) -> str:
    """The digest of a LoRA adapter's files (config and weights), as the fingerprint records it."""
    with DigestCache() as cache:
        return _lora_info(name, path, cache).digest


def _lora_info(name: str, path_text: str, cache: DigestCache) -> LoraInfo:
    path = Path(path_text).expanduser()
    if not path.exists():
        raise FingerprintError(f"LoRA adapter {name!r}: {path} does not exist (a local path is required)")
    if path.is_file():
        entries: list[Any] = [[path.name, cache.digest(path)]]
    else:
        entries = []
        for rel, file in sorted(_iter_files(path, None)):
            if rel == "adapter_config.json":
                stable = {k: v for k, v in _read_json_object(file).items() if k not in _VOLATILE_ADAPTER_KEYS}
                entries.append([rel, digest_of(stable, domain="adapter-config")])
            elif rel.endswith(WEIGHT_SUFFIXES) and rel.rsplit("/", 1)[-1] not in _NOT_WEIGHTS:
                entries.append([rel, cache.digest(file)])
        if not entries:
            raise FingerprintError(f"LoRA adapter {name!r}: no adapter files found in {path}")
    return LoraInfo(name=name, digest=digest_of(entries, domain="lora"))


# -- tokenizer -------------------------------------------------------------------------------------


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _tokenizer_info(root: Path) -> TokenizerInfo:
    present: list[str] = []
    parts: list[Any] = []
    tokenizer_config: dict[str, Any] = {}
    special_map: dict[str, Any] = {}
    for name in TOKENIZER_FILES:
        path = root / name
        if not path.is_file():
            continue
        present.append(name)
        if name == "tokenizer_config.json":
            tokenizer_config = _read_json_object(path)
            stable = {k: v for k, v in tokenizer_config.items() if k not in _VOLATILE_TOKENIZER_KEYS}
            parts.append([name, digest_of(stable, domain="tokenizer-config")])
        else:
            data = _read_bytes(path)
            if name == "special_tokens_map.json":
                try:
                    loaded = json.loads(data)
                except ValueError as exc:
                    raise FingerprintError(f"{path} is not valid JSON: {exc}") from exc
                special_map = loaded if isinstance(loaded, dict) else {}
            parts.append([name, blake3_hex(data)])
    if not present:
        _logger().warning("no_tokenizer_files", model_dir=str(root), looked_for=list(TOKENIZER_FILES))
    tokens = {
        key: _token_text(tokenizer_config.get(key)) or _token_text(special_map.get(key)) for key in _SPECIAL_TOKENS
    }
    return TokenizerInfo(
        digest=digest_of(parts, domain="tokenizer"),
        files=tuple(present),
        chat_template_digest=_chat_template_digest(root, tokenizer_config),
        **tokens,
    )


def _chat_template_digest(root: Path, tokenizer_config: dict[str, Any]) -> str | None:
    """Digest of the chat template transformers would use: ``chat_template.jinja`` first, then
    ``chat_template.json``, then ``tokenizer_config.json``'s ``chat_template``."""
    jinja = root / "chat_template.jinja"
    if jinja.is_file():
        return digest_of(_read_text(jinja), domain="chat-template")
    template: Any = None
    json_file = root / "chat_template.json"
    if json_file.is_file():
        template = _read_json_object(json_file).get("chat_template")
    if template is None:
        template = tokenizer_config.get("chat_template")
    if template is None:
        return None
    return digest_of(template, domain="chat-template")
