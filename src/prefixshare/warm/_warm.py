"""``warm``: prefill documents once so every replica loads them; ``prompt_for``: prompts that hit them."""

from __future__ import annotations

import contextlib
import os
import socket
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefixshare import _metrics
from prefixshare._log import get_logger
from prefixshare._version import __version__
from prefixshare.adapters import PrefillRequest, WarmEngine
from prefixshare.adapters.sglang import request_kwargs
from prefixshare.errors import PrefixShareError
from prefixshare.keys import (
    REQ_DOCUMENT,
    REQ_PREFIX_TOKENS,
    REQ_TENANT,
    ChunkHasher,
    admission_digest,
    namespace,
    store_salt,
    tenant_salt,
)
from prefixshare.policies import AdmissionRequest
from prefixshare.warm._chunks import NamespaceIndex
from prefixshare.warm._documents import Document, DocumentError, _from_string, _pair, resolve_documents, split_text
from prefixshare.warm._lookup import CALL_TIMEOUT_S, Held, LookupUnavailable, ServerLookup
from prefixshare.warm._registry import DocumentRecord, Registry, encode_ids
from prefixshare.warm._room import ServerRoom
from prefixshare.warm._template import Template, as_template, prefix_ids, question_ids, tokens_digest

if TYPE_CHECKING:  # pragma: no cover
    from prefixshare.fingerprint import Fingerprint
    from prefixshare.policies import Policy, Rule
    from prefixshare.share import PrefixShare

#: tokens per engine call when warming many documents (progress is reported after each call)
DEFAULT_BATCH_TOKENS = 16384
DEFAULT_VERIFY_TIMEOUT_S = 30.0
#: how many times warm prefills a document again when verification finds chunks of it missing
DEFAULT_RETRIES = 2

WARMED, SKIPPED, TOO_SHORT, REFUSED, FAILED = "warmed", "skipped", "too_short", "refused", "failed"
#: how warm checks that the store holds a document: on an fs tier's directory, or by asking the MP server
VERIFY_FS, VERIFY_SERVER, VERIFY_OFF = "fs", "server", "off"


class WarmError(PrefixShareError):
    """Some documents were not warmed (refused by admission, or chunks missing after the prefill)."""

    def __init__(self, message: str, report: WarmReport | None = None) -> None:
        super().__init__(message)
        self.report = report


class DocumentTooLongError(DocumentError):
    """A document (with its template) does not fit the engine's context; nothing was warmed."""

    def __init__(self, too_long: list[tuple[str, int]], limit: int, max_model_len: int) -> None:
        self.too_long, self.limit, self.max_model_len = too_long, limit, max_model_len
        listed = ", ".join(f"{doc_id!r} ({n:,} tokens)" for doc_id, n in too_long)
        super().__init__(
            f"{len(too_long)} document{'s' if len(too_long) != 1 else ''} longer than the engine's context "
            f"allows ({limit:,} prefix tokens with max_model_len {max_model_len:,}): {listed}. Nothing was "
            "warmed; raise the engine's max_model_len (--max-model-len), or split them explicitly with "
            "split=True (--split: each part becomes its own document 'ID#N')"
        )


@dataclass
class DocumentResult:
    """What warm did with one document."""

    id: str
    status: str
    tokens: int
    chunk_tokens: int = 0
    chunks: int = 0
    bytes: int = 0
    source: str | None = None
    seconds: float | None = None
    #: prompt tokens the prefill did not compute (already in the store or the engine's prefix cache)
    cached_tokens: int = 0
    #: True: the store was checked and holds every chunk; False: checked, some are missing; None: not checked
    #: (``reason`` says why: "unverified: ...")
    verified: bool | None = None
    #: what answered ``verified``: "fs" (the fs tier's directory) or "server" (the MP server's lookup)
    verified_by: str | None = None
    reason: str = ""
    part_of: str | None = None
    #: engine calls that prefilled it (more than one: verification found chunks missing, or the engine's own
    #: prefix cache answered the first call, and warm prefilled it again)
    attempts: int = 0


