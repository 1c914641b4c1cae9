"""``prefixshare fingerprint``: show a model's compatibility fingerprint, or diff it against another."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.markup import escape

from prefixshare.cli._common import (
    EXIT_CHECK_FAILED,
    EXIT_OK,
    JSON_OPTION,
    StrEnum,
    emit_json,
    err,
    handles_errors,
    out,
)

if TYPE_CHECKING:
    from prefixshare.fingerprint import Difference, EngineSettings, Fingerprint, Manifest, WeightsMode

_MAX_SHOWN = 10


class _WeightsChoice(StrEnum):
    content = "content"
    headers = "headers"


def register(app: typer.Typer) -> None:
    """Add the ``fingerprint`` command to ``app`` (a no-op when it is already there)."""
    if any(info.name == "fingerprint" for info in app.registered_commands):
        return
    app.command("fingerprint")(fingerprint)


@handles_errors
def fingerprint(
    ctx: typer.Context,
    model_dir: Path = typer.Argument(..., help="Hugging Face style model directory (config.json, weights...)."),
    engine: str = typer.Option("vllm", "--engine", help='Engine: "vllm", "sglang" or another name.'),
    engine_version: str | None = typer.Option(None, "--engine-version", help="Engine version."),
    kv_layout: str = typer.Option(
        "unknown",
        "--kv-layout",
        help="KV byte layout label, as the engine adapters record it: lmcache-MAJOR.MINOR/DEVICE/ORDER, ORDER being "
        "how a stored object's bytes are ordered: L,T,H,KV,D (K and V fused per head: vLLM 0.32), KV,L,T,H,D "
        "(split K and V: SGLang) or L,T,C (MLA); e.g. lmcache-0.5/cuda/L,T,H,KV,D. \"unknown\" matches only "
        '"unknown": pass the label of the engine that wrote a store to compare --against its manifests.',
    ),
    kv_dtype: str = typer.Option("auto", "--kv-dtype", help='KV cache dtype; "auto" = the model dtype.'),
    block_size: int | None = typer.Option(None, "--block-size", help="Engine KV block size (tokens)."),
    chunk_size: int = typer.Option(256, "--chunk-size", help="LMCache chunk size (tokens)."),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel degree."),
    pp: int = typer.Option(1, "--pp", help="Pipeline-parallel degree."),
    lora: list[str] | None = typer.Option(None, "--lora", help="LoRA adapter as NAME=PATH; repeat for several."),
    tenant: str | None = typer.Option(None, "--tenant", help="Tenant whose KV must stay separate."),
    weights: _WeightsChoice = typer.Option(
        "content",
        "--weights",
        case_sensitive=False,
        help="Weights identity: content (blake3 of every byte, cached) or headers (safetensors headers "
        "and sizes only; same-shape checkpoints with different values collide).",
    ),
    revision: str | None = typer.Option(None, "--revision", help="Hugging Face commit of MODEL_DIR."),
    cache_dir: Path | None = typer.Option(
        None, "--cache-dir", help="Where weight digests are cached (default: $PREFIXSHARE_CACHE_DIR or ~/.cache)."
    ),
    against: str | None = typer.Option(
        None,
        "--against",
        help="Compare with another model dir (same engine options), a manifest or fingerprint JSON file, "
        "or a store URL/dir holding manifests. Exit 0 if identical, 1 if different.",
    ),
    as_json: bool = JSON_OPTION,
) -> None:
    """Print a model's compatibility fingerprint, or explain how it differs from another one."""
    from prefixshare.fingerprint import compute_fingerprint

    settings = _settings(
        engine=engine,
        engine_version=engine_version,
        kv_layout=kv_layout,
        kv_dtype=kv_dtype,
        block_size=block_size,
        chunk_size=chunk_size,
        tp=tp,
        pp=pp,
        lora=_parse_lora(lora or []),
        tenant=tenant,
    )
    mode: WeightsMode = "headers" if weights is _WeightsChoice.headers else "content"
    fp = compute_fingerprint(model_dir, settings, weights=mode, revision=revision, cache_dir=cache_dir)
    if against is None:
        if as_json:
            emit_json(_fingerprint_json(fp))
        else:
            _print_table(fp)
        raise typer.Exit(EXIT_OK)

    kind, comparisons, corrupt = _compare(fp, against, settings, mode, cache_dir)
    identical = any(not diffs for _, _, diffs in comparisons)
    if as_json:
        emit_json(_comparison_json(fp, against, kind, comparisons, corrupt, identical))
    else:
        _print_comparisons(fp, against, comparisons, corrupt)
        hint = None if identical or kind == "model" else _settings_hint(comparisons, _given_options(ctx))
        if hint:
            out.print(f"[yellow]hint:[/] {escape(hint)}")
    raise typer.Exit(EXIT_OK if identical else EXIT_CHECK_FAILED)


# -- helpers ---------------------------------------------------------------------------------------


