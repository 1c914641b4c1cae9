"""Bad input: fuzzed policies (YAML and keyword arguments) and fuzzed CLI arguments always end in a clear error
that names the field or argument, never a traceback; a policy whose tier cannot be reached fails when the
server is started, naming the tier. No engine is started here.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import typer
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from conftest import free_port
from e2e.common import policy_for
from faults._matrix import Row, record
from prefixshare.errors import PolicyError, ServerError
from prefixshare.policies import Policy
from test_policy_fuzz import FIELDS, policies

POLICY_EXAMPLES = 300
CLI_EXAMPLES = 150


def test_fuzzed_policies_name_their_fields() -> None:
    """tests/test_policy_fuzz.py's strategy, counted: every example is a Policy or a PolicyError whose every
    problem names a field of the policy (and says what is wrong)."""
    seen: Counter[str] = Counter()

    @settings(max_examples=POLICY_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow],
              database=None)
    @given(policies)
    def check(data: dict) -> None:
        try:
            Policy.build(**data)
            seen["valid"] += 1
        except PolicyError as exc:
            assert exc.problems, exc
            for problem in exc.problems:
                root = problem.loc.split(".")[0].split("[")[0]
                assert problem.message and (root in FIELDS or root in {"(file)", "(policy)", "preset"}), problem
            seen["error naming the field"] += 1

    check()
    total = sum(seen.values())
    assert total >= POLICY_EXAMPLES * 0.9 and seen["error naming the field"] > 0, seen
    record(Row("bad input", f"{total} fuzzed policies (hypothesis: random fields, types, nesting)",
               "100% either valid or a PolicyError naming each bad field with what is wrong; no traceback",
               engine="none", extra={"cases": total, **seen}))


def test_fuzzed_policy_yaml_through_the_cli(cli: typer.Typer, tmp_path: Path) -> None:
    seen: Counter[int] = Counter()
    path = tmp_path / "p.yaml"

    @settings(max_examples=CLI_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow],
              database=None)
    @given(st.one_of(policies.map(lambda d: yaml.safe_dump(d, allow_unicode=True)), st.text(max_size=200),
                     st.binary(max_size=100).map(lambda b: b.decode("latin-1"))))
    def check(text: str) -> None:
        path.write_text(text, encoding="utf-8")
        result = CliRunner().invoke(cli, ["policy", "validate", str(path)])
        assert result.exit_code in (0, 2), result.output
        assert "Traceback" not in result.output
        assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
        if result.exit_code == 2:
            assert str(path) in result.output or ":" in result.output  # names the file or the field
        seen[result.exit_code] += 1

    check()
    total = sum(seen.values())
    record(Row("bad input", f"{total} fuzzed policy files (YAML, random text, random bytes) to `policy validate`",
               "exit 0 (valid) or 2 with the file and field named; no traceback",
               engine="none", extra={"cases": total, **{f"exit_{k}": v for k, v in seen.items()}}))


ARG_VALUES = st.one_of(st.text(max_size=20), st.sampled_from(["-1", "0", "1e99", "nan", "1h", "50GB", "-", "",
                                                                "/nonexistent", "../../etc/passwd", "\x00", "%s"]))
COMMANDS = [
    ["policy", "validate"], ["policy", "render"], ["inspect", "--policy"], ["gc", "--policy", "{policy}", "--ttl"],
    ["gc", "--policy", "{policy}", "--max-bytes"], ["doctor", "--policy"], ["server", "status", "--policy"],
    ["fingerprint"], ["plan"], ["warm", "{arg}", "--policy"],
]


def test_fuzzed_cli_arguments_give_clear_errors(cli: typer.Typer, tmp_path: Path) -> None:
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(yaml.safe_dump(policy_for(tmp_path / "store").to_dict()))
    seen: Counter[str] = Counter()

    @settings(max_examples=CLI_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow],
              database=None)
    @given(st.sampled_from(COMMANDS), ARG_VALUES, st.lists(ARG_VALUES, max_size=2))
    def check(command: list[str], value: str, rest: list[str]) -> None:
        argv = [c.replace("{policy}", str(policy_file)).replace("{arg}", value) for c in command] + [value, *rest]
        result = CliRunner().invoke(cli, argv)
        assert "Traceback" not in result.output, (argv, result.output)
        assert result.exception is None or isinstance(result.exception, SystemExit), (argv, repr(result.exception))
        if result.exit_code != 0:
            assert result.output.strip(), argv  # an error says something
        seen[f"exit_{result.exit_code}"] += 1

    check()
    total = sum(seen.values())
    record(Row("bad input", f"{total} fuzzed CLI invocations (policy, inspect, gc, doctor, server, fingerprint, "
               "plan, warm with random values)",
               "every failure exits non-zero with a message and no traceback",
               engine="none", extra={"cases": total, **seen}))


@pytest.mark.server
def test_an_unreachable_tier_fails_at_startup_naming_the_tier(cli: typer.Typer, tmp_path: Path) -> None:
    from prefixshare.server import LMCacheServer

    port = free_port()  # nothing listens there
    policy = policy_for(tmp_path / "store", l2=[{"type": "resp", "host": "127.0.0.1", "port": port}])
    with pytest.raises(ServerError) as info:
        LMCacheServer(policy).start()
    assert f"resp:127.0.0.1:{port}" in str(info.value) and "unreachable" in str(info.value)
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(yaml.safe_dump(policy.to_dict()))
    result = CliRunner().invoke(cli, ["server", "start", "--policy", str(policy_file)])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert f"resp:127.0.0.1:{port}" in result.output, result.output
    record(Row("bad input", "a policy whose L2 tier is unreachable (resp at a closed port)",
               "the server does not start: ServerError / `server start` exit 1 naming the tier "
               f"(\"l2 tier resp:127.0.0.1:PORT is unreachable: ... does not answer PING\")",
               engine="none", tier="resp", extra={"message": str(info.value)[:160], "cli_exit": result.exit_code}))
