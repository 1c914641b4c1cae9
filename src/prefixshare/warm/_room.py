"""Backpressure for warm: how much room the MP server's memory (L1) has for the next batch's KV.

Every store passes through the server's memory: the engine's KV lands in L1, and the server writes it to its L2
tiers from there. LMCache's server drops a store it cannot reserve L1 memory for (the allocation fails; the
server logs a warning, the engine hears nothing). LMCache's own L1 eviction runs once a second, only above its
trigger watermark (0.8 by default). prefixshare's server evicts when L1 takes a write and, before a reservation
that would not fit, in the reserving thread (:mod:`prefixshare.server.plugins.eviction`); either evicts only
chunks no one holds: not staged, not being read, and not waiting for their L2 write. So a batch of documents
whose KV is more than the room at that moment is partly dropped: 59 of 200 documents of a corpus were lost with
a 0.25 GB L1 (400 MB of KV per 16k-token batch) before warm paced its batches.

The room: with prefixshare's server, L1's size less the bytes it cannot evict (its ``/status`` reports them:
``prefixshare_unevictable_bytes``); with LMCache's own, L1's free bytes. warm reads ``/status`` before each
engine call and sends only the documents whose KV fits (:meth:`ServerRoom.fit`); when not even the first fits,
it waits, within a bound, for what frees room: the L2 writes that make chunks evictable, or LMCache's eviction.
An engine call returns before its stores reach the server, so the KV of the calls of the last :data:`TRANSIT_S`
that has not reached the server yet is counted as taken: beyond the bytes the server reports it reserved since
(``prefixshare_reserved_bytes_total``), or, from LMCache's own server, beyond its usage's growth, until the
server, seen busy after the call, is idle again (its stores landed).
:meth:`ServerRoom.settled` tells verification that the server has no store in progress, so a chunk still
missing will not land and can be prefilled again. A load needs room in L1 too: with LMCache's own eviction,
right after a burst of stores has taken L1 over its watermark, a replica's lookup misses until the next eviction
and recomputes.

What bounds how fast anything can be stored once L1 is full: with LMCache's own loop, a share of L1
(``l1.eviction_ratio``, 0.2 by default) per second (a 1 GB L1 took at most about 200 MB/s of new KV); with
prefixshare's server, the rate at which its L2 tier writes chunks (a chunk is evictable once written).
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Any

import httpx

from prefixshare.warm._lookup import http_client

#: free L1 kept aside (a share of its size) for other writers and the allocator's rounding
MARGIN = 0.05
#: how long warm waits for room before it sends the next document anyway (its store may then be dropped, and
#: verification reports it)
WAIT_TIMEOUT_S = 15.0
#: polls of /status while waiting for room: the first after this many seconds, each 1.5x the last, at most POLL_MAX_S
#: (the server evicts when L1 crosses its watermark; LMCache alone, once a second)
POLL_FIRST_S = 0.02
POLL_MAX_S = 0.25
STATUS_TIMEOUT_S = 2.0
#: how long after an engine call its KV counts as taken even where the server's usage does not show it yet
TRANSIT_S = 1.0


@dataclass(frozen=True)
class Room:
    """One reading of the server's memory (``/status``)."""

    used: int
    total: int
    #: the usage share above which the server evicts
    watermark: float
    #: chunks the server is still writing to its L2 tiers, or has yet to (not evictable until written)
    pending: int
    #: chunks being written into L1 (reserved, not yet admitted)
    staging: int
    #: bytes of L1 no eviction can free now (staged, read, or waiting for the L2 write); None: the server does
    #: not say (LMCache's own server, which evicts only once a second: its free bytes are the room)
    unevictable: int | None = None
    #: bytes L1 has reserved since the server started (``prefixshare_reserved_bytes_total``); None: not said
    reserved: int | None = None

    @property
    def taken(self) -> int:
        """The bytes of L1 a store cannot have: those the server cannot evict, or, if it does not say, its usage."""
        return self.used if self.unevictable is None else self.unevictable

    @property
    def free(self) -> int:
        return max(int(self.total * (1.0 - MARGIN)) - self.taken, 0)

    @property
    def evicting(self) -> bool:
        """Whether the server's eviction will free memory at its next pass (usage at or over its watermark)."""
        return self.used >= self.watermark * self.total

    @property
    def idle(self) -> bool:
        """No store in progress: nothing staged in L1, nothing waiting for or in an L2 write."""
        return self.pending == 0 and self.staging == 0


