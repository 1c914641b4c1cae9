"""prefixshare's fs L2 adapter: LMCache's fs adapter plus integrity data, run inside LMCache's MP server.

Loaded by the server through LMCache's ``plugin`` L2 adapter type (the fs tier renders the spec; nothing in
prefixshare imports this module, which imports LMCache)::

    --l2-adapter '{"type": "plugin", "module_path": "prefixshare.server.plugins.fs",
                   "class_name": "CheckedFSL2Adapter", "adapter_params": {"base_path": "/dir"}, ...}'

File names, lookups (a file-exists check) and deletes are LMCache's fs adapter's own, so several servers on
one directory share chunks and LMCache's tools still read the files. What differs:

* **store** writes ``payload + trailer`` (see :mod:`prefixshare.server.plugins.integrity`) to a temporary file
  created with mode 0640 (never world-readable), then renames it into place;
* **load** reads the payload and the trailer, and accepts the chunk only if the digest over the file name and
  the payload matches. A damaged chunk (truncated, bit-flipped, copied in under another name, written
  without integrity data) is never loaded: the load reports a miss for it, so the engine recomputes from
  that chunk on, and the file is renamed ``<name>.corrupt`` (lookups stop finding it; ``prefixshare doctor``
  lists it, ``prefixshare store gc --damaged`` removes it). One structured log line per damaged chunk.

With ``key_env`` in the adapter's parameters (the fs tier's ``key_env``) digests are keyed: the key is read
from that environment variable of the server's process when the adapter starts (never from the policy), and
``accept_key_envs`` names further keys accepted for reading (a rotation). A chunk this server cannot check
because it holds no key (``keyed``) is not loaded and left in place; every other refusal is quarantined.

The digest costs one blake3 pass over the bytes on store and on load (GB/s per core; measured in
docs/benchmarks.md).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import aiofiles.os
from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.fs_l2_adapter import FSL2Adapter, FSL2AdapterConfig

from prefixshare._log import configure_from_environment, get_logger
from prefixshare.server.plugins import integrity

log = get_logger("prefixshare.store")

#: mode of every chunk file we create (before the process umask): the owner writes, its group reads
FILE_MODE = 0o640


class CheckedFSL2AdapterConfig(FSL2AdapterConfig):
    """LMCache's fs adapter fields (``base_path``, ``relative_tmp_dir``, ``read_ahead_size``,
    ``use_odirect``; O_DIRECT is not used by this adapter: the trailer breaks block alignment), plus the names
    of the store key variables (``key_env``, ``accept_key_envs``). LMCache's plugin loader builds it from the
    adapter's parameters by this class's name."""

    key_env: str | None = None
    accept_key_envs: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, d: dict) -> CheckedFSL2AdapterConfig:
        base = FSL2AdapterConfig.from_dict(d)
        config = cls(base.base_path, base.relative_tmp_dir, base.read_ahead_size, base.use_odirect)
        key_env, accept = d.get("key_env"), d.get("accept_key_envs") or []
        if key_env is not None and not isinstance(key_env, str):
            raise ValueError("key_env must be the name of an environment variable")
        if not isinstance(accept, list) or not all(isinstance(a, str) for a in accept):
            raise ValueError("accept_key_envs must be a list of environment variable names")
        if accept and key_env is None:
            raise ValueError("accept_key_envs needs key_env")
        config.key_env, config.accept_key_envs = key_env, tuple(accept)
        return config


class CheckedFSL2Adapter(FSL2Adapter):
    """fs L2 adapter whose chunks carry a digest that every load verifies."""

    def __init__(self, config: FSL2AdapterConfig | dict[str, Any], l1_memory_desc: Any = None) -> None:
        configure_from_environment()  # the MP server's process: log as the process that started it
        if isinstance(config, dict):
            config = CheckedFSL2AdapterConfig.from_dict(config)
        key_env = getattr(config, "key_env", None)
        #: None: unkeyed digests; else the keys this server signs with and accepts (StoreKeyError when missing)
        self.keyring = integrity.Keyring.from_env(key_env, getattr(config, "accept_key_envs", ())) if key_env else None
        config.use_odirect = False
        super().__init__(config)
        self.damaged = 0  # chunks refused on load since start
        self.verified = 0
        self.uncheckable = 0  # keyed chunks this server holds no key for (not loaded, left in place)
        self._log = log.bind(base_path=str(self._base_path))

    # ---- store ----------------------------------------------------------------------------------------

    def _write(self, tmp: Path, final: Path, payload: memoryview, tail: bytes) -> None:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
        try:
            with os.fdopen(fd, "wb", closefd=True) as f:
                f.write(payload)
                f.write(tail)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        os.replace(tmp, final)

    async def _execute_store(self, keys: list[Any], objects: list[Any], task_id: Any) -> None:  # type: ignore[override]
        success, written = True, 0
        stored_keys: list[Any] = []
        stored_sizes: list[int] = []
        for key, obj in zip(keys, objects, strict=True):
            final, tmp = self._key_to_file_and_tmp_path(key)
            try:
                if await aiofiles.os.path.exists(final):
                    continue
                payload = memoryview(obj.byte_array).cast("B")
                tail = await self._loop.run_in_executor(None, integrity.trailer, final.name, payload, self.keyring)
                await self._loop.run_in_executor(None, self._write, tmp, final, payload, tail)
                written += payload.nbytes
                stored_keys.append(key)
                # the file's size: LMCache's delete subtracts what it stats, so usage must add the same
                stored_sizes.append(payload.nbytes + integrity.TRAILER_BYTES)
            except Exception as exc:  # one failed chunk fails the task; the others are still tried
                self._log.warning("store.write_failed", file=final.name, error=repr(exc))
                success = False
        if stored_keys:
            self._notify_keys_stored(stored_keys, stored_sizes)
        with self._lock:
            self._completed_store_tasks[task_id] = L2StoreResult(success, written)
        self._store_efd.notify()

    # ---- load -----------------------------------------------------------------------------------------

    def _read_checked(self, path: Path, dst: memoryview) -> integrity.Verdict:
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            n = dst.nbytes
            got = 0
            while got < n:
                k = f.readinto(dst[got:])
                if not k:
                    break
                got += k
            if got < n:
                return "truncated"
            tail = f.read(integrity.TRAILER_BYTES)
        # blake3 (~8 GB/s a core) is the cost, not the read
        return integrity.check(path.name, dst, tail, size, self.keyring)

    def _quarantine(self, path: Path, verdict: str) -> None:
        self.damaged += 1
        target = path.with_name(path.name + integrity.QUARANTINE_SUFFIX)
        try:
            os.replace(path, target)
            moved = True
        except OSError:
            moved = False
        self._log.warning("store.damaged_chunk", file=path.name, verdict=verdict, quarantined=moved,
                          action="not loaded; the engine recomputes from this chunk")

    async def _execute_load(self, keys: list[Any], objects: list[Any], task_id: Any) -> None:  # type: ignore[override]
        bitmap = Bitmap(len(keys))
        for i, key in enumerate(keys):
            path = self._key_to_path(key)
            try:
                dst = memoryview(objects[i].byte_array).cast("B")
                verdict = await self._loop.run_in_executor(None, self._read_checked, path, dst)
            except FileNotFoundError:
                continue
            except Exception as exc:
                self._log.warning("store.read_failed", file=path.name, error=repr(exc))
                continue
            if verdict == "ok":
                self.verified += 1
                bitmap.set(i)
            elif verdict in integrity.UNCHECKABLE:
                self.uncheckable += 1
                self._log.warning("store.keyed_chunk", file=path.name, action="not loaded (this server holds no "
                                  "store key); set the fs tier's key_env on every server of this store")
            else:
                self._quarantine(path, verdict)
        loaded = [keys[i] for i in bitmap.get_indices_list()]
        if loaded:
            self._notify_keys_accessed(loaded)
        with self._lock:
            self._completed_load_tasks[task_id] = bitmap
        self._load_efd.notify()

    def report_status(self) -> dict[str, Any]:
        status = super().report_status()
        status.update(type="prefixshare.CheckedFSL2Adapter",
                      integrity="blake3-keyed" if self.keyring is not None else "blake3",
                      chunks_verified=self.verified, chunks_damaged=self.damaged, chunks_uncheckable=self.uncheckable)
        return status
