"""``prefixshare vllm-args`` / ``sglang-args``: flags and environment for engine servers behind an HTTP API."""

from __future__ import annotations

import importlib
import json as _json
import shlex
from pathlib import Path

import typer

from prefixshare.cli._common import JSON_OPTION, emit_json, handles_errors

#: command -> (adapter module, default instance name, what the command prints)
_ENGINES = {
    "vllm-args": ("prefixshare.adapters.vllm", "vllm-serve",
                  "Print the `vllm serve` command line (with --kv-transfer-config) and environment for a replica."),
    "sglang-args": ("prefixshare.adapters.sglang", "sglang-serve",
                    "Print the `python -m sglang.launch_server` command line and environment for a replica."),
}


def _register_one(app: typer.Typer, command: str, module: str, default_instance: str, doc: str) -> None:
    @app.command(command, help=doc)
    @handles_errors
    def serve_flags(
        policy: Path = typer.Option(..., "--policy", "-p", help="Policy YAML file (the server reads it at start)."),
        model: str = typer.Option(..., "--model", "-m", help="Model directory or name, as given to the server."),
        instance: str = typer.Option(default_instance, "--instance", help="Name under which stats are published."),
        json: bool = JSON_OPTION,
    ) -> None:
        from prefixshare.policies import Policy

        serve_args = importlib.import_module(module).serve_args
        argv, env = serve_args(Policy.from_yaml(str(policy)), model, policy_file=str(policy), instance=instance)
        if json:
            data = {"argv": argv, "env": env}
            if "--kv-transfer-config" in argv:
                data["kv_transfer_config"] = _json.loads(argv[argv.index("--kv-transfer-config") + 1])
            emit_json(data)
            return
        typer.echo(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " \\")
        typer.echo(" ".join(shlex.quote(a) for a in argv))


def register(app: typer.Typer) -> None:
    for command, (module, instance, doc) in _ENGINES.items():
        _register_one(app, command, module, instance, doc)
