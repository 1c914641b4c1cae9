"""Cross-replica prefix sharing with real SGLang CPU engines, and vLLM <-> SGLang safety.

SGLang runs with the test-only ``sgl_kernel`` stand-in from tests/shims (our AVX2 CPUs have no kernel
wheel). Every replica is a fresh process; outputs are compared with a cold SGLang engine (greedy ids
exactly, logprobs within 1e-4), with the same negative controls as the vLLM tests. Cross-engine: the
two engines write different byte layouts under what would be the same key, so each must load nothing
of the other's KV — and a bit-level comparison checks that the fingerprint's layout labels tell the
truth (equal labels if and only if equal stored bytes).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.common import (
    CHUNK,
    SHIM_ENV,
    corrupt_copy,
    document_ids,
    hf_greedy,
    http_server,
    policy_for,
    post_json,
    run_replica,
    same_output,
    write_policy_file,
)
from prefixshare.server import LMCacheServer

pytestmark = [pytest.mark.engine, pytest.mark.server]

DOC_TOKENS = 1000
SGL = {"engine_type": "sglang", "timeout": 300}


def req(ids: list[int], **settings: Any) -> dict[str, Any]:
    return {"prompt_token_ids": ids, "max_tokens": 12, **settings}


@pytest.fixture(scope="module")
def prompts(models: dict[str, Path]) -> dict[str, list[int]]:
    sizes = {"doc": (13, DOC_TOKENS), "short": (14, 200), "pinned": (15, 200), "tenant": (16, 600),
             "doc2": (17, 500), "doc3": (18, 500)}
    return {name: document_ids(models["main"], seed, n) for name, (seed, n) in sizes.items()}


@pytest.fixture(scope="module")
def store(work: Path) -> Path:
    return work / "store"


@pytest.fixture(scope="module")
def server(store: Path) -> Iterator[LMCacheServer]:
    with LMCacheServer(policy_for(store)) as srv:
        yield srv


@pytest.fixture(scope="module")
def cold(work: Path, models: dict[str, Path], prompts: dict[str, list[int]]) -> dict[str, Any]:
    names = ["doc", "short", "pinned", "tenant", "doc3"]
    result = run_replica(work, "sgl-cold", models["main"], None, [req(prompts[n]) for n in names], **SGL)
    return dict(zip(names, result["results"], strict=True))


@pytest.fixture(scope="module")
def replica_a(work: Path, models: dict[str, Path], prompts: dict[str, list[int]], server: LMCacheServer) -> dict[str, Any]:
    requests = [
        req(prompts["doc"]),
        req(prompts["short"]),  # 200 tokens < min_tokens 256 and not pinned: not stored
        req(prompts["pinned"], document_id="manual-9"),  # short but pinned: stored
        req(prompts["tenant"], tenant="acme"),
    ]
    return run_replica(work, "sgl-a", models["main"], server.policy, requests, **SGL)


@pytest.fixture(scope="module")
def replica_b(work: Path, models: dict[str, Path], prompts: dict[str, list[int]], server: LMCacheServer,
              replica_a: dict[str, Any]) -> dict[str, Any]:
    requests = [
        req(prompts["doc"]),
        req(prompts["short"]),
        req(prompts["pinned"], document_id="manual-9"),
        req(prompts["tenant"], tenant="globex"),
        req(prompts["tenant"], tenant="acme"),
    ]
    return run_replica(work, "sgl-b", models["main"], server.policy, requests, server_args=True, **SGL)  # ServerArgs form


def test_fresh_sglang_replica_loads_the_document_from_the_store(
    replica_a: dict[str, Any], replica_b: dict[str, Any], cold: dict[str, Any]
) -> None:
    a, b = replica_a["results"][0], replica_b["results"][0]
    assert a["storage_tokens"] == 0 and same_output(a, cold["doc"])
    assert b["storage_tokens"] >= 0.9 * DOC_TOKENS, b  # storage hits on its FIRST request
    assert same_output(b, cold["doc"])
    stats = replica_b["stats"]
    assert stats["tokens_loaded"] >= b["storage_tokens"] and stats["hits"] >= 1
    assert stats["bytes_loaded"] == stats["tokens_loaded"] * stats["kv_bytes_per_token"]


def test_sglang_admission_and_tenants(
    replica_a: dict[str, Any], replica_b: dict[str, Any], cold: dict[str, Any], prompts: dict[str, list[int]],
    store: Path,
) -> None:
    short, pinned, other, same = replica_b["results"][1:5]
    assert short["storage_tokens"] == 0 and same_output(short, cold["short"])
    assert pinned["storage_tokens"] == 192 and same_output(pinned, cold["pinned"])
    assert replica_a["stats"]["refused"] == {"min_tokens": 1}
    assert other["storage_tokens"] == 0 and same_output(other, cold["tenant"])  # tenants never hit each other
    assert same["storage_tokens"] >= 576 and same_output(same, cold["tenant"])
    # the store's objects, by chunk hash: the refused short prompt wrote none, the pinned one all of its own
    from prefixshare.warm import ChunkHasher

    hasher = ChunkHasher(CHUNK)
    namespace = replica_a["stats"]["namespace"]
    unsalted = {f.name.split("@")[3].removesuffix(".data") for f in store.glob(f"{namespace}@*.data")
                if f.name.count("@") == 3}
    assert not set(hasher.hashes(prompts["short"])) & unsalted
    assert set(hasher.hashes(prompts["pinned"])) <= unsalted
    assert len(unsalted) == DOC_TOKENS // CHUNK + 200 // CHUNK  # the document and the pinned prompt, nothing else
    for tenant in ("acme", "globex"):
        assert len(list(store.glob(f"{namespace}@*@t-{tenant}.data"))) == 600 // CHUNK


def test_sglang_http_server_replica_is_covered_too(
    work: Path, models: dict[str, Path], prompts: dict[str, list[int]], server: LMCacheServer,
    replica_a: dict[str, Any], cold: dict[str, Any],
) -> None:
    """A replica behind SGLang's HTTP server, started with the command and environment `prefixshare sglang-args`
    prints; a /generate request carries the document id in its rid, as request_kwargs builds it."""
    import sys

    from conftest import free_port
    from prefixshare.adapters.sglang import request_kwargs, serve_args

    policy_file = write_policy_file(work / "sgl-serve-policy.yaml", server.policy)
    argv, env = serve_args(server.policy, str(models["main"]), policy_file=str(policy_file), instance="sgl-http")
    assert argv[:3] == ["python", "-m", "sglang.launch_server"]
    port = free_port()
    argv = [sys.executable, *argv[1:], "--host", "127.0.0.1", "--port", str(port),
            # SGLang's CPU engine (tests/helpers/sglang_replica.py runs it with the same settings)
            "--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph", "--page-size", "16",
            "--dtype", "float32", "--mem-fraction-static", "0.3", "--max-total-tokens", "16384", "--random-seed", "0"]
    with http_server(argv, {**env, "SGLANG_USE_CPU_ENGINE": "1", **SHIM_ENV}, work / "sgl-http-server.log",
                     port) as url:
        answer = post_json(f"{url}/generate", {
            "input_ids": prompts["doc"], "return_logprob": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True},
            **request_kwargs(document_id="manual-http")})
    meta = answer["meta_info"]
    assert int((meta.get("cached_tokens_details") or {}).get("storage") or 0) >= 0.9 * DOC_TOKENS, meta
    result = {"token_ids": answer["output_ids"], "logprobs": [x[0] for x in meta["output_token_logprobs"]]}
    assert same_output(result, cold["doc"])


@pytest.mark.parametrize(("variant", "field"), [("other_tok", "tokenizer"), ("other_weights", "weights")])
def test_incompatible_sglang_replicas_load_nothing_and_say_why(
    work: Path, models: dict[str, Path], prompts: dict[str, list[int]], server: LMCacheServer,
    replica_a: dict[str, Any], cold: dict[str, Any], variant: str, field: str,
) -> None:
    out = run_replica(work, f"sgl-incompatible-{field}", models[variant], server.policy, [req(prompts["doc"])], **SGL)
    result = out["results"][0]
    assert result["storage_tokens"] == 0 and out["stats"]["tokens_loaded"] == 0  # same ids, same store: nothing
    warnings = _incompatible_events(out)
    assert len(warnings) == 1 and any(field in d for d in warnings[0]["differences"]), out["events"]
    if variant == "other_tok":
        assert same_output(result, cold["doc"])  # the same weights on the same ids: the cold answer
    else:
        assert result["token_ids"] == hf_greedy(models[variant], [prompts["doc"]], 12)[0]  # its own cold answer


def test_sglang_corrupted_chunks_change_the_output_unless_checked(
    work: Path, models: dict[str, Path], prompts: dict[str, list[int]], store: Path, replica_a: dict[str, Any],
    cold: dict[str, Any],
) -> None:
    """Without integrity checks the noisy KV is loaded and changes the answer (the KV is really used); with them
    (the default) it is refused and SGLang answers like a cold engine."""
    bad = corrupt_copy(store, work / "corrupt-store")
    unchecked = policy_for(bad, l2=[{"type": "fs", "base_path": str(bad), "integrity": "none"}])
    with LMCacheServer(unchecked) as srv:
        result = run_replica(work, "sgl-corrupt", models["main"], srv.policy, [req(prompts["doc"])], **SGL)
    loaded = result["results"][0]
    assert loaded["storage_tokens"] >= 0.9 * DOC_TOKENS and not same_output(loaded, cold["doc"])
    with LMCacheServer(policy_for(bad)) as srv:
        checked = run_replica(work, "sgl-corrupt-checked", models["main"], srv.policy, [req(prompts["doc"])], **SGL)
    refused = checked["results"][0]
    assert refused["storage_tokens"] == 0 and same_output(refused, cold["doc"])


def test_sglang_store_down_means_recompute(
    work: Path, models: dict[str, Path], prompts: dict[str, list[int]], cold: dict[str, Any]
) -> None:
    srv = LMCacheServer(policy_for(work / "down-store")).start()
    try:
        out = run_replica(work, "sgl-down", models["main"], srv.policy, [req(prompts["doc2"]), req(prompts["doc3"])],
                          kill_before={"1": srv.pid}, **SGL)
    finally:
        srv.stop()
    after = out["results"][1]
    assert same_output(after, cold["doc3"]) and after["storage_tokens"] == 0
    assert after["seconds"] <= cold["doc3"]["seconds"] + srv.policy.load.timeout_s + 1.0, after["seconds"]


# --- vLLM <-> SGLang -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cross(work: Path, models: dict[str, Path], prompts: dict[str, list[int]]) -> dict[str, Any]:
    """vLLM and SGLang replicas on one store, in both orders, plus each engine's own store for bit comparison."""
    out: dict[str, Any] = {}
    shared = work / "cross-store"
    with LMCacheServer(policy_for(shared)) as srv:
        out["vllm_writes"] = run_replica(work, "x-vllm-a", models["main"], srv.policy, [req(prompts["doc"])])
        out["sglang_reads"] = run_replica(work, "x-sgl-b", models["main"], srv.policy, [req(prompts["doc"])], **SGL)
        out["vllm_reads"] = run_replica(work, "x-vllm-b", models["main"], srv.policy,
                                        [req(prompts["doc"]), req(prompts["tenant"])])
    out["store"] = shared
    return out


