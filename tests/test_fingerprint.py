"""Tests for prefixshare.fingerprint and the ``prefixshare fingerprint`` command.

Every test builds tiny fake Hugging Face model directories in ``tmp_path`` (config.json, a small
safetensors file, tokenizer.json and a tokenizer_config.json with a chat template), so the suite is
fast and needs neither torch nor transformers.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import structlog
from safetensors.numpy import save_file
from typer.testing import CliRunner

from prefixshare.errors import FingerprintError, IncompatibleError
from prefixshare.fingerprint import (
    MANIFEST_DIR,
    EngineSettings,
    Fingerprint,
    _digests,
    check_compatible,
    compute_fingerprint,
    diff,
    explain,
    load_manifest,
    read_manifests,
    write_manifest,
)

SHA = "0123456789abcdef0123456789abcdef01234567"

BASE_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "head_dim": 4,
    "hidden_size": 16,
    "num_attention_heads": 4,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "max_position_embeddings": 128,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.50.0",
    "_name_or_path": "/somewhere/on/host-a",
}
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"


def make_model(
    path: Path,
    *,
    value: float = 1.0,
    config: dict[str, Any] | None = None,
    chat_template: str | None = CHAT_TEMPLATE,
    vocab: dict[str, int] | None = None,
    bos: str = "<s>",
) -> Path:
    """Write a tiny fake HF model directory and return it."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**BASE_CONFIG, **(config or {})}))
    save_file(
        {"embed": np.full((8, 4), value, dtype=np.float32), "lm_head": np.arange(8, dtype=np.float32)},
        str(path / "model.safetensors"),
    )
    (path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab or {"<s>": 0, "a": 1}}}))
    tok_config: dict[str, Any] = {"bos_token": bos, "eos_token": {"content": "</s>"}, "name_or_path": str(path)}
    if chat_template is not None:
        tok_config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return path


def make_lora(path: Path, value: float = 0.5) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": 8, "base_model_name_or_path": str(path)}))
    save_file({"lora_A": np.full((2, 4), value, dtype=np.float32)}, str(path / "adapter_model.safetensors"))
    (path / "README.md").write_text("not part of the digest")
    return path


SETTINGS = EngineSettings(engine="vllm", kv_layout="vllm/fused-kv", block_size=16, chunk_size=256)


def settings(**changes: Any) -> EngineSettings:
    """SETTINGS with ``changes``, validated (``model_copy(update=...)`` would skip validation)."""
    return EngineSettings.model_validate({**SETTINGS.model_dump(), **changes})


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Never touch the user's digest cache; undo any structlog configuration done by the CLI."""
    monkeypatch.setenv("PREFIXSHARE_CACHE_DIR", str(tmp_path / "digest-cache"))
    yield
    structlog.reset_defaults()


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return make_model(tmp_path / "model")


@pytest.fixture
def fp(model: Path) -> Fingerprint:
    return compute_fingerprint(model, SETTINGS)


# -- digest stability ------------------------------------------------------------------------------

_CHILD = """
import sys
from prefixshare.fingerprint import EngineSettings, compute_fingerprint
lora = [("b", sys.argv[2]), ("a", sys.argv[2])]
s = EngineSettings(engine="vllm", kv_layout="vllm/fused-kv", block_size=16, lora=lora)
fp = compute_fingerprint(sys.argv[1], s)
print(fp.digest)
"""


def test_digest_is_identical_across_processes_and_hash_seeds(tmp_path: Path) -> None:
    model = make_model(tmp_path / "model", config={"rope_scaling": {"type": "linear", "factor": 2.0}})
    lora = make_lora(tmp_path / "lora")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(model), str(lora)],
            env={**os.environ, "PYTHONHASHSEED": seed},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in ("0", "1", "random")
    ]
    digests = set()
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr
        digests.add(stdout.strip().splitlines()[-1])  # structlog's default logs to stdout
    local = compute_fingerprint(model, settings(lora=(("a", str(lora)), ("b", str(lora)))))
    assert digests == {local.digest}
    assert len(local.digest) == 32 and local.short == local.digest[:12]


