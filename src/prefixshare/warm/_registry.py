"""The document registry: which documents are warm in a store, under which fingerprint.

One JSON file per document, fingerprint and store salt (the tenant's and request's salt the document's KV was
stored under), beside the store's manifests::

    <store>/.prefixshare/documents/<fingerprint digest>/<safe id>.json              (no salt)
    <store>/.prefixshare/documents/<fingerprint digest>/@<safe salt>/<safe id>.json (a tenant's, a salt's)

so tenants who warm documents of the same id each keep their own record (a tenant's warm never overwrites
another's). Records of earlier versions kept every salt in the first form; they are still read, and match a
lookup only under the salt they record.

``<safe id>`` is the document id itself when it is a plain file name (letters, digits, ``.``, ``_``,
``-``; starting with a letter or digit; at most 100 characters); any other id (``guide/intro.md``,
``../etc``, ``manual#2``) is stored under ``_<blake3 of the id>.json`` and kept verbatim inside the JSON,
so no id can name a path outside the registry. Files are written atomically with mode 0o640 in
directories of mode 0o750. Only JSON is ever read.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from prefixshare._files import write_private_atomic
from prefixshare.errors import PrefixShareError
from prefixshare.keys import chunk_file_name

REGISTRY_DIR = ".prefixshare/documents"
RECORD_FORMAT = "prefixshare-document/1"
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
_DIGEST = re.compile(r"^[0-9a-f]{8,64}$")
_MAX_RECORD_BYTES = 16 * 1024 * 1024


class RegistryError(PrefixShareError, ValueError):
    """A registry path or record is invalid."""


class DocumentRecord(BaseModel):
    """What the registry records about one warmed document."""

    model_config = ConfigDict(extra="ignore")

    format: str = RECORD_FORMAT
    id: str
    source: str | None = None
    content_hash: str | None = None
    text_hash: str
    template_digest: str
    prefix_digest: str
    tokens: int = Field(description="prefix tokens (template + document)")
    chunk_tokens: int = Field(description="tokens in full chunks: what the store holds")
    chunk_size: int
    chunks: int
    chunk_hashes: list[str]
    #: (kv_rank, object_group) of every object of each chunk
    objects: list[tuple[int, int]] = Field(default_factory=list)
    salt: str = ""
    tenant: str | None = None
    bytes: int
    fingerprint: str
    namespace: str
    model: str | None = None
    engine: str | None = None
    warmed_at: str
    host: str
    seconds: float | None = None
    prefixshare_version: str | None = None
    #: the prefix's token ids (u32 little-endian, base64): what ``prefixshare verify`` replays; checked
    #: against ``prefix_digest`` when read (None in records of earlier versions)
    prefix_ids: str | None = None

    def prefix_token_ids(self) -> list[int] | None:
        """The warmed prefix's token ids, or None when the record has none or they do not match its digest."""
        from prefixshare.warm._template import tokens_digest

        if not self.prefix_ids:
            return None
        try:
            raw = base64.b64decode(self.prefix_ids, validate=True)
        except (binascii.Error, ValueError):
            return None
        if len(raw) != 4 * self.tokens:
            return None
        ids = list(struct.unpack(f"<{self.tokens}I", raw))
        return ids if tokens_digest(ids) == self.prefix_digest else None

    def chunk_files(self) -> list[str]:
        return [chunk_file_name(self.namespace, rank, group, h, self.salt)
                for h in self.chunk_hashes for rank, group in self.objects]


def encode_ids(ids: list[int]) -> str:
    """Token ids as :attr:`DocumentRecord.prefix_ids` holds them."""
    return base64.b64encode(struct.pack(f"<{len(ids)}I", *ids)).decode("ascii")


def safe_name(doc_id: str) -> str:
    """The registry file name (without ``.json``) of a document id: the id when safe, else a digest."""
    if _SAFE_NAME.match(doc_id) and ".." not in doc_id:
        return doc_id
    return "_" + blake3.blake3(doc_id.encode("utf-8")).hexdigest()[:40]


def write_json_atomic(path: Path, data: dict[str, Any], *, root: Path) -> None:
    body = json.dumps(data, indent=2, sort_keys=True) + "\n"
    write_private_atomic(path, body.encode("utf-8"), stop=root, fsync=False)


@dataclass
class CorruptRecord:
    path: str
    reason: str


@dataclass
class RecordList:
    records: list[DocumentRecord] = field(default_factory=list)
    corrupt: list[CorruptRecord] = field(default_factory=list)
    #: (fingerprint, salt, document id) -> file it was read from
    paths: dict[tuple[str, str, str], Path] = field(default_factory=dict)


