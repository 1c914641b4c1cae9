"""A deliberately slow store for benchmarks and tests: LMCache's fs L2 adapter with an added read (and write) delay.

Loaded by LMCache's MP server through its ``plugin`` L2 adapter type (never imported by prefixshare itself)::

    --l2-adapter '{"type": "plugin", "module_path": "prefixshare.bench._throttle",
                   "class_name": "ThrottledFSL2Adapter",
                   "adapter_params": {"base_path": "/dir", "chunk_delay_s": 0.05, "read_gbps": 0.2}}'

Every load (L2 -> the server's memory) first sleeps ``chunk_delay_s`` per chunk plus ``bytes / read_gbps``,
then reads and checks the files exactly like the fs tier's adapter (it reads what an fs tier wrote). With
``control_path``, both are read from that JSON file (``{"chunk_delay_s": ..., "read_gbps": ...}``) at every load,
so a benchmark can change the store's speed while the server runs (:func:`prefixshare.bench._procs.set_throttle`
writes it). With ``store_chunk_delay_s``, each chunk's write first sleeps that long in the I/O thread that
writes it (``io_threads`` at a time): a medium that takes new chunks slowly, so the server's memory holds them,
unevictable, until they are written. Lookups (file-exists checks) and deletes are the fs tier's own. It models a
store whose medium is slow — a congested NFS mount, a remote object store — the case in which loading loses to
recomputing (and, slow to write, in which the server's memory fills). Build the spec with
:func:`prefixshare.bench._procs.throttled_store_spec` (which imports nothing of LMCache).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from lmcache.v1.distributed.l2_adapters.fs_l2_adapter import FSL2AdapterConfig

from prefixshare.server.plugins.fs import CheckedFSL2Adapter

class ThrottledFSL2Adapter(CheckedFSL2Adapter):
    """prefixshare's (checked) fs L2 adapter whose loads are slowed by a per-chunk delay and/or a bandwidth cap."""

    def __init__(self, params: dict[str, Any], l1_memory_desc: Any = None) -> None:
        params = dict(params)
        self.chunk_delay_s = float(params.pop("chunk_delay_s", 0.0))
        gbps = params.pop("read_gbps", None)
        self.read_bytes_per_s = float(gbps) * 1e9 if gbps else None
        self.control_path = params.pop("control_path", None)
        self.store_chunk_delay_s = float(params.pop("store_chunk_delay_s", 0.0))
        self._control_mtime: int | None = None
        super().__init__(FSL2AdapterConfig.from_dict(params))

    def _reload(self) -> None:
        """The control file's settings, when it changed since the last load (a missing or torn file: unchanged)."""
        try:
            mtime = os.stat(self.control_path).st_mtime_ns
            if mtime == self._control_mtime:
                return
            with open(self.control_path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError):
            return
        self._control_mtime = mtime
        self.chunk_delay_s = float(data.get("chunk_delay_s") or 0.0)
        gbps = data.get("read_gbps")
        self.read_bytes_per_s = float(gbps) * 1e9 if gbps else None

    def _store_chunk(self, final: Any, tmp: Any, payload: memoryview) -> int:
        if self.store_chunk_delay_s > 0:
            time.sleep(self.store_chunk_delay_s)  # an I/O thread of the adapter's pool: the medium is busy
        return super()._store_chunk(final, tmp, payload)

    def _start_load(self, keys: list[Any], objects: list[Any], task_id: Any) -> None:
        """The fs tier's load, started after the delay (a timer on the adapter's event loop: no thread waits)."""
        if self.control_path:
            self._reload()
        delay = self.chunk_delay_s * len(keys)
        if self.read_bytes_per_s:
            delay += sum(len(obj.byte_array) for obj in objects) / self.read_bytes_per_s
        if delay <= 0:
            super()._start_load(keys, objects, task_id)
            return
        start = super()._start_load
        self._loop.call_soon_threadsafe(lambda: self._loop.call_later(delay, start, keys, objects, task_id))

    def report_status(self) -> dict[str, Any]:
        status = super().report_status()
        status["throttle"] = {"chunk_delay_s": self.chunk_delay_s, "read_bytes_per_s": self.read_bytes_per_s,
                              "store_chunk_delay_s": self.store_chunk_delay_s}
        return status


