"""``prefixshare verify``: are the answers replicas serve from the store the ones they compute?

Two sources of store hits to check, one verdict line at the end:

* ``--url URL``: the hits a running ``vllm serve`` replica set aside (policy ``verify.sample``), replayed over
  its HTTP API;
* ``--model DIR``: the store's warmed documents (all, ``--sample N`` of them or ``--document ID``), replayed on
  an engine this command starts with the policy, as ``prefixshare warm`` does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.markup import escape

from prefixshare.cli._common import EXIT_BAD_INPUT, EXIT_CHECK_FAILED, JSON_OPTION, emit_json, fail, handles_errors, out

_STYLE = {"ok": "green", "mismatch": "red", "unverifiable": "yellow"}


def register(app: typer.Typer) -> None:
    @app.command("verify")
    @handles_errors
    def verify_cmd(
        policy: Path = typer.Option(..., "--policy", "-p", help="Policy YAML file (the replicas')."),
        url: str | None = typer.Option(None, "--url", help="A running vllm serve replica (e.g. http://127.0.0.1:8000): "
                                       "verify the store hits it set aside (policy verify.sample)."),
        instance: str = typer.Option("vllm-serve", "--instance", help="With --url: the replica's instance name "
                                     "(prefixshare vllm-args --instance; its hits wait in this node's run directory)."),
        api_key: str | None = typer.Option(None, "--api-key", envvar="VLLM_API_KEY", help="With --url: the "
                                           "replica's API key, if it has one."),
        model: str | None = typer.Option(None, "--model", "-m", help="Verify the store's warmed documents on an "
                                         "engine started here with this model (as your replicas load it)."),
        sample: int | None = typer.Option(None, "--sample", min=1, help="With --model: this many documents, at "
                                          "random (default: all)."),
        document: str | None = typer.Option(None, "--document", help="With --model: this document only."),
        seed: int | None = typer.Option(None, "--seed", help="With --sample: the draw's seed."),
        limit: int | None = typer.Option(None, "--limit", min=1, help="With --url: at most this many hits."),
        budget: float | None = typer.Option(None, "--budget", min=0.0, help="With --url: stop after this many "
                                            "seconds (the rest stay pending)."),
        dtype: str | None = typer.Option(None, "--dtype", help="With --model: model/KV dtype; must match your "
                                         "replicas (default: float32 on CPU hosts, auto elsewhere)."),
        block_size: int | None = typer.Option(None, "--block-size", help="With --model: engine KV block size; must "
                                              "match your replicas."),
        json: bool = JSON_OPTION,
    ) -> None:
        """Replay store hits loaded and recomputed; quarantine the chunks of any whose answer differs.

        Exit 0 when no hit mismatched (or none was pending), 1 when one did (its chunks are quarantined) or none
        could be verified, 2 on bad input."""
        from prefixshare.policies import Policy

        if (url is None) == (model is None):
            raise fail("give --url URL (hits a vllm serve replica set aside) or --model DIR (the store's warmed "
                       "documents)", EXIT_BAD_INPUT)
        if model is not None and sample is not None and document is not None:
            raise fail("give --sample N or --document ID, not both", EXIT_BAD_INPUT)
        if url is not None and (sample is not None or document is not None):
            raise fail("--sample and --document choose warmed documents: use them with --model", EXIT_BAD_INPUT)
        loaded = Policy.from_yaml(str(policy))
        if url is not None:
            report = _served(loaded, url, instance, api_key, limit, budget)
        else:
            assert model is not None
            if not Path(model).expanduser().exists():
                raise fail(f"--model {model}: no such directory", EXIT_BAD_INPUT)
            report = _documents(loaded, str(policy), str(Path(model).expanduser().resolve()), sample=sample,
                                document=document, seed=seed, dtype=dtype, block_size=block_size, quiet=json)
        if json:
            emit_json(report.to_dict())
        else:
            _print(report)
        if report.verdict == "mismatch" or (report.checks and report.verdict == "unverifiable"):
            raise typer.Exit(EXIT_CHECK_FAILED)


def _served(policy: Any, url: str, instance: str, api_key: str | None, limit: int | None,
            budget: float | None) -> Any:
    from prefixshare.runtime import pending_tasks
    from prefixshare.verify import ServedReplica, VerifyReport, verify_tasks

    if not pending_tasks(instance):
        return VerifyReport()  # nothing set aside: no need to reach the replica
    with ServedReplica(url, api_key=api_key) as replica:
        return verify_tasks(replica, policy, instance, limit=limit, budget_s=budget)


def _documents(policy: Any, policy_file: str, model: str, *, sample: int | None, document: str | None,
               seed: int | None, dtype: str | None, block_size: int | None, quiet: bool) -> Any:
    from prefixshare.cli._warm import _shutdown, runtime_errors, stdout_to_stderr
    from prefixshare.warm import apply_engine_env, vllm_engine_kwargs

    apply_engine_env(engine="vllm")
    from prefixshare.share import PrefixShare
    from prefixshare.verify import verify_documents

    kwargs = vllm_engine_kwargs(policy, model, dtype=dtype, block_size=block_size)
    with stdout_to_stderr(quiet), PrefixShare(policy_file) as ps:
        with runtime_errors("the vLLM engine did not start"):
            llm = ps.attach(kwargs)
        try:
            with runtime_errors("verification failed"):
                return verify_documents(ps, llm, sample=sample, document=document, seed=seed)
        finally:
            _shutdown(llm)


def _print(report: Any) -> None:
    from rich.table import Table

    if report.checks:
        table = Table(title="verify: store hits replayed loaded and recomputed", header_style="bold")
        for name, justify in (("hit", "left"), ("verdict", "left"), ("tokens", "right"), ("loaded", "right"),
                              ("max |Δ logprob|", "right"), ("seconds", "right"), ("note", "left")):
            table.add_column(name, justify=justify, overflow="fold")  # type: ignore[arg-type]
        for c in report.checks:
            diff = c.comparison.to_dict()["max_diff"] if c.comparison else None
            table.add_row(escape(c.document_id or c.request_id), f"[{_STYLE.get(c.verdict, '')}]{c.verdict}[/]",
                          f"{c.tokens:,}", f"{c.reloaded_tokens:,}/{c.loaded_tokens:,}",
                          "-" if diff is None else f"{diff:.2g}", f"{c.seconds:.2f}", escape(c.reason))
        out.print(table)
    style = {"ok": "green", "mismatch": "red"}.get(report.verdict, "yellow")
    line = report.summary() if report.checks else "none: no store hits were pending verification"
    out.print(f"[bold {style}]{escape(line)}[/]")
