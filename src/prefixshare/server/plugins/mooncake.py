"""LMCache L2 adapter over Mooncake Store's Python client (``mooncake.store.MooncakeDistributedStore``).

Loaded only by LMCache's MP server, through its ``plugin`` L2 adapter type; nothing in prefixshare imports
this module (it imports LMCache and Mooncake at top level). The ``mooncake_store`` tier renders the spec::

    {"type": "plugin", "module_path": "prefixshare.server.plugins.mooncake",
     "class_name": "MooncakeStoreL2Adapter",
     "adapter_params": {"master_server_addr": "host:port", "metadata_server": "http://host:port/metadata",
                        "local_hostname": "10.0.0.5", "protocol": "tcp", "global_segment_size": 4294967296, ...}}

LMCache 0.5.6's own ``mooncake_store`` adapter needs a compiled extension its wheel does not ship; this one
uses only Mooncake's published Python client. Each chunk is one Mooncake object, copied straight between
LMCache's L1 buffers and Mooncake (``batch_put_from`` / ``batch_get_into``: no serialisation, no pickle).

Traps handled here (and tested):

* Mooncake's setup dict reads ``master_server_addr``. ``master_server_address`` (its CLI flag's name) and
  ``mooncake_master_server_addr`` (LMCache's in-process key) are ignored *silently*: Mooncake then retries
  a default master for ~90 s and stores nothing. Such keys are refused with the fix.
* ``batch_is_exist`` answers 1 (present), 0 (absent) or a negative error code (-900 when the master is
  unreachable). Only 1 is a hit; treating any non-zero value as present reports false hits.
* ``batch_get_into`` answers the number of bytes read or a negative code; a load counts only when it read
  exactly the chunk's size.
* The master refuses to remove an object read less than its ``default_kv_lease_ttl`` ago (10 s by default;
  measured in the network lab: a delete right after a load freed nothing, the same delete 11 s later did). A
  refused delete is logged and retried by one thread after ``lease_ttl_s`` (+1 s), up to ``DELETE_RETRIES``
  times; the store's usage counts the object until it is really gone.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.platform import create_event_notifier
from tenacity import RetryError, Retrying, retry_if_result, stop_after_delay, wait_fixed

from prefixshare._log import configure_from_environment, get_logger
from prefixshare._net import connect_error

if TYPE_CHECKING:
    from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
    from lmcache.v1.memory_management import MemoryObj

log = get_logger(__name__)

#: Mooncake's code for a key it does not hold (nothing to delete, nothing to load)
OBJECT_NOT_FOUND = -704
#: Mooncake's code for a call that did not reach the master (used here too when the client raised)
RPC_FAILED = -900

#: keys Mooncake silently ignores in its setup dict, and the key it actually reads
WRONG_MASTER_KEYS = ("master_server_address", "mooncake_master_server_addr")
MASTER_KEY = "master_server_addr"
#: adapter params that are ours, not Mooncake's setup keys
_OWN_KEYS = {"num_workers", "key_prefix", "connect_timeout_s", "lease_ttl_s"}
#: a delete the master refused (a read lease) is tried again this many times, each lease_ttl_s + 1 s later
DELETE_RETRIES = 3
_SETUP_KEYS = {"local_hostname", "metadata_server", "global_segment_size", "local_buffer_size", "protocol",
               "rdma_devices", MASTER_KEY}


def where(address: str) -> str:
    """host:port of an address or URL, for logs: never a scheme's credentials, path or query."""
    if "://" in address:
        parts = urlsplit(address)
        host = parts.hostname or ""
        return f"{host}:{parts.port}" if parts.port else host
    return address.rsplit("@", 1)[-1]


def check_params(params: dict[str, Any]) -> dict[str, Any]:
    """Validated adapter params (raises ValueError naming the field and the fix)."""
    for wrong in WRONG_MASTER_KEYS:
        if wrong in params:
            raise ValueError(f"{wrong!r} is not a key Mooncake reads (it would be ignored silently, then ~90 s "
                             f"of retries against a default master): rename it to {MASTER_KEY!r}")
    unknown = set(params) - _SETUP_KEYS - _OWN_KEYS
    if unknown:
        raise ValueError(f"unknown Mooncake adapter params {sorted(unknown)}; known: "
                         f"{sorted(_SETUP_KEYS | _OWN_KEYS)}")
    for key in (MASTER_KEY, "metadata_server"):
        if not isinstance(params.get(key), str) or not params[key]:
            raise ValueError(f"{key!r} is required (a non-empty string)")
    host, sep, port = params[MASTER_KEY].rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{MASTER_KEY!r} must be host:port, e.g. 127.0.0.1:50051")
    return params


