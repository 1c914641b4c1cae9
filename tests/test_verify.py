"""Sampled verification without an engine: tasks and their tokens, the sampler, a replay's salt, the comparison,
the quarantine over a real directory tier, the HTTP replayer's parsing, the document registry's token ids, and
the command's errors. The engine paths (a real collision caught, good hits passing) are in
tests/faults/test_verification.py."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import httpx
import pytest
import typer
from typer.testing import CliRunner

from conftest import free_port
from prefixshare.adapters import PrefillRequest, PrefillResult
from prefixshare.errors import PolicyError, PrefixShareError
from prefixshare.fingerprint import EngineSettings
from prefixshare.keys import REQ_LOAD, REQ_VERIFY, ChunkHasher, chunk_file_name
from prefixshare.policies import Policy
from prefixshare.runtime import (
    ConnectorRuntime,
    HitSampler,
    VerifyTask,
    default_tolerance,
    find_task,
    keep_task,
    new_token,
    pending_tasks,
    read_stats,
    read_task,
)
from prefixshare.verify import (
    ServedReplica,
    check_task,
    compare,
    loaded_chunk_hashes,
    mismatch_records,
    parse_completion,
    quarantine,
    verify_tasks,
)

CHUNK = 64


@pytest.fixture(autouse=True)
def _own_run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test its own pending hits and stats (the suite shares one cache directory otherwise)."""
    monkeypatch.setenv("PREFIXSHARE_CACHE_DIR", str(tmp_path / "ps-cache"))


@pytest.fixture
def policy(tmp_path: Path) -> Policy:
    return Policy.build(chunk_size=CHUNK, l2=[{"type": "fs", "base_path": str(tmp_path / "store"), "create": True}],
                        server={"port": free_port(), "http_port": free_port()},
                        verify={"sample": 1.0, "max_per_minute": 600})


def task(instance: str = "unit", ids: list[int] | None = None, loaded: int = 128, **kw: Any) -> VerifyTask:
    ids = list(range(1, 201)) if ids is None else ids
    return VerifyTask(instance, "prefixshare-ns1", "req-1", ids, loaded, token=new_token(), kv_dtype="float32", **kw)


# --- tasks -----------------------------------------------------------------------------------------------------


def test_a_task_round_trips_and_is_found_only_by_its_token_and_prompt() -> None:
    t = task(store_salt="t-acme", params={"prefixshare.tenant": "acme"})
    path = keep_task(t)
    assert path.name == f"{t.token}.json" and oct(path.stat().st_mode & 0o777) == "0o640"
    assert read_task(path) == t and pending_tasks("unit") == [path]
    assert find_task("unit", t.token, t.token_ids) == t
    assert find_task("unit", t.token, t.token_ids[:-1]) is None  # another prompt: refused
    assert find_task("other", t.token, t.token_ids) is None  # another replica's hit
    for bad in ("../unit/x", new_token(), "", None, 7, t.token + "0"):
        assert find_task("unit", bad, t.token_ids) is None


@pytest.mark.parametrize(("field", "value", "message"), [
    ("format", "something/1", "not a prefixshare verify task"),
    ("token_ids", [1, -2], "token_ids"),
    ("token_ids", "1,2", "token_ids"),
    ("loaded_tokens", 0, "loaded_tokens"),
    ("loaded_tokens", 10_000, "loaded_tokens"),
    ("params", [], "params"),
    ("store_salt", 5, "store_salt"),
    ("token", "../../x", "token"),
    ("request_id", 3, "request_id"),
])
def test_a_malformed_task_is_refused(field: str, value: Any, message: str) -> None:
    raw = json.loads(task().to_json())
    raw[field] = value
    with pytest.raises(ValueError, match=message):
        VerifyTask.from_json(json.dumps(raw).encode())


def test_a_task_under_another_name_is_refused(tmp_path: Path) -> None:
    t = task()
    path = tmp_path / f"{new_token()}.json"
    path.write_bytes(t.to_json())
    with pytest.raises(ValueError, match="holds the task"):
        read_task(path)


def test_tolerance_by_kv_dtype() -> None:
    assert default_tolerance("float32") == 1e-3
    assert default_tolerance("bfloat16") == 0.1 and default_tolerance("auto") == 0.1
    assert default_tolerance("fp8_e4m3") == default_tolerance("float8_e5m2") == 0.25


# --- the sampler -------------------------------------------------------------------------------------------------


