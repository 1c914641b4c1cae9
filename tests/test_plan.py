"""Tests for prefixshare.plan and the ``prefixshare plan`` command. Pure arithmetic: fast, no network."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import prefixshare.plan as P
from prefixshare.errors import PrefixShareError
from prefixshare.plan import (
    LINK_PRESETS,
    PREFILL_WINS,
    SHARING_WINS,
    ModelShape,
    PlanError,
    kv_bytes_per_token,
    link_from_gbps,
    list_shapes,
    parse_link,
    parse_prompt_lengths,
    plan,
    shape_from_config,
)

REPO = Path(__file__).resolve().parents[1]
PACKAGE_SHAPES = REPO / "src" / "prefixshare" / "plan" / "shapes"
EXAMPLE_SHAPES = REPO / "examples" / "models"

QWEN3_8B_BPT = 147_456


# --------------------------------------------------------------------------------------------------
# Reference values
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("qwen3-8b", 147_456),
        ("qwen3-32b", 262_144),
        ("qwen3-30b-a3b", 98_304),
        ("llama-3.1-8b", 131_072),
        ("deepseek-v3", 61 * (512 + 64) * 2),
        ("tiny", 4 * 2 * 64 * 2 * 4),
        ("demo", 8 * 2 * 64 * 2 * 4),
        ("bench", 12 * 4 * 64 * 2 * 4),
    ],
)
def test_shipped_bytes_per_token(name: str, expected: int) -> None:
    assert kv_bytes_per_token(shape_from_config(name)) == expected


def test_qwen3_8b_4096_tokens_over_2_5gbe() -> None:
    p = plan("qwen3-8b", prompt_lengths=[4096], links=["2.5GbE"])
    row = p.rows[0]
    assert p.kv_bytes_per_token == QWEN3_8B_BPT
    assert row.kv_bytes == 603_979_776
    assert round(row.kv_bytes / 1e9, 2) == 0.60
    seconds = row.transfer("2.5GbE").transfer_s
    assert seconds == pytest.approx(603_979_776 * 8 / 2.5e9)
    assert round(seconds, 1) == 1.9
    assert row.transfer("2.5GbE").verdict is None  # no prefill rate, no verdict
    assert row.prefill_s is None


def test_shipped_shape_geometry() -> None:
    s = shape_from_config("qwen3-8b")
    assert (s.num_layers, s.num_kv_heads, s.head_dim, s.dtype, s.attention) == (36, 8, 128, "bfloat16", "gqa")
    moe = shape_from_config("qwen3-30b-a3b")
    assert (moe.num_layers, moe.num_kv_heads, moe.model_type) == (48, 4, "qwen3_moe")


# --------------------------------------------------------------------------------------------------
# Config parsing: GQA, MHA, MLA, nested, derived head_dim, errors
# --------------------------------------------------------------------------------------------------


def _cfg(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "model_type": "llama",
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "hidden_size": 512,
        "torch_dtype": "bfloat16",
    }
    base.update(over)
    return {k: v for k, v in base.items() if v is not None}


def test_head_dim_derived_from_hidden_size() -> None:
    s = shape_from_config(_cfg())
    assert s.head_dim == 64
    assert kv_bytes_per_token(s) == 4 * 2 * 64 * 2 * 2


def test_explicit_head_dim_wins_over_derivation() -> None:
    s = shape_from_config(_cfg(head_dim=256))  # Gemma-style: head_dim != hidden / heads
    assert s.head_dim == 256


def test_missing_kv_heads_means_mha() -> None:
    s = shape_from_config(_cfg(num_key_value_heads=None))
    assert s.num_kv_heads == 8
    assert s.attention == "mha"
    assert kv_bytes_per_token(s) == 4 * 8 * 64 * 2 * 2


def test_mqa_detected() -> None:
    assert shape_from_config(_cfg(num_key_value_heads=1)).attention == "mqa"


def test_mla_is_one_plane() -> None:
    cfg = _cfg(kv_lora_rank=512, qk_rope_head_dim=64, num_hidden_layers=61, num_key_value_heads=128)
    s = shape_from_config(cfg)
    assert s.is_mla and s.attention == "mla" and s.kv_planes == 1
    assert s.elements_per_token_per_layer == 576
    assert kv_bytes_per_token(s) == 61 * 576 * 2  # not x2 for K and V, and kv heads are irrelevant
    assert kv_bytes_per_token(s, "fp8") == 61 * 576


def test_mla_missing_rope_dim_is_an_error() -> None:
    with pytest.raises(PlanError, match="qk_rope_head_dim"):
        shape_from_config(_cfg(kv_lora_rank=512))


def test_nested_text_config() -> None:
    cfg = {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        "torch_dtype": "bfloat16",
        "vision_config": {"depth": 32, "hidden_size": 1280},
        "text_config": _cfg(torch_dtype=None, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                            hidden_size=3584),
    }
    s = shape_from_config(cfg)
    assert (s.num_layers, s.num_kv_heads, s.head_dim) == (28, 4, 128)
    assert s.dtype == "bfloat16"  # inherited from the top level
    assert s.model_type == "qwen2_5_vl"
    assert s.architectures == ("Qwen2_5_VLForConditionalGeneration",)


def test_missing_key_names_the_key() -> None:
    with pytest.raises(PlanError, match="num_hidden_layers"):
        shape_from_config(_cfg(num_hidden_layers=None))
    with pytest.raises(PlanError, match="head_dim"):
        shape_from_config(_cfg(hidden_size=None))


def test_bad_values_are_rejected() -> None:
    with pytest.raises(PlanError, match="positive integer"):
        shape_from_config(_cfg(num_hidden_layers="36"))
    with pytest.raises(PlanError, match="not divisible"):
        shape_from_config(_cfg(hidden_size=500))


def test_plan_error_is_a_prefixshare_value_error() -> None:
    assert issubclass(PlanError, PrefixShareError) and issubclass(PlanError, ValueError)


def test_sliding_window_and_context_notes() -> None:
    s = shape_from_config(_cfg(sliding_window=4096, max_position_embeddings=8192))
    assert s.sliding_window == 4096 and any("sliding_window" in n for n in s.notes)
    off = shape_from_config(_cfg(sliding_window=4096, use_sliding_window=False))
    assert off.sliding_window is None and not off.notes
    p = plan(s, prompt_lengths=[1024, 16384], links=["10GbE"])
    assert any("16384" in n and "max_position_embeddings" in n for n in p.notes)


# --------------------------------------------------------------------------------------------------
# Sources: paths, directories, names
# --------------------------------------------------------------------------------------------------


def test_source_file_and_directory(tmp_path: Path) -> None:
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(_cfg()))
    by_dir = shape_from_config(model_dir)
    by_file = shape_from_config(str(model_dir / "config.json"))
    assert by_dir.name == by_file.name == "my-model"
    assert kv_bytes_per_token(by_dir) == kv_bytes_per_token(by_file)


def test_source_errors(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="unknown model or shape 'no-such-model'"):
        shape_from_config("no-such-model")
    with pytest.raises(PlanError, match="no config.json"):
        shape_from_config(tmp_path)
    with pytest.raises(PlanError, match="no such file"):
        shape_from_config(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(PlanError, match="not valid JSON"):
        shape_from_config(bad)


def test_shipped_name_is_case_insensitive_and_repo_id_falls_back() -> None:
    assert shape_from_config("Qwen3-8B").name == "qwen3-8b"
    assert shape_from_config("qwen3-8b.json").name == "qwen3-8b"


def test_repo_id_reads_local_hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = tmp_path / "models--acme--Widget-1B"
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    (snap / "config.json").write_text(json.dumps(_cfg()))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    assert shape_from_config("acme/Widget-1B").num_layers == 4
    # Not cached, but the repo's last component names a shipped shape.
    assert kv_bytes_per_token(shape_from_config("Qwen/Qwen3-8B")) == QWEN3_8B_BPT


def test_list_shapes() -> None:
    names = list_shapes()
    for expected in ("qwen3-8b", "qwen3-32b", "qwen3-30b-a3b", "llama-3.1-8b", "deepseek-v3", "tiny", "demo", "bench"):
        assert expected in names


def test_example_shapes_are_identical_to_shipped_copies() -> None:
    shipped = {p.name: p.read_bytes() for p in PACKAGE_SHAPES.glob("*.json")}
    examples = {p.name: p.read_bytes() for p in EXAMPLE_SHAPES.glob("*.json")}
    assert shipped, "no shipped shapes found"
    assert examples == shipped, "examples/models/*.json must be identical copies of src/prefixshare/plan/shapes/"


@pytest.mark.parametrize(("name", "arch", "shape"), [("tiny", "llama", "tiny"), ("demo", "llama", "demo"),
                                                   ("bench", "llama", "bench"), ("qwen3-tiny", "qwen3", "tiny")])
def test_local_shapes_match_the_model_generator(name: str, arch: str, shape: str) -> None:
    """The shipped tiny/demo/bench/qwen3-tiny files describe the models ``prefixshare.model`` generates."""
    model_shapes = pytest.importorskip("prefixshare.model._shapes")
    generated = dict(model_shapes.shape_fields(shape, arch))
    shipped = json.loads((PACKAGE_SHAPES / f"{name}.json").read_text())
    for key, value in generated.items():
        assert shipped["torch_dtype" if key == "dtype" else key] == value, key
    assert kv_bytes_per_token(shape_from_config(name)) == model_shapes.kv_bytes_per_token(shape, arch=arch)


def test_model_shape_direct_construction_validates() -> None:
    with pytest.raises(PlanError, match="num_kv_heads"):
        ModelShape(name="x", num_layers=2, dtype="bf16", head_dim=64)
    s = ModelShape(name="x", num_layers=2, dtype="bf16", num_kv_heads=1, head_dim=64)
    assert s.dtype == "bfloat16"
    assert kv_bytes_per_token(s) == 2 * 64 * 2 * 2


# --------------------------------------------------------------------------------------------------
# dtypes
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kv_dtype", "width"),
    [("auto", 2), ("fp8", 1), ("fp8_e4m3", 1), ("fp8_e5m2", 1), ("bf16", 2), ("fp16", 2), ("half", 2),
     ("fp32", 4), ("float", 4), ("FP8", 1), ("torch.float16", 2)],
)
def test_kv_dtype_override(kv_dtype: str, width: int) -> None:
    assert kv_bytes_per_token(shape_from_config("qwen3-8b"), kv_dtype) == QWEN3_8B_BPT // 2 * width


def test_auto_follows_model_dtype_and_unknown_dtype_fails() -> None:
    assert kv_bytes_per_token(shape_from_config("tiny")) == 4096  # fp32 model
    with pytest.raises(PlanError, match="unknown dtype 'int4'"):
        kv_bytes_per_token(shape_from_config("tiny"), "int4")
    no_dtype = shape_from_config(_cfg(torch_dtype=None))
    with pytest.raises(PlanError, match="torch_dtype"):
        kv_bytes_per_token(no_dtype)
    assert kv_bytes_per_token(no_dtype, "bf16") == 4 * 2 * 64 * 2 * 2
    assert shape_from_config(_cfg(torch_dtype=None, dtype="float16")).dtype == "float16"  # transformers v5 key


# --------------------------------------------------------------------------------------------------
# Links
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "name", "bits"),
    [
        ("2.5GbE", "2.5GbE", 2.5e9),
        ("10gbe", "10GbE", 10e9),
        ("25GbE", "25GbE", 25e9),
        ("100GbE", "100GbE", 100e9),
        ("200GbE", "200GbE", 200e9),
        ("TB4", "TB4", 40e9),
        ("thunderbolt 5", "TB5", 80e9),
        ("Thunderbolt-4", "TB4", 40e9),
        ("3.2GB/s", "3.2GB/s", 3.2e9 * 8),
        ("3.2 GBps", "3.2GB/s", 3.2e9 * 8),
        ("800MB/s", "800MB/s", 800e6 * 8),
        ("25Gb/s", "25Gb/s", 25e9),
        ("25Gbps", "25Gb/s", 25e9),
        ("40 Gbit/s", "40Gb/s", 40e9),
        ("1GiB/s", "1GiB/s", 2**30 * 8),
    ],
)
def test_parse_link(text: str, name: str, bits: float) -> None:
    link = parse_link(text)
    assert link.name == name
    assert link.bits_per_s == pytest.approx(bits)


@pytest.mark.parametrize("text", ["", "fast", "3.2", "3.2GB", "10GbE/s", "-1GB/s", "0GB/s", "3iB/s", "12 parsecs"])
def test_parse_link_rejects(text: str) -> None:
    with pytest.raises(PlanError):
        parse_link(text)


def test_link_from_gbps_and_transfer_formula() -> None:
    link = link_from_gbps(10)
    assert link.name == "10Gb/s" and link.bytes_per_s == 1.25e9
    assert link.seconds_for(1_250_000_000) == pytest.approx(1.0)
    assert link.seconds_for(1_250_000_000, efficiency=0.5, sharers=2) == pytest.approx(4.0)
    with pytest.raises(PlanError):
        link_from_gbps(0)
    assert set(LINK_PRESETS) == {"2.5GbE", "10GbE", "25GbE", "100GbE", "200GbE", "TB4", "TB5"}


# --------------------------------------------------------------------------------------------------
# Verdicts and plan options
# --------------------------------------------------------------------------------------------------


def test_verdict_flips_with_prefill_rate() -> None:
    # 4096 tokens of Qwen3-8B over 2.5GbE take ~1.93 s; prefill at 1000 tok/s takes 4.1 s, at 5000 0.82 s.
    slow = plan("qwen3-8b", prompt_lengths=[4096], links=["2.5GbE"], prefill_tokens_per_s=1000)
    fast = plan("qwen3-8b", prompt_lengths=[4096], links=["2.5GbE"], prefill_tokens_per_s=5000)
    assert slow.rows[0].transfer("2.5GbE").verdict == SHARING_WINS
    assert fast.rows[0].transfer("2.5GbE").verdict == PREFILL_WINS
    assert fast.rows[0].prefill_s == pytest.approx(4096 / 5000)
    # The break-even rate is link bytes/s / bytes per token; just below it sharing wins, just above it loses.
    breakeven = 2.5e9 / 8 / QWEN3_8B_BPT
    assert plan("qwen3-8b", [4096], ["2.5GbE"], breakeven * 0.99).rows[0].transfers[0].sharing_wins is True
    assert plan("qwen3-8b", [4096], ["2.5GbE"], breakeven * 1.01).rows[0].transfers[0].sharing_wins is False


def test_verdict_per_link() -> None:
    p = plan("qwen3-8b", prompt_lengths=[4096], links=["2.5GbE", "100GbE"], prefill_tokens_per_s=5000)
    verdicts = [t.verdict for t in p.rows[0].transfers]
    assert verdicts == [PREFILL_WINS, SHARING_WINS]


def test_latency_concurrency_and_efficiency() -> None:
    base = plan("qwen3-8b", [4096], ["10GbE"]).rows[0].transfers[0]
    slowed = plan("qwen3-8b", [4096], ["10GbE"], concurrency=4, per_load_latency_s=0.05, efficiency=0.5).rows[0]
    t = slowed.transfers[0]
    assert t.transfer_s == pytest.approx(base.transfer_s * 4 / 0.5)
    assert t.load_s == pytest.approx(t.transfer_s + 0.05)
    # Latency alone can flip a verdict: 100GbE moves 4096 tokens in ~48 ms, prefill at 50k tok/s takes ~82 ms.
    assert plan("qwen3-8b", [4096], ["100GbE"], 50_000).rows[0].transfers[0].sharing_wins is True
    flipped = plan("qwen3-8b", [4096], ["100GbE"], 50_000, per_load_latency_s=0.05).rows[0].transfers[0]
    assert flipped.sharing_wins is False


@pytest.mark.parametrize(
    "kwargs",
    [
        {"prompt_lengths": []},
        {"prompt_lengths": [0]},
        {"links": []},
        {"links": ["10GbE", "10gbe"]},
        {"prefill_tokens_per_s": 0},
        {"concurrency": 0},
        {"efficiency": 1.5},
        {"per_load_latency_s": -1},
    ],
)
def test_plan_rejects_bad_options(kwargs: dict[str, Any]) -> None:
    with pytest.raises(PlanError):
        plan("qwen3-8b", **kwargs)


def test_plan_defaults_and_to_dict_is_json() -> None:
    p = plan("qwen3-8b", kv_dtype="fp8", prefill_tokens_per_s=5000)
    assert [r.tokens for r in p.rows] == [1024, 4096, 16384, 32768]
    assert [link.name for link in p.links] == list(P.DEFAULT_LINKS)
    d = json.loads(json.dumps(p.to_dict()))
    assert d["kv_bytes_per_token"] == QWEN3_8B_BPT // 2
    assert d["kv_dtype"] == "fp8" and d["bytes_per_element"] == 1
    assert d["shape"]["name"] == "qwen3-8b"
    assert d["rows"][1]["kv_bytes"] == 4096 * QWEN3_8B_BPT // 2
    assert d["rows"][1]["transfers"][0]["verdict"] in (SHARING_WINS, PREFILL_WINS)
    assert "147,456" not in d["formula"] and "73,728 bytes/token" in d["formula"]


def test_parse_prompt_lengths() -> None:
    assert parse_prompt_lengths("1024, 4k,32K") == [1024, 4096, 32768]
    for bad in ("", "abc", "1.5k", "-4", "0"):
        with pytest.raises(PlanError):
            parse_prompt_lengths(bad)


def test_import_pulls_in_nothing_heavy() -> None:
    code = (
        "import sys, prefixshare.plan, prefixshare.cli._plan; "
        "heavy = [m for m in ('torch', 'transformers', 'lmcache', 'vllm', 'sglang', 'numpy') if m in sys.modules]; "
        "print(','.join(heavy))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == ""


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------


runner = CliRunner()


def test_cli_table(cli: Any) -> None:
    result = runner.invoke(
        cli, ["plan", "qwen3-8b", "--tokens", "4096", "--link", "2.5GbE", "--prefill-rate", "1000"],
        env={"COLUMNS": "200"},
    )
    assert result.exit_code == 0, result.output
    assert "147,456 bytes/token" in result.output
    assert "4,096" in result.output
    assert "0.60 GB" in result.output
    assert "1.93 s" in result.output
    assert SHARING_WINS in result.output


def test_cli_json(cli: Any) -> None:
    result = runner.invoke(
        cli, ["plan", "qwen3-32b", "--tokens", "1024,4k", "--link", "10GbE", "--link", "3.2GB/s", "--link-gbps",
              "40", "--kv-dtype", "fp8", "--prefill-rate", "5000", "--json"],
    )
    assert result.exit_code == 0, result.output
    d = json.loads(result.stdout)
    assert d["kv_bytes_per_token"] == 262_144 // 2
    assert [r["tokens"] for r in d["rows"]] == [1024, 4096]
    assert [t["link"] for t in d["rows"][0]["transfers"]] == ["10GbE", "3.2GB/s", "40Gb/s"]
    assert all(t["verdict"] in (SHARING_WINS, PREFILL_WINS) for t in d["rows"][1]["transfers"])


def test_cli_list_shapes(cli: Any) -> None:
    result = runner.invoke(cli, ["plan", "--list-shapes"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "qwen3-8b" in result.output and "147,456" in result.output
    as_json = runner.invoke(cli, ["plan", "--list-shapes", "--json"])
    names = {s["name"]: s["kv_bytes_per_token"] for s in json.loads(as_json.stdout)}
    assert names["deepseek-v3"] == 70_272


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["plan", "no-such-shape"], "unknown model or shape 'no-such-shape'"),
        (["plan", "qwen3-8b", "--link", "warp9"], "bad link 'warp9'"),
        (["plan", "qwen3-8b", "--kv-dtype", "int4"], "unknown dtype 'int4'"),
        (["plan", "qwen3-8b", "--tokens", "lots"], "bad prompt length 'lots'"),
        (["plan"], "missing MODEL_OR_SHAPE"),
    ],
)
def test_cli_bad_input_exits_2_without_traceback(cli: Any, args: list[str], message: str) -> None:
    result = runner.invoke(cli, args, env={"COLUMNS": "300"})
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output
    assert not isinstance(result.exception, PlanError)  # handled, not propagated


def test_cli_missing_config_key(cli: Any, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(_cfg(num_hidden_layers=None)))
    result = runner.invoke(cli, ["plan", str(tmp_path)], env={"COLUMNS": "300"})
    assert result.exit_code == 2
    assert "num_hidden_layers" in result.output