def test_json_round_trip_keeps_digest(fp: Fingerprint) -> None:
    again = Fingerprint.from_json(fp.to_json())
    assert again == fp
    assert again.digest == fp.digest
    assert json.loads(fp.to_json(indent=2))["engine"]["kv_dtype"] == "bfloat16"


def test_equivalent_spellings_give_the_same_digest(tmp_path: Path) -> None:
    a = compute_fingerprint(make_model(tmp_path / "a"), SETTINGS)
    # Same values, other spellings and key order; a different save location and transformers version.
    config = dict(reversed(list(BASE_CONFIG.items())))
    config.update(rope_theta=10000, transformers_version="9.9", _name_or_path="/elsewhere")
    config["dtype"] = "bf16"  # transformers 5 spelling
    del config["torch_dtype"]
    b_dir = make_model(tmp_path / "b")
    (b_dir / "config.json").write_text(json.dumps(config, indent=4))
    b = compute_fingerprint(b_dir, settings(kv_dtype="torch.bfloat16"))
    assert diff(a, b) == []  # tokenizer_config.json's name_or_path differs too: volatile, ignored
    assert a.digest == b.digest
    assert hash(a) == hash(b) == hash(a.digest)


def test_kv_dtype_auto_resolves_to_model_dtype(fp: Fingerprint) -> None:
    assert fp.engine.kv_dtype == "bfloat16"
    assert fp.model.torch_dtype == "bfloat16"


def test_nested_text_config(tmp_path: Path) -> None:
    text = {k: BASE_CONFIG[k] for k in ("num_hidden_layers", "num_key_value_heads", "hidden_size", "rope_theta")}
    config = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "torch_dtype": "float16",
        "text_config": {**text, "num_hidden_layers": 6, "sliding_window": 512},
    }
    model = make_model(tmp_path / "mm")
    (model / "config.json").write_text(json.dumps(config))
    fp = compute_fingerprint(model, SETTINGS)
    assert fp.model.num_hidden_layers == 6
    assert fp.model.sliding_window == 512
    assert fp.model.architectures == ("Gemma3ForConditionalGeneration",)
    assert fp.model.head_dim is None  # missing keys are null
    assert fp.engine.kv_dtype == "float16"


def test_tokenizer_fields(fp: Fingerprint) -> None:
    assert fp.tokenizer.files == ("tokenizer.json", "tokenizer_config.json")
    assert fp.tokenizer.bos_token == "<s>"
    assert fp.tokenizer.eos_token == "</s>"
    assert fp.tokenizer.pad_token is None
    assert fp.tokenizer.chat_template_digest is not None


def test_chat_template_jinja_file_takes_precedence(tmp_path: Path) -> None:
    a = make_model(tmp_path / "a")
    b = make_model(tmp_path / "b")
    (b / "chat_template.jinja").write_text("{{ other }}")
    fa, fb = compute_fingerprint(a, SETTINGS), compute_fingerprint(b, SETTINGS)
    assert [d.field for d in diff(fa, fb)] == ["tokenizer.chat_template_digest"]


# -- weights identity ------------------------------------------------------------------------------


def test_same_shape_different_values_differ_in_content_mode(tmp_path: Path) -> None:
    a = compute_fingerprint(make_model(tmp_path / "a", value=1.0), SETTINGS)
    b = compute_fingerprint(make_model(tmp_path / "b", value=2.0), SETTINGS)
    assert a.digest != b.digest
    assert a.weights.files[0].size == b.weights.files[0].size
    messages = [d.message for d in diff(a, b)]
    assert any(m.startswith("weights differ (content digest") for m in messages)
    assert any("model.safetensors content" in m for m in messages)


