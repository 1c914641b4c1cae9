"""``prefixshare server start|status|stop --policy FILE``: the node's LMCache MP server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from prefixshare.cli._common import EXIT_CHECK_FAILED, JSON_OPTION, emit_json, handles_errors, out

POLICY_OPTION = typer.Option(..., "--policy", "-p", help="Policy YAML file.")


def _summary(server: Any) -> dict[str, Any]:
    info: dict[str, Any] = {"url": server.url, "http_url": server.http_url, "healthy": server.healthy(),
                            "pid": server.pid, "log": str(server.log_path)}
    if info["healthy"]:
        status = server.status()
        l1 = status.get("storage_manager", {}).get("l1_manager", {})
        info.update(
            chunk_size=status.get("chunk_size"),
            hash_algorithm=status.get("hash_algorithm"),
            active_sessions=status.get("active_sessions"),
            l1_objects=l1.get("total_object_count"),
            l1_used_bytes=l1.get("memory_used_bytes"),
            l1_total_bytes=l1.get("memory_total_bytes"),
        )
    return info


def register(app: typer.Typer) -> None:
    server_app = typer.Typer(help="Start, inspect and stop the node's LMCache MP server.", no_args_is_help=True)

    @server_app.command("start")
    @handles_errors
    def start(policy: Path = POLICY_OPTION, json: bool = JSON_OPTION) -> None:
        """Start the server in the background (or reuse a compatible one) and wait until it is healthy."""
        from prefixshare.policies import Policy
        from prefixshare.server import LMCacheServer

        server = LMCacheServer(Policy.from_yaml(str(policy)), detach=True).start()
        info = _summary(server) | {"started": server.owned}
        if json:
            emit_json(info)
        else:
            verb = "started" if server.owned else "reused running server"
            out.print(f"[green]{verb}[/] {server.url} (http {server.http_url}, pid {info['pid']}, log {info['log']})")

    @server_app.command("status")
    @handles_errors
    def status(policy: Path = POLICY_OPTION, json: bool = JSON_OPTION) -> None:
        """Show whether the policy's server is up, with its L1 usage. Exit 1 when it is not running."""
        from prefixshare.policies import Policy
        from prefixshare.server import LMCacheServer

        info = _summary(LMCacheServer(Policy.from_yaml(str(policy))))
        if json:
            emit_json(info)
        elif info["healthy"]:
            used, total = info.get("l1_used_bytes") or 0, info.get("l1_total_bytes") or 0
            out.print(f"[green]healthy[/] {info['url']} pid {info['pid']} chunk {info['chunk_size']} "
                      f"L1 {info['l1_objects']} objects, {used / 2**20:.1f}/{total / 2**20:.0f} MiB, "
                      f"{info['active_sessions']} sessions")
        else:
            out.print(f"[red]not running[/] {info['url']}")
        if not info["healthy"]:
            raise typer.Exit(EXIT_CHECK_FAILED)

    @server_app.command("stop")
    @handles_errors
    def stop(policy: Path = POLICY_OPTION, json: bool = JSON_OPTION) -> None:
        """Stop a server started with `prefixshare server start`."""
        from prefixshare.policies import Policy
        from prefixshare.server import LMCacheServer

        stopped = LMCacheServer(Policy.from_yaml(str(policy))).stop_detached()
        if json:
            emit_json({"stopped": stopped})
        else:
            out.print("[green]stopped[/]" if stopped else "no server started by prefixshare was running")

    app.add_typer(server_app, name="server")
