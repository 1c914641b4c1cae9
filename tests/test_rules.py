"""Admission rules: behaviour, reasons, composition laws, config round trip, errors, thread safety."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from prefixshare.errors import PolicyError
from prefixshare.policies import (
    TTL,
    AdmissionRequest,
    AllOf,
    Always,
    AnyOf,
    ByteBudget,
    Decision,
    Frequency,
    MinTokens,
    Never,
    Not,
    Pinned,
    Rule,
    TenantAllow,
    parse_duration,
    parse_size,
    rule_from_config,
)
from prefixshare._units import _exact_duration, _exact_size


def req(prompt_tokens: int = 1000, **kw: Any) -> AdmissionRequest:
    kw.setdefault("now", 1_000_000.0)
    return AdmissionRequest(prompt_tokens=prompt_tokens, **kw)


# --------------------------------------------------------------------------------------------------
# Strategies
# --------------------------------------------------------------------------------------------------

DOCS = ["manual-1", "manual-22", "codebase", "faq", "Manual-3", "x"]
TENANTS = ["acme", "globex", "guest"]

requests = st.builds(
    AdmissionRequest,
    prompt_tokens=st.integers(0, 3000),
    document_id=st.none() | st.sampled_from(DOCS),
    tenant=st.none() | st.sampled_from(TENANTS),
    prefix_digest=st.none() | st.sampled_from(["d1", "d2", "d3"]),
    kv_bytes=st.integers(0, 10**6),
    now=st.floats(0, 1e7, allow_nan=False),
    created_at=st.none() | st.floats(0, 1e7, allow_nan=False),
)

durations = st.integers(1, 10**8) | st.floats(1e-3, 1e9, allow_nan=False)
stateless_leaves = st.one_of(
    st.builds(MinTokens, st.integers(1, 3000)),
    st.lists(st.sampled_from(["manual-*", "codebase", "f?q", "*", "[mx]*"]), min_size=1, max_size=3).map(
        lambda g: Pinned(*g)
    ),
    st.builds(TTL, durations),
    st.lists(st.sampled_from(TENANTS), min_size=1, max_size=3).map(lambda t: TenantAllow(*t)),
    st.just(Always()),
    st.just(Never()),
)
# Fresh stateful rules: fine for structure (config, equality), never called in law tests.
all_leaves = (
    stateless_leaves
    | st.builds(Frequency, st.integers(1, 50), durations, max_keys=st.integers(1, 10**6))
    | st.builds(ByteBudget, st.integers(1, 10**15), st.sampled_from(["total", "document", "tenant"]))
)


def trees(leaves: st.SearchStrategy[Rule]) -> st.SearchStrategy[Rule]:
    return st.recursive(
        leaves,
        lambda children: st.one_of(
            st.lists(children, min_size=1, max_size=4).map(lambda rs: AllOf(*rs)),
            st.lists(children, min_size=1, max_size=4).map(lambda rs: AnyOf(*rs)),
            children.map(Not),
        ),
        max_leaves=12,
    )


rules = trees(stateless_leaves)
any_rules = trees(all_leaves)


def admits(rule: Rule, r: AdmissionRequest) -> bool:
    return bool(rule(r))


# --------------------------------------------------------------------------------------------------
# Requests and decisions
# --------------------------------------------------------------------------------------------------


def test_decision_is_truthy_when_admitted() -> None:
    assert Decision(True, "ok", "x") and not Decision(False, "no", "x")
    with pytest.raises(AttributeError):
        Decision(True, "ok").admit = False  # type: ignore[misc]


def test_request_defaults_and_validation() -> None:
    before = time.time()
    r = AdmissionRequest(prompt_tokens=10)
    assert before <= r.now <= time.time()
    assert (r.document_id, r.tenant, r.prefix_digest, r.kv_bytes, r.created_at) == (None, None, None, 0, None)
    for bad in ({"prompt_tokens": -1}, {"prompt_tokens": 1, "kv_bytes": -5}, {"prompt_tokens": True}):
        with pytest.raises(ValueError):
            AdmissionRequest(**bad)


# --------------------------------------------------------------------------------------------------
# Leaf rules
# --------------------------------------------------------------------------------------------------


def test_min_tokens() -> None:
    rule = MinTokens(256)
    assert rule(req(120)) == Decision(False, "min_tokens: 120 < 256", "min_tokens")
    assert rule(req(256)) == Decision(True, "min_tokens: 256 >= 256", "min_tokens")


def test_pinned() -> None:
    rule = Pinned("manual-*", "codebase")
    assert rule(req(document_id="manual-7")) == Decision(True, "pinned: doc 'manual-*'", "pinned")
    assert rule(req(document_id="codebase")).reason == "pinned: doc 'codebase'"
    assert rule(req(document_id="faq")) == Decision(False, "not pinned", "pinned")
    assert not rule(req(document_id="Manual-7"))  # case-sensitive on every platform
    assert rule(req()) == Decision(False, "not pinned: no document_id", "pinned")


def test_tenant_allow() -> None:
    rule = TenantAllow("acme", "globex")
    assert rule(req(tenant="acme")) == Decision(True, "tenant_allow: 'acme'", "tenant_allow")
    assert rule(req(tenant="guest")) == Decision(False, "tenant_allow: 'guest' not allowed", "tenant_allow")
    assert rule(req()) == Decision(False, "tenant_allow: no tenant", "tenant_allow")


def test_ttl() -> None:
    rule = TTL(3600)
    assert rule(req(now=7200.0)) == Decision(True, "ttl: no created_at", "ttl")
    assert rule(req(now=7200.0, created_at=0.0)) == Decision(False, "ttl: expired 3600s ago", "ttl")
    assert rule(req(now=3600.0, created_at=0.0)) == Decision(True, "ttl: age 3600s <= 3600s", "ttl")  # boundary
    assert rule(req(now=3600.5, created_at=0.0)).reason == "ttl: expired 0.5s ago"
    assert TTL("7d").seconds == 7 * 86400


def test_always_never() -> None:
    assert Always()(req()) == Decision(True, "always", "always")
    assert Never()(req()) == Decision(False, "never", "never")


# --------------------------------------------------------------------------------------------------
# Frequency
# --------------------------------------------------------------------------------------------------


def test_frequency_window() -> None:
    rule = Frequency(3, 10)
    seen = lambda now: rule(req(prefix_digest="p", now=now))  # noqa: E731
    assert seen(0.0) == Decision(False, "frequency: seen 1 < 3 in 10s", "frequency")
    assert not seen(4.0)
    assert seen(10.0) == Decision(True, "frequency: seen 3 >= 3 in 10s", "frequency")  # t=0 is still within 10s
    assert seen(12.0)  # 4, 10, 12
    assert not seen(100.0)  # everything older than 90 expired
    assert rule.count(req(prefix_digest="p", now=100.0)) == 1
    assert rule.count(req(prefix_digest="p", now=200.0)) == 0  # count() records nothing
    assert rule.count(req(prefix_digest="other", now=100.0)) == 0


def test_frequency_keys() -> None:
    rule = Frequency(2, "1h")
    assert rule.window_s == 3600.0
    assert not rule(req(prefix_digest="d", document_id="doc", now=1.0))
    assert not rule(req(document_id="doc", now=2.0))  # keyed by digest first, document_id only without one
    assert rule(req(prefix_digest="d", now=3.0))
    assert rule(req(document_id="doc", now=4.0))
    assert rule(req(now=5.0)) == Decision(False, "frequency: no prefix_digest or document_id", "frequency")
    rule.reset()
    assert rule.tracked_keys == 0 and not rule(req(prefix_digest="d", now=6.0))


def test_frequency_lru_bound() -> None:
    rule = Frequency(2, 1000, max_keys=2)
    for key in ("a", "b", "a", "c"):  # "a" was touched after "b": "b" is the least recently seen
        rule(req(prefix_digest=key, now=1.0))
    assert rule.tracked_keys == 2
    assert rule.count(req(prefix_digest="b", now=1.0)) == 0
    assert rule.count(req(prefix_digest="a", now=1.0)) == 2
    assert rule(req(prefix_digest="a", now=2.0))
    assert not rule(req(prefix_digest="b", now=2.0))  # forgotten: must be seen n times again


def test_frequency_logs_once_when_full() -> None:
    rule = Frequency(1, 10, max_keys=1)
    with capture_logs() as logs:
        for key in "abcd":
            rule(req(prefix_digest=key, now=1.0))
    assert [entry["event"] for entry in logs] == ["frequency.table_full"]


def test_frequency_thread_safety_exact_count() -> None:
    n, threads, calls, keys = 5, 16, 500, 10
    rule = Frequency(n, 10**9)
    admitted = [0] * threads
    barrier = threading.Barrier(threads)

    def work(t: int) -> None:
        barrier.wait()
        for i in range(calls):
            if rule(req(prefix_digest=f"k{i % keys}", now=1000.0)):
                admitted[t] += 1

    pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    # Each key is seen threads*calls/keys times; all but its first n-1 sightings are admitted.
    assert sum(admitted) == threads * calls - keys * (n - 1)
    assert rule.tracked_keys == keys


def test_frequency_thread_safety_with_eviction() -> None:
    rule = Frequency(2, 10**9, max_keys=8)
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            for i in range(400):
                rule(req(prefix_digest=f"k{(i * 7 + t) % 50}", now=1.0))
        except BaseException as exc:  # pragma: no cover - the failure we look for
            errors.append(exc)

    pool = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    assert not errors and rule.tracked_keys == 8


# --------------------------------------------------------------------------------------------------
# ByteBudget
# --------------------------------------------------------------------------------------------------


def test_byte_budget_per_tenant() -> None:
    rule = ByteBudget("1KB", per="tenant")
    assert rule.max_bytes == 1000
    a1 = req(tenant="acme", prefix_digest="a1", kv_bytes=600)
    a2 = req(tenant="acme", prefix_digest="a2", kv_bytes=600)
    assert rule(a1) == Decision(True, "byte_budget: tenant 'acme' 0+600 <= 1000 bytes", "byte_budget")
    assert rule(a1)  # checking records nothing
    assert rule.commit(a1) is True
    assert rule(a2) == Decision(False, "byte_budget: tenant 'acme' 600+600 > 1000 bytes", "byte_budget")
    assert rule(req(tenant="globex", kv_bytes=600))  # another bucket
    assert rule(req(kv_bytes=600)).reason == "byte_budget: tenant <none> 0+600 <= 1000 bytes"
    assert rule(a1) == Decision(True, "byte_budget: already counted", "byte_budget")
    assert rule.commit(a1) is False and rule.used(a1) == 600  # a digest is counted once
    assert rule.release("a1") == 600
    assert rule.used(a1) == 0 and rule(a2)
    assert rule.release("a1") == 0  # unknown digest: nothing


def test_byte_budget_per_document_and_total() -> None:
    per_doc = ByteBudget(1000, per="document")
    per_doc.commit(req(document_id="m", kv_bytes=700))
    per_doc.commit(req(document_id="m", kv_bytes=200))
    per_doc.commit(req(document_id="n", kv_bytes=50))
    assert per_doc.usage() == {"m": 900, "n": 50}
    assert not per_doc(req(document_id="m", kv_bytes=101)) and per_doc(req(document_id="m", kv_bytes=100))
    assert per_doc.used() == 950

    total = ByteBudget("1KiB")
    assert total.max_bytes == 1024
    for tenant, size in (("a", 500), ("b", 500)):
        total.commit(req(tenant=tenant, kv_bytes=size))
    assert total.usage() == {None: 1000}
    assert total(req(kv_bytes=24)).reason == "byte_budget: total 1000+24 <= 1024 bytes"
    assert not total(req(kv_bytes=25))
    # Release without a digest: the request's kv_bytes from its bucket, never below zero.
    assert total.release(req(kv_bytes=400)) == 400 and total.used() == 600
    assert total.release(req(kv_bytes=10**6)) == 600 and total.usage() == {}
    total.commit(req(kv_bytes=5))
    total.reset()
    assert total.usage() == {}


def test_byte_budget_commit_past_budget_is_recorded_and_logged() -> None:
    rule = ByteBudget(100)
    with capture_logs() as logs:
        rule.commit(req(kv_bytes=150))
    assert rule.used() == 150
    assert logs and logs[0]["event"] == "byte_budget.over" and logs[0]["used_bytes"] == 150


def test_byte_budget_thread_safety_exact_totals() -> None:
    rule = ByteBudget("1TB", per="tenant")

    def work(t: int) -> None:
        for i in range(1000):
            rule.commit(req(tenant=TENANTS[i % 3], prefix_digest=f"{t}-{i}", kv_bytes=1))
            if i % 2:
                rule.release(f"{t}-{i}")

    pool = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    assert rule.used() == 8 * 500
    assert sum(rule.usage().values()) == 4000


# --------------------------------------------------------------------------------------------------
# Composition
# --------------------------------------------------------------------------------------------------


def test_operators_build_flat_composites() -> None:
    a, b, c = MinTokens(1), TTL(5), Pinned("x")
    assert (a & b) & c == a & (b & c) == AllOf(a, b, c)
    assert (a | b) | c == a | (b | c) == AnyOf(a, b, c)
    assert AllOf(AllOf(a, b), c).rules == (a, b, c)
    assert (a & b) | c == AnyOf(AllOf(a, b), c)  # different kinds are not flattened
    assert ~a == Not(a) and ~~a is a
    assert a & b != b & a  # structure is ordered (admit value is not: see the laws below)


def test_repr() -> None:
    rule = MinTokens(256) & (Pinned("manual-*") | Frequency(2, "1h")) & ~TenantAllow("guest")
    assert repr(rule) == (
        "MinTokens(256) & (Pinned('manual-*') | Frequency(n=2, window_s=3600.0)) & ~TenantAllow('guest')"
    )
    assert repr(~(MinTokens(1) | Never())) == "~(MinTokens(1) | Never())"
    assert repr(AllOf(Always())) == "AllOf(Always())"
    assert repr(ByteBudget("50GB", per="tenant")) == "ByteBudget(max_bytes=50000000000, per='tenant')"
    assert repr(Frequency(1, 2, max_keys=3)) == "Frequency(n=1, window_s=2.0, max_keys=3)"
    assert repr(TTL(60)) == "TTL(60.0)"


def test_composite_reasons() -> None:
    small, pinned = MinTokens(256), Pinned("manual-*")
    r = req(100, document_id="manual-1")
    assert (small & pinned)(r) == Decision(False, "min_tokens: 100 < 256", "min_tokens")
    assert (pinned & Always())(r) == Decision(True, "pinned: doc 'manual-*'; always", "all")
    assert (small | pinned)(r) == Decision(True, "pinned: doc 'manual-*'", "pinned")
    assert (small | Never())(r) == Decision(False, "min_tokens: 100 < 256; never", "any")
    assert (~small)(r) == Decision(True, "not(min_tokens: 100 < 256)", "not")


def test_composites_short_circuit() -> None:
    freq = Frequency(1, 10)
    assert not (Never() & freq)(req(prefix_digest="p"))
    assert (Always() | freq)(req(prefix_digest="p"))
    assert freq.tracked_keys == 0


def test_equality_ignores_state() -> None:
    used = Frequency(2, 10)
    used(req(prefix_digest="p"))
    assert used == Frequency(2, 10) and hash(used) == hash(Frequency(2, 10))
    budget = ByteBudget(10)
    budget.commit(req(kv_bytes=3))
    assert budget == ByteBudget(10) and budget != ByteBudget(10, per="tenant")
    assert Frequency(2, 10) != Frequency(3, 10) != Frequency(3, 10, max_keys=5)
    assert MinTokens(5) != TTL(5) and MinTokens(5) != 5
    assert len({MinTokens(5), MinTokens(5), Pinned("a", "b"), Pinned("a", "b")}) == 2


@given(rules, rules, requests)
def test_de_morgan(a: Rule, b: Rule, r: AdmissionRequest) -> None:
    assert admits(~(a & b), r) == admits(~a | ~b, r)
    assert admits(~(a | b), r) == admits(~a & ~b, r)


@given(rules, requests)
def test_double_negation_and_idempotence(a: Rule, r: AdmissionRequest) -> None:
    assert admits(Not(Not(a)), r) == admits(~~a, r) == admits(a, r)
    assert admits(a & a, r) == admits(a | a, r) == admits(a, r)
    assert admits(~a, r) != admits(a, r)


@given(rules, rules, rules, requests)
def test_commutativity_associativity_distributivity(a: Rule, b: Rule, c: Rule, r: AdmissionRequest) -> None:
    assert admits(a & b, r) == admits(b & a, r)
    assert admits(a | b, r) == admits(b | a, r)
    assert admits(AllOf(AllOf(a, b), c), r) == admits(AllOf(a, AllOf(b, c)), r)
    assert admits(AnyOf(AnyOf(a, b), c), r) == admits(AnyOf(a, AnyOf(b, c)), r)
    assert admits(a & (b | c), r) == admits((a & b) | (a & c), r)
    assert admits(a | (b & c), r) == admits((a | b) & (a | c), r)


@given(rules, requests)
def test_always_never_identities(a: Rule, r: AdmissionRequest) -> None:
    assert admits(a & Always(), r) == admits(Always() & a, r) == admits(a, r)
    assert admits(a | Never(), r) == admits(Never() | a, r) == admits(a, r)
    assert not admits(a & Never(), r)
    assert admits(a | Always(), r)
    assert admits(~Never(), r) and not admits(~Always(), r)


@given(st.lists(rules, min_size=1, max_size=5), requests)
def test_composites_agree_with_all_any(children: list[Rule], r: AdmissionRequest) -> None:
    decisions = [child(r) for child in children]
    all_of, any_of = AllOf(*children)(r), AnyOf(*children)(r)
    assert all_of.admit == all(decisions)
    assert any_of.admit == any(decisions)
    if not all_of.admit:
        assert all_of.reason == next(d.reason for d in decisions if not d.admit)
    if any_of.admit:
        assert any_of.reason == next(d.reason for d in decisions if d.admit)


# --------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------

EXAMPLE = """
admission:
  all:
    - min_tokens: 256
    - any:
        - pinned: ["manual-*", "codebase"]
        - frequency: {n: 2, window: 1h}
    - not: {tenant_allow: [guest]}
    - byte_budget: {max: 50GB, per: tenant}
    - ttl: 7d