def setup_config(params: dict[str, Any]) -> dict[str, str]:
    """Mooncake's setup dict (string values, its own key names)."""
    cfg = {"local_hostname": "127.0.0.1", "protocol": "tcp", "global_segment_size": str(4 << 30),
           "local_buffer_size": str(1 << 30)}
    cfg.update({k: str(v) for k, v in params.items() if k in _SETUP_KEYS and v not in (None, "")})
    return cfg


def mooncake_key(prefix: str, key: ObjectKey) -> str:
    """One Mooncake object name per chunk: every field of LMCache's key (``@`` never occurs in them)."""
    name = f"{prefix}/{key.model_name}@{key.kv_rank:#010x}@{key.object_group_id:x}@{key.chunk_hash.hex()}"
    return f"{name}@{key.cache_salt}" if key.cache_salt else name


def present(code: int) -> bool:
    """``batch_is_exist``: 1 present, 0 absent, negative = an error (-900: master unreachable) -> a miss."""
    return code == 1


def loaded(code: int, expected: int) -> bool:
    """``batch_get_into``: bytes read, or a negative error code; only a full chunk counts."""
    return code == expected


def _wait_for_master(address: str, timeout_s: float) -> None:
    """Fail fast (with the address) when the master does not accept connections, instead of Mooncake's own
    ~90 s of retries."""
    host, _, port = address.rpartition(":")

    def refused() -> bool:
        return connect_error(host, int(port), timeout=1.0) is not None

    try:
        Retrying(stop=stop_after_delay(timeout_s), wait=wait_fixed(0.2), retry=retry_if_result(bool))(refused)
    except RetryError:
        raise ConnectionError(f"mooncake_master at {where(address)} is not reachable after {timeout_s:.0f} s") from None