def test_the_sampler_takes_its_fraction_deterministically() -> None:
    sampler = HitSampler(0.1, 600, 64, "unit")
    ids = [f"req-{i}" for i in range(4000)]
    chosen = [i for i in ids if sampler.chosen(i)]
    assert 300 < len(chosen) < 500  # 10 % of 4000, within a wide margin
    assert chosen == [i for i in ids if HitSampler(0.1, 600, 64, "unit").chosen(i)]
    assert all(HitSampler(1.0, 6, 1, "u").chosen(i) for i in ids[:50])


def test_the_sampler_is_bounded_by_rate_and_by_pending_hits() -> None:
    by_rate = HitSampler(1.0, 2, 100, "rate")  # a bucket of 2, refilled at 2 a minute
    assert [by_rate.admit() for _ in range(3)] == [None, None, "rate"]
    by_queue = HitSampler(1.0, 600, 2, "queue")
    for _ in range(2):
        assert by_queue.admit() is None
        keep_task(task("queue"))
    assert by_queue.admit() == "pending"


# --- the connector's side: sampling hits and replaying them -------------------------------------------------------


@pytest.fixture
def runtime(tmp_path: Path, policy: Policy) -> ConnectorRuntime:
    from prefixshare.model import ensure_model

    model = ensure_model(tmp_path.parent / "verify-model", shape="tiny", seed=0)
    settings = EngineSettings(engine="vllm", kv_layout="vllm/cpu/NHD", kv_dtype="float32", block_size=32)
    extra = {"prefixshare.policy": policy.to_dict(), "prefixshare.instance": "replica-a"}
    return ConnectorRuntime(extra, model_dir=str(model), settings=settings, role="scheduler")


def test_a_hit_is_set_aside_and_its_replay_is_keyed_like_the_request(runtime: ConnectorRuntime) -> None:
    ids = list(range(300))
    info = runtime.begin("r1", ids, {"prefixshare.tenant": "acme", "prefixshare.document_id": "manual"})
    salt = runtime.salt(info, "t-acme")
    runtime.lookup_done(info, 256, 0.01)
    info.loaded_tokens = 256
    assert runtime.sample_hit(info, ids, cache_salt="t-acme", store_salt=salt, first_token=7,
                              params={"prefixshare.tenant": "acme", "prefixshare.document_id": "manual", "x": 1})
    [path] = pending_tasks("replica-a")
    kept = read_task(path)
    assert (kept.store_salt, kept.first_token, kept.loaded_tokens) == ("t-acme", 7, 256)
    assert kept.params == {"prefixshare.tenant": "acme", "prefixshare.document_id": "manual"}
    # a replay with a fresh engine salt is keyed with the request's store salt, loads, and stores nothing
    replay = runtime.begin("v1", ids, {REQ_VERIFY: kept.token, REQ_LOAD: "always", "prefixshare.tenant": "acme"})
    assert replay.verify_run and not replay.admitted and runtime.salt(replay, "verify-1234-load") == "t-acme"
    assert runtime.load_mode(replay) == "always"
    replay.loaded_tokens = 256
    assert not runtime.sample_hit(replay, ids, cache_salt=None, store_salt="t-acme", first_token=7, params={})
    # a token for another prompt (or none of this replica's) loads nothing, under the engine's own salt
    other = runtime.begin("v2", ids[:-1], {REQ_VERIFY: kept.token, REQ_LOAD: "always"})
    assert runtime.load_mode(other) == "never" and not other.admitted
    assert runtime.salt(other, "verify-x") == "r-verify-x"  # the engine's own salt, as a request salt alone
    runtime.publish(force=True)
    assert read_stats("replica-a")["verify"]["sampled"] == 1


def test_a_lora_hit_is_not_set_aside(runtime: ConnectorRuntime) -> None:
    info = runtime.begin("r1", list(range(300)), None)
    info.loaded_tokens = 256
    assert not runtime.sample_hit(info, list(range(300)), cache_salt=None, store_salt=None, first_token=1,
                                  params=None, lora=True)
    runtime.publish(force=True)
    assert read_stats("replica-a")["verify"]["dropped"] == {"lora": 1}


# --- comparison -----------------------------------------------------------------------------------------------


def result(first: int, logprobs: dict[int, float], cached: int = 0) -> PrefillResult:
    return PrefillResult(cached, first, logprobs)


