"""``prefixshare plan --measure``: tiers measured through the adapter their server would build, the prefill cost from
the cost model's persisted estimates, the break-even arithmetic, and a tier that does not answer named with the fix."""

from __future__ import annotations

import json
import math
import os
import socket
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from prefixshare.plan import PREFILL_WINS, SHARING_WINS
from prefixshare.bench._measured import PrefillCost, break_even_tokens, flat_prefill, persisted_prefill
from prefixshare.runtime._cost import CostModel

runner = CliRunner()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("prefill", [flat_prefill(1000.0), PrefillCost(a=0.8, b=0.05, source="test")])
@pytest.mark.parametrize(("latency_s", "bytes_per_s"), [(0.0, 1e9), (0.05, 1e9), (0.3, 2.5e8), (0.01, 5e10)])
def test_break_even_is_where_load_and_prefill_cross(prefill: PrefillCost, latency_s: float,
                                                    bytes_per_s: float) -> None:
    bpt = 147_456

    def load(n: int) -> float:
        return latency_s + n * bpt / bytes_per_s

    n = break_even_tokens(prefill, latency_s, bpt, bytes_per_s)
    if n is None:  # then no length up to a million tokens wins
        assert all(load(k) >= prefill.seconds(k) for k in (1, 10**3, 10**4, 10**5, 10**6))
        return
    assert load(n) <= prefill.seconds(n) + 1e-12
    assert n == 1 or load(n - 1) >= prefill.seconds(n - 1) - 1e-9
    assert load(4 * n) < prefill.seconds(4 * n)  # and it keeps winning (prefill - load is convex)


def test_a_link_slower_per_token_than_a_flat_prefill_never_wins() -> None:
    # 1000 tokens/s of prefill against 147,456 B/token over 100 MB/s: 1.47 ms per token to move, 1 ms to compute
    assert break_even_tokens(flat_prefill(1000.0), 0.0, 147_456, 1e8) is None
    # with a quadratic term prefill catches up: a crossing exists, far out
    n = break_even_tokens(PrefillCost(a=1.0, b=0.1, source="t"), 0.0, 147_456, 1e8)
    assert n is not None and n > 4000


def test_persisted_estimates_are_read_from_what_a_cost_model_saved(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFIXSHARE_CACHE_DIR", str(tmp_path))
    assert persisted_prefill() is None
    model = CostModel("ns-test", store="s", kv_bytes_per_token=1024, chunk_size=64, mode="auto")
    for n in (256, 512, 1024, 2048):  # 1 ms per token, no quadratic term
        model.observe_prefill([(0, n)], n / 1000)
    model.save(force=True)
    found = persisted_prefill()
    assert found is not None
    cost, extra = found
    # the cost model sets a replica's first prefill step aside (one-off warm-up costs): three observations
    assert "ns-test" in cost.source and cost.observations == 3
    assert math.isclose(cost.seconds(1000), 1.0, rel_tol=0.05)
    assert extra["path"].endswith("ns-test.json")


def _policy(tmp_path: Path, tiers: str) -> Path:
    path = tmp_path / "p.yaml"
    path.write_text(f"chunk_size: 64\nl2:\n{tiers}")
    return path


def test_measure_puts_each_tier_beside_the_rated_links(cli: typer.Typer, tmp_path: Path) -> None:
    store = tmp_path / "kv"
    store.mkdir()
    policy = _policy(tmp_path, f"  - type: fs\n    base_path: {store}\n")
    env_before = {k: v for k, v in os.environ.items() if k.startswith("LMCACHE_")}
    result = runner.invoke(cli, ["plan", "qwen3-8b", "--measure", "--policy", str(policy), "--measure-mb", "24",
                                 "--reps", "2", "--prefill-rate", "2000", "-t", "1k,16k", "-l", "2.5GbE", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    (tier,) = data["tiers"]
    assert tier["error"] is None and tier["load_kind"] == "load, page cache evicted"
    assert tier["load_bytes_per_s"] > 1e7 and tier["latency_s"] > 0  # a real medium was read
    assert [c["name"] for c in data["columns"]] == ["2.5GbE", f"{tier['name']} (measured)"]
    assert [r["tokens"] for r in data["rows"]] == [1024, 16384]
    for row in data["rows"]:
        assert math.isclose(row["prefill_s"], row["tokens"] / 2000)
        measured = row["cells"][1]
        assert math.isclose(measured["load_s"], tier["latency_s"] + row["kv_bytes"] / tier["load_bytes_per_s"])
        sharing = measured["load_s"] < row["prefill_s"]
        assert measured["verdict"] == (SHARING_WINS if sharing else PREFILL_WINS)
    assert not list(store.rglob("*psbench*"))  # the test object was deleted
    assert "break_even_tokens" in data["columns"][0]
    # the measurement leaves LMCache's settings in this process's environment as it found them (a server started
    # later by the same process inherits them: a log level set here once hid every INFO line of later servers)
    assert {k: v for k, v in os.environ.items() if k.startswith("LMCACHE_")} == env_before


def test_a_tier_that_does_not_answer_is_named_with_the_fix(cli: typer.Typer, tmp_path: Path) -> None:
    store = tmp_path / "kv"
    store.mkdir()
    port = _closed_port()
    policy = _policy(tmp_path, f"  - type: fs\n    base_path: {store}\n"
                               f"  - type: resp\n    host: 127.0.0.1\n    port: {port}\n")
    result = runner.invoke(cli, ["plan", "tiny", "--measure", "--policy", str(policy), "--measure-mb", "4",
                                 "--reps", "1", "--prefill-rate", "1000", "--json"])
    assert result.exit_code == 1, result.output  # one tier could not be measured
    assert "Traceback" not in result.output
    data = json.loads(result.stdout)
    fs, resp = data["tiers"]
    assert fs["error"] is None
    assert f"127.0.0.1:{port}" in resp["error"] and resp["fix"].startswith("start it")
    assert all(row["cells"][-1]["load_s"] is None for row in data["rows"])


def test_measure_without_a_policy_says_what_to_give(cli: typer.Typer, tmp_path: Path) -> None:
    result = runner.invoke(cli, ["plan", "tiny", "--measure"])
    assert result.exit_code == 2 and "--policy" in result.output
    empty = tmp_path / "p.yaml"
    empty.write_text("chunk_size: 64\n")
    result = runner.invoke(cli, ["plan", "tiny", "--measure", "--policy", str(empty)])
    assert result.exit_code == 2 and "no L2 tier" in result.output