def _incompatible_events(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in result["events"] if e.get("event") == "store.incompatible"]


def test_vllm_written_kv_is_refused_by_sglang_and_the_reverse(cross: dict[str, Any], cold: dict[str, Any]) -> None:
    sgl = cross["sglang_reads"]["results"][0]
    assert sgl["storage_tokens"] == 0 and same_output(sgl, cold["doc"])  # correct cold output, nothing loaded
    assert cross["sglang_reads"]["stats"]["tokens_loaded"] == 0
    reasons = _incompatible_events(cross["sglang_reads"])
    assert reasons and any("KV layout" in d for d in reasons[0]["differences"]), cross["sglang_reads"]["events"]
    # both namespaces side by side: SGLang wrote its own in between; vLLM keeps hitting only its own
    vllm_doc = cross["vllm_reads"]["results"][0]
    assert vllm_doc["num_cached_tokens"] >= 0.9 * DOC_TOKENS  # its own engine's KV: a hit
    sgl_ns = cross["sglang_reads"]["stats"]["namespace"]
    vllm_ns = cross["vllm_reads"]["stats"]["namespace"]
    assert sgl_ns != vllm_ns
    assert _namespaces(cross["store"]) == {sgl_ns, vllm_ns}


def _objects(store: Path, namespace: str | None = None) -> dict[str, bytes]:
    """A store's chunk objects, {chunk hash: bytes}, of one namespace (all when None)."""
    files = [p for p in store.glob("*.data") if p.name.count("@") == 3]
    return {p.name.split("@")[3]: p.read_bytes() for p in files if namespace in (None, p.name.split("@")[0])}


