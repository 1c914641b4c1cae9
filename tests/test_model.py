"""Tests for prefixshare.model (the local model generator) and ``prefixshare model create``.

Most tests share one tiny model built once per session (~2 s). Determinism is checked against a second
build in a separate process with other thread counts. The ``engine`` test loads the model in vLLM (CPU,
in-process fast mode) in a subprocess and compares its greedy tokens with Hugging Face's.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from prefixshare.errors import MissingExtraError
from prefixshare.model import (
    CHAT_TEMPLATE,
    GENERATOR_VERSION,
    MANIFEST,
    SHAPES,
    VOCAB_SIZE,
    ModelError,
    create_model,
    create_or_reuse,
    document_text,
    ensure_model,
    kv_bytes_per_token,
    model_info,
    parameter_count,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

MODEL_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    MANIFEST,
}


def _hashes(root: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.iterdir())}


def _run_python(code: str, *, env: dict[str, str] | None = None, timeout: float = 120) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    assert proc.returncode == 0, f"subprocess failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_model(tmp_path_factory.mktemp("models") / "tiny-0", shape="tiny", seed=0)


@pytest.fixture(scope="session")
def tokenizer(tiny: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(tiny)


@pytest.fixture(scope="session")
def hf_model(tiny: Path) -> Any:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(tiny, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    return model.eval()


def hf_greedy(model: Any, prompt_ids: list[int], n: int) -> list[int]:
    """Greedy decoding with the HF model that, like vLLM's ``ignore_eos``, does not stop at EOS."""
    ids = list(prompt_ids)
    past = None
    step_input = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            out = model(input_ids=step_input, past_key_values=past, use_cache=True)
            past = out.past_key_values
            next_id = int(out.logits[0, -1].argmax())
            ids.append(next_id)
            step_input = torch.tensor([[next_id]])
    return ids[len(prompt_ids) :]


# --- layout and manifest ------------------------------------------------------------------------


def test_layout_and_manifest(tiny: Path) -> None:
    assert {p.name for p in tiny.iterdir()} == MODEL_FILES
    info = model_info(tiny)
    assert (info.shape, info.seed, info.generator_version) == ("tiny", 0, GENERATOR_VERSION)
    assert info.parameters == parameter_count("tiny")
    assert info.vocab_size == VOCAB_SIZE
    assert set(info.files) == MODEL_FILES - {MANIFEST}
    assert info.size_bytes == sum(p.stat().st_size for p in tiny.iterdir())
    for name, meta in info.files.items():
        assert hashlib.sha256((tiny / name).read_bytes()).hexdigest() == meta["sha256"]
    config = json.loads((tiny / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim"):
        assert config[key] == SHAPES["tiny"][key]
    assert config["dtype"] == "float32" and config["initializer_range"] == pytest.approx(0.3)
    # Readable by other users/containers (safetensors alone would write 0600).
    assert all(p.stat().st_mode & 0o044 == 0o044 for p in tiny.iterdir())
    # No leftover scratch directories next to the model.
    assert [p.name for p in tiny.parent.iterdir()] == [tiny.name]


def test_shapes_are_consistent() -> None:
    assert set(SHAPES) == {"tiny", "demo", "bench"}
    for name, fields in SHAPES.items():
        assert fields["head_dim"] == 64
        assert fields["num_attention_heads"] * fields["head_dim"] == fields["hidden_size"]
        assert fields["num_attention_heads"] % fields["num_key_value_heads"] == 0
        assert fields["vocab_size"] == VOCAB_SIZE
        config = transformers.LlamaConfig(**fields)
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config)
        assert sum(p.numel() for p in model.parameters()) == parameter_count(name)
    assert kv_bytes_per_token("demo") == 8 * 2 * 64 * 2 * 4
    with pytest.raises(TypeError):
        SHAPES["tiny"]["hidden_size"] = 1  # type: ignore[index]


# --- determinism --------------------------------------------------------------------------------


def test_same_seed_gives_identical_files_across_processes(tiny: Path, tmp_path: Path) -> None:
    other = tmp_path / "tiny-0-again"
    # Another process, other thread counts for the BPE trainer (rayon) and torch.
    _run_python(
        f"from prefixshare.model import create_model; create_model({str(other)!r}, shape='tiny', seed=0)",
        env={"RAYON_NUM_THREADS": "7", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "true"},
    )
    assert _hashes(other) == _hashes(tiny)


def test_different_seed_gives_different_weights(tiny: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    other = create_model(tmp_path / "tiny-1", seed=1)
    a, b = _hashes(tiny), _hashes(other)
    assert a["model.safetensors"] != b["model.safetensors"]
    assert a["config.json"] == b["config.json"]
    wa, wb = load_file(tiny / "model.safetensors"), load_file(other / "model.safetensors")
    assert wa.keys() == wb.keys()
    assert not torch.equal(wa["model.embed_tokens.weight"], wb["model.embed_tokens.weight"])
    assert not torch.equal(wa["model.layers.0.self_attn.k_proj.weight"], wb["model.layers.0.self_attn.k_proj.weight"])
    assert model_info(other).seed == 1


def test_global_rng_untouched(tmp_path: Path) -> None:
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    create_model(tmp_path / "m", seed=2)
    assert torch.equal(torch.rand(3), expected)


# --- tokenizer ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "Hello world, this is a test.",
        "  leading spaces\n\nand\tTabs  ",
        "Unicode: naïve café, 東京, emoji 🚀 ✓",
        "x=42; f(y) -> [1, 2, 3] # 2026-11-29",
        "",
    ],
)
def test_tokenizer_round_trips(tokenizer: Any, text: str) -> None:
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.unk_token_id not in ids