def test_compare_passes_equal_runs_and_a_near_tie_and_fails_foreign_kv() -> None:
    cold = result(5, {5: -0.70, 9: -0.71, 2: -3.0})
    assert compare(result(5, {5: -0.7001, 9: -0.7099, 2: -3.0}), cold, 1e-3).ok
    swapped = compare(result(9, {9: -0.7050, 5: -0.7052}), cold, 0.01)  # a tie decided the other way
    assert swapped.ok and swapped.load_token == 9 and swapped.cold_token == 5
    foreign = compare(result(5, {5: -2.5, 3: -0.2}), cold, 0.1)
    assert not foreign.ok and "log-probability -2.5000 loaded vs -0.7000 cold" in foreign.reason
    missing = compare(result(3, {3: -0.1}), cold, 0.1)
    assert not missing.ok and math.isinf(missing.max_diff) and missing.to_dict()["max_diff"] is None
    assert not compare(PrefillResult(0), cold, 0.1).ok


# --- quarantine over a real directory tier -----------------------------------------------------------------------


def _write_chunks(store: Path, namespace: str, hashes: list[str], salt: str = "") -> list[Path]:
    store.mkdir(parents=True, exist_ok=True)
    paths = []
    for h in hashes:
        path = store / chunk_file_name(namespace, (1 << 24) | (1 << 8), 0, h, salt)
        path.write_bytes(b"kv")
        paths.append(path)
    return paths


def test_the_chunks_a_request_loaded_are_all_its_whole_chunks_it_touched(policy: Policy) -> None:
    ids = list(range(1, 641))
    hashes = ChunkHasher(CHUNK).hashes(ids)
    assert len(hashes) == 10
    assert loaded_chunk_hashes(policy, task(ids=ids, loaded=639)) == hashes  # all but the last token
    assert loaded_chunk_hashes(policy, task(ids=ids, loaded=128)) == hashes[:2]
    assert loaded_chunk_hashes(policy, task(ids=ids[:150], loaded=129)) == hashes[:2]  # no partial chunk


def test_quarantine_sets_aside_exactly_the_loaded_chunks_and_records_why(policy: Policy, tmp_path: Path) -> None:
    store = tmp_path / "store"
    ids = list(range(1, 321))
    hashes = ChunkHasher(CHUNK).hashes(ids)
    t = task(ids=ids, loaded=192, store_salt="t-acme")
    loaded = _write_chunks(store, t.namespace, hashes[:3], "t-acme")
    later = _write_chunks(store, t.namespace, hashes[3:], "t-acme")  # not loaded by the request
    other_salt = _write_chunks(store, t.namespace, hashes[:3], "t-guest")
    other_ns = _write_chunks(store, "prefixshare-ns2", hashes[:3], "t-acme")
    q = quarantine(policy, t, {"reason": "unit"})
    assert q.chunks == 3 and sorted(q.files) == sorted(map(str, loaded))
    assert all(not p.exists() and p.with_name(p.name + ".corrupt").exists() for p in loaded)
    assert all(p.exists() for p in later + other_salt + other_ns)
    assert q.server_deleted == 0 and "does not answer" in (q.server_error or "")  # no server here: reported
    [record] = mismatch_records(policy)
    assert record["namespace"] == t.namespace and record["quarantined"]["files"] == 3
    assert record["comparison"] == {"reason": "unit"}


def test_doctor_lists_what_verification_found(policy: Policy) -> None:
    from prefixshare.store import doctor

    [check] = [c for c in doctor(policy).checks if c.name == "verification"]
    assert check.status == "ok" and check.data["mismatches"] == 0
    quarantine(policy, task(), {"reason": "first token differs"})
    [check] = [c for c in doctor(policy).checks if c.name == "verification"]
    assert check.status == "warn" and check.data["namespaces"] == ["prefixshare-ns1"]
    assert "first token differs" in check.message and "weights: headers" in check.fix
    off = policy.model_copy(update={"verify": policy.verify.model_copy(update={"sample": 0.0})})
    [check] = [c for c in doctor(off).checks if c.name == "verification"]
    assert check.status == "warn"  # the records stay until removed, even with sampling off


# --- check_task with a scripted replica ----------------------------------------------------------------------------


class Scripted:
    """A replica whose answers are given: records what it was asked."""

    kind = "vllm"

    def __init__(self, answers: list[PrefillResult], reset: bool = True) -> None:
        self.answers, self.asked, self.resets, self.reset = list(answers), [], 0, reset

    def prefill(self, requests: list[PrefillRequest]) -> list[PrefillResult]:
        self.asked.extend(requests)
        return [self.answers.pop(0) for _ in requests]

    def reset_prefix_cache(self) -> bool:
        self.resets += 1
        return self.reset


