"""The ``prefixshare`` command line. Each ``_<topic>.py`` module registers its commands on :data:`app`."""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    name="prefixshare",
    help="Share the KV cache of stable prefixes across vLLM and SGLang replicas.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Command modules, in the order their commands are listed in --help. Heavy imports stay inside commands.
_COMMAND_MODULES = ("_policy", "_fingerprint", "_plan", "_server", "_engines", "_model", "_warm", "_store",
                    "_doctor", "_verify", "_demo", "_bench")


_registered = False


def _register_all() -> None:
    """Add every command module's commands to :data:`app` (once; safe to call again)."""
    global _registered
    if _registered:
        return
    _registered = True
    for name in _COMMAND_MODULES:
        module = importlib.import_module(f"{__name__}.{name}")
        module.register(app)


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks for errors."),
    log_json: bool = typer.Option(False, "--log-json", help="Log as JSON lines on stderr."),
    log_level: str = typer.Option("WARNING", "--log-level", help="Log level for prefixshare's own logs."),
) -> None:
    from prefixshare._log import configure

    configure(level=log_level, json=log_json)


def main() -> None:
    _register_all()
    app()