def test_same_shape_different_values_collide_in_headers_mode(tmp_path: Path) -> None:
    """Expected and documented: headers mode only sees names, dtypes, shapes, offsets and sizes."""
    a = compute_fingerprint(make_model(tmp_path / "a", value=1.0), SETTINGS, weights="headers")
    b = compute_fingerprint(make_model(tmp_path / "b", value=2.0), SETTINGS, weights="headers")
    assert a.weights.mode == "headers"
    assert a.digest == b.digest
    # ...but a different shape is still caught.
    c_dir = make_model(tmp_path / "c")
    save_file({"embed": np.ones((9, 4), dtype=np.float32)}, str(c_dir / "model.safetensors"))
    c = compute_fingerprint(c_dir, SETTINGS, weights="headers")
    assert a.digest != c.digest


def test_content_and_headers_modes_never_match(model: Path) -> None:
    a = compute_fingerprint(model, SETTINGS)
    b = compute_fingerprint(model, SETTINGS, weights="headers")
    fields = {d.field for d in diff(a, b)}
    assert {"weights.mode", "weights.digest"} <= fields


def test_weight_files_are_sorted_and_training_artefacts_skipped(model: Path) -> None:
    save_file({"x": np.zeros(2, dtype=np.float32)}, str(model / "a-extra.safetensors"))
    (model / "training_args.bin").write_bytes(b"pickle")
    (model / ".hidden.safetensors").write_bytes(b"no")
    fp = compute_fingerprint(model, SETTINGS)
    assert [f.path for f in fp.weights.files] == ["a-extra.safetensors", "model.safetensors"]


def test_revision_detection(tmp_path: Path) -> None:
    snap = make_model(tmp_path / "models--org--m" / "snapshots" / SHA)
    assert compute_fingerprint(snap, SETTINGS).weights.revision == SHA
    # A cache repository folder is followed through refs/main.
    (tmp_path / "models--org--m" / "refs").mkdir()
    (tmp_path / "models--org--m" / "refs" / "main").write_text(SHA)
    assert compute_fingerprint(tmp_path / "models--org--m", SETTINGS).weights.revision == SHA
    plain = make_model(tmp_path / "plain")
    assert compute_fingerprint(plain, SETTINGS).weights.revision is None
    (plain / ".revision").write_text("abc123\n")
    assert compute_fingerprint(plain, SETTINGS).weights.revision == "abc123"
    assert compute_fingerprint(plain, SETTINGS, revision="explicit").weights.revision == "explicit"


def test_revision_counts_only_in_headers_mode(model: Path) -> None:
    a = compute_fingerprint(model, SETTINGS, revision="r1")
    b = compute_fingerprint(model, SETTINGS, revision="r2")
    assert a.digest == b.digest  # content mode: the bytes are the identity
    ha = compute_fingerprint(model, SETTINGS, weights="headers", revision="r1")
    hb = compute_fingerprint(model, SETTINGS, weights="headers", revision="r2")
    assert [d.message for d in diff(ha, hb)] == ["weights revision differs: r1 vs r2"]


# -- digest cache ----------------------------------------------------------------------------------


@pytest.fixture
def count_hashes(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    calls: list[Path] = []
    real = _digests.hash_file

    def counting(path: Path) -> str:
        calls.append(path)
        return real(path)

    monkeypatch.setattr(_digests, "hash_file", counting)
    return calls


def test_cache_avoids_rehashing_and_notices_touched_files(
    model: Path, tmp_path: Path, count_hashes: list[Path]
) -> None:
    first = compute_fingerprint(model, SETTINGS)
    assert len(count_hashes) == 1
    cache_file = tmp_path / "digest-cache" / "digests.json"
    assert cache_file.is_file()
    second = compute_fingerprint(model, SETTINGS)  # a fresh cache object: like a restart
    assert len(count_hashes) == 1
    assert second.digest == first.digest
    weights = model / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    third = compute_fingerprint(model, SETTINGS)
    assert len(count_hashes) == 2
    assert third.digest == first.digest


def test_cache_dir_argument_and_corrupt_cache(model: Path, tmp_path: Path, count_hashes: list[Path]) -> None:
    cache = tmp_path / "explicit-cache"
    cache.mkdir()
    (cache / "digests.json").write_text("{not json")
    fp = compute_fingerprint(model, SETTINGS, cache_dir=cache)
    assert len(count_hashes) == 1
    data = json.loads((cache / "digests.json").read_text())  # rewritten, valid again
    assert str(model.resolve() / "model.safetensors") in data["entries"]
    assert compute_fingerprint(model, SETTINGS, cache_dir=cache).digest == fp.digest
    assert len(count_hashes) == 1
    assert not (tmp_path / "digest-cache").exists()


def test_unwritable_cache_dir_is_not_fatal(model: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "file-not-dir"
    blocker.write_text("")
    assert compute_fingerprint(model, SETTINGS, cache_dir=blocker / "sub").weights.digest


# -- diffs -----------------------------------------------------------------------------------------


def _rewrite_tokenizer(d: Path) -> None:
    (d / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"<s>": 0, "b": 1}}}))