def test_tokenizer_vocab_matches_config(tiny: Path, tokenizer: Any) -> None:
    config = json.loads((tiny / "config.json").read_text())
    assert len(tokenizer) == tokenizer.vocab_size == config["vocab_size"] == VOCAB_SIZE
    assert tokenizer.bos_token_id == config["bos_token_id"] == 1
    assert tokenizer.eos_token_id == config["eos_token_id"] == 2
    assert tokenizer.pad_token_id == config["pad_token_id"] == 3
    assert tokenizer.unk_token_id == 0
    # The synthetic English compresses well: ~1.3 tokens per word.
    words = 500
    n_tokens = len(tokenizer(document_text(words, seed=7), add_special_tokens=False).input_ids)
    assert words < n_tokens < 2 * words


def test_chat_template_renders(tiny: Path, tokenizer: Any) -> None:
    assert json.loads((tiny / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<s><|system|>\nBe brief.</s>\n<|user|>\nHi there</s>\n<|assistant|>\n"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.convert_tokens_to_ids("<|assistant|>") in ids
    no_prompt = tokenizer.apply_chat_template(messages[1:], tokenize=False)
    assert no_prompt == "<s><|user|>\nHi there</s>\n"
    with pytest.raises(Exception, match="unsupported role"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


# --- weights: greedy output depends on the context ----------------------------------------------


def test_hf_greedy_depends_on_context(tokenizer: Any, hf_model: Any) -> None:
    outputs = []
    for seed in (1, 2):
        prompt = tokenizer(document_text(60, seed=seed)).input_ids
        out = hf_greedy(hf_model, prompt, 20)
        assert len(set(out)) > 5, f"degenerate greedy output {out}"
        outputs.append(out)
    assert outputs[0] != outputs[1]
    # Agrees with transformers' own generate() (up to an EOS, where generate stops).
    prompt = tokenizer(document_text(60, seed=1)).input_ids
    generated = hf_model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)
    tail = generated[0, len(prompt) :].tolist()
    assert tail == outputs[0][: len(tail)]


# --- existing directories -----------------------------------------------------------------------


def test_existing_model_is_reused_without_rebuilding(tiny: Path) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in tiny.iterdir()}
    started = time.perf_counter()
    assert create_model(tiny) == tiny
    assert ensure_model(tiny, "tiny", 0) == tiny
    assert create_or_reuse(str(tiny)) == (tiny, True)
    assert time.perf_counter() - started < 0.5
    assert {p.name: p.stat().st_mtime_ns for p in tiny.iterdir()} == before


def test_conflicting_directory_needs_overwrite(tmp_path: Path) -> None:
    root = create_model(tmp_path / "m", seed=3)
    with pytest.raises(ModelError, match="seed=3"):
        create_model(root, seed=4)
    with pytest.raises(ModelError, match="overwrite"):
        ensure_model(root, "tiny", 4)
    path, reused = create_or_reuse(root, seed=4, overwrite=True)
    assert (path, reused) == (root, False)
    assert model_info(root).seed == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_broken_model_directory_is_detected(tmp_path: Path) -> None:
    root = create_model(tmp_path / "m", seed=5)
    (root / "tokenizer.json").unlink()
    with pytest.raises(ModelError, match=r"tokenizer\.json"):
        ensure_model(root, "tiny", 5)
    create_model(root, seed=5, overwrite=True)
    assert (root / "tokenizer.json").is_file()


def test_refuses_foreign_or_invalid_targets(tmp_path: Path) -> None:
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    for overwrite in (False, True):
        with pytest.raises(ModelError, match="did not create"):
            create_model(foreign, overwrite=overwrite)
    assert (foreign / "notes.txt").read_text() == "mine"
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ModelError, match="not a directory"):
        create_model(a_file)
    with pytest.raises(ModelError, match="unknown llama shape .huge.; choose one of: tiny, demo, bench"):
        create_model(tmp_path / "x", shape="huge")
    with pytest.raises(ModelError, match="seed"):
        create_model(tmp_path / "x", seed=-1)
    with pytest.raises(ModelError, match="missing"):
        model_info(tmp_path)