@dataclass
class WarmReport:
    """The outcome of one :func:`warm` call."""

    namespace: str
    fingerprint: str
    engine: str
    chunk_size: int
    store: str | None
    documents: list[DocumentResult] = field(default_factory=list)
    seconds: float = 0.0
    #: how prefilled documents were checked: "fs", "server" or "off"
    verification: str = VERIFY_OFF
    #: seconds the engine spent prefilling (the batches' wall time, planning and verification excluded)
    prefill_seconds: float = 0.0
    #: wall seconds of each step of the call, in order: "plan" (tokenizing, the fingerprint, the store's
    #: directory scan), "triage" (what the store already holds, admission), "prefill" (the engine's batches and
    #: the copies of their KV into the server), "verify" (until the store holds every chunk), "record" (the
    #: registry); "retry" (prefilling and verifying again the documents verification found incomplete) comes
    #: between "verify" and "record" when there were any. What a slow warm spends its time on, without a profiler.
    phases: dict[str, float] = field(default_factory=dict)
    #: seconds spent pacing: reading the server's memory before each engine call and waiting for room in it
    #: (within "prefill" and "retry"; see :mod:`prefixshare.warm._room`)
    paced_seconds: float = 0.0

    def _with(self, *statuses: str) -> list[DocumentResult]:
        return [d for d in self.documents if d.status in statuses]

    @property
    def warmed(self) -> list[DocumentResult]:
        return self._with(WARMED)

    @property
    def skipped(self) -> list[DocumentResult]:
        return self._with(SKIPPED)

    @property
    def failed(self) -> list[DocumentResult]:
        """Documents that are not warm although they could be (refused by admission, chunks missing)."""
        return self._with(REFUSED, FAILED)

    @property
    def ok(self) -> bool:
        return not self.failed

    def totals(self) -> dict[str, int]:
        stored = self._with(WARMED, SKIPPED)
        return {
            "documents": len(self.documents),
            "warmed": len(self.warmed),
            "skipped": len(self.skipped),
            "too_short": len(self._with(TOO_SHORT)),
            "failed": len(self.failed),
            # of the warmed and skipped documents: checked in the store, and not checked (reason: "unverified: ...")
            "verified": sum(1 for d in stored if d.verified is True),
            "unverified": sum(1 for d in stored if d.verified is None),
            "tokens": sum(d.tokens for d in self.documents),
            "warmed_tokens": sum(d.chunk_tokens for d in self.warmed),
            "warmed_bytes": sum(d.bytes for d in self.warmed),
            "stored_bytes": sum(d.bytes for d in self._with(WARMED, SKIPPED)),
            # documents prefilled more than once (verification found chunks missing, or the engine's own prefix
            # cache answered the first prefill)
            "retried": sum(1 for d in self.documents if d.attempts > 1),
        }

    def rates(self) -> dict[str, float | None]:
        """Warmed documents, tokens and KV bytes per second of the whole call (planning and verification
        included), and the KV bytes per second of the prefill alone."""
        warmed = self.warmed
        kv = sum(d.bytes for d in warmed)

        def per(n: float, seconds: float) -> float | None:
            return round(n / seconds, 3) if seconds > 0 and warmed else None

        return {"documents_per_s": per(len(warmed), self.seconds),
                "tokens_per_s": per(sum(d.chunk_tokens for d in warmed), self.seconds),
                "kv_gbps": per(kv / 1e9, self.seconds), "prefill_s": round(self.prefill_seconds, 3),
                "prefill_kv_gbps": per(kv / 1e9, self.prefill_seconds)}

    def to_dict(self) -> dict[str, Any]:
        return {"namespace": self.namespace, "fingerprint": self.fingerprint, "engine": self.engine,
                "chunk_size": self.chunk_size, "store": self.store, "seconds": round(self.seconds, 3),
                "verification": self.verification, "ok": self.ok, "totals": self.totals(), "rates": self.rates(),
                "paced_seconds": round(self.paced_seconds, 3),
                "phases": {name: round(seconds, 4) for name, seconds in self.phases.items()},
                "documents": [asdict(d) for d in self.documents]}


@dataclass(frozen=True)
class WarmProgress:
    """Reported to ``progress`` after planning, after each engine call and at the end."""

    phase: str  # "plan", "prefill", "verify", "done"
    documents_done: int
    documents_total: int
    tokens_done: int
    tokens_total: int
    bytes_done: int
    bytes_total: int
    current: str | None = None
    #: seconds since warm() began
    elapsed_s: float = 0.0
    #: KV bytes of this call's chunks already in the fs tier's directory (None: no directory tier to look in);
    #: with ``elapsed_s``, the store's write rate
    stored_bytes: int | None = None


@dataclass
class _Planned:
    doc: Document
    ids: list[int]
    part_of: str | None = None
    hashes: list[str] = field(default_factory=list)
    result: DocumentResult | None = None


# --- salts and digests the connector computes (kept equal by tests/test_warm.py) ---------------------------


def expected_salt(tenant: str | None, cache_salt: str | None = None) -> str:
    """The cache salt the connector gives a request with this tenant and request salt (the file suffix)."""
    return store_salt(tenant, cache_salt) or ""


def _admission_digest(ids: list[int], chunk_size: int, tenant: str | None = None) -> str | None:
    """The ``prefix_digest`` the connector gives the admission rules for a prompt whose prefix is ``ids``, sent
    for ``tenant`` (its store salt is part of the digest)."""
    return admission_digest(ids, chunk_size, store_salt(tenant, None))


def _params(doc_id: str, prefix_tokens: int, tenant: str | None) -> dict[str, Any]:
    params: dict[str, Any] = {REQ_DOCUMENT: doc_id, REQ_PREFIX_TOKENS: prefix_tokens}
    if tenant:
        params[REQ_TENANT] = tenant
    return params


# --- warm ---------------------------------------------------------------------------------------------------


def warm(
    ps: PrefixShare,
    docs: Any,
    engine: Any = None,
    *,
    prefix: Template | str | None = None,
    force: bool = False,
    tenant: str | None = None,
    cache_salt: str | None = None,
    split: bool = False,
    reserve_tokens: int = 0,
    batch_tokens: int = DEFAULT_BATCH_TOKENS,
    verify: bool | str = True,
    verify_timeout_s: float = DEFAULT_VERIFY_TIMEOUT_S,
    retries: int = DEFAULT_RETRIES,
    pace: bool = True,
    strict: bool = True,
    progress: Callable[[WarmProgress], None] | None = None,
) -> WarmReport:
    """Prefill ``docs`` once on ``engine`` so that every replica with the same fingerprint loads them.

    ``docs``: paths, folders, globs, ``(id, text)`` / ``(id, Path)`` pairs, a dict ``{id: text}`` or
    :class:`Document` objects. ``prefix``: where documents sit in later prompts (a :class:`Template`, a string
    holding ``{document}``, or None for the document alone); build those prompts with :func:`prompt_for`.

    Only the prefix is prefilled (one generated token, discarded) and stored (``prefixshare.prefix_tokens``).
    Documents whose every chunk is already in the store under this fingerprint are skipped unless ``force``.
    Afterwards the store is checked for every chunk of every prefilled document, polling for up to
    ``verify_timeout_s`` (the server writes its tiers asynchronously), and each document is recorded in the
    store's registry (when the store has a directory). ``verify``: True (``"auto"``) checks an fs tier's
    directory when the policy has one, else asks the node's MP server which chunks it holds (any tier: see
    :mod:`prefixshare.warm._lookup` for that lookup and its side effect, a load from L2 into the server's
    memory); ``"fs"`` or ``"server"`` pick one; False skips the check. A document the check finds incomplete
    is prefilled again (the engine's prefix cache emptied first) up to ``retries`` times, then ``failed``
    (``verified=False``); one that could not be checked stays ``warmed``, ``verified=None``, with a reason
    starting "unverified:". Verification stops early when nothing lands and the server has no store in progress.
    ``pace``: before each engine call, send only the documents whose KV the server's memory (L1) has room for,
    waiting (bounded) for room when none fits; the server drops a store it has no memory for (see
    :mod:`prefixshare.warm._room`). A document longer than the context
    (``max_model_len - max(reserve_tokens, 1)``) raises :class:`DocumentTooLongError` before anything is
    warmed, unless ``split=True``.

    Returns a :class:`WarmReport`; with ``strict`` (default) raises :class:`WarmError` (carrying the report)
    when a document could not be warmed.
    """
    started = time.monotonic()
    run_id = uuid.uuid4().hex[:8]
    log = get_logger(__name__, run=run_id)
    policy = ps.policy
    mode = _verify_mode(verify, bool(policy.directories))  # a bad value fails before any engine work
    eng = ps.warm_engine(engine)
    template = as_template(prefix).resolve(eng.tokenizer)
    limit = eng.max_model_len - max(int(reserve_tokens), 1)

    # 1. tokenize every document before any engine work, so a too-long one stops everything
    planned = _plan(eng, eng.tokenizer, template, resolve_documents(docs), limit, split)

    run = _WarmRun.open(ps, eng, policy, template, planned, run_id=run_id, log=log, started=started,
                        tenant=tenant, cache_salt=cache_salt, force=force, progress=progress, pace=pace)
    run.report.phases["plan"] = time.monotonic() - started

    try:
        # 2. what is already there, what admission refuses, what must be prefilled
        with run.phase("triage"):
            run.triage(verify_timeout_s)
        run.report_progress("plan")

        # 3. prefill in batches of about batch_tokens tokens
        with run.phase("prefill"):
            run.prefill(batch_tokens)

        # 4. verify that the store holds every chunk (an fs tier's directory, else the MP server), prefill again
        # what it lacks, then record
        run.check(mode, verify_timeout_s, retries, batch_tokens)
        with run.phase("record"):
            run.record()
    finally:
        run.close()

    return run.finish(strict)


