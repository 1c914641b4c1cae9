"""``prefixshare doctor --policy P [--model M]``: check a node's set-up, end with one verdict line."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape

from prefixshare.cli._common import EXIT_BAD_INPUT, EXIT_CHECK_FAILED, JSON_OPTION, emit_json, fail, handles_errors, out

_MARK = {"ok": "[green]ok  [/]", "info": "[blue]info[/]", "warn": "[yellow]warn[/]", "fail": "[red]FAIL[/]"}


def register(app: typer.Typer) -> None:
    @app.command("doctor")
    @handles_errors
    def doctor_cmd(
        policy: Path = typer.Option(..., "--policy", "-p", help="Policy YAML file."),
        model: Path | None = typer.Option(None, "--model", "-m", help="Local model directory to compare with the "
                                          "store's fingerprints."),
        verify: bool = typer.Option(False, "--verify", help="Read every chunk of the store and check its digest "
                                    "(damaged chunks are listed; gc --verify removes them)."),
        json: bool = JSON_OPTION,
    ) -> None:
        """Check this node: versions, server, store, damaged objects, model vs store fingerprints, hashing,
        telemetry.

        Ends with one verdict line. Exit 0 when the node is ready (warnings allowed), 1 when a check fails,
        2 on bad input."""
        from prefixshare.policies import Policy
        from prefixshare.store import doctor

        loaded = Policy.from_yaml(str(policy))
        if model is not None and not (model / "config.json").is_file():
            raise fail(f"--model {model}: not a model directory (no config.json)", EXIT_BAD_INPUT)
        report = doctor(loaded, model=str(model.resolve()) if model is not None else None, verify=verify)
        if json:
            emit_json(report.to_dict())
        else:
            for check in report.checks:
                out.print(f"{_MARK.get(check.status, check.status)} [bold]{check.name:11}[/] {escape(check.message)}")
                if check.fix and check.status in ("warn", "fail"):
                    out.print(f"     {'':11} fix: {escape(check.fix)}")
                for comp in check.data.get("comparisons", [])[:5] if check.status == "fail" else []:
                    out.print(f"     {'':11} vs {comp['short']} ({escape(comp['host'])}): "
                              + escape("; ".join(comp["differences"]) or "identical"))
            style = "green" if report.ok else "red"
            out.print(f"[bold {style}]{escape(report.verdict())}[/]")
        if not report.ok:
            raise typer.Exit(EXIT_CHECK_FAILED)