def test_missing_extra_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(MissingExtraError, match=r"prefixshare\[model\]"):
        create_model(tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_empty_directory_is_filled(tmp_path: Path) -> None:
    root = tmp_path / "empty"
    root.mkdir()
    assert create_model(root, seed=6) == root
    assert model_info(root).seed == 6


def test_concurrent_builders_agree(tmp_path: Path) -> None:
    target = tmp_path / "shared"
    code = f"from prefixshare.model import ensure_model; print(ensure_model({str(target)!r}, 'tiny', 8))"
    procs = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr
        assert stdout.strip().endswith(str(target))
    assert model_info(target).seed == 8
    assert {p.name for p in target.iterdir()} == MODEL_FILES
    assert [p.name for p in tmp_path.iterdir()] == ["shared"]


# --- document_text ------------------------------------------------------------------------------


def test_document_text_is_deterministic_english_like() -> None:
    text = document_text(300, seed=1)
    assert text == document_text(300, seed=1)
    assert text != document_text(300, seed=2)
    assert len(text.split()) == 300
    assert "\n\n" in text and text[0].isupper() and text.rstrip()[-1] in ".?!;:"
    # Same seed, more words: the shorter text is a prefix up to its last word's punctuation.
    longer = document_text(1000, seed=1)
    assert longer.startswith(text[: text.rindex(" ")])
    for n in (1, 13, 14, 15, 137):
        short = document_text(n, seed=1)
        assert len(short.split()) == n and short.endswith(".")
        assert longer.startswith(short[:-1].rstrip(",.?!;:"))
    assert document_text(0) == ""
    with pytest.raises(ValueError):
        document_text(-1)


def test_import_is_light() -> None:
    out = _run_python(
        "import sys, prefixshare.model, prefixshare.cli._model; "
        "print(sorted(m for m in ('torch', 'transformers', 'tokenizers') if m in sys.modules))"
    )
    assert out.strip() == "[]"


# --- CLI ----------------------------------------------------------------------------------------


@pytest.fixture()
def cli() -> Callable[..., Any]:
    """The ``model`` command group on an app with the real root callback (logging set-up)."""
    from prefixshare.cli import _root
    from prefixshare.cli._model import register

    app = typer.Typer(pretty_exceptions_enable=False)
    app.callback()(_root)
    register(app)
    runner = CliRunner()
    return lambda *args: runner.invoke(app, list(args))


def test_cli_create_json(cli: Callable[..., Any], tmp_path: Path) -> None:
    target = tmp_path / "cli-model"
    result = cli("model", "create", str(target), "--seed", "9", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["path"] == str(target.resolve())
    assert (data["shape"], data["seed"], data["reused"]) == ("tiny", 9, False)
    assert data["parameters"] == parameter_count("tiny")
    assert data["vocab_size"] == VOCAB_SIZE
    assert data["size_bytes"] == sum(p.stat().st_size for p in target.iterdir())

    again = cli("model", "create", str(target), "--seed", "9", "--json")
    assert again.exit_code == 0 and json.loads(again.stdout)["reused"] is True

    human = cli("model", "create", str(target), "--seed", "9")
    assert human.exit_code == 0
    assert "reused" in human.stdout and "4,458,752" in human.stdout and "MiB" in human.stdout


def test_cli_errors(cli: Callable[..., Any], tmp_path: Path) -> None:
    bad_shape = cli("model", "create", str(tmp_path / "x"), "--shape", "huge")
    assert bad_shape.exit_code == 2
    target = create_model(tmp_path / "m", seed=10)
    conflict = cli("model", "create", str(target), "--seed", "11")
    assert conflict.exit_code == 2
    assert "--overwrite" in conflict.stderr and "Traceback" not in conflict.output


# --- Qwen3 --------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_model(tmp_path_factory.mktemp("models") / "qwen3-0", shape="tiny", seed=0, arch="qwen3")


def test_qwen3_keeps_the_qwen3_8b_head_geometry_in_bf16(qwen3: Path) -> None:
    from safetensors import safe_open

    info = model_info(qwen3)
    assert (info.arch, info.shape, info.parameters) == ("qwen3", "tiny", parameter_count("tiny", arch="qwen3"))
    config = json.loads((qwen3 / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    assert (config["num_key_value_heads"], config["head_dim"], config["num_attention_heads"]) == (8, 128, 16)
    assert config["dtype"] == "bfloat16" and config["bos_token_id"] is None
    assert kv_bytes_per_token("tiny", arch="qwen3") == 3 * 8 * 128 * 2 * 2
    with safe_open(str(qwen3 / "model.safetensors"), "pt") as fh:
        names = list(fh.keys())
        assert {str(fh.get_slice(n).get_dtype()) for n in names} == {"BF16"}
    # the per-head q/k RMS norms that set Qwen3 apart from Llama, one weight per head dim
    assert "model.layers.0.self_attn.q_norm.weight" in names and "model.layers.0.self_attn.k_norm.weight" in names
    model, loading = transformers.AutoModelForCausalLM.from_pretrained(qwen3, output_loading_info=True,
                                                                       dtype=torch.float32)
    assert not loading["missing_keys"] and not loading["unexpected_keys"] and not loading["mismatched_keys"]
    tok = transformers.AutoTokenizer.from_pretrained(qwen3)
    outs = [hf_greedy(model.eval(), tok(document_text(60, seed=s)).input_ids, 12) for s in (1, 2)]
    assert outs[0] != outs[1] and all(len(set(o)) > 4 for o in outs), outs


def test_qwen3_tokenizer_and_chat_template(qwen3: Path) -> None:
    from prefixshare.model import QWEN3_CHAT_TEMPLATE

    tok = transformers.AutoTokenizer.from_pretrained(qwen3)
    assert json.loads((qwen3 / "tokenizer_config.json").read_text())["chat_template"] == QWEN3_CHAT_TEMPLATE
    assert len(tok) == VOCAB_SIZE and tok.bos_token_id is None
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token, tok.pad_token_id) == ("<|im_end|>", 2, "<|endoftext|>", 0)
    plain = tok("Hello world").input_ids
    assert plain == tok("Hello world", add_special_tokens=False).input_ids  # no BOS, like Qwen3
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    quiet = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert quiet == text + "<think>\n\n</think>\n\n"
    ids = tok(text, add_special_tokens=False).input_ids
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3 and ids.count(tok.eos_token_id) == 2
    with pytest.raises(Exception, match="unsupported role"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_qwen3_shapes_match_transformers() -> None:
    from prefixshare.model import QWEN3_SHAPES

    assert set(QWEN3_SHAPES) == {"tiny", "demo"}
    for name, fields in QWEN3_SHAPES.items():
        assert (fields["num_key_value_heads"], fields["head_dim"]) == (8, 128)
        with torch.device("meta"):
            model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**fields))
        assert sum(p.numel() for p in model.parameters()) == parameter_count(name, arch="qwen3")


def test_arch_is_part_of_the_model_identity(qwen3: Path, tmp_path: Path, cli: Callable[..., Any]) -> None:
    assert create_or_reuse(qwen3, shape="tiny", seed=0, arch="qwen3") == (qwen3, True)
    with pytest.raises(ModelError, match="arch='qwen3'.*overwrite"):
        create_model(qwen3, shape="tiny", seed=0)  # the Llama of the same shape and seed is another model
    with pytest.raises(ModelError, match="unknown qwen3 shape 'bench'; choose one of: tiny, demo"):
        create_model(tmp_path / "q", shape="bench", arch="qwen3")
    with pytest.raises(ModelError, match="unknown architecture 'gpt2'"):
        create_model(tmp_path / "q", arch="gpt2")
    result = cli("model", "create", str(qwen3), "--arch", "qwen3", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["arch"] == "qwen3" and json.loads(result.stdout)["reused"] is True
    assert cli("model", "create", str(tmp_path / "q"), "--arch", "qwen3", "--shape", "bench").exit_code == 2


# --- vLLM ---------------------------------------------------------------------------------------

_VLLM_SCRIPT = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

model_dir, prompts = sys.argv[1], json.loads(sys.argv[2])
llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, distributed_executor_backend="uni",
          block_size=32, max_model_len=2048, seed=0)
params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outputs]))
"""


@pytest.mark.engine
@pytest.mark.timeout(400)
def test_vllm_greedy_matches_hf(tiny: Path, tokenizer: Any, hf_model: Any, tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    prompts = [tokenizer(document_text(75, seed=s)).input_ids for s in (1, 2)]
    assert all(80 <= len(p) <= 130 for p in prompts), [len(p) for p in prompts]
    expected = [hf_greedy(hf_model, p, 20) for p in prompts]

    script = tmp_path / "run_vllm.py"
    script.write_text(_VLLM_SCRIPT)
    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    proc = subprocess.run(
        [sys.executable, str(script), str(tiny), json.dumps(prompts)],
        capture_output=True,
        text=True,
        timeout=360,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-3000:]
    got = json.loads(lines[-1].removeprefix("RESULT "))
    assert got == expected
    assert got[0] != got[1]
