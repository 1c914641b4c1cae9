"""How a request becomes a store key: the one place every key fact is written.

The MP server keys a chunk ``ObjectKey(chunk_hash, model_name, kv_rank, object_group_id, cache_salt)``.
prefixshare decides two of those fields and names the wire keys that carry them:

* ``model_name`` is the **namespace**, ``prefixshare-<fingerprint digest>`` (:func:`namespace`), from the
  engine's compatibility fingerprint (:func:`engine_fingerprint`): KV written under another fingerprint is
  never looked up;
* ``cache_salt`` is the **store salt** (:func:`store_salt`): a request's tenant, LoRA adapter and own salt,
  so tenants (and adapters) never hit each other's KV.

Also here: the connector's extra-config and per-request keys (``KEY_*``, ``REQ_*``), the token packing and
the admission digest the admission rules see, and the names of chunk files in a directory tier with LMCache's
chunk hashes (:class:`ChunkHasher`). Connectors, ``warm``, ``store`` and the benchmarks all import these from
here, so warm checks exactly the objects replicas will look up.
"""

from __future__ import annotations

import functools
import re
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import blake3

from prefixshare.fingerprint import EngineSettings, Fingerprint, compute_fingerprint

if TYPE_CHECKING:  # pragma: no cover
    from prefixshare.policies import Policy

#: keys of the connector's extra config (and of per-request kv_transfer_params) that are ours
KEY_POLICY = "prefixshare.policy"
KEY_POLICY_FILE = "prefixshare.policy_file"
KEY_INSTANCE = "prefixshare.instance"
KEY_EXPECT = "prefixshare.fingerprint"
REQ_DOCUMENT = "prefixshare.document_id"
REQ_TENANT = "prefixshare.tenant"
REQ_PREFIX_TOKENS = "prefixshare.prefix_tokens"
REQ_STORE = "prefixshare.store"
#: a request's own load mode: "always" (load whatever the store holds), "never" (recompute), "auto" (the cost model)
REQ_LOAD = "prefixshare.load"
LOAD_MODES = ("auto", "always", "never")
#: a verification run (prefixshare.verify): never stored, never sampled for verification itself
REQ_VERIFY = "prefixshare.verify"

_SAFE = re.compile(r"^[A-Za-z0-9._-]{1,48}$")


def tenant_salt(tenant: str) -> str:
    """A cache-salt component for a tenant: readable when safe, else a digest (salts forbid '@', '/')."""
    return f"t-{tenant}" if _SAFE.match(tenant) else "t-" + blake3.blake3(tenant.encode()).hexdigest()[:24]


def store_salt(tenant: str | None, request_salt: str | None, lora_name: str | None = None) -> str | None:
    """The cache salt a request's store keys carry, from its tenant, its LoRA adapter and its own salt.

    Distinct ``(tenant, LoRA, request salt)`` never give the same salt (short of a 160-bit digest collision), and
    no request salt can stand for a tenant: a tenant alone is ``t-<tenant>`` (:func:`tenant_salt`), a request's
    own salt alone ``r-<salt>`` (``rh-`` and a digest when unsafe), and any combination ``s-`` and a digest of
    the components, each tagged and length-prefixed, so that a separator inside a tenant's name or a salt cannot
    move a boundary. The engine's
    own salt set to the tenant's (what ``prompt_for`` does, to split the engine's prefix cache by tenant too) is
    not a second component: the store key is the same with or without it. Salts hold no '@' or '/' (they are
    part of file names): an unsafe or long component is digested.
    """
    if tenant and request_salt == tenant_salt(tenant):
        request_salt = None
    parts = [(tag, value) for tag, value in (("tenant", tenant), ("lora", lora_name), ("request", request_salt))
             if value]
    if not parts:
        return None
    if parts == [("tenant", tenant)]:
        return tenant_salt(tenant)  # type: ignore[arg-type]
    if parts == [("request", request_salt)]:
        assert request_salt is not None
        if _SAFE.match(request_salt):
            return "r-" + request_salt
        return "rh-" + blake3.blake3(request_salt.encode()).hexdigest()[:40]
    encoded = b"".join(b"%s:%d:%s" % (tag.encode(), len(value.encode()), value.encode()) for tag, value in parts)
    return "s-" + blake3.blake3(b"prefixshare-store-salt\0" + encoded).hexdigest()[:40]