class Registry:
    """The registry of one store (``root`` is the store directory)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.base = self.root / REGISTRY_DIR

    def _dir(self, fingerprint: str, salt: str = "") -> Path:
        if not _DIGEST.match(fingerprint):
            raise RegistryError(f"not a fingerprint digest: {fingerprint!r}")
        return self.base / fingerprint / f"@{safe_name(salt)}" if salt else self.base / fingerprint

    def path(self, fingerprint: str, doc_id: str, salt: str = "") -> Path:
        directory = self._dir(fingerprint, salt)
        path = directory / f"{safe_name(doc_id)}.json"
        # defence in depth: whatever safe_name returns stays inside the registry
        if path.resolve().parent != directory.resolve():
            raise RegistryError(f"document id {doc_id!r} maps outside the registry")
        return path

    def _places(self, fingerprint: str, doc_id: str, salt: str) -> list[Path]:
        """Where the record of ``doc_id`` under ``salt`` may be: its own path, then, for a salt, the flat path
        an earlier version kept every salt's record at."""
        own = self.path(fingerprint, doc_id, salt)
        return [own, self.path(fingerprint, doc_id)] if salt else [own]

    def get(self, fingerprint: str, doc_id: str, salt: str = "") -> DocumentRecord | None:
        """The record of ``doc_id`` warmed under ``salt`` (an earlier version's record in the first form counts
        when it records that salt)."""
        for path in self._places(fingerprint, doc_id, salt):
            try:
                record = self._load(path)
            except (FileNotFoundError, RegistryError):
                continue
            if record.id == doc_id and record.fingerprint == fingerprint and record.salt == salt:
                return record
        return None

    def put(self, record: DocumentRecord) -> Path:
        path = self.path(record.fingerprint, record.id, record.salt)
        write_json_atomic(path, record.model_dump(mode="json"), root=self.root)
        for legacy in self._places(record.fingerprint, record.id, record.salt)[1:]:
            with contextlib.suppress(FileNotFoundError, RegistryError):
                if self._load(legacy).salt == record.salt:
                    legacy.unlink()  # an earlier version's record of this very salt: replaced, not kept twice
        return path

    def remove(self, fingerprint: str, doc_id: str, salt: str = "") -> bool:
        removed = False
        for path in self._places(fingerprint, doc_id, salt):
            try:
                if path.parent.name == fingerprint and salt and self._load(path).salt != salt:
                    continue  # another salt's record in the earlier layout
                path.unlink()
                removed = True
            except (FileNotFoundError, RegistryError):
                continue
        return removed

    def _load(self, path: Path) -> DocumentRecord:
        if path.stat().st_size > _MAX_RECORD_BYTES:
            raise RegistryError(f"{path} is too large")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as exc:
            raise RegistryError(f"{path} is not valid JSON: {exc}") from None
        if not isinstance(raw, dict) or raw.get("format") != RECORD_FORMAT:
            raise RegistryError(f"{path} is not a prefixshare document record")
        try:
            record = DocumentRecord.model_validate(raw)
        except ValidationError as exc:
            raise RegistryError(f"{path} is malformed: {exc.errors()[0]['msg']}") from None
        flat = path.parent.name == record.fingerprint  # no salt, or an earlier version's record of any salt
        salted = (bool(record.salt) and path.parent.name == f"@{safe_name(record.salt)}"
                  and path.parent.parent.name == record.fingerprint)
        if path.name != f"{safe_name(record.id)}.json" or not (flat or salted):
            raise RegistryError(f"{path} records document {record.id!r} of {record.fingerprint[:12]}, "
                                "which belongs under another name")
        return record

    def fingerprints(self) -> list[str]:
        try:
            return sorted(p.name for p in self.base.iterdir() if p.is_dir() and _DIGEST.match(p.name))
        except FileNotFoundError:
            return []

    def records(self, fingerprint: str | None = None) -> RecordList:
        """Every record (of one fingerprint, or all), with the unreadable ones listed apart."""
        out = RecordList()
        for fp in [fingerprint] if fingerprint else self.fingerprints():
            directory = self._dir(fp)
            try:
                paths = sorted(directory.glob("*.json")) + sorted(directory.glob("@*/*.json"))
            except FileNotFoundError:
                continue
            for path in paths:
                try:
                    record = self._load(path)
                except (OSError, RegistryError) as exc:
                    out.corrupt.append(CorruptRecord(str(path), str(exc)))
                    continue
                out.records.append(record)
                out.paths[(record.fingerprint, record.salt, record.id)] = path
        return out
