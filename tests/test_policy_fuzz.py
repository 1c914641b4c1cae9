"""Bad input never escapes as a traceback: fuzzed policies give a Policy or a PolicyError naming fields."""

from __future__ import annotations

from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from prefixshare.errors import PolicyError
from prefixshare.policies import Policy

FIELDS = ["version", "name", "chunk_size", "tenant", "l1", "l2", "server", "load", "fingerprint", "admission",
          "preset", "bogus"]
SUBFIELDS = ["size_gb", "eviction", "port", "http_port", "timeout_s", "mode", "type", "base_path", "create",
             "host", "startup_nodes", "weights", "min_tokens", "all", "any", "not", "pinned", "ttl", "frequency",
             "byte_budget", "endpoint", "region", "cluster_mode"]

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=False),
                    st.text(max_size=12), st.sampled_from(["fs", "resp", "valkey", "s3", "LRU", "auto", "1h",
                                                           "50GB", "/tmp", "127.0.0.1:1", "single-node"]))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3),
    st.dictionaries(st.sampled_from(SUBFIELDS), inner, max_size=4)), max_leaves=12)
policies = st.dictionaries(st.sampled_from(FIELDS), values, max_size=6)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policies)
def test_fuzzed_policies_are_valid_or_name_their_fields(data: dict) -> None:
    try:
        Policy.build(**data)
    except PolicyError as exc:
        assert exc.problems, exc
        for problem in exc.problems:
            assert problem.loc and problem.message
            root = problem.loc.split(".")[0].split("[")[0]
            assert root in FIELDS or root in {"(file)", "(policy)", "preset"}, problem


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(st.one_of(policies.map(lambda d: yaml.safe_dump(d, allow_unicode=True)), st.text(max_size=200)))
def test_validate_cli_never_shows_a_traceback(cli, tmp_path_factory, text: str) -> None:  # noqa: ANN001
    path = Path(tmp_path_factory.mktemp("fuzz")) / "p.yaml"
    path.write_text(text, encoding="utf-8")
    result = CliRunner().invoke(cli, ["policy", "validate", str(path)])
    assert result.exit_code in (0, 2), result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