def _verify_mode(verify: bool | str, has_directory: bool) -> str:
    """``warm``'s ``verify`` argument as one of "fs", "server", "off"."""
    if verify is True or verify == "auto":
        return VERIFY_FS if has_directory else VERIFY_SERVER
    if verify is False or verify is None or verify == VERIFY_OFF:
        return VERIFY_OFF
    if verify == VERIFY_SERVER:
        return VERIFY_SERVER
    if verify == VERIFY_FS:
        if not has_directory:
            raise PrefixShareError("verify='fs' needs an fs tier in the policy; use verify=True (the MP server "
                                   "checks other tiers) or verify='server'")
        return VERIFY_FS
    raise PrefixShareError(f"verify={verify!r}: use True ('auto'), 'fs', 'server' or False")


def _plan(eng: WarmEngine, tokenizer: Any, template: Template, documents: list[Document], limit: int,
          split: bool) -> list[_Planned]:
    """Tokenize every document; one longer than ``limit`` is split (``split``) or raises
    :class:`DocumentTooLongError` (naming every such document)."""
    planned: list[_Planned] = []
    too_long: list[tuple[str, int]] = []
    for doc in documents:
        ids = prefix_ids(tokenizer, template, doc.text)
        if len(ids) <= limit:
            planned.append(_Planned(doc, ids))
        elif split:
            parts = split_text(doc.text, lambda text: len(prefix_ids(tokenizer, template, text)) <= limit)
            for i, part in enumerate(parts, 1):
                sub = Document(f"{doc.id}#{i}", part, doc.source, doc.content_hash)
                planned.append(_Planned(sub, prefix_ids(tokenizer, template, part), part_of=doc.id))
        else:
            too_long.append((doc.id, len(ids)))
    if too_long:
        raise DocumentTooLongError(too_long, limit, eng.max_model_len)
    return planned