@functools.lru_cache(maxsize=256)
def _u32_packer(n: int) -> Any:
    return struct.Struct(f"<{n}I").pack


def token_bytes(ids: Any) -> bytes:
    """Token ids as little-endian u32, packed in one C call (~3.5 ns a token, no per-token Python work); ids that do
    not fit a u32 (none of any real vocabulary) are packed as u64 behind a marker, whose length can never equal
    a u32 packing's."""
    try:
        return _u32_packer(len(ids))(*ids)
    except struct.error:
        return b"\xffq" + struct.pack(f"<{len(ids)}q", *ids)


#: version of :func:`admission_digest`'s encoding. Admission digests are never persisted (the frequency rule's
#: sightings and the byte budget's commitments live in the connector's memory), so a new version needs no
#: migration; it only must be the same in the connector and in :mod:`prefixshare.warm` (tests/test_warm.py).
#: v1 was blake3 of the JSON list of the ids (~0.4 ms at 8k tokens); v2 is keyed blake3 of ``token_bytes``;
#: v3 adds the request's store salt (tenant, LoRA, its own salt) in front of them.
ADMISSION_DIGEST_VERSION = 3
_ADMISSION_KEY = blake3.blake3(f"prefixshare admission digest v{ADMISSION_DIGEST_VERSION}".encode()).digest()


def admission_digest(ids: Any, chunk_size: int, salt: str | None = None) -> str | None:
    """The prefix digest the admission rules see (``AdmissionRequest.prefix_digest``): keyed blake3 of the
    request's store salt (:func:`store_salt`) and its chunk-aligned token ids (``token_bytes``), 32 hex; None
    below one chunk. ``prefixshare.warm`` uses it too.

    The salt is part of it because the same tokens under two salts are two prefixes in the store: a document
    two tenants share is stored twice, and a byte budget that counted it once (the soak found this: 131 MB on
    disk under 2 x 48 MiB of budgets) would let the store grow past it."""
    aligned = len(ids) - len(ids) % chunk_size
    if not aligned:
        return None
    data = token_bytes(ids if aligned == len(ids) else ids[:aligned])
    hasher = blake3.blake3(key=_ADMISSION_KEY)
    if salt:
        hasher.update(b"salt\0" + salt.encode() + b"\0")
    hasher.update(data)
    return hasher.hexdigest()[:32]


def namespace(fp: Fingerprint) -> str:
    """The store namespace of a fingerprint: what the MP server sees as the model name."""
    return f"prefixshare-{fp.digest[:20]}"


def engine_fingerprint(policy: Policy, model_dir: str, settings: EngineSettings, *,
                       tokenizer_dir: str | None = None) -> Fingerprint:
    """The fingerprint an engine with these settings namespaces the store with: the one place the connectors
    and ``warm`` compute it, so a warm checks exactly the objects the engine's replicas will look up."""
    settings = settings.model_copy(update={"chunk_size": policy.chunk_size, "tenant": policy.tenant})
    return compute_fingerprint(model_dir, settings, weights=policy.fingerprint.weights,
                               revision=policy.fingerprint.revision, tokenizer_dir=tokenizer_dir)



# --- chunk objects in a directory tier ------------------------------------------------------------------------
# The fs tier writes one file per key:
#     <namespace>@0x<kv_rank, 8 hex>@<object_group_id hex>@<chunk_hash hex>[@<cache_salt>].data
# A prefix of ``n`` tokens becomes ``n // chunk_size`` chunks (a partial last chunk is never stored).

