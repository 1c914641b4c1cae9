"""Warm without an engine: documents, templates, chunk keys, the registry, and warm() over a fake engine that
writes chunk files the way the MP server's fs tier does (the real engine path is tests/e2e/test_warm_e2e.py)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from conftest import free_port
from prefixshare import PrefixShare
from prefixshare.keys import namespace, store_salt
from prefixshare.runtime import ConnectorRuntime, RequestInfo
from prefixshare.fingerprint import EngineSettings, compute_fingerprint
from prefixshare.policies import Policy
from prefixshare.warm import (
    ChunkHasher,
    DocumentError,
    DocumentTooLongError,
    PrefillRequest,
    PrefillResult,
    Registry,
    Template,
    TemplateError,
    WarmError,
    chunk_file_name,
    expected_salt,
    parse_chunk_file,
    prompt_for,
    resolve_documents,
    safe_name,
    warm,
)
from prefixshare.keys import blake3_chunk_hashes
from prefixshare.warm._documents import split_text
from prefixshare.warm._template import prefix_ids

CHUNK = 64


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from prefixshare.model import create_model

    return create_model(tmp_path_factory.mktemp("warm-model") / "tiny", shape="tiny", seed=0)


@pytest.fixture(scope="module")
def tokenizer(tiny: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny))


# --- documents -----------------------------------------------------------------------------------------------


def test_documents_from_files_folders_globs_pairs_and_dicts(tmp_path: Path) -> None:
    (tmp_path / "docs" / "guide").mkdir(parents=True)
    (tmp_path / "docs" / "a.md").write_text("alpha")
    (tmp_path / "docs" / "guide" / "b.md").write_text("beta")
    (tmp_path / "docs" / ".hidden").write_text("skip")
    folder = resolve_documents([str(tmp_path / "docs")])
    assert [d.id for d in folder] == ["a.md", "guide/b.md"]
    assert folder[0].source == str((tmp_path / "docs" / "a.md").resolve()) and folder[0].content_hash
    assert [d.id for d in resolve_documents(str(tmp_path / "docs" / "**" / "*.md"))] == ["a.md", "guide/b.md"]
    assert [d.id for d in resolve_documents(tmp_path / "docs" / "a.md")] == ["a.md"]
    pairs = resolve_documents([("manual-1", "text one"), ("manual-2", tmp_path / "docs" / "a.md")])
    assert [(d.id, d.text) for d in pairs] == [("manual-1", "text one"), ("manual-2", "alpha")]
    assert [d.id for d in resolve_documents({"x": "1", "y": "2"})] == ["x", "y"]


@pytest.mark.parametrize(
    ("docs", "message"),
    [
        (["just some text"], "(id, text) pairs"),
        ([("", "text")], "non-empty"),
        ([("a\nb", "text")], "control characters"),
        ([("a", "one"), ("a", "two")], "two documents have the id"),
        (["/no/such/*.md"], "matches no files"),
        ([], "no documents"),
    ],
)
def test_bad_documents_are_refused_with_a_reason(docs: Any, message: str) -> None:
    with pytest.raises(DocumentError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_documents(docs)


def test_binary_files_are_refused(tmp_path: Path) -> None:
    (tmp_path / "blob.bin").write_bytes(b"\xff\xfe\x00\x01")
    with pytest.raises(DocumentError, match="not UTF-8"):
        resolve_documents([str(tmp_path / "blob.bin")])


def test_split_parts_fit_and_join_back() -> None:
    text = "\n\n".join(f"paragraph {i} " + "word " * (i % 7 + 3) for i in range(40)) + "\n" + "x" * 90
    parts = split_text(text, lambda t: len(t) <= 60)
    assert "".join(parts) == text and all(len(p) <= 60 for p in parts)


# --- templates ----------------------------------------------------------------------------------------------


def test_template_placeholders_are_checked() -> None:
    with pytest.raises(TemplateError):
        Template(prefix="no placeholder")
    with pytest.raises(TemplateError):
        Template(prefix="{document} twice {document}")
    with pytest.raises(TemplateError):
        Template(question="no question here")
    t = Template(prefix="Manual:\n{document}\n", question="Q: {question}\nA:")
    assert t.prefix_text("X {document} Y") == "Manual:\nX {document} Y\n"  # document text is never parsed
    assert t.question_text("why?") == "Q: why?\nA:"


def test_chat_template_places_the_document_in_the_user_turn(tokenizer: Any) -> None:
    t = Template.chat(system="Use {braces} freely.").resolve(tokenizer)
    prefix = t.prefix_text("DOC")
    assert prefix.startswith("<s><|system|>\nUse {braces} freely.</s>\n<|user|>\nDOC")
    assert t.question_text("Q?") == "\n\nQ?</s>\n<|assistant|>\n"
    whole = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Use {braces} freely."}, {"role": "user", "content": "DOC\n\nQ?"}],
        tokenize=False, add_generation_prompt=True)
    assert prefix + t.question_text("Q?") == whole


# --- chunk keys ------------------------------------------------------------------------------------------------


def test_chunk_hashes_are_lmcaches_own(tokenizer: Any) -> None:
    from prefixshare.model import document_text

    ids = tokenizer.encode(document_text(300, seed=1))
    ours = ChunkHasher(CHUNK).hashes(ids)
    assert len(ours) == len(ids) // CHUNK
    assert ours == blake3_chunk_hashes(ids, CHUNK)  # pins LMCache 0.5.6's rolling blake3 scheme
    assert ChunkHasher(CHUNK).hashes(ids[:CHUNK - 1]) == []
    # a prefix's chunks are the first chunks of every longer prompt (rolling hash)
    assert ChunkHasher(CHUNK).hashes(ids + [5, 6, 7] * 40)[: len(ours)] == ours


def test_chunk_file_names_round_trip() -> None:
    name = chunk_file_name("prefixshare-abc", 0x01000100, 0, "ab" * 32, "t-acme")
    assert name == f"prefixshare-abc@0x01000100@0@{'ab' * 32}@t-acme.data"
    parsed = parse_chunk_file(name)
    assert parsed is not None and parsed.salt == "t-acme" and parsed.world_size == 1 and parsed.kv_rank == 0x01000100
    assert parse_chunk_file("notes.data") is None and parse_chunk_file("a@b@c@zz.data") is None


@pytest.mark.parametrize(("tenant", "salt"), [(None, None), ("acme", None), ("acme", "s1"), (None, "s1"),
                                              ("a@b/c", None), ("t" * 64, "x" * 100), ("acme", "t-acme"),
                                              (None, "t-acme")])
def test_expected_salt_matches_the_connector(tenant: str | None, salt: str | None) -> None:
    info = RequestInfo("r", 10, tenant=tenant)
    assert expected_salt(tenant, salt) == (ConnectorRuntime.salt(None, info, salt) or "")  # type: ignore[arg-type]


def test_admission_digest_matches_the_connector(tmp_path: Path, tiny: Path) -> None:
    """warm() asks the admission rules with the digest the connector computes for the prompts that reuse the
    warmed prefix (the document, then a question): they must be equal, or a frequency rule counts them apart."""
    from prefixshare.warm._warm import _admission_digest

    policy = Policy.build(chunk_size=CHUNK, l2=[{"type": "fs", "base_path": str(tmp_path)}],
                          admission={"frequency": {"n": 2, "window": "1h"}})
    settings = EngineSettings(engine="vllm", kv_layout="vllm/cpu/NHD", kv_dtype="float32", block_size=32)
    rt = ConnectorRuntime({"prefixshare.policy": policy.to_dict(), "prefixshare.instance": "digest"},
                          model_dir=str(tiny), settings=settings, role="scheduler")
    try:
        for n in (CHUNK - 1, CHUNK, 3 * CHUNK + 5, 40 * CHUNK):
            prefix = [(i * 7919) % 32000 for i in range(n)]
            question = [11, 12, 13]
            for params, prompt in (({}, prefix),  # the prefill warm() sends
                                   ({"prefixshare.prefix_tokens": n}, prefix + question),  # a prompt_for() prompt
                                   ({"prefixshare.prefix_tokens": n}, tuple(prefix + question))):
                info = rt.begin(f"r{n}-{len(params)}-{type(prompt).__name__}", prompt, params)
                assert info.admission_request is not None
                assert info.admission_request.prefix_digest == _admission_digest(prefix, CHUNK)
                tenant = rt.begin(f"t{n}-{len(params)}-{type(prompt).__name__}", prompt,
                                  {**params, "prefixshare.tenant": "acme"})
                assert tenant.admission_request is not None
                assert tenant.admission_request.prefix_digest == _admission_digest(prefix, CHUNK, "acme")
                assert n < CHUNK or tenant.admission_request.prefix_digest != info.admission_request.prefix_digest
        assert _admission_digest(list(range(CHUNK - 1)), CHUNK) is None
    finally:
        rt.close()


def test_registry_prefix_digest_is_unchanged() -> None:
    """Registry records persist tokens_digest: its bytes are what array('I', ids) gave (little-endian u32)."""
    import array
    import sys

    import blake3

    from prefixshare.warm._template import tokens_digest

    ids = [0, 1, 255, 256, 65535, 65536, 151_935, 2**32 - 1]
    if sys.byteorder == "little":
        assert tokens_digest(ids) == blake3.blake3(array.array("I", ids).tobytes()).hexdigest()[:32]
    assert tokens_digest(ids) == "faf781f6b3c851dcf073a0ea0f44cbae"  # the value before token_bytes


# --- registry ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("doc_id", ["../../etc/passwd", "/etc/passwd", "a/b", "..", ".hidden", "a\\b", "x" * 300,
                                    "manual#2", "C:\\x"])
def test_unsafe_ids_never_leave_the_registry(tmp_path: Path, doc_id: str) -> None:
    registry = Registry(tmp_path)
    path = registry.path("0" * 32, doc_id)
    assert path.parent == tmp_path / ".prefixshare" / "documents" / ("0" * 32)
    assert path.name.startswith("_") and "/" not in safe_name(doc_id)


def test_safe_ids_are_readable_file_names(tmp_path: Path) -> None:
    assert safe_name("manual-v3.md") == "manual-v3.md"
    assert Registry(tmp_path).path("f" * 32, "manual-v3.md").name == "manual-v3.md.json"
    with pytest.raises(ValueError):
        Registry(tmp_path).path("../x", "a")


# --- warm over a fake engine ---------------------------------------------------------------------------------------


class FakeEngine:
    """A WarmEngine that writes chunk files like the MP server's fs tier (write=False: the store drops them)."""

    kind = "fake"

    def __init__(self, model: Path, tokenizer: Any, policy: Policy, store: Path, max_model_len: int = 2048) -> None:
        self._tok = tokenizer
        self.policy = policy
        self.store = store
        self.max_model_len = max_model_len
        self.write = True
        self.calls: list[list[PrefillRequest]] = []
        self.resets = 0
        settings = EngineSettings(engine="vllm", kv_layout="test/layout", kv_dtype="float32", block_size=32,
                                  chunk_size=policy.chunk_size)
        self.fp = compute_fingerprint(model, settings)
        self.hasher = ChunkHasher(policy.chunk_size)

    @property
    def tokenizer(self) -> Any:
        return self._tok

    def fingerprint(self) -> Any:
        return self.fp

    def kv_bytes_per_token(self) -> int:
        return 4096

    def prefill(self, requests: list[PrefillRequest]) -> list[PrefillResult]:
        self.calls.append(requests)
        for req in requests:
            assert req.kv_transfer_params["prefixshare.prefix_tokens"] == len(req.token_ids)
            if not self.write:
                continue
            salt = expected_salt(req.kv_transfer_params.get("prefixshare.tenant"), req.cache_salt)
            for h in self.hasher.hashes(req.token_ids):
                name = chunk_file_name(namespace(self.fp), 0x01000100, 0, h, salt)
                (self.store / name).write_bytes(b"\0" * 4096 * CHUNK)
        return [PrefillResult(0) for _ in requests]

    def reset_prefix_cache(self) -> None:
        self.resets += 1