"""


def test_parse_example() -> None:
    rule = rule_from_config(yaml.safe_load(EXAMPLE)["admission"])
    assert rule == AllOf(
        MinTokens(256),
        Pinned("manual-*", "codebase") | Frequency(2, 3600),
        ~TenantAllow("guest"),
        ByteBudget(50 * 10**9, per="tenant"),
        TTL(7 * 86400),
    )
    assert rule.to_config() == yaml.safe_load(EXAMPLE)["admission"]


def test_parse_shorthands() -> None:
    assert rule_from_config("always") == Always()
    assert rule_from_config({"never": None}) == Never()
    assert rule_from_config({"always": True}) == Always()
    assert rule_from_config({"pinned": "codebase"}) == Pinned("codebase")
    assert rule_from_config({"byte_budget": "512MiB"}) == ByteBudget(512 * 2**20, per="total")
    assert rule_from_config({"ttl": 90}) == TTL("90s")
    assert rule_from_config({"frequency": {"n": 3, "window": "15m", "max_keys": 10}}) == Frequency(3, 900, max_keys=10)
    rule = MinTokens(5)
    assert rule_from_config(rule) is rule


@settings(max_examples=150)
@given(any_rules)
def test_config_round_trip(rule: Rule) -> None:
    config = rule.to_config()
    assert rule_from_config(config) == rule
    assert rule_from_config(json.loads(json.dumps(config))) == rule
    assert rule_from_config(yaml.safe_load(yaml.safe_dump(config))) == rule
    assert rule_from_config(config).to_config() == config


def problems_of(config: Any, loc: str = "admission") -> list[Any]:
    with pytest.raises(PolicyError) as info:
        rule_from_config(config, loc=loc)
    assert isinstance(info.value, ValueError)
    for problem in info.value.problems:
        assert problem.fix, problem  # every problem says how to fix it
        assert problem.loc in str(info.value)
    return info.value.problems


KNOWN = "all, always, any, byte_budget, frequency, min_tokens, never, not, pinned, tenant_allow, ttl"


@pytest.mark.parametrize(
    ("config", "loc", "text"),
    [
        (
            {"all": [{"min_tokens": -3}]},
            "admission.all[0].min_tokens",
            "expected a positive integer number of tokens, e.g. 256",
        ),
        ({"all": [{"min_tokens": "lots"}]}, "admission.all[0].min_tokens", "not an integer"),
        (
            {"all": [{"min_tokens": 256}, {"any": [{"pinned": 5}]}]},
            "admission.all[1].any[0].pinned",
            "e.g. ['manual-*'",
        ),
        ({"pinned": ["ok", ""]}, "admission.pinned[1]", "non-empty string"),
        ({"pinned": []}, "admission.pinned", "is empty"),
        ({"min_token": 5}, "admission", "did you mean 'min_tokens'? known rules: " + KNOWN),
        ({"MinTokens": 5}, "admission", "did you mean 'min_tokens'?"),
        ({"not": {"tenant_alow": ["guest"]}}, "admission.not", "did you mean 'tenant_allow'?"),
        ({"frequency": {"n": 2}}, "admission.frequency.window", "is required; e.g. frequency: {n: 2, window: 1h}"),
        (
            {"frequency": {"n": 2, "window": 9, "max_key": 1}},
            "admission.frequency.max_key",
            "did you mean 'max_keys'? options: n, window, max_keys",
        ),
        ({"frequency": {"n": 0, "window": "1h"}}, "admission.frequency.n", "positive integer number of sightings"),
        ({"frequency": {"n": 1, "window": "1h", "max_keys": -1}}, "admission.frequency.max_keys", "positive integer"),
        ({"frequency": 2}, "admission.frequency", "mapping with n, window, max_keys"),
        ({"byte_budget": {"max": "50G", "per": "tenant"}}, "admission.byte_budget.max", "'50GB'"),
        ({"byte_budget": {"max": "50GB", "per": "team"}}, "admission.byte_budget.per", "total, document, tenant"),
        ({"byte_budget": {"per": "tenant"}}, "admission.byte_budget.max", "is required"),
        ({"byte_budget": "lots"}, "admission.byte_budget", "'512MiB'"),
        ({"byte_budget": 0}, "admission.byte_budget", "not positive"),
        ({"ttl": "soon"}, "admission.ttl", "'30s', '15m', '1h', '7d'"),
        ({"ttl": 0}, "admission.ttl", "not positive"),
        ({"all": []}, "admission.all", "is empty"),
        ({"any": {"ttl": 5}}, "admission.any", "not a list of rules"),
        ({"min_tokens": 256, "ttl": "7d"}, "admission", "has 2 rule names, expected exactly 1"),
        ({}, "admission", "known rules: " + KNOWN),
        ([{"min_tokens": 256}], "admission", "wrap the list in all:"),
        ("min_tokens", "admission", "needs a value; write it as a mapping, e.g. min_tokens: 256"),
        ("sometimes", "admission", "known rules: " + KNOWN),
        ({"always": 5}, "admission.always", "takes no value"),
        (42, "admission", "not a rule"),
        ({"tenant_allow": [1]}, "admission.tenant_allow[0]", "tenant names"),
        ({1: 2}, "admission", "not a known rule"),
    ],
)
def test_parse_errors_name_path_and_fix(config: Any, loc: str, text: str) -> None:
    problems = problems_of(config)
    assert [p.loc for p in problems] == [loc]
    assert text in str(problems[0])


def test_parse_errors_are_all_reported() -> None:
    config = yaml.safe_load(
        """
        all:
          - min_tokens: -3
          - any:
              - pinned: [ok, 3]
              - frequency: {n: 0, windw: 1h}
          - not: {tenant_alow: [guest]}
          - byte_budget: {max: 50G, per: team}
          - ttl: soon
        """
    )
    locs = [p.loc for p in problems_of(config, loc="policy.admission")]
    assert locs == [
        "policy.admission.all[0].min_tokens",
        "policy.admission.all[1].any[0].pinned[1]",
        "policy.admission.all[1].any[1].frequency.windw",
        "policy.admission.all[1].any[1].frequency.window",
        "policy.admission.all[1].any[1].frequency.n",
        "policy.admission.all[2].not",
        "policy.admission.all[3].byte_budget.max",
        "policy.admission.all[3].byte_budget.per",
        "policy.admission.all[4].ttl",
    ]


def test_unknown_rule_without_close_match_lists_known_names() -> None:
    (problem,) = problems_of({"zzzzzz": 1})
    assert "did you mean" not in problem.fix and problem.fix == "known rules: " + KNOWN
    assert problem.value == "zzzzzz"


@pytest.mark.parametrize(
    ("build", "loc"),
    [
        (lambda: MinTokens(0), "MinTokens(n)"),
        (lambda: MinTokens(True), "MinTokens(n)"),
        (lambda: Pinned(), "Pinned(doc_globs)"),
        (lambda: TenantAllow("a", 3), "TenantAllow(tenants)[1]"),
        (lambda: TTL("soon"), "TTL(seconds)"),
        (lambda: Frequency(2, -1), "Frequency(window_s)"),
        (lambda: Frequency(2, 1, max_keys=0), "Frequency(max_keys)"),
        (lambda: ByteBudget("50G"), "ByteBudget(max_bytes)"),
        (lambda: ByteBudget(10, per="team"), "ByteBudget(per)"),
        (lambda: AllOf(), "AllOf()"),
        (lambda: AnyOf(MinTokens(1), "x"), "AnyOf()[1]"),
        (lambda: Not(5), "Not(rule)"),
    ],
)
def test_keyword_construction_errors(build: Any, loc: str) -> None:
    with pytest.raises(PolicyError) as info:
        build()
    assert [p.loc for p in info.value.problems] == [loc]
    assert info.value.problems[0].fix


# --------------------------------------------------------------------------------------------------
# Durations and sizes
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        (30, 30.0), (1.5, 1.5), (0, 0.0), ("30", 30.0), ("30s", 30.0), ("15m", 900.0), ("1h", 3600.0),
        ("7d", 604800.0), ("2w", 1209600.0), ("1.5h", 5400.0), ("1h30m", 5400.0), ("500ms", 0.5), (" 5 m ", 300.0),
    ],
)  # fmt: skip
def test_parse_duration(text: Any, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    "bad", ["", "soon", "5x", "-5s", "1M", "h", "5 hours", -1, True, None, float("nan"), float("inf")]
)
def test_parse_duration_errors(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"invalid duration .*'15m'"):
        parse_duration(bad)


@pytest.mark.parametrize(
    ("text", "size"),
    [
        (0, 0), (1024, 1024), (1e9, 10**9), ("1024", 1024), ("10B", 10), ("50GB", 50 * 10**9),
        ("512MiB", 512 * 2**20), ("1.5GB", 1_500_000_000), ("1kb", 1000), ("2 TiB", 2 * 2**40), ("1.5KiB", 1536),
    ],
)  # fmt: skip
def test_parse_size(text: Any, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("bad", ["", "50G", "-1GB", "1.0001KB", "GB", "lots", -1, True, 1.5, None])
def test_parse_size_errors(bad: Any) -> None:
    with pytest.raises(ValueError, match="invalid size"):
        parse_size(bad)


@given(st.integers(0, 10**20))
def test_exact_size_round_trips(size: int) -> None:
    assert parse_size(_exact_size(size)) == size


@given(st.integers(0, 10**12).map(float) | st.floats(0, 1e12, allow_nan=False))
def test_exact_duration_round_trips(seconds: float) -> None:
    assert parse_duration(_exact_duration(seconds)) == seconds


def test_exact_forms_are_readable() -> None:
    assert [_exact_size(n) for n in (50 * 10**9, 512 * 2**20, 1000, 1001)] == ["50GB", "512MiB", "1KB", 1001]
    assert [_exact_duration(s) for s in (604800.0, 3600.0, 90.0, 61.0, 0.5)] == ["7d", "1h", "90s", "61s", 0.5]


def test_import_is_light() -> None:
    code = (
        "import sys, prefixshare.policies; "
        "heavy = {'structlog', 'yaml', 'pydantic', 'lmcache', 'difflib'} & set(sys.modules); "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