@dataclass
class _WarmRun:
    """The state one :func:`warm` call shares between its phases: the store settings, the plan, the report
    and the progress counters."""

    ps: PrefixShare
    eng: WarmEngine
    policy: Policy
    template: Template
    planned: list[_Planned]
    run_id: str
    log: Any
    started: float
    tenant: str | None
    cache_salt: str | None
    force: bool
    progress: Callable[[WarmProgress], None] | None
    fp: Fingerprint
    ns: str
    dirs: list[Path]
    registry: Registry | None
    salt: str
    hasher: ChunkHasher
    kv_per_token: int
    rule: Rule | None
    index: NamespaceIndex | None
    report: WarmReport
    todo: list[_Planned] = field(default_factory=list)
    tokens_total: int = 0
    bytes_total: int = 0
    done: dict[str, int] = field(default_factory=lambda: {"documents": 0, "tokens": 0, "bytes": 0})
    #: the MP server's lookup (opened on first use; ``lookup_error`` says why there is none)
    lookup: ServerLookup | None = None
    lookup_error: str | None = None
    triage_timeout_s: float = DEFAULT_VERIFY_TIMEOUT_S
    #: the server's memory, read to pace the engine calls (``pace``) and to tell when its stores are done
    room: ServerRoom | None = None
    pace: bool = True

    @classmethod
    def open(cls, ps: PrefixShare, eng: WarmEngine, policy: Policy, template: Template, planned: list[_Planned],
             *, run_id: str, log: Any, started: float, tenant: str | None, cache_salt: str | None, force: bool,
             progress: Callable[[WarmProgress], None] | None, pace: bool = True) -> _WarmRun:
        """Resolve the fingerprint, the store (registry, directory tiers, salt) and the admission rule; log the
        start."""
        fp = eng.fingerprint()
        ns = namespace(fp)
        root = policy.store_root
        dirs = policy.directories
        registry = Registry(root) if root is not None else None
        salt = expected_salt(tenant, cache_salt)
        hasher = ChunkHasher(policy.chunk_size, policy.server.hash_algorithm)
        kv_per_token = eng.kv_bytes_per_token()
        rule = policy.admission_rule()
        index = NamespaceIndex.scan(dirs, ns) if dirs else None
        report = WarmReport(ns, fp.digest, eng.kind, policy.chunk_size, str(root) if root else None)
        log.info("warm.start", documents=len(planned), namespace=ns, store=report.store, force=force)
        return cls(ps=ps, eng=eng, policy=policy, template=template, planned=planned, run_id=run_id, log=log,
                   started=started, tenant=tenant, cache_salt=cache_salt, force=force, progress=progress, fp=fp,
                   ns=ns, dirs=dirs, registry=registry, salt=salt, hasher=hasher, kv_per_token=kv_per_token,
                   rule=rule, index=index, report=report,
                   room=ServerRoom(policy.server.http_url, log=log), pace=pace)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time one step of the call into the report's ``phases``."""
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.report.phases[name] = time.monotonic() - t0

    def report_progress(self, phase: str, current: str | None = None) -> None:
        done = self.done
        _metrics.warm_progress(done["documents"], done["tokens"], done["bytes"], run=self.run_id,
                               engine=self.eng.kind, total_tokens=self.tokens_total, finished=phase == "done")
        if self.progress is not None:
            self.progress(WarmProgress(phase, done["documents"], len(self.todo), done["tokens"], self.tokens_total,
                                       done["bytes"], self.bytes_total, current,
                                       elapsed_s=time.monotonic() - self.started,
                                       stored_bytes=self.stored_bytes() if phase == "prefill" else None))

    def stored_bytes(self) -> int | None:
        """KV bytes of the chunks of ``todo`` the directory tiers hold now (a names-only scan; None without a
        directory tier)."""
        if not self.dirs or not self.todo:
            return None
        index = NamespaceIndex.scan(self.dirs, self.ns)
        chunks = sum(len(i.hashes) - len(index.missing(i.hashes, self.salt)) for i in self.todo)
        return chunks * self.policy.chunk_size * self.kv_per_token

    def server_lookup(self, timeout_s: float) -> ServerLookup | None:
        """The node's MP server, asked which chunks it holds (opened once per run; None: it cannot answer, and
        ``lookup_error`` says why)."""
        if self.lookup is None and self.lookup_error is None:
            try:
                self.lookup = ServerLookup.open(self.policy.server.http_url, self.ns, timeout_s=max(timeout_s, 0.5))
            except LookupUnavailable as exc:
                self.lookup_error = str(exc)
                self.log.warning("warm.server_lookup_unavailable", reason=self.lookup_error)
        return self.lookup

    def ask_server(self, item: _Planned, deadline: float) -> Held | None:
        """The server's answer for ``item``'s prefix; None (and ``lookup_error`` set) when it cannot answer."""
        lookup = self.lookup
        if lookup is None:
            return None
        try:
            return lookup.held(item.ids, self.salt, deadline)
        except LookupUnavailable as exc:
            self.lookup_error = str(exc)
            self.lookup = None
            lookup.close()
            self.log.warning("warm.server_lookup_failed", document=item.doc.id, reason=self.lookup_error)
            return None

    def close(self) -> None:
        if self.lookup is not None:
            self.lookup.close()
        if self.room is not None:
            self.report.paced_seconds = self.room.paced_s
            self.room.close()

    def triage(self, timeout_s: float = DEFAULT_VERIFY_TIMEOUT_S) -> None:
        """Give every planned document its result (in the report) and collect those to prefill in ``todo``
        (``timeout_s`` bounds each question to the server, on stores without a directory)."""
        self.triage_timeout_s = timeout_s
        for item in self.planned:
            if self._needs_prefill(item):
                self.todo.append(item)
        self.tokens_total = sum(len(i.ids) for i in self.todo)
        self.bytes_total = sum(i.result.bytes for i in self.todo if i.result)

    def _needs_prefill(self, item: _Planned) -> bool:
        """False when ``item`` is shorter than a chunk, already present (unless ``force``) or refused."""
        policy = self.policy
        doc, ids = item.doc, item.ids
        item.hashes = self.hasher.hashes(ids)
        chunk_tokens = len(item.hashes) * policy.chunk_size
        result = DocumentResult(doc.id, WARMED, len(ids), chunk_tokens, len(item.hashes),
                                chunk_tokens * self.kv_per_token, doc.source, part_of=item.part_of)
        item.result = result
        self.report.documents.append(result)
        if not item.hashes:
            result.status = TOO_SHORT
            result.reason = (f"{len(ids)} tokens is less than one chunk ({policy.chunk_size}); "
                             "nothing of it can be stored or shared")
            return False
        if not self.force and self._already_stored(item, result):
            return False
        if self.rule is not None:
            decision = self.rule(AdmissionRequest(prompt_tokens=len(ids), document_id=doc.id, tenant=self.tenant,
                                                  prefix_digest=_admission_digest(ids, policy.chunk_size, self.tenant),
                                                  kv_bytes=chunk_tokens * self.kv_per_token))
            if not decision.admit:
                result.status = REFUSED
                result.reason = (f"the policy's admission rules refuse it ({decision.reason}); pin it to warm it: "
                                 f"admission: {{any: [pinned: [{doc.id!r}]], ...}}")
                return False
        return True

    def _already_stored(self, item: _Planned, result: DocumentResult) -> bool:
        """Mark ``result`` skipped when the store holds every chunk of ``item``: by the fs tier's directory, else
        by the MP server's answer, else (the server cannot answer) by a registry record of the same prefix."""
        if self.index is not None:
            if self.index.missing(item.hashes, self.salt):
                return False
            result.status, result.verified, result.verified_by = SKIPPED, True, VERIFY_FS
            result.reason = "already in the store"
            result.bytes = self.index.bytes_of(item.hashes, self.salt) or result.bytes
            return True
        timeout_s = self.triage_timeout_s
        if self.server_lookup(timeout_s) is not None:
            held = self.ask_server(item, time.monotonic() + min(max(timeout_s, 1.0), CALL_TIMEOUT_S))
            if held is not None:
                if not (held.complete and held.chunks == len(item.hashes)):
                    return False  # (the registry may say otherwise: the server is what replicas load from)
                result.status, result.verified, result.verified_by = SKIPPED, True, VERIFY_SERVER
                result.reason = "already held by the server"
                return True
        if _registered(self.registry, self.fp.digest, item, self.salt):
            result.status, result.verified = SKIPPED, None
            result.reason = f"already in the store by its registry record (unverified: {self.lookup_error})"
            return True
        return False

    def prefill(self, batch_tokens: int) -> None:
        """Prefill ``todo`` in batches of about ``batch_tokens`` tokens, reporting progress after each.

        A document the store lacks may still sit in the engine's own prefix cache (warmed before the store lost
        it, or asked about by users): the engine then computes none of it, so its connector stores none of it.
        Documents of which the prefill computed no chunk at all are prefilled again after the engine's prefix
        cache is emptied (what ``force`` does first); a partial hit is left to verification to report."""
        eng = self.eng
        if self.todo and self.force:
            eng.reset_prefix_cache()  # a forced warm must compute (and store) again, not hit its own cache
        cached = self._prefill_batches(self.todo, batch_tokens, count=True)
        if cached and not self.force:
            self.log.info("warm.engine_cache_reset", documents=len(cached),
                          reason="the engine's prefix cache held documents the store lacks; prefilled again")
            eng.reset_prefix_cache()
            self._prefill_batches(cached, batch_tokens, count=False)

    def _prefill_batches(self, items: list[_Planned], batch_tokens: int, *, count: bool) -> list[_Planned]:
        """Prefill ``items`` in engine calls of about ``batch_tokens`` tokens, each cut to what the server's
        memory has room for (``pace``); returns those the engine computed no chunk of (every chunk a cache hit)."""
        hit: list[_Planned] = []
        for batch in _batches(items, batch_tokens):
            while batch:
                sizes = [i.result.bytes if i.result else 0 for i in batch]
                room = self.room if self.pace else None
                n = room.fit(sizes) if room is not None else len(batch)
                hit += self._prefill_call(batch[:n], count=count)
                if room is not None:
                    room.sent(sum(sizes[:n]))
                batch = batch[n:]
        return hit

    def _prefill_call(self, batch: list[_Planned], *, count: bool) -> list[_Planned]:
        """One engine call over ``batch``; returns those of it the engine computed no chunk of."""
        tenant, cache_salt = self.tenant, self.cache_salt
        hit: list[_Planned] = []
        t0 = time.monotonic()
        engine_salt = cache_salt or (tenant_salt(tenant) if tenant else None)  # as Prompt.engine_input
        requests = [PrefillRequest(i.ids, _params(i.doc.id, len(i.ids), tenant), engine_salt) for i in batch]
        results = self.eng.prefill(requests)
        seconds = time.monotonic() - t0
        self.report.prefill_seconds += seconds
        batch_tokens_n = sum(len(i.ids) for i in batch) or 1
        for item, res in zip(batch, results, strict=True):
            assert item.result is not None
            item.result.cached_tokens = res.cached_tokens
            item.result.attempts += 1
            share = round(seconds * len(item.ids) / batch_tokens_n, 4)
            item.result.seconds = share if count else round((item.result.seconds or 0.0) + share, 4)
            if res.cached_tokens >= len(item.hashes) * self.policy.chunk_size:
                hit.append(item)
            if count:
                self.done["documents"] += 1
                self.done["tokens"] += len(item.ids)
                self.done["bytes"] += item.result.bytes
        self.report_progress("prefill", batch[-1].doc.id)
        return hit

    def verify(self, mode: str, verify_timeout_s: float, items: list[_Planned] | None = None) -> None:
        """Check that the store holds every chunk of ``items`` (default ``todo``; ``mode``: "fs", "server" or
        "off"); mark the missing ones failed, those that could not be checked unverified."""
        self.report.verification = mode
        items = self.todo if items is None else items
        if not items:
            return
        if mode == VERIFY_OFF:
            for item in items:
                assert item.result is not None
                item.result.reason = "unverified: verification was turned off (verify=False)"
            return
        self.report_progress("verify")
        if mode == VERIFY_FS:
            self._verify_fs(verify_timeout_s, items)
        else:
            self._verify_on_server(verify_timeout_s, items)
            if self.dirs:  # the registry records the objects the directory holds
                self.index = NamespaceIndex.scan(self.dirs, self.ns)
        results = [i.result for i in items if i.result is not None]
        self.log.info("warm.verified", by=mode, documents=len(results),
                      verified=sum(1 for r in results if r.verified is True),
                      missing=sum(1 for r in results if r.verified is False),
                      unverified=sum(1 for r in results if r.verified is None))

    def _missing_hint(self, item: _Planned) -> str:
        hint = (f"the server drops a store it has no memory for (its log, {self.ps.server.log_path}, then says "
                "'Failed to batched allocate'; 'store.chunks_not_stored' for a chunk that left its memory before "
                "the store wrote it): raise the policy's l1.size_gb; else check that log and ps.stats()")
        cached = item.result.cached_tokens if item.result is not None else 0
        if cached >= self.policy.chunk_size and not self.force:
            hint = (f"the engine did not compute {cached} of its tokens (its prefix cache held them), and its "
                    f"connector stores only what it computes: warm it again with force=True; or {hint}")
        return hint

    def check(self, mode: str, verify_timeout_s: float, retries: int, batch_tokens: int) -> None:
        """Verify (phase "verify"), then prefill again what verification found incomplete (phase "retry")."""
        with self.phase("verify"):
            self.verify(mode, verify_timeout_s)
        # a retry needs a server that says what it holds in memory: one that does not (gone, or not LMCache's
        # MP server) would make each round wait out the whole verify timeout for stores that cannot land
        if mode != VERIFY_OFF and retries > 0 and self.incomplete() and self._settled() is not None:
            with self.phase("retry"):
                self.retry(mode, verify_timeout_s, retries, batch_tokens)

    def incomplete(self) -> list[_Planned]:
        """The prefilled documents verification found chunks missing of."""
        return [i for i in self.todo if i.result is not None and i.result.status == FAILED
                and i.result.verified is False]

    def retry(self, mode: str, verify_timeout_s: float, retries: int, batch_tokens: int) -> None:
        """Prefill again, and verify again, the documents verification found incomplete, up to ``retries``
        times. The engine's prefix cache is emptied first: it still holds them, and the engine's connector
        stores only what the engine computes."""
        for attempt in range(1, retries + 1):
            items = self.incomplete()
            if not items:
                return
            self.log.warning("warm.retry", attempt=attempt, documents=len(items),
                             reasons=sorted({i.result.reason.split(";")[0] for i in items if i.result})[:3])
            for item in items:
                assert item.result is not None
                item.result.status, item.result.verified, item.result.reason = WARMED, None, ""
            self.eng.reset_prefix_cache()
            self._prefill_batches(items, batch_tokens, count=False)
            self.verify(mode, verify_timeout_s, items)

    def _settled(self) -> bool | None:
        """Whether the server reports no store in progress (None when it cannot say)."""
        return self.room.settled() if self.room is not None else None

    def _verify_fs(self, timeout_s: float, items: list[_Planned]) -> None:
        t0 = time.monotonic()
        self.index = index = _wait_for_chunks(self.dirs, self.ns, items, self.salt, timeout_s, self._settled)
        waited = time.monotonic() - t0
        for item in items:
            assert item.result is not None
            item.result.verified_by = VERIFY_FS
            missing = index.missing(item.hashes, self.salt)
            if missing:
                item.result.status = FAILED
                item.result.verified = False
                item.result.reason = (f"{len(missing)} of {len(item.hashes)} chunks are not in the store after "
                                      f"{_waited(waited, timeout_s)}; {self._missing_hint(item)}")
            else:
                item.result.verified = True
                item.result.bytes = index.bytes_of(item.hashes, self.salt) or item.result.bytes

    def _verify_on_server(self, timeout_s: float, items: list[_Planned]) -> None:
        """Ask the MP server for every chunk of ``items``, polling (the store lands after the prefill returns)
        until it holds them all, or ``timeout_s`` passes, or nothing more lands and the server has no store in
        progress."""
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        pending: list[_Planned] = []
        lookup = self.server_lookup(timeout_s)
        for item in items:
            assert item.result is not None
            if lookup is None:
                self._unverified(item, self.lookup_error or "the server cannot answer")
            elif lookup.l1_bytes is not None and item.result.bytes > lookup.l1_bytes:
                self._unverified(item, f"its KV ({_mib(item.result.bytes)}) is more than the server's memory "
                                       f"(L1, {_mib(lookup.l1_bytes)}) holds, and the server's lookup loads every "
                                       "chunk into it")
            else:
                pending.append(item)
        answers: dict[int, Held] = {}
        delay = VERIFY_POLL_FIRST_S
        #: one question may finish past the deadline (the timeout bounds the wait for chunks, not an answer)
        per_question = min(max(timeout_s, 1.0), CALL_TIMEOUT_S)
        stall = _Stall(self._settled)
        while pending:
            waiting: list[_Planned] = []
            for n, item in enumerate(pending):
                held = self.ask_server(item, max(deadline, time.monotonic() + per_question))
                if held is None:  # the server stopped answering: what is left cannot be checked
                    for rest in [*waiting, *pending[n:]]:
                        self._unverified(rest, self.lookup_error or "the server cannot answer")
                    return
                answers[id(item)] = held
                if held.chunks != len(item.hashes):
                    self._unverified(item, f"the server hashes the prefix into {held.chunks} chunks where warm "
                                           f"expects {len(item.hashes)} (is its chunk size the policy's "
                                           f"{self.policy.chunk_size}?)")
                elif held.complete:
                    assert item.result is not None
                    item.result.verified, item.result.verified_by = True, VERIFY_SERVER
                else:
                    waiting.append(item)
            pending = waiting
            left = deadline - time.monotonic()
            found = sum(answers[id(i)].found for i in pending) + len(items) - len(pending)
            if not pending or left <= 0 or stall.over(found):
                break
            time.sleep(min(delay, left))
            delay = min(delay * 1.5, VERIFY_POLL_MAX_S)
        waited = time.monotonic() - t0
        for item in pending:
            assert item.result is not None
            held = answers[id(item)]
            item.result.status = FAILED
            item.result.verified, item.result.verified_by = False, VERIFY_SERVER
            item.result.reason = (f"the server at {self.policy.server.http_url} holds {held.found} of the "
                                  f"{held.total} objects of its {held.chunks} chunks (in its memory or its tiers) "
                                  f"after {_waited(waited, timeout_s)}; {self._missing_hint(item)}")

    def _unverified(self, item: _Planned, why: str) -> None:
        assert item.result is not None
        item.result.verified, item.result.verified_by = None, None
        item.result.reason = f"unverified: {why}"

    def record(self) -> None:
        """Record every warmed or skipped document in the store's registry (when the store has one)."""
        registry = self.registry
        if registry is None:
            return
        model = getattr(self.eng, "model_dir", None)
        model_dir = model() if callable(model) else None
        objects = sorted(self.index.expected_objects()) if self.index is not None else []
        for item in self.planned:
            res = item.result
            if res is None or res.status not in (WARMED, SKIPPED):
                continue
            existing = registry.get(self.fp.digest, item.doc.id, self.salt)
            if (res.status == SKIPPED and existing is not None and existing.prefix_ids
                    and existing.prefix_digest == tokens_digest(item.ids)):
                continue
            registry.put(_record(item, res, self.fp.digest, self.ns, self.policy.chunk_size, objects, self.salt,
                                 self.tenant, self.template, model_dir, self.eng.kind))

    def finish(self, strict: bool) -> WarmReport:
        """Report the end; with ``strict``, raise :class:`WarmError` when a document could not be warmed."""
        report = self.report
        report.seconds = time.monotonic() - self.started
        self.report_progress("done")
        totals = report.totals()
        self.log.info("warm.done", seconds=round(report.seconds, 2), **totals,
                      phases={name: round(seconds, 3) for name, seconds in report.phases.items()})
        if strict and report.failed:
            lines = "; ".join(f"{d.id}: {d.reason}" for d in report.failed)
            raise WarmError(f"{len(report.failed)} of {len(report.documents)} documents were not warmed: {lines}",
                            report)
        return report


