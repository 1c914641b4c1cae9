"""``prefixshare demo``: a fresh replica loads a manual another replica prefilled, with TTFT measured against
a cold replica (see :mod:`prefixshare.demo._run`)."""

from __future__ import annotations

from prefixshare.demo._run import QUESTIONS, DemoConfig, DemoError, DemoResult, find_manual, render_table, run_demo

__all__ = ["QUESTIONS", "DemoConfig", "DemoError", "DemoResult", "find_manual", "render_table", "run_demo"]
