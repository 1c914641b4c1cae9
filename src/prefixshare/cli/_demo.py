"""``prefixshare demo [--quick]``: the one-command demo (``make demo``)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape

from prefixshare.cli._common import EXIT_CHECK_FAILED, JSON_OPTION, emit_json, err, handles_errors, out


def register(app: typer.Typer) -> None:
    @app.command("demo")
    @handles_errors
    def demo_cmd(
        quick: bool = typer.Option(False, "--quick", help="Tiny model and a short manual (CI; under a minute)."),
        out_dir: Path | None = typer.Option(None, "--out", help="Where to write demo.json, demo.png, logs and the "
                                            "store (default: the user cache dir)."),
        manual: Path | None = typer.Option(None, "--manual", help="Document to share (default: examples/manual.md)."),
        json: bool = JSON_OPTION,
    ) -> None:
        """The demo: a fresh replica loads a manual another one prefilled, instead of recomputing it.

        Replica A warms examples/manual.md; replica B (a fresh process) answers three questions whose
        prompts start with it; a cold replica answers them too. Prints TTFT cold vs warm, tokens and bytes
        loaded, speedup, and writes demo.png."""
        from prefixshare.demo import render_table, run_demo

        def log(line: str) -> None:
            (err if json else out).print(escape(line))

        from prefixshare.cli._warm import runtime_errors

        with runtime_errors("the demo failed"):
            result = run_demo(quick=quick, out_dir=out_dir, manual=manual, log=log)
        if json:
            emit_json(result.to_dict())
        else:
            render_table(result, out)
            if quick:
                out.print("(--quick checks the mechanics with the tiny model, whose prefill is about as cheap as a "
                          "load: run `prefixshare demo` without --quick to see the speedup)")
            t = result.timings
            out.print(f"plot: {result.plot or '(matplotlib not installed: pip install prefixshare[demo])'}")
            out.print(f"total {t['total_s']:.0f} s (model {t['model_s']:.0f} s, server {t['server_s']:.0f} s, "
                      f"replica A {t['replica_a_s']:.0f} s, cold replica {t['replica_cold_s']:.0f} s, "
                      f"replica B {t['replica_b_s']:.0f} s)")
        if not all(r["tokens_loaded"] > 0 and r["same_first_token"] for r in result.rows):
            err.print("[red]replica B did not load the manual for every question, or answered differently[/]")
            raise typer.Exit(EXIT_CHECK_FAILED)
