"""Test-only raw MP client: store / lookup / retrieve KV through a running LMCache MP server, no engine.

It registers plain CPU tensors the way an engine-driven (CPU) engine does, so tests can prove a real
round trip through the server and its L2 tier without starting vLLM or SGLang.
Usage: python mp_roundtrip.py store|abandon|fetch|lookup RPC_URL [model_name] [cache_salt]
``abandon`` reserves the chunks for a store (PREPARE_STORE) and unregisters without writing or committing them:
what an engine does when its store RPC times out or it exits mid-store.
Server must run with --supported-transfer-mode engine_driven (or auto) and --chunk-size 32.
"""
import os, sys, time, uuid
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")
import torch, zmq
from lmcache.utils import EngineType
from lmcache.v1.gpu_connector.utils import LayoutHints
from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey
from lmcache.v1.multiprocess.group_view import EngineGroupInfo
from lmcache.v1.multiprocess.transfer_context import EngineDrivenTransferContext
from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

MODE, URL = sys.argv[1], sys.argv[2]
MODEL = sys.argv[3] if len(sys.argv) > 3 else "probe/tiny-llama"
SALT = sys.argv[4] if len(sys.argv) > 4 else ""
L, NB, BS, NH, HS = 2, 16, 16, 2, 64          # layers, blocks, block_size, kv heads, head dim
CHUNK, NTOK, TIMEOUT = 32, 128, 10.0
TOKENS = tuple(range(1000, 1000 + NTOK))
BLOCK_IDS = list(range(3, 3 + NTOK // BS))     # deliberately not starting at 0

def make_kv(fill):
    g = torch.Generator().manual_seed(1234)
    # vLLM-style NHD per-layer paged tensor: (2, num_blocks, block_size, kv_heads, head_dim)
    return {f"layer.{i}": (torch.randn((2, NB, BS, NH, HS), generator=g) if fill
                           else torch.zeros((2, NB, BS, NH, HS))) for i in range(L)}

def key(rid, worker_id):
    return IPCCacheServerKey(model_name=MODEL, world_size=1, num_kv_readers=1, worker_id=worker_id,
                             token_ids=TOKENS, start=0, end=NTOK, request_id=rid,
                             cache_salt=SALT)

def main():
    zctx = zmq.Context(); zctx.setsockopt(zmq.LINGER, 0)
    client = RequestClientFactory.create(URL, context=zctx)
    kv = make_kv(fill=(MODE == "store"))
    tc = EngineDrivenTransferContext(instance_id=4242 + os.getpid() % 1000, req_client=client)
    tc.register(kv, MODEL, 1, CHUNK // BS, TIMEOUT,
                layout_hints=LayoutHints(kv_layout="NHD"),
                engine_group_infos=[EngineGroupInfo(engine_group_id=0,
                                    layer_indices=tuple(range(L)), tokens_per_block=BS)],
                engine_type=EngineType.VLLM)
    rid = f"{MODE}-{uuid.uuid4().hex}"
    try:
        if MODE == "store":
            ok = tc.submit_store(rid, key(rid, 0), kv, [BLOCK_IDS], None, CHUNK // BS).result(timeout=TIMEOUT)
            print("STORE ok =", ok)
        elif MODE == "abandon":
            reply = client.prepare_store(key(rid, 0), tc._instance_id).result(timeout=TIMEOUT)
            print("RESERVED slots =", len(reply.context.get("slots", [])))
        else:
            t0 = time.monotonic()
            client.lookup(key(rid, None), 1).result(timeout=TIMEOUT)     # LOOKUP (+prefetch L2->L1)
            hit = None
            while hit is None and time.monotonic() - t0 < TIMEOUT:
                hit = client.query_prefetch_status(rid).result(timeout=TIMEOUT)  # chunks hit, None=pending
                if hit is None: time.sleep(0.02)
            print(f"LOOKUP hit_chunks={hit}/{NTOK // CHUNK} ({(time.monotonic()-t0)*1e3:.0f} ms)")
            if MODE == "fetch":
                ntok = hit * CHUNK
                k = IPCCacheServerKey(model_name=MODEL, world_size=1, num_kv_readers=1, worker_id=0,
                                      token_ids=TOKENS[:ntok], start=0, end=ntok,
                                      request_id=rid, cache_salt=SALT)
                ok = tc.submit_retrieve(rid, k, kv, [BLOCK_IDS[: ntok // BS]], None,
                                        CHUNK // BS).result(timeout=TIMEOUT)
                ref = make_kv(fill=True)
                same = all(torch.equal(kv[n][:, BLOCK_IDS], ref[n][:, BLOCK_IDS]) for n in kv)
                others_zero = all(not kv[n][:, [b for b in range(NB) if b not in BLOCK_IDS]].any() for n in kv)
                print("RETRIEVE ok =", ok, "bytes_equal =", same, "untouched_blocks_zero =", others_zero)
                sys.exit(0 if (ok and same and others_zero and hit == NTOK // CHUNK) else 1)
    finally:
        client.end_session(rid).result(timeout=TIMEOUT)
        tc.unregister().result(timeout=TIMEOUT)
        tc.close(); client.close(); zctx.term()

if __name__ == "__main__":
    main()