def _fingerprint_json(fp: Fingerprint) -> dict[str, Any]:
    """The ``--json`` output for one fingerprint: its digest, short form and fields."""
    return {"digest": fp.digest, "short": fp.short, "fingerprint": fp.model_dump(mode="json")}


def _comparison_json(
    fp: Fingerprint,
    against: str,
    kind: str,
    comparisons: list[tuple[str, str, list[Difference]]],
    corrupt: list[dict[str, str]],
    identical: bool,
) -> dict[str, Any]:
    """The ``--json`` output with ``--against``: the fingerprint, what it was compared with, and each diff."""
    return {
        **_fingerprint_json(fp),
        "against": {"source": against, "kind": kind, "corrupt_manifests": corrupt},
        "identical": identical,
        "comparisons": [
            {
                "label": label,
                "digest": digest,
                "identical": not diffs,
                "differences": [d.model_dump(mode="json") for d in diffs],
            }
            for label, digest, diffs in comparisons
        ],
    }


def _settings(**values: Any) -> EngineSettings:
    from pydantic import ValidationError

    from prefixshare.errors import FingerprintError
    from prefixshare.fingerprint import EngineSettings

    try:
        return EngineSettings(**values)
    except ValidationError as exc:
        problems = "; ".join(
            f"--{str(e['loc'][0]).replace('_', '-') if e['loc'] else 'options'}: {e['msg']}" for e in exc.errors()
        )
        raise FingerprintError(f"invalid engine options: {problems}") from None


def _parse_lora(items: list[str]) -> list[tuple[str, str]]:
    from prefixshare.errors import FingerprintError

    pairs = []
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise FingerprintError(f"--lora {item!r}: expected NAME=PATH")
        pairs.append((name.strip(), path.strip()))
    return pairs


def _compare(
    fp: Fingerprint, against: str, settings: EngineSettings, mode: WeightsMode, cache_dir: Path | None
) -> tuple[str, list[tuple[str, str, list[Difference]]], list[dict[str, str]]]:
    """Resolve ``--against`` and diff ``fp`` with what it names: (kind, [(label, digest, diffs)], corrupt)."""
    from prefixshare.errors import FingerprintError
    from prefixshare.fingerprint import MANIFEST_DIR, compute_fingerprint, diff, explain, read_manifests

    path = Path(against).expanduser()
    is_url = "://" in against
    if not is_url and path.is_file():
        other, label = _load_fingerprint_file(path)
        return "file", [(label, other.digest, diff(fp, other))], []
    if not is_url and path.is_dir() and (path / "config.json").is_file():
        other = compute_fingerprint(path, settings, weights=mode, cache_dir=cache_dir)
        return "model", [(str(path), other.digest, diff(fp, other))], []
    if is_url or (path.is_dir() and (path / MANIFEST_DIR).is_dir()):
        manifests = read_manifests(against)
        corrupt = [c.model_dump() for c in manifests.corrupt]
        pairs = explain(against, fp) if manifests else []
        return "store", [(_manifest_label(m), m.digest, diffs) for m, diffs in pairs], corrupt
    if not path.exists():
        raise FingerprintError(f"--against {against}: no such file, directory or store URL")
    raise FingerprintError(
        f"--against {against}: not a model directory (no config.json), a fingerprint/manifest JSON file, "
        f"or a store holding {MANIFEST_DIR}/"
    )


def _load_fingerprint_file(path: Path) -> tuple[Fingerprint, str]:
    """A manifest (verified), this command's ``--json`` output, or a bare fingerprint JSON file."""
    from pydantic import ValidationError

    from prefixshare.errors import FingerprintError
    from prefixshare.fingerprint import Fingerprint, load_manifest

    try:
        text = path.read_text(encoding="utf-8")
        raw = json.loads(text)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise FingerprintError(f"--against {path}: cannot read JSON: {exc}") from exc
    if isinstance(raw, dict) and "format" in raw and "checksum" in raw:
        manifest = load_manifest(text, url=str(path))
        return manifest.fingerprint, _manifest_label(manifest)
    data = raw.get("fingerprint", raw) if isinstance(raw, dict) else raw
    try:
        return Fingerprint.model_validate(data), str(path)
    except ValidationError as exc:
        raise FingerprintError(f"--against {path}: not a fingerprint or manifest: {exc}") from None


#: fingerprint fields set by this command's engine options: field -> (parameter name, option)
_ENGINE_OPTIONS = {
    "engine.engine": ("engine", "--engine"),
    "engine.engine_version": ("engine_version", "--engine-version"),
    "engine.kv_layout": ("kv_layout", "--kv-layout"),
    "engine.kv_dtype": ("kv_dtype", "--kv-dtype"),
    "engine.block_size": ("block_size", "--block-size"),
    "engine.chunk_size": ("chunk_size", "--chunk-size"),
    "engine.tp": ("tp", "--tp"),
    "engine.pp": ("pp", "--pp"),
    "tenant": ("tenant", "--tenant"),
}


