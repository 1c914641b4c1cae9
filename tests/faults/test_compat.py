"""Compatibility, beyond what the end-to-end tests already show with engines
(tests/e2e/test_vllm_sharing.py: other tokenizer, other weights, other KV dtype -> nothing loaded and the
difference named; tests/e2e/test_sglang_sharing.py: vLLM <-> SGLang layouts kept apart).

Here, without engines: another chunk size, another KV layout label and other LoRA adapters give another
fingerprint (so another store namespace: nothing is looked up across them) and the store's manifests name the
field; a replica whose policy's chunk size differs from the running server's is refused at attach.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from e2e.common import policy_for
from faults._matrix import Row, record
from prefixshare.errors import ServerError
from prefixshare.fingerprint import EngineSettings, compute_fingerprint, explain, write_manifest

BASE = {"engine": "vllm", "engine_version": "0.32", "kv_layout": "lmcache-0.5/cpu/L,T,H,KV,D", "kv_dtype": "float32",
        "block_size": 32, "chunk_size": 64}


def _namespace(fp: Any) -> str:
    return f"prefixshare-{fp.digest[:20]}"


@pytest.mark.parametrize(("what", "change", "field"), [
    ("chunk size 64 -> 128", {"chunk_size": 128}, "chunk_size"),
    ("stored-object order in the layout label (L,T,H,KV,D -> KV,L,T,H,D)",
     {"kv_layout": "lmcache-0.5/cpu/KV,L,T,H,D"}, "kv_layout"),
    ("LMCache series in the layout label (lmcache-0.5 -> lmcache-0.6)",
     {"kv_layout": "lmcache-0.6/cpu/L,T,H,KV,D"}, "kv_layout"),
    ("tensor parallel 1 -> 2", {"tp": 2}, "tp"),
    ("LoRA adapter with other weights under the same name", {"lora": (("support", "{lora_b}"),)}, "lora"),
])
def test_other_engine_settings_get_another_namespace_and_are_named(
    tmp_path: Path, model: Path, what: str, change: dict[str, Any], field: str
) -> None:
    lora_a, lora_b = tmp_path / "lora-a", tmp_path / "lora-b"
    for path, weights in ((lora_a, b"A" * 64), (lora_b, b"B" * 64)):
        path.mkdir()
        (path / "adapter_model.safetensors").write_bytes(weights)
        (path / "adapter_config.json").write_text('{"r": 8}')
    base = dict(BASE)
    if field == "lora":
        base["lora"] = (("support", str(lora_a)),)
        change = {"lora": (("support", str(lora_b)),)}
    store = tmp_path / "store"
    store.mkdir()
    fp_a = compute_fingerprint(model, EngineSettings(**base))
    fp_b = compute_fingerprint(model, EngineSettings(**{**base, **change}))
    assert fp_a.digest != fp_b.digest and _namespace(fp_a) != _namespace(fp_b)
    write_manifest(str(store), fp_a)
    report = explain(str(store), fp_b)
    assert report and report[0][1], report  # the store holds only the other fingerprint: named differences
    named = [d.field for d in report[0][1]]
    assert any(field in f for f in named), named
    record(Row("compatibility", f"a replica with another {what} on the same store",
               f"another fingerprint, so another namespace: nothing is looked up across them; the startup "
               f"warning names {named[0]}", engine="none",
               extra={"digests_differ": fp_a.digest != fp_b.digest, "named_fields": named,
                      "differences": [d.message for d in report[0][1]][:3]}))


def test_lora_requests_are_salted_by_adapter_name_and_weights(tmp_path: Path) -> None:
    """Per request, vLLM's LoRA adapter salts the keys: by its name AND a digest of its files, so a base-model
    request never reads an adapter's KV, and two replicas serving different adapters under one name share none."""
    from types import SimpleNamespace

    from prefixshare._log import get_logger
    from prefixshare.runtime import ConnectorRuntime, RequestInfo

    adapters = {}
    for tag, weights in (("v1", b"A" * 64), ("v2", b"B" * 64), ("v1-copy", b"A" * 64)):
        path = tmp_path / tag
        path.mkdir()
        (path / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16}')
        (path / "adapter_model.safetensors").write_bytes(weights)
        adapters[tag] = str(path)
    replica = SimpleNamespace(_lora_ids={}, log=get_logger("test"))
    info = RequestInfo("r", 64)

    def salt(name: str | None, path: str | None) -> str | None:
        lora = ConnectorRuntime.lora_id(replica, name, path)  # type: ignore[arg-type]
        return ConnectorRuntime.salt(None, info, None, lora)  # type: ignore[arg-type]

    salts = {"base": salt(None, None), "support@v1": salt("support", adapters["v1"]),
             "support@v2": salt("support", adapters["v2"]), "support@v1-copy": salt("support", adapters["v1-copy"]),
             "billing@v1": salt("billing", adapters["v1"])}
    assert salts["base"] is None
    assert salts["support@v1"] != salts["support@v2"]  # same name, other weights: other keys
    assert salts["support@v1"] == salts["support@v1-copy"]  # the same adapter files elsewhere: shared
    assert salts["support@v1"] != salts["billing@v1"]
    record(Row("compatibility", "LoRA requests: the base model, two adapters under one name with other weights, "
               "and a copy of one adapter at another path",
               "each adapter salts the keys by name and a digest of its files: no request reads the base model's "
               "or another adapter's KV; the same adapter files share", engine="none",
               extra={"cases": len(salts), "distinct_salts": len(set(salts.values())), "salts": salts}))


@pytest.mark.server
def test_a_replica_whose_chunk_size_differs_from_the_running_server_is_refused(tmp_path: Path) -> None:
    from prefixshare import PrefixShare
    from prefixshare.server import LMCacheServer

    policy = policy_for(tmp_path / "store")
    with LMCacheServer(policy):
        other = policy.to_dict()
        other["chunk_size"] = 128
        from prefixshare.policies import Policy

        with pytest.raises(ServerError) as info:
            PrefixShare(Policy.build(**other), server=False).start()
    assert "chunk_size 64 (policy: 128)" in str(info.value), str(info.value)
    record(Row("compatibility", "a replica whose policy's chunk size (128) differs from the running server's (64)",
               "refused before the engine starts: ServerError naming chunk_size (the keys would never match)",
               engine="none", extra={"message": str(info.value)[:160]}))
