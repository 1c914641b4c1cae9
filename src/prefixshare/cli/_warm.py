"""``prefixshare warm PATHS... --policy P --model M``: prefill documents into the shared store once."""

from __future__ import annotations

import contextlib
import json as _json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape

from prefixshare.cli._common import (
    EXIT_BAD_INPUT,
    EXIT_CHECK_FAILED,
    EXIT_RUNTIME,
    JSON_OPTION,
    emit_json,
    err,
    fail,
    handles_errors,
    human_size,
    out,
)


@contextlib.contextmanager
def stdout_to_stderr(enabled: bool) -> Iterator[None]:
    """Send everything written to file descriptor 1 (engine logs, native prints) to stderr meanwhile, so
    ``--json`` output stays the only thing on stdout."""
    if not enabled:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


@contextlib.contextmanager
def runtime_errors(what: str) -> Iterator[None]:
    """Engine errors (not prefixshare's own) as one line and exit 3, unless --debug."""
    from prefixshare.errors import PrefixShareError

    try:
        yield
    except (PrefixShareError, typer.Exit, KeyboardInterrupt):
        raise
    except Exception as exc:
        if "--debug" in sys.argv:
            raise
        raise fail(f"{what}: {type(exc).__name__}: {exc}", EXIT_RUNTIME) from None


def _unescape(text: str | None) -> str | None:
    """``\\n`` and ``\\t`` typed on a command line mean a newline and a tab."""
    return text.replace("\\n", "\n").replace("\\t", "\t") if text is not None else None


def _engine_args(items: list[str]) -> dict[str, Any]:
    args: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise typer.BadParameter(f"expected KEY=VALUE, got {item!r}", param_hint="--engine-arg")
        try:
            args[key.strip().replace("-", "_")] = _json.loads(value)
        except ValueError:
            args[key.strip().replace("-", "_")] = value
    return args


def _template(template: str | None, chat: bool, system: str | None, question: str | None) -> Any:
    from prefixshare.warm import Template

    if chat or system is not None:
        if template is not None:
            raise typer.BadParameter("use either --template or --chat/--system", param_hint="--template")
        return Template.chat(system=system)
    if template is None and question is None:
        return None
    kwargs: dict[str, Any] = {}
    if template is not None:
        kwargs["prefix"] = template
    if question is not None:
        kwargs["question"] = question
    return Template(**kwargs)