def _rewrite_chat_template(d: Path) -> None:
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ messages | tojson }}"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))


def _rewrite_weights(d: Path) -> None:
    save_file(
        {"embed": np.full((8, 4), 3.0, dtype=np.float32), "lm_head": np.arange(8, dtype=np.float32)},
        str(d / "model.safetensors"),
    )


def _rewrite_config(**changes: Any) -> Callable[[Path], None]:
    def apply(d: Path) -> None:
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(changes)
        (d / "config.json").write_text(json.dumps(cfg))

    return apply


def _rewrite_bos(d: Path) -> None:
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["bos_token"] = "<|begin|>"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))


CASES: list[tuple[str, dict[str, Any], Callable[[Path], None] | None, str, str]] = [
    # (id, settings changes, model dir change, expected field, expected words in message)
    ("tokenizer", {}, _rewrite_tokenizer, "tokenizer.digest", "tokenizer differs: tokenizer files digest"),
    (
        "chat-template",
        {},
        _rewrite_chat_template,
        "tokenizer.chat_template_digest",
        "tokenizer differs: chat template digest",
    ),
    ("bos-token", {}, _rewrite_bos, "tokenizer.bos_token", "tokenizer differs: bos token '<s>' vs '<|begin|>'"),
    ("kv-dtype", {"kv_dtype": "float32"}, None, "engine.kv_dtype", "engine.kv_dtype: bfloat16 vs float32"),
    (
        "layout",
        {"kv_layout": "sglang/split-kv:token-major"},
        None,
        "engine.kv_layout",
        "engine KV layout differs: vllm/fused-kv vs sglang/split-kv:token-major",
    ),
    ("weights", {}, _rewrite_weights, "weights.digest", "weights differ (content digest"),
    ("block-size", {"block_size": 32}, None, "engine.block_size", "engine.block_size: 16 vs 32"),
    ("chunk-size", {"chunk_size": 512}, None, "engine.chunk_size", "engine.chunk_size: 256 vs 512"),
    ("tp", {"tp": 2}, None, "engine.tp", "engine.tp: 1 vs 2"),
    ("pp", {"pp": 2}, None, "engine.pp", "engine.pp: 1 vs 2"),
    ("lora", {"lora": "LORA"}, None, "engine.lora", "engine LoRA adapters differ: only in b: sql"),
    ("tenant", {"tenant": "acme"}, None, "tenant", "tenant differs: unset vs 'acme'"),
    (
        "rope-theta",
        {},
        _rewrite_config(rope_theta=500000.0),
        "model.rope_theta",
        "model config differs: rope_theta 10000.0 vs 500000.0",
    ),
    (
        "rope-scaling",
        {},
        _rewrite_config(rope_scaling={"type": "yarn", "factor": 4.0}),
        "model.rope_scaling",
        'model config differs: rope_scaling unset vs {"factor":4.0,"type":"yarn"}',
    ),
    (
        "layers",
        {},
        _rewrite_config(num_hidden_layers=3),
        "model.num_hidden_layers",
        "model config differs: num_hidden_layers 2 vs 3",
    ),
    (
        "other-config-key",
        {},
        _rewrite_config(attention_bias=True),
        "model.config_digest",
        "model config.json differs (config digest",
    ),
]