def _registered(registry: Registry | None, fingerprint: str, item: _Planned, salt: str) -> bool:
    """Whether the registry records ``item``'s very prefix (and salt) as warmed."""
    if registry is None:
        return False
    record = registry.get(fingerprint, item.doc.id, salt)
    return record is not None and record.prefix_digest == tokens_digest(item.ids)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _batches(items: list[_Planned], budget: int) -> list[list[_Planned]]:
    batches: list[list[_Planned]] = []
    current: list[_Planned] = []
    size = 0
    for item in items:
        if current and size + len(item.ids) > budget:
            batches.append(current)
            current, size = [], 0
        current.append(item)
        size += len(item.ids)
    if current:
        batches.append(current)
    return batches


#: verification polls: first after this many seconds, each wait 1.5x the last, at most VERIFY_POLL_MAX_S (asking
#: the server); a directory tier's scans wait VERIFY_SCAN_FRACTION of the time waited so far, in the same bounds
VERIFY_POLL_FIRST_S = 0.005
VERIFY_POLL_MAX_S = 0.2
VERIFY_SCAN_FRACTION = 0.1


def _waited(seconds: float, timeout_s: float) -> str:
    if seconds >= timeout_s:
        return f"{timeout_s:g} s"
    return f"{seconds:.1f} s (nothing landed for {STALL_S:g} s and the server had no store in progress)"