@pytest.fixture
def setup(tmp_path: Path, tiny: Path, tokenizer: Any) -> tuple[PrefixShare, FakeEngine, Path]:
    store = tmp_path / "store"
    store.mkdir()
    policy = Policy.build(chunk_size=CHUNK, l2=[{"type": "fs", "base_path": str(store)}],
                          server={"port": free_port(), "http_port": free_port()},
                          admission={"any": [{"min_tokens": 256}, {"pinned": ["manual-*"]}]})
    ps = PrefixShare(policy, server=False)
    return ps, FakeEngine(tiny, tokenizer, policy, store), store


def _docs() -> dict[str, str]:
    from prefixshare.model import document_text

    return {"manual-a": document_text(500, seed=1), "guide": document_text(400, seed=2),
            "manual-tiny": "A short note.", "small": document_text(120, seed=3)}


def test_warm_stores_verifies_records_and_skips_the_second_time(setup: Any, tokenizer: Any) -> None:
    ps, eng, store = setup
    template = Template.chat(system="Answer from the document.")
    events: list[Any] = []
    report = warm(ps, _docs(), eng, prefix=template, strict=False, progress=events.append, batch_tokens=600)
    status = {d.id: d.status for d in report.documents}
    assert status == {"manual-a": "warmed", "guide": "warmed", "manual-tiny": "too_short", "small": "refused"}
    assert "pin it" in next(d for d in report.documents if d.id == "small").reason
    assert [len(c) for c in eng.calls] == [1, 1]  # batches of about batch_tokens tokens
    assert events[0].phase == "plan" and events[-1].phase == "done" and events[-1].documents_done == 2
    warmed = {d.id: d for d in report.warmed}
    assert all(d.verified for d in warmed.values())
    # each step timed, in order, within the call's wall time; the prefill step holds the engine's batches
    assert list(report.phases) == ["plan", "triage", "prefill", "verify", "record"]
    assert all(v >= 0 for v in report.phases.values()) and sum(report.phases.values()) <= report.seconds
    assert report.phases["prefill"] >= report.prefill_seconds > 0
    assert report.to_dict()["phases"] == {k: round(v, 4) for k, v in report.phases.items()}
    registry = Registry(store)
    record = registry.get(eng.fp.digest, "manual-a")
    assert record is not None and record.chunks == warmed["manual-a"].chunks == record.tokens // CHUNK
    assert record.bytes == record.chunks * 4096 * CHUNK and record.namespace == namespace(eng.fp)
    assert record.host and record.warmed_at and record.template_digest == template.resolve(tokenizer).digest
    path = registry.path(eng.fp.digest, "manual-a")
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o750
    assert stat.S_IMODE((store / ".prefixshare" / "documents").stat().st_mode) == 0o750
    # the prompt for any question starts with exactly the warmed tokens
    for question in ("What is it?", "Why?"):
        prompt = prompt_for(ps, ("manual-a", _docs()["manual-a"]), question, engine=eng, prefix=template)
        assert prompt.token_ids[: prompt.prefix_tokens] == prefix_ids(tokenizer, template.resolve(tokenizer),
                                                                      _docs()["manual-a"])
        assert prompt.prefix_tokens == record.tokens
        assert prompt.kv_transfer_params["prefixshare.prefix_tokens"] == record.tokens
    # second run: nothing to prefill
    again = warm(ps, _docs(), eng, prefix=template, strict=False)
    assert {d.id for d in again.skipped} == {"manual-a", "guide"} and len(eng.calls) == 2
    forced = warm(ps, {"guide": _docs()["guide"]}, eng, prefix=template, force=True)
    assert forced.warmed[0].id == "guide" and eng.resets == 1 and len(eng.calls) == 3