@pytest.mark.parametrize(
    ("settings_change", "dir_change", "field", "words"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_each_change_is_named(
    tmp_path: Path,
    settings_change: dict[str, Any],
    dir_change: Callable[[Path], None] | None,
    field: str,
    words: str,
) -> None:
    a_dir = make_model(tmp_path / "a")
    b_dir = make_model(tmp_path / "b")
    if dir_change:
        dir_change(b_dir)
    if settings_change.get("lora") == "LORA":
        settings_change = {"lora": [("sql", make_lora(tmp_path / "lora"))]}
    a = compute_fingerprint(a_dir, SETTINGS)
    b = compute_fingerprint(b_dir, settings(**settings_change))
    differences = diff(a, b)
    assert field in {d.field for d in differences}, differences
    assert any(words in d.message for d in differences), [d.message for d in differences]
    assert a.digest != b.digest
    with pytest.raises(IncompatibleError) as info:
        check_compatible(a, b)
    assert any(words in text for text in info.value.differences)


def test_settings_changes_touch_only_their_field(tmp_path: Path) -> None:
    a_dir = make_model(tmp_path / "a")
    a = compute_fingerprint(a_dir, SETTINGS)
    b = compute_fingerprint(a_dir, settings(kv_dtype="float32", tp=4))
    assert [d.field for d in diff(a, b)] == ["engine.kv_dtype", "engine.tp"]
    d = diff(a, b)[0]
    assert (d.a, d.b, str(d)) == ("bfloat16", "float32", "engine.kv_dtype: bfloat16 vs float32")


def test_lora_adapter_content_change(tmp_path: Path, model: Path) -> None:
    lora = make_lora(tmp_path / "lora", value=0.5)
    a = compute_fingerprint(model, settings(lora=[("sql", str(lora))]))
    (lora / "README.md").write_text("edited: not part of the adapter digest")
    assert compute_fingerprint(model, settings(lora=[("sql", str(lora))])) == a
    moved = make_lora(tmp_path / "elsewhere", value=0.5)  # same files at another path: same digest
    assert compute_fingerprint(model, settings(lora=[("sql", str(moved))])) == a
    make_lora(lora, value=0.75)
    b = compute_fingerprint(model, settings(lora=[("sql", str(lora))]))
    assert [x.message.split(" files")[0] for x in diff(a, b)] == ["engine LoRA adapters differ: adapter 'sql'"]


def test_identical_fingerprints_have_no_differences(fp: Fingerprint, model: Path) -> None:
    assert diff(fp, compute_fingerprint(model, SETTINGS)) == []
    check_compatible(fp, fp)


# -- errors ----------------------------------------------------------------------------------------


def test_missing_config_names_the_path(tmp_path: Path) -> None:
    model = make_model(tmp_path / "m")
    (model / "config.json").unlink()
    with pytest.raises(FingerprintError, match=str(model / "config.json")):
        compute_fingerprint(model, SETTINGS)


@pytest.mark.parametrize(
    ("breakage", "match"),
    [
        (lambda d: (d / "config.json").write_text("{oops"), "config.json is not valid JSON"),
        (lambda d: (d / "model.safetensors").unlink(), "no weight files"),
        (lambda d: (d / "tokenizer_config.json").write_text("[1]"), "tokenizer_config.json must hold a JSON object"),
        (
            lambda d: (d / "config.json").write_text(json.dumps({**BASE_CONFIG, "torch_dtype": None})),
            "has no torch_dtype",
        ),
        (
            lambda d: (d / "config.json").write_text(json.dumps({**BASE_CONFIG, "num_hidden_layers": "many"})),
            "config.json has unexpected values",
        ),
    ],
    ids=["bad-json", "no-weights", "bad-tokenizer-config", "no-dtype", "bad-value"],
)
def test_bad_model_dirs(tmp_path: Path, breakage: Callable[[Path], Any], match: str) -> None:
    model = make_model(tmp_path / "m")
    breakage(model)
    with pytest.raises(FingerprintError, match=match):
        compute_fingerprint(model, SETTINGS)


def test_other_bad_inputs(tmp_path: Path, model: Path) -> None:
    with pytest.raises(FingerprintError, match="does not exist"):
        compute_fingerprint(tmp_path / "nope", SETTINGS)
    with pytest.raises(FingerprintError, match="LoRA adapter 'x'"):
        compute_fingerprint(model, settings(lora=(("x", str(tmp_path / "nope")),)))
    with pytest.raises(FingerprintError, match="weights must be"):
        compute_fingerprint(model, SETTINGS, weights="bytes")  # type: ignore[arg-type]


def test_dangling_weights_symlink_names_the_path(model: Path) -> None:
    (model / "model-00002.safetensors").symlink_to(model / "gone.safetensors")
    with pytest.raises(FingerprintError, match=re.escape("model-00002.safetensors")):
        compute_fingerprint(model, SETTINGS)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files regardless of their mode")
def test_unreadable_weights_name_the_path(model: Path) -> None:
    weights = model / "model.safetensors"
    weights.chmod(0)
    try:
        with pytest.raises(FingerprintError, match=str(weights)):
            compute_fingerprint(model, SETTINGS)
    finally:
        weights.chmod(0o644)


def test_engine_settings_validation() -> None:
    with pytest.raises(ValueError):
        EngineSettings(engine="vllm", tp=0)
    with pytest.raises(ValueError, match="unique"):
        EngineSettings(engine="vllm", lora=[("a", "/x"), ("a", "/y")])
    s = EngineSettings(engine=" VLLM ", kv_dtype="BF16", lora=[("a", Path("/x"))])
    assert (s.engine, s.kv_dtype, s.lora) == ("vllm", "bfloat16", (("a", "/x"),))


def test_import_is_light() -> None:
    code = (
        "import sys, prefixshare.fingerprint\n"
        "heavy = [m for m in ('torch', 'transformers', 'lmcache', 'vllm', 'sglang') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# -- manifests -------------------------------------------------------------------------------------


def _memory_store() -> str:
    return f"memory://prefixshare-tests/{uuid.uuid4().hex}"


@pytest.mark.parametrize("kind", ["local", "file-url", "memory"])
def test_manifest_round_trip(kind: str, tmp_path: Path, fp: Fingerprint) -> None:
    store = {"local": str(tmp_path / "store"), "file-url": f"file://{tmp_path}/store", "memory": _memory_store()}[kind]
    written = write_manifest(store, fp, extra={"replica": "a", "port": 8000})
    assert written.url is not None and written.url.endswith(f"{MANIFEST_DIR}/{fp.digest}.json")
    manifests = read_manifests(store)
    assert len(manifests) == 1 and manifests.corrupt == []
    got = manifests[0]
    assert got.fingerprint == fp and got.digest == fp.digest
    assert got.extra == {"replica": "a", "port": 8000}
    assert got.host and got.prefixshare_version and got.created_at.tzinfo is not None
    # Writing the same fingerprint again replaces its manifest.
    write_manifest(store, fp)
    assert len(read_manifests(store)) == 1


def test_read_manifests_of_empty_store(tmp_path: Path) -> None:
    assert read_manifests(tmp_path / "none") == []
    assert read_manifests(_memory_store()) == []


def test_manifest_permissions(tmp_path: Path, fp: Fingerprint) -> None:
    old = os.umask(0)  # even with a permissive umask
    try:
        write_manifest(tmp_path / "store", fp)
    finally:
        os.umask(old)
    path = tmp_path / "store" / MANIFEST_DIR / f"{fp.digest}.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o750
    assert stat.S_IMODE(path.parent.parent.stat().st_mode) == 0o750
    assert not list(path.parent.glob("*.tmp"))


def test_tampered_and_corrupt_manifests_are_skipped_and_reported(tmp_path: Path, fp: Fingerprint) -> None:
    store = tmp_path / "store"
    other = fp.model_copy(update={"tenant": "other"})
    write_manifest(store, fp)
    write_manifest(store, other)
    path = store / MANIFEST_DIR / f"{fp.digest}.json"
    data = json.loads(path.read_text())
    data["fingerprint"]["engine"]["kv_dtype"] = "float32"  # a hand edit
    path.write_text(json.dumps(data))
    (store / MANIFEST_DIR / "garbage.json").write_text("not json")
    manifests = read_manifests(store)
    assert [m.digest for m in manifests] == [other.digest]
    reasons = {Path(c.url).name: c.reason for c in manifests.corrupt}
    assert "integrity checksum" in reasons[path.name]
    assert "not valid JSON" in reasons["garbage.json"]
    with pytest.raises(FingerprintError, match="integrity checksum"):
        load_manifest(path.read_text())


def test_manifest_renamed_to_another_digest_is_rejected(tmp_path: Path, fp: Fingerprint) -> None:
    store = tmp_path / "store"
    write_manifest(store, fp)
    src = store / MANIFEST_DIR / f"{fp.digest}.json"
    src.rename(src.with_name("0" * 32 + ".json"))
    manifests = read_manifests(store)
    assert manifests == [] and "named after another digest" in manifests.corrupt[0].reason


def test_explain_orders_closest_first(fp: Fingerprint) -> None:
    store = _memory_store()
    far = fp.model_copy(update={"tenant": "x", "engine": fp.engine.model_copy(update={"tp": 8, "kv_dtype": "fp8"})})
    near = fp.model_copy(update={"engine": fp.engine.model_copy(update={"chunk_size": 128})})
    for f in (far, near, fp):
        write_manifest(store, f)
    result = explain(store, fp)
    assert [len(d) for _, d in result] == [0, 1, 3]
    assert result[1][1][0].message == "engine.chunk_size: 256 vs 128"


# -- CLI -------------------------------------------------------------------------------------------


def _run(cli: Any, *args: str) -> Any:
    return CliRunner().invoke(cli, ["fingerprint", *args])


def test_cli_table(cli: Any, model: Path, fp: Fingerprint) -> None:
    result = _run(cli, str(model), "--kv-layout", "vllm/fused-kv", "--block-size", "16")
    assert result.exit_code == 0, result.output
    assert fp.digest in result.stdout
    assert "engine.kv_layout" in result.stdout and "vllm/fused-kv" in result.stdout


def test_cli_json(cli: Any, model: Path, fp: Fingerprint) -> None:
    result = _run(cli, str(model), "--kv-layout", "vllm/fused-kv", "--block-size", "16", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["digest"] == fp.digest
    assert Fingerprint.model_validate(data["fingerprint"]) == fp


def test_cli_lora_and_headers(cli: Any, tmp_path: Path, model: Path) -> None:
    lora = make_lora(tmp_path / "lora")
    result = _run(cli, str(model), "--lora", f"sql={lora}", "--weights", "headers", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["fingerprint"]["weights"]["mode"] == "headers"
    assert [x["name"] for x in data["fingerprint"]["engine"]["lora"]] == ["sql"]


def test_cli_against_model_dirs(cli: Any, tmp_path: Path, model: Path) -> None:
    same = make_model(tmp_path / "same")
    other = make_model(tmp_path / "other", value=2.0)
    assert _run(cli, str(model), "--against", str(same)).exit_code == 0
    result = _run(cli, str(model), "--against", str(other))
    assert result.exit_code == 1
    assert "weights differ (content digest" in result.stdout
    result = _run(cli, str(model), "--against", str(other), "--json")
    assert result.exit_code == 1
    data = json.loads(result.stdout)
    assert data["identical"] is False
    assert "weights.digest" in {d["field"] for d in data["comparisons"][0]["differences"]}


def test_cli_against_manifest_and_fingerprint_files(cli: Any, tmp_path: Path, model: Path) -> None:
    base = ["--kv-layout", "vllm/fused-kv", "--block-size", "16"]
    fp = compute_fingerprint(model, SETTINGS)
    manifest = write_manifest(tmp_path / "store", fp)
    assert manifest.url is not None
    assert _run(cli, str(model), *base, "--against", manifest.url).exit_code == 0
    result = _run(cli, str(model), *base, "--kv-dtype", "float32", "--against", manifest.url)
    assert result.exit_code == 1
    assert "engine.kv_dtype: float32 vs bfloat16" in result.stdout
    # this command's own --json output works as a fingerprint file
    dumped = tmp_path / "fp.json"
    dumped.write_text(_run(cli, str(model), *base, "--json").stdout)
    assert _run(cli, str(model), *base, "--against", str(dumped)).exit_code == 0


def test_cli_against_store(cli: Any, tmp_path: Path, model: Path) -> None:
    base = ["--kv-layout", "vllm/fused-kv", "--block-size", "16"]
    fp = compute_fingerprint(model, SETTINGS)
    for store in (str(tmp_path / "store"), _memory_store()):
        write_manifest(store, fp.model_copy(update={"tenant": "t1"}))
        result = _run(cli, str(model), *base, "--against", store)
        assert result.exit_code == 1
        assert "tenant differs: unset vs 't1'" in result.stdout
        write_manifest(store, fp)
        result = _run(cli, str(model), *base, "--against", store)
        assert result.exit_code == 0, result.output
        assert "identical" in result.stdout
    empty = _run(cli, str(model), "--against", _memory_store())
    assert empty.exit_code == 1 and "no manifests" in empty.stdout


def test_cli_against_store_hints_at_engine_options_left_at_their_defaults(cli: Any, tmp_path: Path,
                                                                          model: Path) -> None:
    store = str(tmp_path / "store")
    write_manifest(store, compute_fingerprint(model, SETTINGS))  # kv_layout vllm/fused-kv, block_size 16
    result = _run(cli, str(model), "--against", store)
    assert result.exit_code == 1
    assert "engine KV layout differs: unknown vs vllm/fused-kv" in result.stdout
    assert "hint:" in result.stdout and "rerun with --kv-layout vllm/fused-kv --block-size 16" in result.stdout
    same = _run(cli, str(model), "--against", store, "--kv-layout", "vllm/fused-kv", "--block-size", "16")
    assert same.exit_code == 0 and "hint:" not in same.stdout
    # an option the user passed is a real difference: no hint
    chosen = _run(cli, str(model), "--against", store, "--kv-layout", "vllm/fused-kv", "--block-size", "8")
    assert chosen.exit_code == 1 and "engine.block_size: 8 vs 16" in chosen.stdout and "hint:" not in chosen.stdout
    # nor when something else than engine options differs
    other = make_model(tmp_path / "other", value=2.0)
    assert "hint:" not in _run(cli, str(other), "--against", store).stdout


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--lora", "oops"], "NAME=PATH"),
        (["--tp", "0"], "--tp"),
        (["--against", "/does/not/exist"], "no such file"),
    ],
)
def test_cli_bad_input_exit_2(cli: Any, model: Path, args: list[str], words: str) -> None:
    result = _run(cli, str(model), *args)
    assert result.exit_code == 2, result.output
    assert words in result.output


def test_cli_missing_model_dir(cli: Any, tmp_path: Path) -> None:
    result = _run(cli, str(tmp_path / "missing"))
    assert result.exit_code == 2
    assert "does not exist" in result.output


def test_engine_name_counts_only_when_the_layout_is_unknown(tmp_path: Path) -> None:
    """The declared KV layout decides whether bytes are usable; with no layout, the engine must match."""
    model = make_model(tmp_path / "m")
    declared = [EngineSettings(engine=e, engine_version=v, kv_layout="canonical/test", kv_dtype="float32")
                for e, v in (("vllm", "0.32"), ("sglang", "0.5"))]
    a, b = (compute_fingerprint(model, s, cache_dir=tmp_path) for s in declared)
    assert a.digest == b.digest and diff(a, b) == []
    unknown = [s.model_copy(update={"kv_layout": "unknown"}) for s in declared]
    a, b = (compute_fingerprint(model, s, cache_dir=tmp_path) for s in unknown)
    fields = {d.field for d in diff(a, b)}
    assert {"engine.engine", "engine.engine_version"} <= fields