@dataclass
class _Call:
    """An engine call whose KV the server's usage may not show yet."""

    returned: float  # monotonic time the call returned
    kv_bytes: int
    taken_before: int  # the server's taken bytes (Room.taken) read before the call
    reserved_before: int | None  # the server's reserved bytes (Room.reserved) read before the call
    seen_busy: bool = False  # the server was seen with a store in progress since


def parse_room(status: dict[str, Any]) -> Room | None:
    """The :class:`Room` ``/status`` describes; None when it lacks the fields (another LMCache version)."""
    sm = status.get("storage_manager")
    if not isinstance(sm, dict):
        return None
    usage = sm.get("l1_usage")
    l1 = sm.get("l1_manager") if isinstance(sm.get("l1_manager"), dict) else {}
    store = sm.get("store_controller") if isinstance(sm.get("store_controller"), dict) else {}
    evict = sm.get("l1_eviction_controller") if isinstance(sm.get("l1_eviction_controller"), dict) else {}
    if not (isinstance(usage, list) and len(usage) == 2 and all(isinstance(v, int) for v in usage) and usage[1] > 0):
        return None
    watermark = evict.get("trigger_watermark", 0.8)
    unevictable, reserved = evict.get("prefixshare_unevictable_bytes"), evict.get("prefixshare_reserved_bytes_total")
    return Room(used=usage[0], total=usage[1],
                watermark=float(watermark) if isinstance(watermark, (int, float)) else 0.8,
                pending=int(store.get("pending_keys_count") or 0) + int(store.get("in_flight_task_count") or 0),
                staging=int(l1.get("staging_object_count") or 0),
                unevictable=unevictable if isinstance(unevictable, int) and unevictable >= 0 else None,
                reserved=reserved if isinstance(reserved, int) and reserved >= 0 else None)