def test_a_good_hit_is_replayed_with_fresh_salts_and_passes(policy: Policy) -> None:
    t = task(loaded=128, params={"prefixshare.tenant": "acme"})
    replica = Scripted([result(5, {5: -0.5}, 128), result(5, {5: -0.5002}, 0)])
    check = check_task(replica, policy, t)
    assert check.verdict == "ok" and check.reloaded_tokens == 128 and replica.resets == 0
    load, cold = replica.asked
    assert load.kv_transfer_params == {"prefixshare.tenant": "acme", REQ_VERIFY: t.token, REQ_LOAD: "always"}
    assert cold.kv_transfer_params[REQ_LOAD] == "never"
    assert load.cache_salt != cold.cache_salt and load.cache_salt.startswith("verify-")  # neither hits the other
    assert load.top_logprobs == policy.verify.top_logprobs


@pytest.mark.parametrize(("answers", "reason"), [
    ([result(5, {5: -0.5}, 64)], "the store no longer holds what the request loaded (64 of 128"),
    ([result(5, {5: -0.5}, 128), result(5, {5: -0.5}, 32)], "the recompute was not cold"),
])
def test_a_hit_that_cannot_be_replayed_is_unverifiable(policy: Policy, answers: list[PrefillResult],
                                                       reason: str) -> None:
    check = check_task(Scripted(answers), policy, task(loaded=128))
    assert check.verdict == "unverifiable" and check.reason.startswith(reason) and check.quarantined is None


def test_a_mismatch_quarantines_and_empties_the_replicas_cache(policy: Policy, tmp_path: Path) -> None:
    ids = list(range(1, 201))
    t = task(ids=ids, loaded=128)
    files = _write_chunks(tmp_path / "store", t.namespace, ChunkHasher(CHUNK).hashes(ids)[:2])
    keep_task(t)
    replica = Scripted([result(5, {5: -3.0, 8: -0.1}, 128), result(8, {8: -0.1, 5: -1.0}, 0)], reset=False)
    report = verify_tasks(replica, policy, "unit")
    [check] = report.checks
    assert report.verdict == "mismatch" and check.verdict == "mismatch" and check.engine_cache_reset is False
    assert check.quarantined is not None and len(check.quarantined.files) == 2
    assert all(not p.exists() for p in files) and replica.resets == 1
    assert pending_tasks("unit") == []  # judged: never replayed again
    assert read_stats("unit")["verify"]["mismatch"] == 1


def test_verification_stops_at_its_limit_and_leaves_the_rest_pending(policy: Policy) -> None:
    for _ in range(3):
        keep_task(task())
    replica = Scripted([result(5, {5: -0.5}, 128), result(5, {5: -0.5}, 0)])
    report = verify_tasks(replica, policy, "unit", limit=1)
    assert (len(report.checks), report.pending, report.verdict) == (1, 2, "ok") and len(pending_tasks("unit")) == 2


# --- the HTTP replayer -------------------------------------------------------------------------------------------


def completion(first: int, top: dict[int, float], stats: dict[str, int] | None = None,
               usage: dict[str, Any] | None = None) -> dict[str, Any]:
    data: dict[str, Any] = {"choices": [{"logprobs": {"tokens": [f"token_id:{first}"],
                                                      "top_logprobs": [{f"token_id:{t}": lp for t, lp in top.items()}]}}]}
    if stats is not None:
        data["kv_transfer_params"] = {"cached_token_stats": stats}
    if usage is not None:
        data["usage"] = usage
    return data


def test_a_completion_says_what_was_not_computed_and_the_first_tokens_logprobs() -> None:
    stats = {"num_vllm_cached_tokens": 0, "num_lmcache_cached_tokens": 639, "num_lmcache_extra_cached_tokens": 639}
    parsed = parse_completion(completion(7, {7: -0.25, 3: -2.0}, stats))
    assert parsed == PrefillResult(639, 7, {7: -0.25, 3: -2.0})
    by_usage = parse_completion(completion(7, {7: -0.25}, usage={"prompt_tokens_details": {"cached_tokens": 32}}))
    assert by_usage.cached_tokens == 32
    with pytest.raises(PrefixShareError, match="connector attached"):
        parse_completion(completion(7, {7: -0.25}))
    with pytest.raises(PrefixShareError, match="not a token id"):
        parse_completion({"choices": [{"logprobs": {"tokens": ["hello"], "top_logprobs": [{}]}}]})


