"""``prefixshare vllm-args`` / ``sglang-args``: flags and environment for engine servers behind an HTTP API."""

from __future__ import annotations

import json as _json
import shlex
from pathlib import Path

import typer

from prefixshare.cli._common import JSON_OPTION, emit_json, handles_errors


def register(app: typer.Typer) -> None:
    register_vllm(app)
    register_sglang(app)


def register_vllm(app: typer.Typer) -> None:
    @app.command("vllm-args")
    @handles_errors
    def vllm_args(
        policy: Path = typer.Option(..., "--policy", "-p", help="Policy YAML file (the server reads it at start)."),
        model: str = typer.Option(..., "--model", "-m", help="Model directory or name, as given to vllm serve."),
        instance: str = typer.Option("vllm-serve", "--instance", help="Name under which stats are published."),
        json: bool = JSON_OPTION,
    ) -> None:
        """Print the `vllm serve` command line (with --kv-transfer-config) and environment for a replica."""
        from prefixshare.adapters.vllm import serve_args
        from prefixshare.policy import Policy

        loaded = Policy.from_yaml(str(policy))
        argv, env = serve_args(loaded, model, policy_file=str(policy), instance=instance)
        if json:
            emit_json({"argv": argv, "env": env, "kv_transfer_config": _json.loads(argv[-1])})
            return
        typer.echo(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " \\")
        typer.echo(" ".join(shlex.quote(a) for a in argv))


def register_sglang(app: typer.Typer) -> None:
    @app.command("sglang-args")
    @handles_errors
    def sglang_args(
        policy: Path = typer.Option(..., "--policy", "-p", help="Policy YAML file (the server reads it at start)."),
        model: str = typer.Option(..., "--model", "-m", help="Model directory or name, as given to SGLang."),
        instance: str = typer.Option("sglang-serve", "--instance", help="Name under which stats are published."),
        json: bool = JSON_OPTION,
    ) -> None:
        """Print the `python -m sglang.launch_server` command line and environment for a replica."""
        from prefixshare.adapters.sglang import serve_args
        from prefixshare.policy import Policy

        loaded = Policy.from_yaml(str(policy))
        argv, env = serve_args(loaded, model, policy_file=str(policy), instance=instance)
        if json:
            emit_json({"argv": argv, "env": env})
            return
        typer.echo(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " \\")
        typer.echo(" ".join(shlex.quote(a) for a in argv))
