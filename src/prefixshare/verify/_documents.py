"""Verifying the store's warmed documents offline (``prefixshare verify --model DIR``).

Every document ``warm`` recorded under the engine's fingerprint carries its prefix's token ids; each chosen
document becomes a verify task of the engine's own instance (keyed with the record's store salt) and is
replayed like a sampled hit: loaded from the store and recomputed, first tokens compared, quarantined on a
mismatch.
"""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING, Any

from prefixshare.errors import PrefixShareError
from prefixshare.keys import REQ_DOCUMENT, REQ_PREFIX_TOKENS, REQ_TENANT
from prefixshare.runtime import VerifyTask, keep_task, new_token
from prefixshare.verify._run import Check, VerifyReport, judged, verify_tasks
from prefixshare.warm import DocumentRecord, Registry

if TYPE_CHECKING:  # pragma: no cover
    from prefixshare.share import PrefixShare


def document_task(record: DocumentRecord, ids: list[int], instance: str, kv_dtype: str) -> VerifyTask:
    """A verify task replaying ``record``'s prefix: one more token after it, so the whole of its chunks can be
    loaded (an engine computes at least the prompt's last token)."""
    params: dict[str, Any] = {REQ_DOCUMENT: record.id, REQ_PREFIX_TOKENS: len(ids)}
    if record.tenant:
        params[REQ_TENANT] = record.tenant
    return VerifyTask(instance, record.namespace, f"document:{record.id}", [*ids, ids[0]], record.chunk_tokens,
                      store_salt=record.salt or None, params=params, kv_dtype=kv_dtype, sampled_at=time.time(),
                      token=new_token())


def choose(records: list[DocumentRecord], *, sample: int | None, document: str | None,
           seed: int | None = None) -> list[DocumentRecord]:
    """The records to verify: one by id, ``sample`` of them at random, or all (in id order)."""
    records = sorted(records, key=lambda r: r.id)
    if document is not None:
        found = [r for r in records if r.id == document]
        if not found:
            known = ", ".join(r.id for r in records[:10]) or "none"
            raise PrefixShareError(f"document {document!r} is not recorded under this engine's fingerprint "
                                   f"(recorded: {known}); warm it first, with the same model and engine settings")
        return found
    if sample is not None and sample < len(records):
        return sorted(random.Random(seed).sample(records, sample), key=lambda r: r.id)
    return records


def verify_documents(ps: PrefixShare, engine: Any = None, *, sample: int | None = None, document: str | None = None,
                     seed: int | None = None) -> VerifyReport:
    """Replay the store's warmed documents (all, ``sample`` of them, or ``document``) on ``engine``."""
    eng = ps.warm_engine(engine)
    if eng.kind != "vllm":
        raise PrefixShareError(f"verification replays run on vLLM engines, not {eng.kind}")
    root = ps.policy.store_root
    if root is None:
        raise PrefixShareError("the policy's store has no directory, so it has no document registry; verify the "
                               "hits replicas set aside instead (policy verify.sample, prefixshare verify --url)")
    fp = eng.fingerprint()
    chosen = choose(Registry(root).records(fp.digest).records, sample=sample, document=document, seed=seed)
    report = VerifyReport()
    paths = []
    for record in chosen:
        ids = record.prefix_token_ids()
        if ids is None:
            check = Check(f"document:{record.id}", "unverifiable", document_id=record.id, tokens=record.tokens,
                          reason="the record holds no prefix token ids (warmed by an earlier version): warm it "
                          "again with --force")
            report.checks.append(check)
            judged(eng.kind, ps.instance, check, record.namespace)
            continue
        task = document_task(record, ids, ps.instance, fp.engine.kv_dtype)
        paths.append(keep_task(task))
    replayed = verify_tasks(eng, ps.policy, ps.instance, paths=paths)
    report.checks.extend(replayed.checks)
    return report