#: verification stops waiting when no chunk has landed for this long and the server has no store in progress
STALL_S = 2.0


class _Stall:
    """Tells verification when to stop waiting early: no progress for :data:`STALL_S` and ``settled()``."""

    def __init__(self, settled: Callable[[], bool | None] | None) -> None:
        self.settled = settled
        self.best: int | None = None
        self.since = time.monotonic()

    def over(self, progress: int) -> bool:
        """``progress``: any count that grows as chunks land."""
        now = time.monotonic()
        if self.best is None or progress > self.best:
            self.best, self.since = progress, now
            return False
        return self.settled is not None and now - self.since >= STALL_S and self.settled() is True


def _wait_for_chunks(dirs: list[Path], ns: str, items: list[_Planned], salt: str, timeout_s: float,
                     settled: Callable[[], bool | None] | None = None) -> NamespaceIndex:
    """Scan the namespace until every chunk of ``items`` is there (the server writes L2 asynchronously), or
    ``timeout_s`` passes, or no chunk has landed for :data:`STALL_S` and ``settled()`` says the server has no
    store in progress.

    The server's write lands 0.1-0.3 s after the prefill returns (bench model, 1k-4k tokens). Between two scans
    warm waits a tenth of the time it has waited so far (at least 5 ms, at most 200 ms), so it sees the last
    chunk about a tenth later than it landed (polls growing by half each time overshot it by up to a half, a
    median of 114 ms at 4k tokens); and at least twice the last scan's own time, so a store of many files is
    not listed back to back. Each scan is one listing of the tier directories (names only), not a ``stat`` per
    chunk."""
    started = time.monotonic()
    deadline = started + timeout_s
    stall = _Stall(settled)
    while True:
        scan_started = time.monotonic()
        index = NamespaceIndex.scan(dirs, ns)
        expected = index.expected_objects()
        missing = sum(len(index.missing(i.hashes, salt, expected)) for i in items)
        if not missing:
            return index
        now = time.monotonic()
        left = deadline - now
        if left <= 0 or stall.over(-missing):
            return index
        wait = min(max((now - started) * VERIFY_SCAN_FRACTION, VERIFY_POLL_FIRST_S), VERIFY_POLL_MAX_S)
        time.sleep(min(max(wait, 2 * (now - scan_started)), left))


