"""``prefixshare model ...``: generate local random-weight models for tests, the demo and benchmarks."""

from __future__ import annotations

import time
from pathlib import Path

import typer

from prefixshare.cli._common import JSON_OPTION, StrEnum, emit_json, handles_errors, out
from prefixshare.model import ARCH_SHAPES


class ShapeName(StrEnum):
    """Choices of ``--shape`` (every architecture's shape names; not every architecture has every shape)."""

    tiny = "tiny"
    demo = "demo"
    bench = "bench"


class ArchName(StrEnum):
    """Choices of ``--arch`` (the keys of :data:`prefixshare.model.ARCH_SHAPES`)."""

    llama = "llama"
    qwen3 = "qwen3"


assert {a.value for a in ArchName} == set(ARCH_SHAPES), "ArchName is out of sync with ARCH_SHAPES"
assert {s.value for s in ShapeName} == {n for shapes in ARCH_SHAPES.values() for n in shapes}, "ShapeName is stale"


def _human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def register(app: typer.Typer) -> None:
    """Add the ``model`` command group to ``app``."""
    model_app = typer.Typer(
        name="model",
        help="Generate small local models (random weights, offline tokenizer); no download needed.",
        no_args_is_help=True,
    )

    @model_app.command("create")
    @handles_errors
    def create(
        directory: Path = typer.Argument(..., help="Directory to write the model into (created if missing)."),
        shape: ShapeName = typer.Option(
            ShapeName.tiny,
            "--shape",
            help="Model size. llama: tiny (4.5M params), demo (27M), bench (144M); qwen3: tiny (18M), demo (84M).",
        ),
        arch: ArchName = typer.Option(
            ArchName.llama,
            "--arch",
            help="Architecture: llama (fp32, head dim 64) or qwen3 (Qwen3-8B's 8 KV heads x 128, q/k norms, "
            "bf16, ChatML template).",
        ),
        seed: int = typer.Option(0, "--seed", min=0, help="Seed of the weights and the tokenizer's corpus."),
        overwrite: bool = typer.Option(
            False, "--overwrite", help="Rebuild even if DIRECTORY already holds a prefixshare model."
        ),
        json: bool = JSON_OPTION,
    ) -> None:
        """Write a random-weight Llama or Qwen3 model and its BPE tokenizer in Hugging Face layout.

        The same architecture, shape and seed always give the same files; an existing identical model is reused.
        """
        # Heavy imports (torch, transformers) happen inside create_model.
        from prefixshare.model import create_or_reuse, model_info

        started = time.perf_counter()
        path, reused = create_or_reuse(directory, shape=shape.value, seed=seed, overwrite=overwrite, arch=arch.value)
        seconds = time.perf_counter() - started
        info = model_info(path)

        if json:
            emit_json(
                {
                    "path": str(info.path),
                    "arch": info.arch,
                    "shape": info.shape,
                    "seed": info.seed,
                    "parameters": info.parameters,
                    "vocab_size": info.vocab_size,
                    "size_bytes": info.size_bytes,
                    "reused": reused,
                    "seconds": round(seconds, 3),
                }
            )
            return
        verb = "reused" if reused else "created"
        out.print(f"{verb} {info.path}")
        out.print(f"  model       {info.arch} {info.shape} (seed {info.seed})")
        out.print(f"  parameters  {info.parameters:,}")
        out.print(f"  size        {_human_bytes(info.size_bytes)} on disk")

    app.add_typer(model_app, name="model")