def _given_options(ctx: typer.Context) -> set[str]:
    """Names of the parameters the user set (on the command line), as opposed to left at their defaults."""
    given = set()
    for name in ctx.params:
        source = ctx.get_parameter_source(name)
        if source is not None and source.name != "DEFAULT":
            given.add(name)
    return given


def _settings_hint(comparisons: list[tuple[str, str, list[Difference]]], given: set[str]) -> str | None:
    """One line naming the options to pass when, against a manifest (closest first), only engine settings the
    user left at their defaults differ: this command computes the local fingerprint from its own options; unlike
    ``doctor --model``, it does not take each manifest's engine settings."""
    import shlex

    for label, _, diffs in comparisons:
        fields = {d.field for d in diffs}
        # a manifest with a declared layout blanks engine name and version: they differ only while ours is unknown
        moot = {"engine.engine", "engine.engine_version"} if "engine.kv_layout" in fields else set()
        relevant = [d for d in diffs if not (d.field in moot and d.b is None)]
        if not relevant or any(d.field not in _ENGINE_OPTIONS or _ENGINE_OPTIONS[d.field][0] in given
                               for d in relevant):
            continue
        flags = " ".join(f"{_ENGINE_OPTIONS[d.field][1]} {shlex.quote(str(d.b))}" for d in relevant if d.b is not None)
        if flags:
            return (f"only engine settings you did not pass differ from {label}; to compare like with like, "
                    f"rerun with {flags}")
    return None


def _manifest_label(manifest: Manifest) -> str:
    when = manifest.created_at.strftime("%Y-%m-%d %H:%M:%SZ")
    return f"manifest {manifest.fingerprint.short} from {manifest.host} at {when}"


def _fmt(value: Any) -> str:
    """A table cell: ``-`` for unset, lists joined, dicts as JSON; markup-escaped."""
    if value is None:
        text = "-"
    elif isinstance(value, (list, tuple)):
        text = ", ".join(str(v) for v in value) if value else "-"
    elif isinstance(value, dict):
        text = json.dumps(value, sort_keys=True)
    else:
        text = str(value)
    return escape(text)


def _size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover


def _print_table(fp: Fingerprint) -> None:
    from rich.table import Table

    table = Table(title="compatibility fingerprint", show_header=True, header_style="bold")
    table.add_column("field", no_wrap=True)
    table.add_column("value", overflow="fold")
    model = fp.model.model_dump(mode="json")
    for key, value in model.items():
        table.add_row(f"model.{key}", _fmt(value))
    total = sum(f.size for f in fp.weights.files)
    table.add_row("weights.mode", fp.weights.mode)
    table.add_row("weights.digest", fp.weights.digest)
    count = len(fp.weights.files)
    table.add_row("weights.files", f"{count} file{'' if count == 1 else 's'}, {_size(total)}")
    table.add_row("weights.revision", _fmt(fp.weights.revision))
    for key, value in fp.tokenizer.model_dump(mode="json").items():
        table.add_row(f"tokenizer.{key}", _fmt(value))
    for key, value in fp.engine.model_dump(mode="json").items():
        if key == "lora":
            value = [f"{x['name']}={x['digest'][:12]}" for x in value]
        table.add_row(f"engine.{key}", _fmt(value))
    table.add_row("tenant", _fmt(fp.tenant))
    out.print(table)
    if fp.weights.mode == "headers":
        err.print(
            "[yellow]warning:[/] weights identified by safetensors headers only: checkpoints with equal "
            "shapes but different values get the same fingerprint"
        )
    out.print(f"digest: [bold]{fp.digest}[/]  short: [bold]{fp.short}[/]")


def _print_comparisons(
    fp: Fingerprint,
    against: str,
    comparisons: list[tuple[str, str, list[Difference]]],
    corrupt: list[dict[str, str]],
) -> None:
    out.print(f"this fingerprint: [bold]{fp.short}[/] ({fp.digest})")
    for item in corrupt:
        err.print(f"[yellow]warning:[/] skipped corrupt manifest {escape(item['url'])}: {escape(item['reason'])}")
    if not comparisons:
        out.print(f"no manifests to compare with in {escape(against)}")
        return
    for label, digest, diffs in comparisons[:_MAX_SHOWN]:
        if not diffs:
            out.print(f"[green]identical[/] to {escape(label)} ({digest[:12]})")
            continue
        noun = "difference" if len(diffs) == 1 else "differences"
        out.print(f"[red]{len(diffs)} {noun}[/] from {escape(label)} ({digest[:12]}):")
        for d in diffs:
            out.print(f"  - {d.message}", markup=False)
    if len(comparisons) > _MAX_SHOWN:
        more = len(comparisons) - _MAX_SHOWN
        out.print(f"... and {more} more manifests in {escape(against)} (use --json to see all)")