def _record(item: _Planned, res: DocumentResult, fingerprint: str, ns: str, chunk_size: int,
            objects: list[tuple[int, int]], salt: str, tenant: str | None, template: Template,
            model_dir: str | None, engine: str) -> DocumentRecord:
    return DocumentRecord(
        id=item.doc.id, source=item.doc.source, content_hash=item.doc.content_hash, text_hash=item.doc.text_hash,
        template_digest=template.digest, prefix_digest=tokens_digest(item.ids), tokens=len(item.ids),
        chunk_tokens=len(item.hashes) * chunk_size, chunk_size=chunk_size, chunks=len(item.hashes),
        chunk_hashes=item.hashes, objects=objects, salt=salt, tenant=tenant, bytes=res.bytes,
        fingerprint=fingerprint, namespace=ns, model=model_dir, engine=engine,
        warmed_at=datetime.now(timezone.utc).isoformat(timespec="seconds"), host=socket.gethostname(),
        seconds=res.seconds, prefixshare_version=__version__, prefix_ids=encode_ids(item.ids),
    )


# --- prompts ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    """A prompt whose first ``prefix_tokens`` token ids are exactly the warmed prefix of ``document_id``.

    vLLM: ``llm.generate([p.engine_input()], SamplingParams(..., extra_args={"kv_transfer_params":
    p.kv_transfer_params}))``; over HTTP send ``prompt=p.token_ids`` and ``kv_transfer_params``.
    SGLang: ``engine.generate(**p.sglang_kwargs(), sampling_params={...})``; over HTTP (``/generate``) send the
    same fields (``input_ids``, ``rid``, ``cache_salt``) in the body.
    """

    token_ids: list[int]
    prefix_tokens: int
    document_id: str
    tenant: str | None = None
    cache_salt: str | None = None

    @property
    def kv_transfer_params(self) -> dict[str, Any]:
        """Per-request keys: the document id, and store only the prefix (not the question)."""
        return _params(self.document_id, self.prefix_tokens, self.tenant)

    def engine_input(self) -> dict[str, Any]:
        """The engine prompt. A tenant's prompt carries the tenant's salt as the engine's ``cache_salt`` (unless
        one is given), so the engine's own prefix cache is split by tenant too: without it, a tenant could time
        another's cached prefix (a hit answers faster) on a shared engine."""
        out: dict[str, Any] = {"prompt_token_ids": list(self.token_ids)}
        salt = self.cache_salt or (tenant_salt(self.tenant) if self.tenant else None)
        if salt:
            out["cache_salt"] = salt
        return out

    def sglang_kwargs(self) -> dict[str, Any]:
        """``sglang.Engine.generate`` keyword arguments: the token ids, a request id carrying the document id and
        prefix length (a fresh one per call: SGLang request ids must be unique), and the tenant's cache salt."""
        return {"input_ids": list(self.token_ids),
                **request_kwargs(document_id=self.document_id, tenant=self.tenant, prefix_tokens=self.prefix_tokens,
                                 cache_salt=self.cache_salt)}

    def __len__(self) -> int:
        return len(self.token_ids)