class ServerRoom:
    """Reads one MP server's memory (``/status``) for warm's pacing; quiet and disabled once it cannot answer."""

    def __init__(self, http_url: str, *, log: Any, transport: httpx.BaseTransport | None = None) -> None:
        self.http_url = http_url.rstrip("/")
        self.log = log
        self.error: str | None = None
        #: seconds warm spent pacing, in all: reading the server's memory and waiting for room
        self.paced_s = 0.0
        self._client = http_client(self.http_url, STATUS_TIMEOUT_S, transport)
        #: engine calls not yet shown by the server's usage, maybe
        self._sent: collections.deque[_Call] = collections.deque()
        self._last_taken = 0
        self._last_reserved: int | None = None

    def sent(self, kv_bytes: int) -> None:
        """An engine call of ``kv_bytes`` of KV has just returned (its stores are on their way)."""
        self._sent.append(_Call(time.monotonic(), kv_bytes, self._last_taken, self._last_reserved))

    def _unseen(self, room: Room) -> int:
        """KV of the engine calls of the last TRANSIT_S that has not reached the server: beyond the bytes it
        reserved since (prefixshare's server says), or beyond its taken bytes' growth. A call whose stores the
        server was seen busy with, and is idle again after, has landed: it is no longer counted (an eviction as
        prompt as prefixshare's server's, or an L2 write that makes chunks evictable, hides the growth)."""
        now = time.monotonic()
        for call in self._sent:
            call.seen_busy = call.seen_busy or not room.idle
        while self._sent and (now - self._sent[0].returned > TRANSIT_S or (room.idle and self._sent[0].seen_busy)):
            self._sent.popleft()
        if not self._sent:
            return 0
        oldest = self._sent[0]
        if room.reserved is not None and oldest.reserved_before is not None:
            # the server counts what it reserved: the calls' KV beyond what reached it since the oldest was sent
            unseen = max(sum(call.kv_bytes for call in self._sent) - (room.reserved - oldest.reserved_before), 0)
            if not unseen:
                self._sent.clear()
            return unseen
        grown = max(room.taken - oldest.taken_before, 0)  # an eviction meanwhile hides growth: unseen
        return max(sum(call.kv_bytes for call in self._sent) - grown, 0)

    def close(self) -> None:
        self._client.close()

    def read(self) -> Room | None:
        """The server's memory now; None when it cannot say (the first failure is logged, later reads skipped)."""
        if self.error is not None:
            return None
        try:
            response = self._client.get(self.http_url + "/status")
            room = parse_room(response.json()) if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError) as exc:
            self.error = f"{type(exc).__name__}: {exc}"
        else:
            if room is not None:
                return room
            self.error = f"/status answered HTTP {response.status_code} without the memory's usage"
        self.log.warning("warm.pacing_off", url=self.http_url, reason=self.error,
                         effect="batches are sent without waiting for the server's memory")
        return None

    def fit(self, sizes: list[int], timeout_s: float = WAIT_TIMEOUT_S) -> int:
        """How many of the leading ``sizes`` (KV bytes of the next documents) to send now: as many as the
        server's room holds, at least one. When not even the first fits and room will be freed (by L2 writes in
        progress, or LMCache's eviction once over its watermark), wait for it, up to ``timeout_s``: a slow L2 tier
        holds its chunks unevictable until written, so this is also where warm waits for the store."""
        if not sizes:
            return 0
        deadline = time.monotonic() + timeout_s
        delay = POLL_FIRST_S
        started = time.monotonic()
        try:
            while True:
                room = self.read()
                if room is None:
                    return len(sizes)
                self._last_taken, self._last_reserved = room.taken, room.reserved
                unseen = self._unseen(room)
                n = _leading(sizes, room.free - unseen)
                if n:
                    return n
                left = deadline - time.monotonic()
                if left <= 0 or not (unseen or _will_free(room)):
                    # nothing will free memory (or not in time): send one document; verification tells
                    if sizes[0] > room.total - room.taken:
                        self.log.warning("warm.no_room", kv_bytes=sizes[0], used=room.used, total=room.total,
                                         unevictable=room.unevictable, waited_s=round(time.monotonic() - started, 2),
                                         hint=_no_room_hint(room))
                    return 1
                time.sleep(min(delay, left))
                delay = min(delay * 1.5, POLL_MAX_S)
        finally:
            self.paced_s += time.monotonic() - started

    def settled(self) -> bool | None:
        """Whether the server has no store in progress (None: it cannot say)."""
        room = self.read()
        return None if room is None else room.idle


def _will_free(room: Room) -> bool:
    """Whether waiting can give a store more room: chunks staged or waiting for their L2 write become evictable
    once written; LMCache's own server frees memory only by its eviction, over its watermark."""
    if room.unevictable is not None:
        return not room.idle
    return room.evicting or room.staging > 0


def _no_room_hint(room: Room) -> str:
    if room.unevictable is not None:
        return ("raise the policy's l1.size_gb: the server's memory holds less than a document's KV beside the "
                "chunks it is still writing to its store")
    return (f"raise the policy's l1.size_gb: a document's KV should be well under {1 - room.watermark:.0%} of it "
            "(the share the server frees)")


def _leading(sizes: list[int], free: int) -> int:
    total = 0
    for n, size in enumerate(sizes):
        total += size
        if total > free:
            return n
    return len(sizes)