def test_a_document_whose_chunks_vanished_is_warmed_again(setup: Any) -> None:
    ps, eng, store = setup
    warm(ps, {"guide": _docs()["guide"]}, eng)
    victim = sorted(store.glob("*.data"))[3]
    victim.unlink()
    again = warm(ps, {"guide": _docs()["guide"]}, eng)
    assert [d.status for d in again.documents] == ["warmed"] and victim.exists()


class CachingEngine(FakeEngine):
    """A FakeEngine with a prefix cache of its own: a prompt it has seen is not computed, so not stored."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cache: set[tuple[int, ...]] = set()

    def prefill(self, requests: list[PrefillRequest]) -> list[PrefillResult]:
        fresh = [r for r in requests if tuple(r.token_ids) not in self.cache]
        super().prefill(fresh)
        self.cache.update(tuple(r.token_ids) for r in requests)
        return [PrefillResult(0 if r in fresh else len(r.token_ids) // 32 * 32) for r in requests]

    def reset_prefix_cache(self) -> None:
        super().reset_prefix_cache()
        self.cache.clear()


def test_a_document_the_store_lost_but_the_engine_still_caches_is_stored_again(setup: Any, tiny: Path,
                                                                              tokenizer: Any) -> None:
    """Re-warming after the store lost a document: the engine's own prefix cache answers the prefill (nothing
    computed, so nothing stored), so warm empties that cache and prefills it again."""
    ps, _, store = setup
    eng = CachingEngine(tiny, tokenizer, ps.policy, store)
    warm(ps, {"guide": _docs()["guide"]}, eng)
    for chunk in store.glob("*.data"):
        chunk.unlink()
    again = warm(ps, {"guide": _docs()["guide"]}, eng)
    result = again.documents[0]
    assert result.status == "warmed" and result.verified is True and result.cached_tokens == 0
    assert eng.resets == 1 and len(eng.calls) == 3  # the hit, then the prefill after the reset
    assert len(list(store.glob("*.data"))) == result.chunks


def test_missing_chunks_fail_verification(setup: Any) -> None:
    ps, eng, _ = setup
    eng.write = False
    with pytest.raises(WarmError) as info:
        warm(ps, {"guide": _docs()["guide"]}, eng, verify_timeout_s=0.3)
    result = info.value.report.documents[0]  # type: ignore[union-attr]
    assert result.status == "failed" and result.verified is False and "chunks are not in the store" in result.reason
    # not prefilled again: no server answers what it holds (a retry would wait out the timeout again for
    # stores that cannot land); test_documents_the_server_dropped_are_prefilled_again has one that answers
    assert result.attempts == 1 and len(eng.calls) == 1 and eng.resets == 0
    assert info.value.report.totals()["retried"] == 0  # type: ignore[union-attr]


MIB = 4096 * CHUNK * 4  # the fake engine's KV of a 256-token document (4 chunks)


class L1Engine(FakeEngine):
    """A FakeEngine behind a server memory of ``capacity`` bytes that drops a store it has no room for, as
    LMCache's MP server does, and evicts down to 64 % every TICK_S when over its 80 % watermark (the server:
    once a second), so a client that finds it full sees room only some time later. Its ``/status`` is
    :meth:`status` (an httpx transport's handler)."""

    TICK_S = 0.3

    def __init__(self, *args: Any, capacity: int, **kwargs: Any) -> None:
        import time

        super().__init__(*args, **kwargs)
        self.capacity, self.used, self.tick = capacity, 0, time.monotonic()
        self.dropped: list[str] = []
        self.readings: list[int] = []

    def _evict(self) -> None:
        import time

        now = time.monotonic()
        while now - self.tick >= self.TICK_S:
            self.tick += self.TICK_S
            if self.used >= 0.8 * self.capacity:
                self.used = int(self.capacity * 0.64)

    def prefill(self, requests: list[PrefillRequest]) -> list[PrefillResult]:
        self._evict()
        kept = []
        for req in requests:
            need = len(self.hasher.hashes(req.token_ids)) * 4096 * CHUNK
            if self.used + need > self.capacity:
                self.dropped.append(req.kv_transfer_params["prefixshare.document_id"])
                continue
            self.used += need
            kept.append(req)
        super().prefill(kept)
        self.calls[-1] = requests
        return [PrefillResult(0) for _ in requests]

    def status(self, request: Any) -> Any:
        import httpx

        assert request.url.path == "/status"
        self._evict()
        self.readings.append(self.used)
        return httpx.Response(200, json=_status(self.used, self.capacity))


def _status(used: int, total: int = 100, pending: int = 0, **eviction: int) -> dict[str, Any]:
    """The MP server's ``/status`` as warm's pacing reads it: L1's usage, chunks waiting for their L2 write, and
    the eviction controller's entry (``eviction``: the fields prefixshare's server adds)."""
    return {"storage_manager": {
        "l1_usage": [used, total], "l1_manager": {"staging_object_count": 0},
        "store_controller": {"pending_keys_count": pending, "in_flight_task_count": 0},
        "l1_eviction_controller": {"trigger_watermark": 0.8, **eviction}}}


@pytest.fixture
def l1_setup(setup: Any, tiny: Path, tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, L1Engine, Path]:
    """16 documents (16 MiB of KV) through a 10 MiB server memory, its /status served by the engine."""
    import functools

    import httpx

    import prefixshare.warm._warm as warm_module
    from prefixshare.warm._room import ServerRoom

    ps, _, store = setup
    eng = L1Engine(tiny, tokenizer, ps.policy, store, capacity=10 * MIB)
    monkeypatch.setattr(warm_module, "ServerRoom",
                        functools.partial(ServerRoom, transport=httpx.MockTransport(eng.status)))
    return ps, eng, store


def _corpus() -> dict[str, str]:
    from prefixshare.model import document_text

    return {f"manual-{i}": document_text(2000, seed=100 + i) for i in range(16)}


def _fit_256(tokenizer: Any) -> dict[str, str]:
    """The corpus, each document cut to 256-300 prefix tokens (4 chunks: MIB of KV)."""
    out = {}
    for doc_id, text in _corpus().items():
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        out[doc_id] = tokenizer.decode(ids[:400])
        while len(prefix_ids(tokenizer, Template(), out[doc_id])) > 300:
            out[doc_id] = out[doc_id][:-20]
        assert len(prefix_ids(tokenizer, Template(), out[doc_id])) >= 256
    return out


def test_room_reads_status_and_turns_pacing_off_when_the_server_cannot_say() -> None:
    import httpx

    from prefixshare._log import get_logger
    from prefixshare.warm._room import ServerRoom, parse_room

    assert parse_room({"storage_manager": {"l1_usage": [1, 0]}}) is None  # no capacity: cannot tell
    assert parse_room({"is_healthy": True}) is None  # another LMCache's /status
    calls: list[int] = []

    def old_server(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        return httpx.Response(200, json={"is_healthy": True})

    room = ServerRoom("http://server", log=get_logger("test"), transport=httpx.MockTransport(old_server))
    assert room.fit([10, 10, 10]) == 3 and room.error and room.settled() is None
    assert room.fit([10]) == 1 and len(calls) == 1  # asked once, then pacing is off
    room.close()


@pytest.mark.parametrize(("used", "pending", "waits"), [(78, 0, False), (78, 5, False), (90, 5, True)])
def test_room_waits_only_when_the_server_will_free_memory(used: int, pending: int, waits: bool) -> None:
    """A document that does not fit: below the eviction watermark nothing will be evicted (chunks waiting for
    their L2 write or not), so it is sent at once; over it, warm waits for the eviction, up to its bound."""
    import time

    import httpx

    from prefixshare._log import get_logger
    from prefixshare.warm._room import ServerRoom

    def status(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=_status(used, pending=pending))

    room = ServerRoom("http://server", log=get_logger("test"), transport=httpx.MockTransport(status))
    t0 = time.monotonic()
    assert room.fit([20, 1], timeout_s=0.5) == 1
    assert (time.monotonic() - t0 >= 0.5) is waits
    assert room.fit([10, 6, 1, 1], timeout_s=0.5) == (3 if used == 78 else 1)  # free: 95 % less the usage
    room.close()


@pytest.mark.parametrize(("unevictable", "pending", "sent", "waits"),
                         [(10, 0, 2, False), (90, 0, 1, False), (90, 5, 1, True)])
def test_a_server_that_reports_its_unevictable_bytes_is_paced_to_them(unevictable: int, pending: int, sent: int,
                                                                       waits: bool) -> None:
    """prefixshare's server evicts before a reservation that would not fit, so its room is its size less what it
    cannot evict (``prefixshare_unevictable_bytes``), not its free bytes: at 90 % used with 10 unevictable, two
    documents of 40 go at once where LMCache's reading (5 free) would have sent one and waited. Held by chunks
    the L2 tier is still writing (pending), warm waits for them; held by nothing that will end, it does not."""
    import time

    import httpx

    from prefixshare._log import get_logger
    from prefixshare.warm._room import ServerRoom

    def status(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=_status(90, pending=pending, prefixshare_unevictable_bytes=unevictable))

    room = ServerRoom("http://server", log=get_logger("test"), transport=httpx.MockTransport(status))
    t0 = time.monotonic()
    assert room.fit([40, 40, 10], timeout_s=0.3) == sent
    assert (time.monotonic() - t0 >= 0.3) is waits
    room.close()


def test_a_call_whose_kv_the_server_reserved_is_no_longer_in_transit() -> None:
    """prefixshare's server counts the bytes it reserved: an engine call's KV is in transit only until that count
    grew by as much, whether or not the server is still busy writing it to its store."""
    import httpx

    from prefixshare._log import get_logger
    from prefixshare.warm import _room
    from prefixshare.warm._room import ServerRoom

    server = {"reserved": 1000, "unevictable": 10, "pending": 0}

    def status(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=_status(90, pending=server["pending"],
                                                prefixshare_unevictable_bytes=server["unevictable"],
                                                prefixshare_reserved_bytes_total=server["reserved"]))

    room = ServerRoom("http://server", log=get_logger("test"), transport=httpx.MockTransport(status))
    assert room.fit([40, 40]) == 2  # 95 less 10
    room.sent(80)
    server.update(reserved=1050, unevictable=60, pending=8)  # 50 of the 80 reached the server, still busy
    assert room._unseen(room.read()) == 30
    assert room.fit([10, 10], timeout_s=0.05) == 1  # 95 - 60 - 30 = 5 free: one (at least one), after waiting
    server.update(reserved=1080, unevictable=70)  # all of it reserved; the server still writes 70 to its store
    before = room.paced_s
    assert room.fit([10, 10]) == 2 and room.paced_s - before < _room.TRANSIT_S / 2  # 95 - 70 = 25
    assert room._unseen(room.read()) == 0
    room.close()


def test_a_call_the_server_was_busy_with_and_is_idle_after_has_landed() -> None:
    """An engine call's KV counts as taken until the server's usage shows it, for up to TRANSIT_S; a server that
    evicts as it fills never shows it. Once the server was seen busy after the call and is idle again, the call's
    stores have landed and its KV no longer counts: the next call is sent at once, not TRANSIT_S later."""
    import httpx

    from prefixshare._log import get_logger
    from prefixshare.warm import _room
    from prefixshare.warm._room import ServerRoom

    server = {"used": 60, "pending": 0}

    def status(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=_status(server["used"], pending=server["pending"]))

    room = ServerRoom("http://server", log=get_logger("test"), transport=httpx.MockTransport(status))
    assert room.fit([30, 30]) == 1  # 35 free
    room.sent(30)
    server["pending"] = 4  # its stores arrive; the server evicts as it fills: usage stays 60
    assert room.fit([30], timeout_s=0.05) == 1 and room.paced_s >= 0.05  # 35 free less 30 unseen: waited
    server["pending"] = 0  # written (and evictable): landed
    before = room.paced_s
    assert room.fit([30, 30], timeout_s=5) == 1 and room.paced_s - before < _room.TRANSIT_S / 2
    room.sent(30)
    # a call the server was never seen busy with still counts until TRANSIT_S
    assert room.fit([30], timeout_s=0.05) == 1 and room._unseen(room.read()) == 30
    room.close()


def test_warm_paces_its_engine_calls_to_the_servers_memory(l1_setup: Any, tokenizer: Any) -> None:
    """The whole corpus in one engine call would overflow the server's memory (16 MiB into 10): warm sends only
    what the memory has room for, waits for its eviction when none is left, and loses no document. The negative
    control, pace=False and no retries, loses the documents that did not fit."""
    ps, eng, store = l1_setup
    docs = _fit_256(tokenizer)
    report = warm(ps, docs, eng, retries=0)
    assert report.ok and not eng.dropped and len(report.warmed) == 16
    assert all(d.attempts == 1 and d.verified is True for d in report.warmed)
    assert len(eng.calls) > 2 and sum(len(c) for c in eng.calls) == 16  # cut into several calls
    assert max(eng.readings) >= 0.8 * eng.capacity  # it did fill the memory up to the watermark...
    assert report.paced_seconds > 0  # ...and waited for the eviction

    for chunk in store.glob("*.data"):
        chunk.unlink()
    eng.calls.clear()
    eng.used = 0
    unpaced = warm(ps, docs, eng, retries=0, pace=False, strict=False, verify_timeout_s=0.3, force=True)
    assert len(eng.calls) == 1 and len(eng.dropped) == 6  # 10 fit, 6 dropped
    assert {d.id for d in unpaced.failed} == set(eng.dropped)


def test_documents_the_server_dropped_are_prefilled_again(l1_setup: Any, tokenizer: Any) -> None:
    """Without pacing the server drops 6 of 16 documents; verification sees the server has no store in
    progress, stops waiting after STALL_S (not the 30 s timeout), and warm prefills those 6 again (after
    emptying the engine's prefix cache; unpaced again, so 3 are dropped again and prefilled a third time), and
    they land."""
    import time

    from prefixshare.warm._warm import STALL_S

    ps, eng, _ = l1_setup
    t0 = time.monotonic()
    report = warm(ps, _fit_256(tokenizer), eng, pace=False, verify_timeout_s=30.0)
    seconds = time.monotonic() - t0
    assert report.ok and len(report.warmed) == 16 and all(d.verified is True for d in report.warmed)
    attempts = {d.id: d.attempts for d in report.warmed}
    assert len(eng.dropped) == 9 and sorted(attempts.values()) == [1] * 10 + [2] * 3 + [3] * 3
    assert {i for i, n in attempts.items() if n > 1} == set(eng.dropped) and report.totals()["retried"] == 6
    assert eng.resets == 2 and "retry" in report.phases
    assert STALL_S <= report.phases["verify"] < 10 and seconds < 25


def test_verification_polls_promptly_for_chunks_the_server_writes_late(setup: Any,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The server writes L2 after the prefill returns: warm sees the chunks soon after they land (scans a tenth
    of the time waited apart, from 5 ms), listing the directory each time instead of a stat per chunk file."""
    import threading
    import time

    import prefixshare.warm._chunks as chunks

    ps, eng, store = setup
    landed: list[float] = []
    returned: list[float] = []
    writers: list[threading.Thread] = []
    prefill = eng.prefill

    def late_prefill(requests: list[PrefillRequest]) -> list[PrefillResult]:
        eng.write = False
        out = prefill(requests)
        eng.write = True
        returned.append(time.monotonic())

        def write_later() -> None:
            time.sleep(0.12)
            prefill(requests)
            landed.append(time.monotonic())

        writers.append(threading.Thread(target=write_later))
        writers[-1].start()
        return out

    stats: list[str] = []
    real_stat = Path.stat
    monkeypatch.setattr(Path, "stat", lambda self, *a, **k: (stats.append(self.name), real_stat(self, *a, **k))[1])
    monkeypatch.setattr(eng, "prefill", late_prefill)
    scans: list[float] = []
    real_scan = chunks.NamespaceIndex.scan.__func__
    monkeypatch.setattr(chunks.NamespaceIndex, "scan",
                        classmethod(lambda cls, *a: (scans.append(time.monotonic()), real_scan(cls, *a))[1]))
    report = warm(ps, {"guide": _docs()["guide"]}, eng)
    done = time.monotonic()
    # warm may see the last chunk (and return) before the writer thread, once its files are written, is scheduled
    # again to note the time: the time it notes is then after warm's return, still the chunks' latest landing
    for writer in writers:
        writer.join(timeout=10)
    result = report.documents[0]
    assert result.status == "warmed" and result.verified is True and result.bytes == 4096 * CHUNK * result.chunks
    assert landed and done - landed[0] < 0.1  # (a generous bound: shared CI machines are slow)
    assert len(scans) >= 4
    # verification's scans, a tenth of the time waited apart: before the chunks landed (0.12 s after the prefill
    # returned) none is over 30 ms after the last, nor under 5 ms
    polls = [t for t in scans if t >= returned[0]]
    gaps = [b - a for a, b in zip(polls, polls[1:])]
    assert all(g >= 0.004 for g in gaps) and max(g for a, g in zip(polls, gaps) if a < landed[0]) < 0.03, gaps
    # sizes are read once, for the warmed document's files only (not a stat per file on every poll)
    assert sorted(s for s in stats if s.endswith(".data")) == sorted(f.name for f in store.glob("*.data"))


def test_a_document_longer_than_the_context_is_refused_before_any_work(setup: Any) -> None:
    from prefixshare.model import document_text

    ps, eng, _ = setup
    eng.max_model_len = 600
    docs = {"manual-long": document_text(900, seed=5), "guide": _docs()["guide"]}
    with pytest.raises(DocumentTooLongError) as info:
        warm(ps, docs, eng)
    assert info.value.too_long[0][0] == "manual-long" and info.value.too_long[0][1] > 599
    assert "max_model_len" in str(info.value) and "split=True" in str(info.value)
    assert eng.calls == []  # nothing was prefilled
    report = warm(ps, docs, eng, split=True)
    parts = [d for d in report.documents if d.part_of == "manual-long"]
    assert len(parts) >= 2 and all(d.tokens <= 599 and d.status == "warmed" for d in parts)
    assert parts[0].id == "manual-long#1"


def test_tenant_documents_are_stored_under_the_tenant_salt(setup: Any) -> None:
    ps, eng, store = setup
    report = warm(ps, {"manual-t": _docs()["guide"]}, eng, tenant="acme")
    assert report.warmed[0].verified
    assert all(p.name.endswith("@t-acme.data") for p in store.glob("*.data"))
    record = Registry(store).get(eng.fp.digest, "manual-t", "t-acme")
    assert record is not None and record.salt == "t-acme" and record.tenant == "acme"
    # the engine's own prefix cache is split by tenant too (the timing side channel): prompts carry the salt,
    # which the store key does not count twice
    doc = ("manual-t", _docs()["guide"])
    prompt = prompt_for(ps, doc, "Q?", engine=eng, tenant="acme")
    assert prompt.engine_input()["cache_salt"] == "t-acme" and expected_salt("acme", "t-acme") == "t-acme"
    assert "cache_salt" not in prompt_for(ps, doc, "Q?", engine=eng).engine_input()


def test_sglang_prompts_carry_the_document_prefix_and_tenant_salt_in_sglangs_fields(setup: Any) -> None:
    """SGLang passes only the request id and cache salt to its scheduler: prompt_for's SGLang form puts the
    document id and prefix length in the id, and the store salt (tenant + request salt, as the vLLM connector
    computes it) in cache_salt."""
    from prefixshare.adapters.sglang import parse_rid

    ps, eng, _ = setup
    doc = ("manual-s", _docs()["guide"])
    prompt = prompt_for(ps, doc, "Q?", engine=eng, tenant="acme")
    kw = prompt.sglang_kwargs()
    assert kw["input_ids"] == prompt.token_ids and kw["cache_salt"] == "t-acme" == expected_salt("acme")
    assert parse_rid(kw["rid"]) == {"prefixshare.document_id": "manual-s", "prefixshare.tenant": "acme",
                                    "prefixshare.prefix_tokens": prompt.prefix_tokens}
    assert kw["rid"] != prompt.sglang_kwargs()["rid"]  # SGLang request ids must be unique
    salted = prompt_for(ps, doc, "Q?", engine=eng, tenant="acme", cache_salt="s1").sglang_kwargs()
    assert salted["cache_salt"] == expected_salt("acme", "s1") == store_salt("acme", "s1")
    assert "cache_salt" not in prompt_for(ps, doc, "Q?", engine=eng).sglang_kwargs()


def test_prompt_for_a_registered_document_rereads_its_file(setup: Any, tmp_path: Path) -> None:
    ps, eng, _ = setup
    doc = tmp_path / "manual-file.md"
    doc.write_text(_docs()["guide"])
    warm(ps, [str(doc)], eng)
    prompt = prompt_for(ps, "manual-file.md", "Q?", engine=eng, sources=[tmp_path])
    assert prompt.document_id == "manual-file.md"
    assert prompt_for(ps, str(doc), "Q?", engine=eng).token_ids == prompt.token_ids  # the caller names the file
    doc.write_text("changed")
    with pytest.raises(DocumentError, match="changed since"):
        prompt_for(ps, "manual-file.md", "Q?", engine=eng, sources=[tmp_path])


def test_tenants_who_warm_one_document_id_each_keep_their_own_record(setup: Any) -> None:
    """Two tenants warm different texts under one document id: two records (one per store salt), each
    tenant's prompt_for by id builds its own document's prompt, an untenanted caller finds neither; a record
    of an earlier version (every salt in the flat layout) is still found under its own salt only, and replaced
    when that tenant warms again."""
    from prefixshare.warm._registry import write_json_atomic

    ps, eng, store = setup
    docs = _docs()
    warm(ps, {"manual-a": docs["manual-a"]}, eng, tenant="acme")
    warm(ps, {"manual-a": docs["guide"]}, eng, tenant="globex")
    registry, fp = Registry(store), eng.fingerprint().digest
    acme = registry.get(fp, "manual-a", expected_salt("acme"))
    globex = registry.get(fp, "manual-a", expected_salt("globex"))
    assert acme is not None and globex is not None and acme.prefix_digest != globex.prefix_digest
    assert (acme.tenant, globex.tenant) == ("acme", "globex")
    assert registry.get(fp, "manual-a") is None
    listed = registry.records(fp)
    assert sorted(r.tenant or "" for r in listed.records if r.id == "manual-a") == ["acme", "globex"]
    assert not listed.corrupt
    # an earlier version's record of acme, in the flat layout
    registry.remove(fp, "manual-a", expected_salt("acme"))
    flat = registry.path(fp, "manual-a")
    write_json_atomic(flat, acme.model_dump(mode="json"), root=store)
    assert registry.get(fp, "manual-a", expected_salt("acme")) == acme
    assert registry.get(fp, "manual-a") is None and registry.get(fp, "manual-a", expected_salt("globex")) == globex
    registry.put(acme)
    assert not flat.exists() and registry.get(fp, "manual-a", expected_salt("acme")) == acme


def test_prompt_for_reads_no_path_the_shared_registry_names_outside_the_callers_folders(
        setup: Any, tmp_path: Path) -> None:
    """The registry lives in the shared store: whoever can write it can name any path as a document's source.
    prompt_for reads a registered source only under a folder the caller passes (symlinks resolved), only with
    the record's content hash, and never a record another tenant wrote."""
    ps, eng, store = setup
    docs = tmp_path / "docs"
    docs.mkdir()
    good = docs / "manual-file.md"
    good.write_text(_docs()["guide"])
    warm(ps, [str(good)], eng)
    registry = Registry(store)
    fp = eng.fingerprint().digest
    record = registry.get(fp, "manual-file.md")
    assert record is not None and record.content_hash
    ok = prompt_for(ps, "manual-file.md", "Q?", engine=eng, sources=[docs])  # the control: under the root
    with pytest.raises(DocumentError, match="sources="):
        prompt_for(ps, "manual-file.md", "Q?", engine=eng)  # no folder passed: nothing the store names is read
    secret = tmp_path / "secret.txt"
    secret.write_text(_docs()["guide"])  # same content: only the path check can refuse it
    registry.put(record.model_copy(update={"source": str(secret)}))
    with pytest.raises(DocumentError, match="outside the folders"):
        prompt_for(ps, "manual-file.md", "Q?", engine=eng, sources=[docs])
    (docs / "link.md").symlink_to(secret)  # under the root by name, outside it once resolved
    registry.put(record.model_copy(update={"source": str(docs / "link.md")}))
    with pytest.raises(DocumentError, match="outside the folders"):
        prompt_for(ps, "manual-file.md", "Q?", engine=eng, sources=[docs])
    registry.put(record.model_copy(update={"content_hash": None}))
    with pytest.raises(DocumentError, match="no content hash"):
        prompt_for(ps, "manual-file.md", "Q?", engine=eng, sources=[docs])
    registry.remove(fp, "manual-file.md")
    registry.put(record.model_copy(update={"tenant": "globex", "salt": expected_salt("globex")}))
    with pytest.raises(DocumentError, match="manual-file.md"):
        prompt_for(ps, "manual-file.md", "Q?", engine=eng, sources=[docs], tenant="acme")  # not acme's record
    with pytest.raises(DocumentError, match="manual-file.md"):
        prompt_for(ps, "manual-file.md", "Q?", engine=eng, sources=[docs])  # nor an untenanted caller's
    assert prompt_for(ps, "manual-file.md", "Q?", engine=eng, sources=[docs], tenant="globex").token_ids == \
        ok.token_ids  # globex's own record: read


def test_warm_report_json_is_plain_data(setup: Any) -> None:
    ps, eng, _ = setup
    data = warm(ps, {"guide": _docs()["guide"]}, eng).to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["totals"]["warmed"] == 1 and data["ok"] is True


def test_warm_needs_an_engine(tmp_path: Path) -> None:
    from prefixshare.errors import PrefixShareError

    ps = PrefixShare(Policy.build(chunk_size=CHUNK), server=False)
    with pytest.raises(PrefixShareError, match="attach one first"):
        warm(ps, {"a": "b"})
    with pytest.raises(PrefixShareError, match="cannot warm with"):
        warm(ps, {"a": "b"}, object())
    assert os.environ.get("PREFIXSHARE_CACHE_DIR")  # tests never touch the user's cache


# --- verification by the MP server (stores without a directory) --------------------------------------------


class LookupStub:
    """The two HTTP routes warm asks an LMCache MP server (``/status``, ``/cache/prefetches``), answering as
    LMCache 0.5.6 does (wire format taken from a real server; tests/e2e/test_warm_e2e.py asks a real one)
    for the chunks in ``held``: (salt, chunk hash) pairs, each one object per kv rank."""

    def __init__(self, chunk_size: int) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.hasher = ChunkHasher(chunk_size)
        self.held: set[tuple[str, str]] = set()
        self.registered: list[tuple[str, int]] = []  # (model name, world size) of each engine registration
        self.l1_bytes = 1 << 30
        self.routes = True
        self.pending_polls = 1  # each job answers "pending" this many times first
        self.asked: list[dict[str, Any]] = []
        self.jobs: dict[str, list[Any]] = {}
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, code: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802
                if self.path == "/status":
                    metas = {str(i): {"model_name": m, "world_size": w, "block_size": 32, "use_mla": False}
                             for i, (m, w) in enumerate(stub.registered)}
                    self._send(200, {"is_healthy": True, "non_cuda_context_meta": metas, "cache_context_meta": {},
                                     "storage_manager": {"l1_capacity_bytes_by_backend": {"dram": stub.l1_bytes}}})
                elif stub.routes and self.path.startswith("/cache/prefetches/"):
                    rid = self.path.rsplit("/", 1)[-1]
                    job = stub.jobs.get(rid)
                    if job is None:
                        self._send(404, {"detail": f"unknown prefetch request_id={rid!r}"})
                    elif job[0] > 0:
                        job[0] -= 1
                        self._send(200, {"request_id": rid, "status": "pending"})
                    else:
                        del stub.jobs[rid]
                        self._send(200, {"request_id": rid, "status": "completed", "found_keys": job[1],
                                         "total_keys": job[2]})
                else:
                    self._send(404, {"detail": "Not Found"})

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if not (stub.routes and self.path == "/cache/prefetches"):
                    self._send(404, {"detail": "Not Found"})
                    return
                stub.asked.append(body)
                world = body["world_size"]
                if (body["model_name"], world) not in stub.registered:
                    self._send(503, {"detail": f"no layout registered for model_name={body['model_name']!r} "
                                               f"world_size={body['world_size']}"})
                    return
                hashes = stub.hasher.hashes(body["token_ids"])
                if not hashes:
                    self._send(202, {"chunks": 0, "status": "noop"})
                    return
                found = sum(1 for h in hashes if (body["cache_salt"], h) in stub.held) * world
                rid = os.urandom(8).hex()
                stub.jobs[rid] = [stub.pending_polls, found, len(hashes) * world]
                self._send(202, {"request_id": rid, "chunks": len(hashes), "status": "submitted"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class ServerStoreEngine(FakeEngine):
    """A FakeEngine whose store is the stub server's memory (``delay_s``: the chunks land that much later)."""

    def __init__(self, *args: Any, stub: LookupStub, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stub = stub
        self.delay_s = 0.0
        self.drop_last = False
        self.files = False  # also write the chunk files (a store with a directory tier too)

    def prefill(self, requests: list[PrefillRequest]) -> list[PrefillResult]:
        import threading
        import time

        if self.files:
            super().prefill(requests)
        else:
            self.calls.append(requests)
        pairs = []
        for req in requests:
            salt = expected_salt(req.kv_transfer_params.get("prefixshare.tenant"), req.cache_salt)
            hashes = self.hasher.hashes(req.token_ids)
            pairs += [(salt, h) for h in (hashes[:-1] if self.drop_last else hashes)]
        if self.write:
            def land() -> None:
                time.sleep(self.delay_s)
                self.stub.held.update(pairs)

            threading.Thread(target=land).start() if self.delay_s else land()
        return [PrefillResult(0) for _ in requests]


@pytest.fixture
def on_server(tmp_path: Path, tiny: Path, tokenizer: Any) -> Any:
    """A PrefixShare whose only tier is Redis (no directory to check), its server's HTTP port a LookupStub."""
    stub = LookupStub(CHUNK)
    policy = Policy.build(chunk_size=CHUNK, l2=[{"type": "resp", "host": "127.0.0.1", "port": free_port()}],
                          server={"port": free_port(), "http_port": stub.port},
                          admission={"any": [{"min_tokens": 256}, {"pinned": ["manual-*"]}]})
    ps = PrefixShare(policy, server=False)
    eng = ServerStoreEngine(tiny, tokenizer, policy, tmp_path, stub=stub)
    stub.registered.append((namespace(eng.fp), 1))
    yield ps, eng, stub
    stub.close()


def test_without_a_directory_warm_asks_the_server_which_chunks_it_holds(on_server: Any) -> None:
    ps, eng, stub = on_server
    report = warm(ps, {"guide": _docs()["guide"]}, eng, tenant="acme")
    result = report.documents[0]
    assert report.verification == "server" and result.status == "warmed"
    assert result.verified is True and result.verified_by == "server", result
    # the keys are the engine's: its namespace, the world size it registered, the store salt it stored under
    asked = stub.asked[-1]
    assert asked["model_name"] == namespace(eng.fp) and asked["world_size"] == 1 and asked["cache_salt"] == "t-acme"
    assert len(asked["token_ids"]) == result.tokens
    totals = report.to_dict()["totals"]
    assert (totals["verified"], totals["unverified"]) == (1, 0)
    # a second warm asks the server too: held, so skipped (verified), and the engine gets nothing
    calls = len(eng.calls)
    again = warm(ps, {"guide": _docs()["guide"]}, eng, tenant="acme")
    assert again.documents[0].status == "skipped" and again.documents[0].verified is True
    assert again.documents[0].verified_by == "server" and len(eng.calls) == calls


@pytest.mark.parametrize("drop_last", [False, True])
def test_chunks_the_server_does_not_hold_fail_verification(on_server: Any, drop_last: bool) -> None:
    ps, eng, stub = on_server
    eng.write, eng.drop_last = drop_last, drop_last
    with pytest.raises(WarmError) as info:
        warm(ps, {"guide": _docs()["guide"]}, eng, verify_timeout_s=0.3)
    result = info.value.report.documents[0]  # type: ignore[union-attr]
    assert result.status == "failed" and result.verified is False and result.verified_by == "server"
    held = result.chunks - 1 if drop_last else 0
    assert f"holds {held} of the {result.chunks} objects of its {result.chunks} chunks" in result.reason
    assert len(stub.asked) >= 3  # polled until the timeout, not asked once


def test_server_verification_polls_for_chunks_stored_late(on_server: Any) -> None:
    import time

    ps, eng, stub = on_server
    eng.delay_s = 0.15
    stub.pending_polls = 2
    started = time.monotonic()
    report = warm(ps, {"guide": _docs()["guide"]}, eng)
    assert report.documents[0].verified is True and time.monotonic() - started < 5
    assert len(stub.asked) >= 3  # (one in triage, then polls until the chunks landed)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ("down", "the server at http://127.0.0.1:{port} does not answer"),
        ("old", "this LMCache server has no token lookup (POST /cache/prefetches answers HTTP 404)"),
        ("unregistered", "no engine is registered with the server"),
        ("two_world_sizes", "engines of several world sizes"),
        ("small_l1", "is more than the server's memory (L1, 0.0 MiB) holds"),
        ("off", "verification was turned off (verify=False)"),
    ],
)
def test_what_the_server_cannot_check_is_reported_unverified_not_warmed_and_verified(
    on_server: Any, change: str, why: str
) -> None:
    ps, eng, stub = on_server
    port = stub.port
    if change == "down":
        stub.close()
    stub.routes = change != "old"
    if change == "unregistered":
        stub.registered.clear()
    if change == "two_world_sizes":  # engines of two parallel sizes under one namespace: which one stored?
        stub.registered.append((namespace(eng.fp), 2))
    if change == "small_l1":
        stub.l1_bytes = 1024
    report = warm(ps, {"guide": _docs()["guide"]}, eng, verify=change != "off", verify_timeout_s=1.0)
    result = report.documents[0]
    assert result.status == "warmed" and result.verified is None and result.verified_by is None, result
    assert result.reason.startswith("unverified: ") and why.format(port=port) in result.reason, result.reason
    assert report.ok and report.to_dict()["totals"]["unverified"] == 1
    assert report.to_dict()["totals"]["verified"] == 0


def test_the_server_lookup_checks_a_directory_store_too(tmp_path: Path, tiny: Path, tokenizer: Any) -> None:
    """verify='server' asks the server on any tier, an fs one included (verify=True reads the directory there)."""
    stub = LookupStub(CHUNK)
    store = tmp_path / "store"
    store.mkdir()
    policy = Policy.build(chunk_size=CHUNK, l2=[{"type": "fs", "base_path": str(store)}],
                          server={"port": free_port(), "http_port": stub.port})
    ps = PrefixShare(policy, server=False)
    eng = ServerStoreEngine(tiny, tokenizer, policy, store, stub=stub)
    eng.files = True
    stub.registered.append((namespace(eng.fp), 1))
    try:
        report = warm(ps, {"manual-a": _docs()["manual-a"]}, eng, verify="server")
        assert report.verification == "server" and len(stub.asked) == 1  # (triage read the directory)
        result = report.documents[0]
        assert result.verified is True and result.verified_by == "server"
        record = Registry(store).get(eng.fp.digest, "manual-a")
        assert record is not None and record.objects == [(0x01000100, 0)]  # the directory, scanned after
        assert warm(ps, {"manual-a": _docs()["manual-a"]}, eng).documents[0].verified_by == "fs"
    finally:
        stub.close()


def test_verify_takes_auto_fs_server_or_off(setup: Any, on_server: Any) -> None:
    from prefixshare.errors import PrefixShareError

    fs_ps, fs_eng, _ = setup
    assert warm(fs_ps, {"guide": _docs()["guide"]}, fs_eng, verify="auto").verification == "fs"
    ps, eng, _ = on_server
    with pytest.raises(PrefixShareError, match="needs an fs tier"):
        warm(ps, {"guide": _docs()["guide"]}, eng, verify="fs")
    with pytest.raises(PrefixShareError, match="use True"):
        warm(ps, {"guide": _docs()["guide"]}, eng, verify="yes")
    assert eng.calls == []  # refused before any engine work
    assert warm(ps, {"guide": _docs()["guide"]}, eng, verify=False).verification == "off"


def test_world_sizes_and_l1_are_read_from_the_servers_status() -> None:
    """/status as LMCache 0.5.6 writes it: CPU (engine-driven) registrations and CUDA ones in two sections."""
    from prefixshare.warm._lookup import l1_capacity, registered_world_sizes

    status = {"non_cuda_context_meta": {"4242": {"model_name": "ns-a", "world_size": 1, "block_size": 16}},
              "cache_context_meta": {"7": {"model_name": "ns-b", "world_size": 4, "kv_cache_layout": {}},
                                     "8": {"model_name": "ns-a", "world_size": 1}},
              "storage_manager": {"l1_capacity_bytes_by_backend": {"dram": 107374182}}}
    assert registered_world_sizes(status, "ns-a") == {1} and registered_world_sizes(status, "ns-b") == {4}
    assert registered_world_sizes(status, "ns-c") == set() and registered_world_sizes({}, "ns-a") == set()
    assert l1_capacity(status) == 107374182 and l1_capacity({}) is None


@pytest.mark.server
def test_the_lookup_reads_a_real_servers_answer(tmp_path: Path) -> None:
    """Against a real LMCache MP server (no engine): KV registered and stored through LMCache's own client
    as a CPU engine does, then asked for by token ids as warm asks (tests/e2e/test_warm_e2e.py does it on a
    resp tier with vLLM)."""
    import time
    import uuid

    import torch
    import zmq
    from lmcache.utils import EngineType
    from lmcache.v1.gpu_connector.utils import LayoutHints
    from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey
    from lmcache.v1.multiprocess.group_view import EngineGroupInfo
    from lmcache.v1.multiprocess.transfer_context import EngineDrivenTransferContext
    from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

    from prefixshare._log import get_logger
    from prefixshare.server import LMCacheServer
    from prefixshare.warm._lookup import LookupUnavailable, ServerLookup
    from prefixshare.warm._room import ServerRoom

    model, tokens, block = "prefixshare-lookup-probe", list(range(1000, 1128)), 16
    policy = Policy.build(chunk_size=32, l1={"size_gb": 0.1},
                          l2=[{"type": "fs", "base_path": str(tmp_path / "store"), "create": True}],
                          server={"port": free_port(), "http_port": free_port(), "start_timeout_s": 90})
    with LMCacheServer(policy) as server:
        with pytest.raises(LookupUnavailable, match="no engine is registered"):
            ServerLookup.open(server.http_url, model)
        zctx = zmq.Context()
        client = RequestClientFactory.create(server.url, context=zctx)
        kv = {f"layer.{i}": torch.randn((2, 16, block, 2, 64)) for i in range(2)}
        ctx = EngineDrivenTransferContext(instance_id=4242, req_client=client)
        ctx.register(kv, model, 1, 32 // block, 10.0, layout_hints=LayoutHints(kv_layout="NHD"),
                     engine_group_infos=[EngineGroupInfo(engine_group_id=0, layer_indices=(0, 1),
                                                         tokens_per_block=block)], engine_type=EngineType.VLLM)
        try:
            rid = f"store-{uuid.uuid4().hex}"
            key = IPCCacheServerKey(model_name=model, world_size=1, num_kv_readers=1, worker_id=0,
                                    token_ids=tuple(tokens[:96]), start=0, end=96, request_id=rid, cache_salt="s1")
            assert ctx.submit_store(rid, key, kv, [list(range(3, 9))], None, 32 // block).result(timeout=10)
            lookup = ServerLookup.open(server.http_url, model)
            assert lookup.world_size == 1 and lookup.l1_bytes
            deadline = time.monotonic() + 10
            held = lookup.held(tokens[:96], "s1", deadline)
            assert (held.found, held.total, held.chunks) == (3, 3, 3) and held.complete
            held = lookup.held(tokens, "s1", deadline)  # the 4th chunk was never stored
            assert (held.found, held.total, held.chunks) == (3, 4, 4) and not held.complete
            assert lookup.held(tokens[:96], "", deadline).found == 0  # another salt: other keys
            held = lookup.held(tokens[:20], "s1", deadline)  # less than a chunk
            assert (held.found, held.total, held.chunks) == (0, 0, 0) and not held.complete
            lookup.close()
            # warm's pacing reads the same /status: the memory's usage and the stores in progress
            room = ServerRoom(server.http_url, log=get_logger("test")).read()
            assert room is not None and room.total == int(0.1 * 2**30) and 0 < room.used < room.total
            assert room.watermark == 0.8 and room.idle and not room.evicting
        finally:
            ctx.unregister().result(timeout=10)
            ctx.close()
            client.close()
            zctx.term()


# --- CLI input errors (before any engine starts) -----------------------------------------------------------


def test_warm_cli_refuses_bad_input_before_starting_an_engine(cli: Any, tmp_path: Path, tiny: Path) -> None:
    from typer.testing import CliRunner

    store = tmp_path / "store"
    store.mkdir()
    policy = tmp_path / "p.yaml"
    policy.write_text(f"chunk_size: 64\nl2:\n  - type: fs\n    base_path: {store}\n"
                      f"server:\n  port: {free_port()}\n  http_port: {free_port()}\n")
    doc = tmp_path / "doc.md"
    doc.write_text("hello")
    runner = CliRunner()

    def run(*args: str) -> Any:
        return runner.invoke(cli, ["warm", *args], env={"COLUMNS": "200"})

    cases = [
        (["/no/such/file.md", "--policy", str(policy), "--model", str(tiny)], "not a file, folder or glob"),
        ([str(doc), "--policy", str(policy), "--model", str(tmp_path / "nope")], "no such directory"),
        ([str(doc), "--policy", str(policy), "--model", str(tiny), "--engine", "tgi"], "use vllm or sglang"),
        ([str(doc), "--policy", str(policy), "--model", str(tiny), "--block-size", "48"], "does not divide"),
        ([str(doc), "--policy", str(policy), "--model", str(tiny), "--template", "no placeholder"], "{document}"),
        ([str(doc), "--policy", str(tmp_path / "missing.yaml"), "--model", str(tiny)], "does not exist"),
    ]
    for args, message in cases:
        result = run(*args)
        assert result.exit_code == 2, (args, result.output)
        assert message in result.output and "Traceback" not in result.output, (args, result.output)
    memory_only = tmp_path / "mem.yaml"
    memory_only.write_text(f"chunk_size: 64\nserver:\n  port: {free_port()}\n  http_port: {free_port()}\n")
    result = run(str(doc), "--policy", str(memory_only), "--model", str(tiny))
    assert result.exit_code == 2 and "no L2 tier" in result.output