class MooncakeStoreL2Adapter(L2AdapterInterface):
    """Store / lookup / load chunks as Mooncake objects; each submitted task runs on a worker thread and
    signals its event fd when done (the fs adapter's contract)."""

    def __init__(self, params: dict[str, Any], l1_memory_desc: Any = None, *, store: Any = None) -> None:
        configure_from_environment()  # the MP server's process: log as the process that started it
        super().__init__()
        params = check_params(dict(params))
        self._prefix = str(params.get("key_prefix") or "prefixshare")
        self._master = params[MASTER_KEY]
        cfg = setup_config(params)
        if store is None:
            from mooncake.store import MooncakeDistributedStore

            _wait_for_master(self._master, float(params.get("connect_timeout_s", 10.0)))
            store = MooncakeDistributedStore()
            started = time.monotonic()
            rc = store.setup(cfg)
            if rc != 0:
                raise RuntimeError(f"Mooncake setup failed (code {rc}) with master {where(self._master)}, "
                                   f"metadata {where(cfg['metadata_server'])}")
            log.info("mooncake_connected", master=where(self._master), metadata=where(cfg["metadata_server"]),
                     protocol=cfg["protocol"], segment_bytes=int(cfg["global_segment_size"]),
                     setup_s=round(time.monotonic() - started, 3))
            if cfg["protocol"] == "rdma" and l1_memory_desc is not None and l1_memory_desc.size > 0:
                # RDMA reads/writes L1 directly: register the whole arena once.
                rc = store.register_buffer(l1_memory_desc.ptr, l1_memory_desc.size)
                if rc != 0:
                    raise RuntimeError(f"Mooncake could not register LMCache's L1 memory (code {rc})")
        self._store = store
        self._pool = ThreadPoolExecutor(max_workers=int(params.get("num_workers", 4)),
                                        thread_name_prefix="ps-mooncake")
        self._efds = {kind: create_event_notifier() for kind in ("store", "lookup", "load")}
        self._lock = threading.Lock()
        self._next_id = 0
        self._done: dict[str, dict[L2TaskId, Any]] = {"store": {}, "lookup": {}, "load": {}}
        self._sizes: dict[str, int] = {}  # bytes of the objects this node stored (for delete accounting)
        self._closed = False
        #: refused deletes waiting for their lease to end: name -> (key, tries so far, when to try again)
        self._lease_s = float(params.get("lease_ttl_s", 10.0)) + 1.0
        self._retry: dict[str, tuple[ObjectKey, int, float]] = {}
        self._retry_wake = threading.Event()
        self._retry_thread: threading.Thread | None = None

    # --- event fds ---------------------------------------------------------------------------------------
    def get_store_event_fd(self) -> int:
        return self._efds["store"].fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._efds["lookup"].fileno()

    def get_load_event_fd(self) -> int:
        return self._efds["load"].fileno()

    # --- task plumbing -----------------------------------------------------------------------------------
    def _submit(self, kind: str, work: Any, failed: Any) -> L2TaskId:
        with self._lock:
            task_id = self._next_id
            self._next_id += 1

        def run() -> None:
            try:
                result = work()
            except Exception as exc:  # a failed task is a miss / a failed store, never a crash of the server
                log.warning("mooncake_task_failed", kind=kind, error=str(exc))
                result = failed()
            with self._lock:
                self._done[kind][task_id] = result
            self._efds[kind].notify()

        self._pool.submit(run)
        return task_id

    # --- store -------------------------------------------------------------------------------------------
    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        names = [mooncake_key(self._prefix, k) for k in keys]
        ptrs = [obj.data_ptr for obj in objects]
        sizes = [len(obj.byte_array) for obj in objects]

        def work() -> L2StoreResult:
            codes = self._store.batch_put_from(names, ptrs, sizes)
            ok = [i for i, code in enumerate(codes) if code == 0]
            if len(ok) < len(codes):
                log.warning("mooncake_store_incomplete", stored=len(ok), chunks=len(codes),
                            codes=sorted({c for c in codes if c != 0}))
            if ok:
                with self._lock:
                    self._sizes.update((names[i], sizes[i]) for i in ok)
                self._notify_keys_stored([keys[i] for i in ok], [sizes[i] for i in ok])
            return L2StoreResult(len(ok) == len(codes), sum(sizes[i] for i in ok))

        return self._submit("store", work, lambda: L2StoreResult(False, 0))

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._lock:
            done, self._done["store"] = self._done["store"], {}
        return done

    # --- lookup ------------------------------------------------------------------------------------------
    def submit_lookup_and_lock_task(self, keys: list[ObjectKey],
                                    group_layout_descs: dict[int, MemoryLayoutDesc]) -> L2TaskId:
        names = [mooncake_key(self._prefix, k) for k in keys]

        def work() -> Bitmap:
            codes = self._store.batch_is_exist(names)
            errors = sorted({c for c in codes if c < 0})
            if errors:
                log.warning("mooncake_lookup_error", codes=errors, master=where(self._master))
            bitmap = Bitmap(len(keys))
            for i, code in enumerate(codes):
                if present(code):
                    bitmap.set(i)
            return bitmap

        return self._submit("lookup", work, lambda: Bitmap(len(keys)))

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._done["lookup"].pop(task_id, None)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        # Mooncake leases objects on read; nothing to release (a racing eviction turns the load into a miss).
        return None

    # --- load --------------------------------------------------------------------------------------------
    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        names = [mooncake_key(self._prefix, k) for k in keys]
        ptrs = [obj.data_ptr for obj in objects]
        sizes = [len(obj.byte_array) for obj in objects]

        def work() -> Bitmap:
            codes = self._store.batch_get_into(names, ptrs, sizes)
            bitmap = Bitmap(len(keys))
            for i, code in enumerate(codes):
                if loaded(code, sizes[i]):
                    bitmap.set(i)
            got = bitmap.get_indices_list()
            if len(got) < len(keys):
                log.warning("mooncake_load_incomplete", loaded=len(got), chunks=len(keys),
                            codes=sorted({c for i, c in enumerate(codes) if not loaded(c, sizes[i])}))
            if got:
                self._notify_keys_accessed([keys[i] for i in got])
            return bitmap

        return self._submit("load", work, lambda: Bitmap(len(keys)))

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._done["load"].pop(task_id, None)

    # --- eviction, status, close -------------------------------------------------------------------------
    def delete(self, keys: list[ObjectKey]) -> None:
        if not keys:
            return
        refused = self._remove(keys, [mooncake_key(self._prefix, k) for k in keys])
        if refused:
            # measured in the network lab: objects read less than the master's default_kv_lease_ttl ago (10 s by
            # default) stay; a delete right after a load frees nothing, and a later put can find the segment full
            log.warning("mooncake_delete_refused", chunks=len(refused), of=len(keys),
                        codes=sorted({c for _, _, c in refused}), retry_in_s=self._lease_s,
                        hint="an object read within the master's default_kv_lease_ttl (10 s by default) cannot be "
                             "removed until its lease ends; the delete is retried after lease_ttl_s")
            self._schedule([(k, n) for k, n, _ in refused], tries=1)

    def _remove(self, keys: list[ObjectKey], names: list[str]) -> list[tuple[ObjectKey, str, int]]:
        """Remove ``names`` from Mooncake, account what went; the (key, name, code) the master refused."""
        try:
            codes = self._store.batch_remove(names)
        except Exception as exc:  # the master unreachable: nothing removed, tried again later like a refusal
            log.warning("mooncake_delete_failed", error=str(exc))
            return [(k, n, RPC_FAILED) for k, n in zip(keys, names, strict=True)]
        with self._lock:
            gone = [(k, self._sizes.pop(n)) for k, n, c in zip(keys, names, codes, strict=True)
                    if c == 0 and n in self._sizes]
        if gone:
            self._notify_keys_deleted([k for k, _ in gone], [s for _, s in gone])
        return [(k, n, c) for k, n, c in zip(keys, names, codes, strict=True) if c not in (0, OBJECT_NOT_FOUND)]

    def _schedule(self, refused: list[tuple[ObjectKey, str]], tries: int) -> None:
        due = time.monotonic() + self._lease_s
        with self._lock:
            if self._closed:
                return
            for key, name in refused:
                self._retry[name] = (key, tries, due)
            if self._retry_thread is None:
                self._retry_thread = threading.Thread(target=self._retry_loop, name="ps-mooncake-delete",
                                                      daemon=True)
                self._retry_thread.start()
        self._retry_wake.set()

    def _retry_loop(self) -> None:
        """Deletes the master refused, tried again once their lease has ended (one thread, bounded tries)."""
        while not self._closed:
            now = time.monotonic()
            with self._lock:
                due = [(n, k, t) for n, (k, t, at) in self._retry.items() if at <= now]
                for name, _, _ in due:
                    del self._retry[name]
                wait = min((at for _, _, at in self._retry.values()), default=now + 60.0) - now
            if due:
                tries = {n: t for n, _, t in due}
                refused = self._remove([k for _, k, _ in due], [n for n, _, _ in due])
                again = [(k, n) for k, n, _ in refused if tries[n] < DELETE_RETRIES]
                (log.warning if len(refused) > len(again) else log.info)(
                    "mooncake_delete_retried", chunks=len(due), freed=len(due) - len(refused),
                    refused_again=len(refused), abandoned=len(refused) - len(again))
                for key, name in again:
                    self._schedule([(key, name)], tries=tries[name] + 1)
                continue
            self._retry_wake.wait(timeout=max(0.0, wait))
            self._retry_wake.clear()

    def report_status(self) -> dict[str, Any]:
        return {"is_healthy": not self._closed, "type": "MooncakeStoreL2Adapter", "master": where(self._master)}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._retry_wake.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._retry_thread is not None:
            self._retry_thread.join(timeout=10.0)  # a retry in flight ends before the client closes
        closer = threading.Thread(target=self._store.close, daemon=True)  # bounded: a dead master must not hang
        closer.start()
        closer.join(timeout=10.0)
        for efd in self._efds.values():
            efd.close()
        log.info("mooncake_closed", master=where(self._master))
