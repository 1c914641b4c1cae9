"""``prefixshare inspect`` and ``prefixshare gc``: what a store holds, and pruning it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape

from prefixshare.cli._common import (EXIT_BAD_INPUT, JSON_OPTION, emit_json, err, fail, handles_errors, human_size,
                                     out)

POLICY_OPTION = typer.Option(..., "--policy", "-p", help="Policy YAML file (its directory tier is the store).")
#: ``50G``-style sizes (coreutils: powers of 1024), on top of the policy syntax (50GB, 50GiB)
_SHORT_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP])\s*$", re.IGNORECASE)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def parse_size_arg(value: str) -> int:
    from prefixshare._units import parse_size

    match = _SHORT_SIZE.match(value)
    if match:
        return parse_size(f"{match.group(1)}{match.group(2).upper()}iB")
    try:
        return parse_size(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--max-bytes") from None


def parse_duration_arg(value: str) -> float:
    from prefixshare._units import parse_duration

    try:
        return parse_duration(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--ttl") from None


def _load(policy: Path) -> Any:
    from prefixshare.policies import Policy

    loaded = Policy.from_yaml(str(policy))
    if not loaded.directories:
        raise fail("the policy has no directory (fs) tier: inspect and gc work on directory stores "
                   "(other tiers are pruned by their own eviction settings)", EXIT_BAD_INPUT)
    return loaded


def register(app: typer.Typer) -> None:
    @app.command("inspect")
    @handles_errors
    def inspect_cmd(policy: Path = POLICY_OPTION, json: bool = JSON_OPTION) -> None:
        """Show what the store holds, per fingerprint namespace.

        Documents (complete or not), chunk files, bytes, age, the manifest of who wrote it, and the hit
        counts of this node's engines."""
        from prefixshare.store import inspect_store

        data = inspect_store(_load(policy))
        if json:
            emit_json(data)
            return
        _print_inspect(data)

    @app.command("gc")
    @handles_errors
    def gc_cmd(
        policy: Path = POLICY_OPTION,
        ttl: str | None = typer.Option(None, "--ttl", help="Delete chunks written longer ago than this "
                                       "(e.g. 7d, 12h)."),
        max_bytes: str | None = typer.Option(None, "--max-bytes", help="Then delete the oldest chunks until the "
                                             "store holds at most this (e.g. 50G, 50GB, 512MiB)."),
        verify: bool = typer.Option(False, "--verify", help="Also read every chunk, check its digest and delete "
                                    "the damaged ones."),
        dry_run: bool = typer.Option(False, "--dry-run", help="Print what would be deleted; delete nothing."),
        json: bool = JSON_OPTION,
    ) -> None:
        """Prune the store: damaged chunks, chunks older than --ttl, then the oldest until under --max-bytes.

        Whole documents go together (their newest chunk dates them); registry records of documents that lost
        chunks, corrupt manifests/records and chunks the server set aside as damaged go too (with --verify,
        every chunk failing its integrity check). --dry-run lists exactly what gc deletes."""
        from prefixshare.store import plan_gc, run_gc

        if ttl is None and max_bytes is None and not verify:
            raise fail("give --ttl, --max-bytes and/or --verify", EXIT_BAD_INPUT)
        ttl_s = parse_duration_arg(ttl) if ttl is not None else None
        limit = parse_size_arg(max_bytes) if max_bytes is not None else None
        plan = plan_gc(_load(policy), ttl_s=ttl_s, max_bytes=limit, verify=verify)
        if dry_run:
            data = {**plan.to_dict(), "dry_run": True}
            if json:
                emit_json(data)
            else:
                _print_plan(plan, dry_run=True)
            return
        result = run_gc(plan)
        if json:
            emit_json({**result.to_dict(), "dry_run": False})
        else:
            _print_plan(plan, dry_run=False)
            for item in result.skipped:
                err.print(f"[yellow]skipped[/] {escape(item['path'])}: {escape(item['reason'])}")


def _print_inspect(data: dict[str, Any]) -> None:
    t = data["totals"]
    out.print(f"store [bold]{escape(str(data['store']))}[/]: {t['namespaces']} namespaces, {t['chunk_files']:,} chunk "
              f"files, {human_size(t['bytes'])}, {t['documents']} documents")
    for ns in data["namespaces"]:
        out.print()
        m = ns["manifest"]
        head = f"[bold]{escape(ns['namespace'])}[/]"
        if m:
            out.print(f"{head}  fingerprint {m['short']}, manifest from {escape(m['host'])} at {m['created_at'][:19]}")
            out.print(f"  model     {m['model_type']}, {m['layers']} layers, {m['kv_heads']} KV heads x "
                      f"{m['head_dim']}, weights {m['weights']}, tokenizer {m['tokenizer']}")
            out.print(f"  engine    {escape(m['kv_layout'])}, {m['kv_dtype']}, block {m['block_size']}, chunk "
                      f"{m['chunk_size']}" + (f", tenant {escape(m['tenant'])}" if m["tenant"] else ""))
        else:
            note = "" if ns["prefixshare"] else " (not a prefixshare namespace: left alone)"
            out.print(f"{head}  no manifest{note}")
        age = ns["age_s"] or {}
        salts = ", ".join(f"{escape(k)} {v}" for k, v in ns["salts"].items())
        out.print(f"  chunks    {ns['chunk_files']:,} files, {human_size(ns['bytes'])}, newest {_age(age.get('newest'))} "
                  f"ago, oldest {_age(age.get('oldest'))} ago" + (f"; salts: {salts}" if salts else ""))
        hits = ns["hits"]
        if hits:
            out.print(f"  hits      {hits['hits']} of {hits['requests']} requests, {hits['tokens_loaded']:,} tokens "
                      f"({human_size(hits['bytes_loaded'])}) loaded by {hits['engines']} engine(s) on this node")
        docs = ns["documents"]
        if docs:
            out.print(f"  documents ({len(docs)}):")
            for d in docs:
                state = "" if d["complete"] else f"  [red]INCOMPLETE: {d['missing_chunks']} chunks missing[/]"
                out.print(f"    {escape(d['id'])}  {d['tokens']:,} tokens, {d['chunks']} chunks, {human_size(d['bytes'])}, "
                          f"warmed {d['warmed_at'][:19]} on {escape(d['host'])}{state}")
    for bad in data["corrupt_manifests"]:
        err.print(f"[yellow]corrupt manifest[/] {escape(bad['url'])}: {escape(bad['reason'])}")
    for bad in data["corrupt_records"]:
        err.print(f"[yellow]corrupt registry record[/] {escape(bad['path'])}: {escape(bad['reason'])}")
    if t["other_files"]:
        err.print(f"{t['other_files']} .data files are not LMCache chunk files (left alone)")


def _print_plan(plan: Any, *, dry_run: bool) -> None:
    verb = "would delete" if dry_run else "deleted"
    counts = plan.counts()
    for d in plan.deletions:
        what = f"{d.kind:8} {d.reason:22}"
        size = f" {human_size(d.bytes)}" if d.bytes else ""
        out.print(f"{verb} {what} {escape(d.path)}{size}")
    out.print(f"{verb}: {counts.get('chunk', 0)} chunk files ({human_size(plan.bytes_freed)}), "
              f"{counts.get('tmp', 0)} temporary files, {counts.get('record', 0)} registry records, "
              f"{counts.get('manifest', 0)} manifests; store {human_size(plan.bytes_before)} -> {human_size(plan.bytes_after)}")