def register(app: typer.Typer) -> None:
    @app.command("warm")
    @handles_errors
    def warm_cmd(
        paths: list[str] = typer.Argument(..., help="Files, folders or glob patterns of text documents."),
        policy: Path = typer.Option(..., "--policy", "-p", help="Policy YAML file."),
        model: str = typer.Option(..., "--model", "-m", help="Model directory (as your replicas load it)."),
        engine: str = typer.Option("vllm", "--engine", help="Engine to prefill with: vllm or sglang (the one your "
                                   "replicas run: each engine's KV is stored under its own fingerprint)."),
        force: bool = typer.Option(False, "--force", help="Prefill even documents already in the store."),
        template: str | None = typer.Option(
            None, "--template", help="Text around each document in your prompts, with {document} once "
            "(e.g. 'Answer from this manual.\\n\\n{document}'). Default: the document alone."),
        question: str | None = typer.Option(
            None, "--question-template", help="What follows the prefix in your prompts, with {question} once."),
        chat: bool = typer.Option(False, "--chat", help="Place documents with the model's chat template "
                                  "(user turn: document, then the question)."),
        system: str | None = typer.Option(None, "--system", help="System prompt for --chat (implies --chat)."),
        tenant: str | None = typer.Option(None, "--tenant", help="Tenant the documents belong to."),
        split: bool = typer.Option(False, "--split", help="Split documents longer than the context into parts "
                                   "'ID#N' (default: refuse them)."),
        dtype: str | None = typer.Option(None, "--dtype", help="Model/KV dtype; must match your replicas "
                                         "(default: float32 on CPU hosts, auto elsewhere)."),
        block_size: int | None = typer.Option(None, "--block-size", help="Engine KV block size (SGLang: page "
                                              "size); must match your replicas (default vLLM: largest of "
                                              "128/64/32/16 dividing chunk_size; SGLang: 16 on CPU, its own on GPU)."),
        max_model_len: int | None = typer.Option(None, "--max-model-len", help="Engine context length "
                                                 "(default: the model's)."),
        engine_arg: list[str] = typer.Option([], "--engine-arg", help="Extra vllm.LLM (or sglang.Engine) argument "
                                             "KEY=VALUE (JSON values); repeatable."),
        batch_tokens: int = typer.Option(16384, "--batch-tokens", min=1, help="Tokens per engine call."),
        verify_timeout: float = typer.Option(30.0, "--verify-timeout", help="Seconds to wait for every chunk "
                                             "to reach the store."),
        retries: int = typer.Option(2, "--retries", min=0, help="Times to prefill again a document whose chunks "
                                    "the store lacks after the server finished writing (it drops stores it has "
                                    "no memory for)."),
        json: bool = JSON_OPTION,
    ) -> None:
        """Prefill documents once so every replica loads them; verify the store and record them.

        Exit 0 when every document is warm (or was already), 1 when some could not be (admission refused,
        chunks missing), 2 on bad input (unreadable file, document longer than the context...).
        """
        from prefixshare.policies import Policy

        if engine not in ("vllm", "sglang"):
            raise fail(f"--engine {engine}: unknown engine; use vllm or sglang", EXIT_BAD_INPUT)
        loaded = Policy.from_yaml(str(policy))
        if not Path(model).expanduser().exists():
            raise fail(f"--model {model}: no such directory", EXIT_BAD_INPUT)
        if block_size is not None and loaded.chunk_size % block_size:
            raise fail(f"--block-size {block_size} does not divide the policy's chunk_size {loaded.chunk_size}",
                       EXIT_BAD_INPUT)
        if not loaded.l2:
            from prefixshare.server import LMCacheServer

            if not LMCacheServer(loaded).healthy():
                raise fail("the policy has no L2 tier, so warmed KV would live only in the memory of a server this "
                           "command starts and stops; start it first (prefixshare server start --policy "
                           f"{policy}) or add a shared tier", EXIT_BAD_INPUT)
        tpl = _template(_unescape(template), chat, _unescape(system), _unescape(question))
        from prefixshare.warm import resolve_documents

        docs = resolve_documents(paths)  # bad paths fail here, before an engine starts
        report = _run(loaded, str(policy), str(Path(model).expanduser().resolve()), docs, tpl, engine=engine,
                      force=force,
                      tenant=tenant, split=split, batch_tokens=batch_tokens, verify_timeout=verify_timeout,
                      retries=retries,
                      engine_kwargs={"dtype": dtype, "block_size": block_size, "max_model_len": max_model_len,
                                     "extra": _engine_args(engine_arg)},
                      quiet_stdout=json, show_progress=not json)
        if json:
            emit_json(report.to_dict())
        else:
            _print_report(report)
        if not report.ok:
            raise typer.Exit(EXIT_CHECK_FAILED)


def _run(policy: Any, policy_file: str, model: str, docs: Any, template: Any, *, engine: str, force: bool,
         tenant: str | None, split: bool, batch_tokens: int, verify_timeout: float, retries: int,
         engine_kwargs: dict[str, Any],
         quiet_stdout: bool, show_progress: bool) -> Any:
    from prefixshare.warm import apply_engine_env, sglang_engine_kwargs, vllm_engine_kwargs

    apply_engine_env(engine=engine)
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)  # torch/vLLM deprecation chatter
    from prefixshare.share import PrefixShare
    from prefixshare.warm import warm

    if engine == "sglang":
        kwargs = sglang_engine_kwargs(policy, model, **engine_kwargs)
        name, block = "an SGLang", kwargs.get("page_size", "default")
    else:
        kwargs = vllm_engine_kwargs(policy, model, **engine_kwargs)
        name, block = "a vLLM", kwargs["block_size"]
    progress_cm, callback = _progress(show_progress)
    with stdout_to_stderr(quiet_stdout), PrefixShare(policy_file) as ps:
        if show_progress:
            err.print(f"starting {name} engine for {escape(model)} (dtype {kwargs['dtype']}, block {block})...")
        with runtime_errors(f"the {name.split()[-1]} engine did not start"):
            llm = ps.attach(kwargs, engine_type=engine)
        try:
            with progress_cm, runtime_errors("warming failed"):
                report = warm(ps, docs, llm, prefix=template, force=force, tenant=tenant, split=split,
                              batch_tokens=batch_tokens, verify_timeout_s=verify_timeout, retries=retries,
                              strict=False,
                              progress=callback)
        finally:
            _shutdown(llm)
    return report