DATA_SUFFIX = ".data"
SEP = "@"
_PATH_SLASH = "-SEP-"


@dataclass(frozen=True)
class ChunkFile:
    """One stored object, parsed from its file name."""

    name: str
    namespace: str
    kv_rank: int
    group: int
    chunk_hash: str
    salt: str = ""

    @property
    def world_size(self) -> int:
        """LMCache packs ``(world_size << 24) | (rank << 16) | (local_ws << 8) | local_rank`` into kv_rank."""
        return (self.kv_rank >> 24) & 0xFF or 1

    @property
    def object(self) -> tuple[int, int]:
        return self.kv_rank, self.group


def chunk_file_name(namespace: str, kv_rank: int, group: int, chunk_hash: str, salt: str = "") -> str:
    base = f"{namespace.replace('/', _PATH_SLASH)}{SEP}{kv_rank:#010x}{SEP}{group:x}{SEP}{chunk_hash}"
    return f"{base}{SEP}{salt}{DATA_SUFFIX}" if salt else f"{base}{DATA_SUFFIX}"


def parse_chunk_file(name: str) -> ChunkFile | None:
    """The key a chunk file name encodes, or None when ``name`` is not one (LMCache's own rules)."""
    if not name.endswith(DATA_SUFFIX):
        return None
    parts = name[: -len(DATA_SUFFIX)].split(SEP)
    if len(parts) == 4:
        ns, rank, group, chunk = parts
        salt = ""
    elif len(parts) == 5:
        ns, rank, group, chunk, salt = parts
    else:
        return None
    try:
        bytes.fromhex(chunk)
        return ChunkFile(name, ns.replace(_PATH_SLASH, "/"), int(rank, 16), int(group, 16), chunk.lower(), salt)
    except ValueError:
        return None


def file_prefix(namespace: str) -> str:
    """What every chunk file name of ``namespace`` starts with."""
    return namespace.replace("/", _PATH_SLASH) + SEP


class ChunkHasher:
    """LMCache's token hasher at the server's chunk size and hash algorithm (the keys the server computes)."""

    def __init__(self, chunk_size: int, hash_algorithm: str = "blake3") -> None:
        self.chunk_size = chunk_size
        self.hash_algorithm = hash_algorithm
        self._hasher: Any = None

    def _get(self) -> Any:
        if self._hasher is None:
            import logging

            from lmcache.v1.multiprocess.token_hasher import TokenHasher

            # LMCache logs its hasher's set-up at INFO on every construction; keep that off our output
            lm_log = logging.getLogger("lmcache.v1.multiprocess.token_hasher")
            level = lm_log.level
            lm_log.setLevel(logging.WARNING)
            try:
                self._hasher = TokenHasher(chunk_size=self.chunk_size, hash_algorithm=self.hash_algorithm)
            finally:
                lm_log.setLevel(level)
        return self._hasher

    def hashes(self, token_ids: list[int]) -> list[str]:
        """Hex chunk hashes of every full chunk of ``token_ids``, in order."""
        if len(token_ids) < self.chunk_size:
            return []
        return [h.hex() for h in self._get().compute_chunk_hashes(list(token_ids))]


def blake3_chunk_hashes(token_ids: list[int], chunk_size: int) -> list[str]:
    """LMCache 0.5.6's blake3 rolling hash, re-implemented (used only by tests to pin LMCache's scheme)."""
    import struct

    def h(prefix: bytes | int, tokens: list[int]) -> bytes:
        hasher = blake3.blake3()
        hasher.update(prefix.to_bytes(8, "big", signed=True) if isinstance(prefix, int) else prefix)
        hasher.update(struct.pack(f">{len(tokens)}I", *tokens))
        return hasher.digest()

    prefix: bytes | int = h(0, [0])
    out = []
    for i in range(0, len(token_ids) - len(token_ids) % chunk_size, chunk_size):
        prefix = h(prefix, token_ids[i: i + chunk_size])
        out.append(prefix.hex())
    return out
