"""``prefixshare plan``: KV bytes per token, per prompt length and per link, before building anything.

Everything beyond typer and the shared CLI helpers is imported inside the command, so registering
it costs nothing for the other commands.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from prefixshare.cli._common import EXIT_BAD_INPUT, EXIT_CHECK_FAILED, JSON_OPTION, emit_json, err, fail, \
    handles_errors, out

if TYPE_CHECKING:
    from prefixshare.plan import Plan

_COMMAND_NAME = "plan"

_HELP = """Estimate KV cache size and transfer time for a model, and whether sharing beats prefill.

MODEL_OR_SHAPE is a model directory, a config.json, a shipped shape name (see --list-shapes) or a
Hugging Face repo id already in the local cache. Link presets: 2.5GbE, 10GbE, 25GbE, 100GbE,
200GbE, TB4, TB5; or a measured rate such as 3.2GB/s (bytes) or 25Gb/s (bits). Preset times use
the raw line rate, so they are a best case.
"""


def register(app: typer.Typer) -> None:
    """Add the ``plan`` command to ``app``. Safe to call more than once."""
    if any(info.name == _COMMAND_NAME for info in app.registered_commands):
        return
    app.command(_COMMAND_NAME, help=_HELP)(plan_command)


@handles_errors
def plan_command(
    model: str | None = typer.Argument(None, metavar="MODEL_OR_SHAPE", show_default=False),
    tokens: list[str] | None = typer.Option(
        None,
        "--tokens",
        "-t",
        help="Prompt lengths, comma-separated, repeatable; 4k = 4096. Default: 1024,4096,16384,32768.",
        show_default=False,
    ),
    link: list[str] | None = typer.Option(
        None,
        "--link",
        "-l",
        help="A link preset or measured rate, repeatable. Default: 2.5GbE, 10GbE, 25GbE, 100GbE.",
        show_default=False,
    ),
    link_gbps: list[float] | None = typer.Option(
        None,
        "--link-gbps",
        help="A measured link rate in gigabits/s (e.g. from iperf3), repeatable.",
        show_default=False,
    ),
    prefill_rate: float | None = typer.Option(
        None,
        "--prefill-rate",
        help="Measured prefill throughput in tokens/s; adds a verdict per link.",
        show_default=False,
    ),
    kv_dtype: str = typer.Option(
        "auto", "--kv-dtype", help="KV cache dtype: auto (= model dtype), fp8, bf16, fp16, fp32."
    ),
    concurrency: int = typer.Option(1, "--concurrency", help="Loads sharing the link at the same time."),
    latency_ms: float = typer.Option(0.0, "--latency-ms", help="Fixed cost added to every load, in milliseconds."),
    efficiency: float = typer.Option(1.0, "--efficiency", help="Fraction of the line rate actually achieved (0-1]."),
    list_shapes: bool = typer.Option(False, "--list-shapes", help="List the shipped model shapes and exit."),
    measure: bool = typer.Option(False, "--measure", help="Measure each L2 tier of --policy from this node (a test "
                                 "object stored, read back and deleted) and the engine's prefill rate, and put "
                                 "them beside the rated links."),
    policy: Path | None = typer.Option(None, "--policy", help="--measure: the policy whose tiers are measured."),
    model_dir: Path | None = typer.Option(None, "--model", help="--measure: time a short raw prefill of this model "
                                          "on this node (else the cost model's persisted estimates are used)."),
    measure_mb: float = typer.Option(256.0, "--measure-mb", min=1.0, help="--measure: size of the test object "
                                     "per tier, in MB."),
    reps: int = typer.Option(3, "--reps", min=1, help="--measure: repetitions per tier (medians)."),
    json_output: bool = JSON_OPTION,
) -> None:
    if list_shapes:
        _print_shapes(json_output)
        return
    if measure or policy is not None or model_dir is not None:
        _measure(model, policy, model_dir, tokens=tokens, link=link, link_gbps=link_gbps, prefill_rate=prefill_rate,
                 kv_dtype=kv_dtype, measure_mb=measure_mb, reps=reps, json_output=json_output)
        return
    _rated(model, tokens=tokens, link=link, link_gbps=link_gbps, prefill_rate=prefill_rate, kv_dtype=kv_dtype,
           concurrency=concurrency, latency_ms=latency_ms, efficiency=efficiency, json_output=json_output)


def _rated(model: str | None, *, tokens: list[str] | None, link: list[str] | None, link_gbps: list[float] | None,
           prefill_rate: float | None, kv_dtype: str, concurrency: int, latency_ms: float, efficiency: float,
           json_output: bool) -> None:
    """``plan`` on rated (or given) links: arithmetic only, nothing measured."""
    from prefixshare.plan import (
        DEFAULT_LINKS,
        DEFAULT_PROMPT_LENGTHS,
        PlanError,
        link_from_gbps,
        parse_link,
        parse_prompt_lengths,
        plan,
    )

    if model is None:
        raise PlanError(
            "missing MODEL_OR_SHAPE: give a model directory, a config.json or a shipped shape (--list-shapes)"
        )
    lengths = [n for text in tokens for n in parse_prompt_lengths(text)] if tokens else list(DEFAULT_PROMPT_LENGTHS)
    links = [parse_link(text) for text in link or ()] + [link_from_gbps(g) for g in link_gbps or ()]
    result = plan(
        model,
        prompt_lengths=lengths,
        links=links or DEFAULT_LINKS,
        prefill_tokens_per_s=prefill_rate,
        kv_dtype=kv_dtype,
        concurrency=concurrency,
        per_load_latency_s=latency_ms / 1000,
        efficiency=efficiency,
    )
    if json_output:
        emit_json(result.to_dict())
    else:
        _print_plan(result)


def _print_plan(result: Plan) -> None:
    from rich.table import Table

    from prefixshare.plan import LINK_PRESETS, SHARING_WINS
    from prefixshare.plan import format_bytes, format_seconds

    shape = result.shape
    out.print(f"[bold]{shape.name}[/] ({shape.attention.upper()}): {result.formula}")
    with_verdict = result.prefill_tokens_per_s is not None

    table = Table(show_edge=False, pad_edge=False)
    table.add_column("tokens", justify="right")
    table.add_column("KV size", justify="right")
    if with_verdict:
        table.add_column(f"prefill @{result.prefill_tokens_per_s:,.0f} tok/s", justify="right")
    for link in result.links:
        table.add_column(link.name, justify="right")
    if with_verdict:
        table.add_column("verdict")

    for row in result.rows:
        cells = [f"{row.tokens:,}", format_bytes(row.kv_bytes)]
        if row.prefill_s is not None:
            cells.append(format_seconds(row.prefill_s))
        for t in row.transfers:
            text = format_seconds(t.load_s)
            if t.sharing_wins is not None:
                text = f"[green]{text}[/]" if t.sharing_wins else f"[red]{text}[/]"
            cells.append(text)
        if with_verdict:
            winners = [t.link for t in row.transfers if t.sharing_wins]
            if len(winners) in (0, len(row.transfers)):
                cells.append(str(row.transfers[0].verdict))
            else:
                cells.append(f"{SHARING_WINS} on {', '.join(winners)}")
        table.add_row(*cells)
    out.print(table)

    caveats = []
    if result.concurrency > 1:
        caveats.append(f"{result.concurrency} loads share each link, so each load gets 1/{result.concurrency} of it.")
    if result.per_load_latency_s:
        caveats.append(f"Each load includes {format_seconds(result.per_load_latency_s)} of fixed latency.")
    if result.efficiency == 1.0 and any(link.name in LINK_PRESETS for link in result.links):
        caveats.append(
            "Preset links use the raw line rate (a best case); pass a measured --link 3.2GB/s or --efficiency 0.7."
        )
    for line in [*result.notes, *caveats]:
        out.print(f"[dim]note: {line}[/]")


def _measure(model: str | None, policy_file: Path | None, model_dir: Path | None, *, tokens: list[str] | None,
             link: list[str] | None, link_gbps: list[float] | None, prefill_rate: float | None, kv_dtype: str,
             measure_mb: float, reps: int, json_output: bool) -> None:
    """``plan --measure``: this node's tiers and prefill beside the rated links; exit 1 when a tier could not be
    measured (it is named with the fix)."""
    from rich.markup import escape

    from prefixshare.bench import (
        flat_prefill,
        measure_tier_links,
        measured_plan,
        measured_prefill,
        persisted_prefill,
        prefill_lengths,
    )
    from prefixshare.cli._warm import runtime_errors, stdout_to_stderr
    from prefixshare.plan import DEFAULT_LINKS, DEFAULT_PROMPT_LENGTHS, link_from_gbps, parse_link, \
        parse_prompt_lengths, plan
    from prefixshare.policies import Policy

    if policy_file is None:
        raise fail("--measure needs --policy P.yaml: the tiers it measures are that policy's", EXIT_BAD_INPUT)
    if not policy_file.exists():
        raise fail(f"--policy {policy_file}: no such file", EXIT_BAD_INPUT)
    if model_dir is not None and not model_dir.expanduser().is_dir():
        raise fail(f"--model {model_dir}: no such directory (a model directory with config.json)", EXIT_BAD_INPUT)
    if model is None and model_dir is None:
        raise fail("give MODEL_OR_SHAPE (the model whose KV is planned) or --model DIR", EXIT_BAD_INPUT)
    loaded = Policy.from_yaml(str(policy_file))
    if not loaded.l2:
        raise fail(f"{policy_file} has no L2 tier: nothing crosses a link (add one under store.l2)", EXIT_BAD_INPUT)
    shape = model if model is not None else str(model_dir)
    lengths = [n for text in tokens for n in parse_prompt_lengths(text)] if tokens else list(DEFAULT_PROMPT_LENGTHS)
    rated = [parse_link(text) for text in link or ()] + [link_from_gbps(g) for g in link_gbps or ()]
    rated = rated or [parse_link(name) for name in DEFAULT_LINKS]
    bytes_per_token = plan(shape, prompt_lengths=[1], links=rated[:1], kv_dtype=kv_dtype).kv_bytes_per_token

    def note(line: str) -> None:
        err.print(f"[dim]{escape(line)}[/]")

    context: dict[str, Any] = {"policy": str(policy_file), "measure_bytes": int(measure_mb * 1e6), "reps": reps}
    prefill = None
    if prefill_rate is not None:
        prefill = flat_prefill(prefill_rate)
    elif model_dir is not None:
        with stdout_to_stderr(json_output), runtime_errors("the measured prefill failed"):
            prefill, context["prefill_run"] = measured_prefill(str(model_dir.expanduser().resolve()), loaded,
                                                               lengths=prefill_lengths(lengths), log_line=note)
        longest = max(context["prefill_run"]["lengths"])
        if max(lengths) > longest:
            context.setdefault("caveats", []).append(
                f"prefill beyond {longest:,} tokens is extrapolated from the fit (the longest prompt timed)")
    else:
        found = persisted_prefill()
        if found is not None:
            prefill, context["estimates"] = found
    with stdout_to_stderr(json_output):
        tiers = measure_tier_links(loaded, bytes_per_token=bytes_per_token, total_bytes=int(measure_mb * 1e6),
                                   reps=reps, log_line=note)
    result = measured_plan(shape, lengths=lengths, rated=rated, tiers=tiers, prefill=prefill, kv_dtype=kv_dtype,
                           chunk_tokens=loaded.chunk_size, context=context)
    result["notes"].extend(context.get("caveats", []))
    if prefill is None:
        result["notes"].append("no prefill rate: no persisted estimates on this node (attach an engine once) and no "
                               "--model DIR or --prefill-rate given, so there is no verdict")
    if json_output:
        emit_json(result)
    else:
        _print_measured(result)
    if any(t.error for t in tiers):
        raise typer.Exit(EXIT_CHECK_FAILED)


def _print_measured(result: dict[str, Any]) -> None:
    from rich.table import Table

    from prefixshare.plan import SHARING_WINS, format_bytes, format_seconds

    out.print(f"[bold]{result['shape']}[/]: {result['formula']}")
    prefill = result["prefill"]
    table = Table(show_edge=False, pad_edge=False)
    table.add_column("tokens", justify="right")
    table.add_column("KV size", justify="right")
    if prefill:
        table.add_column("prefill", justify="right")
    for col in result["columns"]:
        table.add_column(col["name"], justify="right")
    for row in result["rows"]:
        cells = [f"{row['tokens']:,}", format_bytes(row["kv_bytes"])]
        if prefill:
            cells.append(format_seconds(row["prefill_s"]))
        for cell in row["cells"]:
            if cell["load_s"] is None:
                cells.append("[yellow]not measured[/]")
                continue
            text = format_seconds(cell["load_s"])
            if cell["verdict"] is not None:
                text = f"[green]{text}[/]" if cell["verdict"] == SHARING_WINS else f"[red]{text}[/]"
            cells.append(text)
        table.add_row(*cells)
    out.print(table)
    if prefill:
        out.print(f"[dim]prefill: {prefill['source']}[/]")
    for col in result["columns"]:
        if col.get("error"):
            out.print(f"[red]{col['name']}: {col['error']}[/]\n  fix: {col['fix']}")
            continue
        rate = f"{col['bytes_per_s'] * 8 / 1e9:.2f} Gbit/s ({col['bytes_per_s'] / 1e9:.2f} GB/s)"
        latency = f", lookup {col['latency_s'] * 1e3:.1f} ms" if col["kind"] == "measured" else " (rated)"
        even = col.get("break_even_tokens", "n/a")
        if prefill:
            even = (f"sharing wins from {even:,} tokens" if isinstance(even, int) else
                    "prefill wins at every prompt length (this link moves a token's KV slower than prefill "
                    "computes it)")
        out.print(f"  {col['name']}: {rate}{latency}; {even}")
    for line in result["notes"]:
        out.print(f"[dim]note: {line}[/]")


def _print_shapes(json_output: bool) -> None:
    from prefixshare.plan import kv_bytes_per_token, list_shapes, shape_from_config

    shapes = [shape_from_config(name) for name in list_shapes()]
    if json_output:
        emit_json([{**s.to_dict(), "kv_bytes_per_token": kv_bytes_per_token(s)} for s in shapes])
        return
    if not shapes:  # only possible in a broken install without package data
        err.print("[yellow]no shipped shapes found[/]")
        return

    from rich.table import Table

    table = Table(show_edge=False, pad_edge=False)
    for title in ("shape", "model_type", "attention", "layers", "KV per layer", "dtype", "bytes/token"):
        table.add_column(title, justify="right" if title in ("layers", "bytes/token") else "left")
    for s in shapes:
        geometry = (
            f"({s.kv_lora_rank}+{s.qk_rope_head_dim}) latent"
            if s.is_mla
            else f"{s.num_kv_heads} heads x {s.head_dim} x 2"
        )
        row: list[Any] = [s.name, s.model_type or "", s.attention, str(s.num_layers), geometry, s.dtype or "?"]
        row.append(f"{kv_bytes_per_token(s):,}" if s.dtype else "?")
        table.add_row(*row)
    out.print(table)