def test_the_served_replica_sends_the_replay_as_vllm_serve_takes_it() -> None:
    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "/models/tiny"}]})
        if request.url.path == "/reset_prefix_cache":
            return httpx.Response(404)
        seen.append(json.loads(request.content))
        return httpx.Response(200, json=completion(7, {7: -0.1}, {"num_vllm_cached_tokens": 0,
                                                                   "num_lmcache_extra_cached_tokens": 64}))

    replica = ServedReplica("http://replica:8000/", transport=httpx.MockTransport(handler))
    [res] = replica.prefill([PrefillRequest([1, 2, 3], {REQ_VERIFY: "t"}, "verify-1-load", top_logprobs=5)])
    assert res == PrefillResult(64, 7, {7: -0.1})
    body = seen[0]
    assert body["model"] == "/models/tiny" and body["prompt"] == [1, 2, 3] and body["max_tokens"] == 1
    assert body["cache_salt"] == "verify-1-load" and body["logprobs"] == 5 and body["return_tokens_as_token_ids"]
    assert body["kv_transfer_params"] == {REQ_VERIFY: "t", "cached_token_stats": True}
    assert replica.reset_prefix_cache() is False  # no dev routes: said, not raised


def test_a_replica_that_does_not_answer_is_named() -> None:
    with pytest.raises(PrefixShareError, match="does not list its model"):
        ServedReplica(f"http://127.0.0.1:{free_port()}")


# --- the registry's prefix ids ----------------------------------------------------------------------------------


def test_a_document_record_holds_its_prefix_ids_checked_against_its_digest() -> None:
    from prefixshare.warm import DocumentRecord
    from prefixshare.warm._registry import encode_ids
    from prefixshare.warm._template import tokens_digest

    ids = [5, 70000, 3, 2**31]
    fields = dict(id="d", text_hash="x", template_digest="t", prefix_digest=tokens_digest(ids), tokens=4,
                  chunk_tokens=0, chunk_size=64, chunks=0, chunk_hashes=[], bytes=0, fingerprint="ab" * 8,
                  namespace="prefixshare-ab", warmed_at="now", host="h")
    assert DocumentRecord(**fields, prefix_ids=encode_ids(ids)).prefix_token_ids() == ids
    assert DocumentRecord(**fields).prefix_token_ids() is None  # an earlier version's record
    assert DocumentRecord(**fields, prefix_ids=encode_ids([5, 70000, 3, 1])).prefix_token_ids() is None
    assert DocumentRecord(**fields, prefix_ids="not base64!").prefix_token_ids() is None


def test_choosing_documents() -> None:
    from types import SimpleNamespace

    from prefixshare.verify._documents import choose

    records: Any = [SimpleNamespace(id=f"doc{i}") for i in range(6)]
    assert [r.id for r in choose(records, sample=None, document=None)] == [f"doc{i}" for i in range(6)]
    assert [r.id for r in choose(records, sample=None, document="doc3")] == ["doc3"]
    picked = [r.id for r in choose(records, sample=2, document=None, seed=1)]
    assert len(picked) == 2 and picked == [r.id for r in choose(records, sample=2, document=None, seed=1)]
    with pytest.raises(PrefixShareError, match="doc0, doc1"):
        choose(records, sample=None, document="nope")


# --- policy and command line ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("field", "value"), [("sample", 1.5), ("sample", -0.1), ("max_pending", 0),
                                              ("top_logprobs", 50), ("tolerance", 0)])
def test_a_bad_verify_setting_names_the_field(field: str, value: Any) -> None:
    with pytest.raises(PolicyError, match=f"verify.{field}"):
        Policy.build(verify={field: value})


def test_verification_is_off_by_default() -> None:
    assert not Policy.build().verify.enabled


@pytest.mark.parametrize(("args", "message"), [
    ([], "give --url URL"),
    (["--url", "http://x", "--model", "m"], "give --url URL"),
    (["--url", "http://x", "--sample", "2"], "use them with --model"),
    (["--model", "m", "--sample", "2", "--document", "d"], "not both"),
    (["--model", "/no/such/model"], "no such directory"),
])
def test_the_command_refuses_bad_arguments(cli: typer.Typer, policy: Policy, tmp_path: Path, args: list[str],
                                           message: str) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(json.dumps(policy.to_dict()))  # JSON is YAML
    res = CliRunner().invoke(cli, ["verify", "--policy", str(path), *args])
    assert res.exit_code == 2, res.output
    assert message in " ".join(res.output.split())


def test_the_command_with_nothing_pending_does_not_contact_the_replica(cli: typer.Typer, policy: Policy,
                                                                      tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(json.dumps(policy.to_dict()))  # JSON is YAML
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: contacting it would fail
    res = CliRunner().invoke(cli, ["verify", "--policy", str(path), "--url", url, "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["verdict"] == "none"