def _shutdown(llm: Any) -> None:
    """Stop the engine (its connector unregisters) while the server still runs; vLLM 0.32's LLMEngine has no
    shutdown() of its own, its engine-core client has; a sglang.Engine has one."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    shutdown = getattr(core if core is not None else llm, "shutdown", None)
    with contextlib.suppress(Exception):
        if callable(shutdown):
            shutdown()


def _rates(p: Any, state: dict[str, Any]) -> str:
    """KV prefilled per second and, where the store is a directory, KV written to it per second (the last
    measured value stays shown between prefill reports)."""
    if p.elapsed_s <= 0:
        return state.get("rate", "")
    text = f"prefill {human_size(int(p.bytes_done / p.elapsed_s))}/s"
    if p.stored_bytes is not None:
        text += f", store {human_size(int(p.stored_bytes / p.elapsed_s))}/s"
    if p.phase == "prefill":
        state["rate"] = text
    return state.get("rate", text)


def _progress(enabled: bool) -> tuple[Any, Any]:
    """A rich progress bar on stderr, shown from the first report (so an early error prints no empty bar)."""
    if not enabled:
        return contextlib.nullcontext(), None
    from rich.progress import (
        BarColumn,
        Progress,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    progress = Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), TaskProgressColumn(),
        TextColumn("{task.fields[docs]} docs"), TextColumn("{task.fields[tokens]} tokens"),
        TextColumn("{task.fields[size]}"), TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TextColumn("ETA"),
        TimeRemainingColumn(),
        console=err, transient=False,
    )
    state: dict[str, Any] = {}

    def callback(p: Any) -> None:
        if "task" not in state:
            progress.start()
            state["task"] = progress.add_task("warming", total=p.tokens_total or None, docs="", tokens="", size="",
                                              rate="")
        progress.update(state["task"], total=p.tokens_total or None, completed=p.tokens_done,
                        description={"plan": "warming", "prefill": "warming", "verify": "verifying",
                                     "done": "done"}.get(p.phase, p.phase),
                        docs=f"{p.documents_done}/{p.documents_total}",
                        tokens=f"{p.tokens_done:,}/{p.tokens_total:,}",
                        size=f"{human_size(p.bytes_done)}/{human_size(p.bytes_total)}", rate=_rates(p, state))

    @contextlib.contextmanager
    def running() -> Iterator[None]:
        try:
            yield
        finally:
            if "task" in state:
                progress.stop()

    return running(), callback


_STYLE = {"warmed": "green", "skipped": "cyan", "too_short": "yellow", "refused": "red", "failed": "red"}


def _print_report(report: Any) -> None:
    from rich.table import Table

    table = Table(title=f"warm: {report.namespace} ({report.fingerprint[:12]}) -> {report.store or 'server'}",
                  header_style="bold")
    for name, justify in (("document", "left"), ("status", "left"), ("tokens", "right"), ("chunks", "right"),
                          ("bytes", "right"), ("seconds", "right"), ("note", "left")):
        table.add_column(name, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for d in report.documents:
        style = _STYLE.get(d.status, "")
        table.add_row(escape(d.id), f"[{style}]{d.status}[/]", f"{d.tokens:,}", str(d.chunks), human_size(d.bytes),
                      f"{d.seconds:.2f}" if d.seconds is not None else "-", escape(d.reason))
    out.print(table)
    t, rates = report.totals(), report.rates()
    if rates["documents_per_s"] is not None:
        out.print(f"{rates['documents_per_s']:.2f} documents/s, {rates['tokens_per_s']:,.0f} tokens/s, "
                  f"KV {rates['kv_gbps']:.3f} GB/s over the whole run ({rates['prefill_kv_gbps']:.3f} GB/s while "
                  f"prefilling, {rates['prefill_s']:.1f} s)")
    out.print(f"{t['warmed']} warmed, {t['skipped']} already warm, {t['too_short']} too short, "
              f"{t['failed']} not warmed; {t['warmed_tokens']:,} tokens ({human_size(t['warmed_bytes'])}) written "
              f"in {report.seconds:.1f} s; {t.get('verified', 0)} verified in the store, {t.get('unverified', 0)} "
              "unverified")
    if t.get("retried") or report.paced_seconds >= 1.0:
        out.print(f"{t.get('retried', 0)} prefilled more than once; {report.paced_seconds:.1f} s waiting for room in "
                  "the server's memory")