def _registered_document(record: DocumentRecord, doc: str, sources: Any) -> Document:
    """A registered document's text, read from a file the caller named (see :func:`prompt_for`), and checked
    against the record's content hash."""
    named = Path(doc)
    if named.is_file():
        path = named
    else:
        if record.source is None:
            raise DocumentError(f"document {doc!r} was warmed from text, not a file; pass (id, text)")
        roots = [] if sources is None else [sources] if isinstance(sources, (str, os.PathLike)) else list(sources)
        if not roots:
            raise DocumentError(
                f"document {doc!r} is registered with source {record.source!r}, but the registry lives in the "
                "shared store, so prompt_for reads a file it names only under a folder you pass: "
                "prompt_for(..., sources=['/path/to/documents']); or pass the file's path, or (id, text)")
        path = Path(record.source).resolve()
        if not any(path.is_relative_to(Path(root).resolve()) for root in roots):
            raise DocumentError(f"document {doc!r}: its registered source {record.source!r} lies outside the "
                                f"folders in sources ({', '.join(str(r) for r in roots)}); not read")
        if not record.content_hash:
            raise DocumentError(f"document {doc!r}: its record has no content hash, so its source is not read; "
                                "warm it again")
    found = _pair(record.id, path)
    if record.content_hash and found.content_hash != record.content_hash:
        raise DocumentError(f"{path} changed since document {doc!r} was warmed; warm it again")
    return found


_PREFIX_CACHE: OrderedDict[tuple[int, str, str], list[int]] = OrderedDict()
_PREFIX_CACHE_SIZE = 32


def _cached_prefix(tokenizer: Any, template: Template, doc: Document) -> list[int]:
    key = (id(tokenizer), template.digest + template.prefix, doc.text_hash)
    ids = _PREFIX_CACHE.get(key)
    if ids is None:
        ids = prefix_ids(tokenizer, template, doc.text)
        _PREFIX_CACHE[key] = ids
        while len(_PREFIX_CACHE) > _PREFIX_CACHE_SIZE:
            _PREFIX_CACHE.popitem(last=False)
    else:
        _PREFIX_CACHE.move_to_end(key)
    return ids


def _resolve_one(ps: PrefixShare, eng: WarmEngine, doc: Any, *, tenant: str | None = None,
                 cache_salt: str | None = None, sources: Any = None) -> Document:
    if isinstance(doc, Document):
        return doc
    if isinstance(doc, tuple) and len(doc) == 2:
        return _pair(*doc)
    if isinstance(doc, Path):
        docs = _from_string(str(doc))
    elif isinstance(doc, str):
        record = None
        root = ps.policy.store_root
        if root is not None:
            record = Registry(root).get(eng.fingerprint().digest, doc, expected_salt(tenant, cache_salt))
        if record is not None and record.tenant not in (None, tenant):
            record = None  # another tenant's record: not this tenant's registry
        if record is not None:
            return _registered_document(record, doc, sources)
        docs = _from_string(doc)
    else:
        raise DocumentError(f"cannot build a prompt from {type(doc).__name__}: pass a document id, a path, "
                            "(id, text) or a Document")
    if len(docs) != 1:
        raise DocumentError(f"{doc!r} names {len(docs)} documents; prompt_for takes one")
    return docs[0]


def prompt_for(
    ps: PrefixShare,
    doc: Any,
    question: str,
    *,
    engine: Any = None,
    prefix: Template | str | None = None,
    tenant: str | None = None,
    cache_salt: str | None = None,
    sources: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None = None,
) -> Prompt:
    """The prompt for ``question`` about ``doc`` whose prefix is, token for token, what :func:`warm` stored.

    ``doc``: a registered document id, a path, ``(id, text)`` or a :class:`Document`. Pass the same ``prefix``
    (template), ``tenant`` and ``cache_salt`` as to :func:`warm`. A registered id is read again from a file and
    checked against its record's content hash; the registry lives in the shared store, so the file is one the
    caller names: ``doc`` itself when it is a file's path, else the record's ``source`` only when it lies
    (symlinks resolved) under one of the folders in ``sources``. A record another tenant wrote is not used.
    """
    eng = ps.warm_engine(engine)
    tokenizer = eng.tokenizer
    template = as_template(prefix).resolve(tokenizer)
    document = _resolve_one(ps, eng, doc, tenant=tenant, cache_salt=cache_salt, sources=sources)
    head = _cached_prefix(tokenizer, template, document)
    tail = question_ids(tokenizer, template, question)
    return Prompt(head + tail, len(head), document.id, tenant, cache_salt)