def _namespaces(store: Path) -> set[str]:
    return {p.name.split("@")[0] for p in store.glob("*.data")}


def _objects_per_engine(work: Path, model: Path, ids: list[int], tag: str,
                        engines: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The same tokens stored by each engine into a store of its own: {engine: {chunk hash: bytes}}, plus
    {engine + ".result": the replica's result}. ``engines``: engine kind -> engine kwargs overrides."""
    objects: dict[str, Any] = {}
    for engine, overrides in engines.items():
        store = work / f"bits-{tag}{engine}"
        with LMCacheServer(policy_for(store)) as srv:
            kwargs = SGL if engine == "sglang" else {}
            result = run_replica(work, f"bits-{tag}{engine}", model, srv.policy, [req(ids)], engine=overrides, **kwargs)
        objects[engine] = _objects(store)
        objects[engine + ".result"] = result
    return objects


@pytest.fixture(scope="module")
def per_engine_objects(cross: dict[str, Any]) -> dict[str, Any]:
    """Each engine's objects for the same document, split by namespace from the cross-engine store: vLLM's from
    the replica that wrote first, SGLang's from the replica that refused them and stored its own."""
    objects: dict[str, Any] = {}
    for engine, result in (("vllm", cross["vllm_writes"]), ("sglang", cross["sglang_reads"])):
        objects[engine] = _objects(cross["store"], _namespace(result))
        objects[engine + ".result"] = result
    return objects


def _namespace(result: dict[str, Any]) -> str:
    return str(result["stats"]["namespace"])


def _assert_labels_tell_the_truth(objects: dict[str, Any]) -> tuple[bool, bool]:
    vllm, sgl = objects["vllm"], objects["sglang"]
    common = sorted(set(vllm) & set(sgl))
    assert len(common) >= DOC_TOKENS // CHUNK - 1, (len(vllm), len(sgl))
    assert all(len(vllm[h]) == len(sgl[h]) for h in common)  # same size per chunk: only the layout differs
    identical = all(vllm[h] == sgl[h] for h in common)
    same_namespace = _namespace(objects["vllm.result"]) == _namespace(objects["sglang.result"])
    assert identical == same_namespace, (identical, same_namespace)
    return identical, same_namespace


def test_layout_labels_tell_the_truth_bit_for_bit(per_engine_objects: dict[str, Any]) -> None:
    """Equal stored bytes if and only if equal fingerprints (namespaces): sharing is allowed exactly where the
    engines' objects are byte-identical. vLLM 0.32 keeps K and V fused in each head (objects ordered
    L,T,H,KV,D); SGLang keeps them in separate buffers (KV,L,T,H,D), so the namespaces must differ too."""
    identical, _ = _assert_labels_tell_the_truth(per_engine_objects)
    assert not identical  # on CPU: the two layouts really differ (else this test would check nothing)
    # each label was checked against the KV the engine registered, as LMCache detects it
    for engine, order in (("vllm", "L,T,H,KV,D"), ("sglang", "KV,L,T,H,D")):
        events = [e for e in per_engine_objects[engine + ".result"]["events"] if e.get("event") == "engine.kv_format"]
        assert events and {e["order"] for e in events} == {order}, (engine, events)
        assert all(e["layout"].endswith("/cpu/" + order) for e in events), events


def test_gpu_layouts_bit_for_bit(work: Path, models: dict[str, Path], prompts: dict[str, list[int]]) -> None:
    """The same check with CUDA builds of both engines on a GPU (split K/V formats, expected byte-identical
    through LMCache's GPU connectors): equal labels if and only if equal bytes. CI machines are CPU-only."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU with CUDA builds of vLLM and SGLang; CI machines are CPU-only")
    gpu = {"vllm": {"dtype": "float16"},
           "sglang": {"device": "cuda", "attention_backend": "triton", "dtype": "float16", "mem_fraction_static": 0.5}}
    _assert_labels_tell_the_truth(_objects_per_engine(work, models["main"], prompts["doc"], "gpu-", gpu))


def test_sglang_written_kv_is_refused_by_vllm(
    work: Path, models: dict[str, Path], prompts: dict[str, list[int]], store: Path, server: LMCacheServer,
    replica_a: dict[str, Any], cross: dict[str, Any],
) -> None:
    """The reverse on a store only SGLang wrote (this module's, which holds the document as SGLang stored it):
    a vLLM replica loads 0 tokens, says why, answers cold."""
    before = _namespaces(store)
    assert _namespace(replica_a) in before and _namespace(cross["vllm_writes"]) not in before, before
    out = run_replica(work, "x-vllm-on-sgl", models["main"], server.policy, [req(prompts["doc"])])
    result = out["results"][0]
    assert result["num_cached_tokens"] == 0 and out["stats"]["tokens_loaded"] == 0
    reasons = _incompatible_events(out)
    assert reasons and any("KV layout" in d for d in reasons[0]["differences"]), out["events"]
    # vLLM's cold answer: its first request on the cross store, which held nothing of vLLM's yet
    assert same_output(result, cross["vllm_writes"]["results"][0])
