"""Operate a directory store: what it holds (:func:`inspect_store`), pruning it (:func:`plan_gc`,
:func:`run_gc`) and checking a node's set-up (:func:`doctor`)."""

from __future__ import annotations

from prefixshare.store._doctor import Check, DoctorReport, doctor
from prefixshare.store._gc import Deletion, GcPlan, GcResult, plan_gc, run_gc
from prefixshare.store._inspect import StoreScan, StoredFile, inspect_store, local_hits, scan_store

__all__ = [
    "Check",
    "Deletion",
    "DoctorReport",
    "GcPlan",
    "GcResult",
    "StoreScan",
    "StoredFile",
    "doctor",
    "inspect_store",
    "local_hits",
    "plan_gc",
    "run_gc",
    "scan_store",
]
