"""What the SGLang backend keeps besides SGLang's own state: importable and testable without SGLang.

:class:`BackendState` holds one backend's runtime (namespace, admission, health, stats), the per-request
timings the cost model learns from, the MP server's port check and the chunks already sent to the store
(:class:`SubmittedChunks`).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

import blake3

from prefixshare.keys import token_bytes
from prefixshare.runtime import ConnectorRuntime, PortCheck


class SubmittedChunks:
    """Chunk prefixes this engine already sent to the store, keyed by (salt, digest of the tokens up to the chunk's
    end); a bounded LRU.

    SGLang re-sends a request's whole prefix when its own radix tree held it (no lookup ran, so LMCache does not
    know the store has it): every question on a warm document would copy the document's KV to the server again
    and count it as stored again (bytes, byte budgets). The vLLM connector skips the same case ("local").
    """

    def __init__(self, chunk_size: int, limit: int = 1 << 16) -> None:
        self.chunk_size = chunk_size
        self.limit = limit
        self._seen: OrderedDict[tuple[str, bytes], None] = OrderedDict()

    def digests(self, token_ids: Any, salt: str) -> list[tuple[str, bytes]]:
        """One key per full chunk: a rolling blake3 over the token ids (each key covers every token before it)."""
        keys = []
        digest = b""
        for end in range(self.chunk_size, len(token_ids) + 1, self.chunk_size):
            digest = blake3.blake3(digest + token_bytes(token_ids[end - self.chunk_size:end])).digest()[:16]
            keys.append((salt, digest))
        return keys

    def known(self, keys: list[tuple[str, bytes]]) -> int:
        """How many leading chunks were sent already."""
        n = 0
        for key in keys:
            if key not in self._seen:
                break
            self._seen.move_to_end(key)
            n += 1
        return n

    def add(self, keys: list[tuple[str, bytes]]) -> None:
        for key in keys:
            self._seen[key] = None
            self._seen.move_to_end(key)
        while len(self._seen) > self.limit:
            self._seen.popitem(last=False)


class BackendState:
    """One backend's prefixshare state (built in SGLang's scheduler process)."""

    def __init__(self, runtime: ConnectorRuntime) -> None:
        self.runtime = runtime
        server = runtime.policy.server
        #: per request: when it became ready to compute, how far it is computed, when its load began (cost model)
        self.timing: dict[str, dict[str, Any]] = {}
        #: the MP server's request port (a dead server refuses at once; LMCache notices only at its next
        #: heartbeat, and until then a lookup waits out the load timeout and a store RPC blocks the scheduler)
        self.port = PortCheck((server.host, server.port))
        self.submitted = SubmittedChunks(runtime.policy.chunk_size)

    def store_reachable(self) -> bool:
        """False while the store is known to be down, or when the server's port refuses now (then it is)."""
        rt = self.runtime
        if not rt.store_available():
            return False
        if self.port.ok():
            return True
        rt.mark_down(f"the LMCache server's port {rt.policy.server.host}:{rt.policy.server.port} refuses connections")
        return False

    def start_timing(self, rid: str, prompt_tokens: int, local_tokens: int) -> bool:
        """Begin timing a request for the cost model (once per request); False when it is timed already."""
        if self.runtime.cost is None or rid in self.timing:
            return False
        self.timing[rid] = {"ready": time.monotonic(), "done": local_tokens, "prompt": prompt_tokens,
                            "transfer_from": None}
        return True

    def observe_checkpoint(self, rid: str, up_to: int) -> None:
        """SGLang checkpoints a request's computed prefix after each prefill chunk: time the chunk."""
        cost, timing = self.runtime.cost, self.timing.get(rid)
        if cost is None or timing is None or up_to <= timing["done"]:
            return
        now = time.monotonic()
        start = timing["done"]
        if timing.get("transfer_from") is not None:
            # the first chunk after a load: the transfer plus computing what the load left
            loaded = timing.pop("loaded", 0)
            start += loaded
            elapsed = now - timing.pop("transfer_from")
            rest = cost.prefill_s(start, up_to) or 0.0
            cost.observe_transfer(loaded, max(0.0, elapsed - rest))
            timing["transfer_from"] = None
        elif up_to > start:
            cost.observe_prefill([(start, up_to)], now - timing["ready"])
        timing["done"], timing["ready"] = up_to, now
        if up_to >= timing["prompt"] - 1:
            info = self.runtime.requests.get(rid)
            cost.outcome(rid, finished_at=now, loaded_tokens=info.loaded_tokens if info else 0)

    def forget(self, rid: str) -> None:
        self.timing.pop(rid, None)
        if self.runtime.cost is not None:
            self.runtime.cost.forget(rid)
