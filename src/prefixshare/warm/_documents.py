"""Documents to warm: resolved from paths, folders, globs, ``(id, text)`` pairs or ``{id: text}`` maps.

Every document has an id (what admission rules such as ``Pinned("manual-*")`` match, and the registry's
key) and its text. Ids of files: the file name for a file argument, the path relative to the folder for a
folder argument (``guide/intro.md``), relative to the pattern's fixed part for a glob (``docs/*.md`` ->
``intro.md``). Pass ``(id, Path)`` or ``{id: Path}`` to choose ids yourself.
"""

from __future__ import annotations

import glob as _glob
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3

from prefixshare.errors import PrefixShareError

#: files a folder walk skips (hidden files and directories are skipped too)
_SKIP_SUFFIXES = (".data", ".tmp", ".pyc")
MAX_ID_LENGTH = 512


class DocumentError(PrefixShareError, ValueError):
    """A document argument cannot be used (missing file, no id for a string, duplicate id...)."""


@dataclass(frozen=True)
class Document:
    """One document to warm: ``id``, ``text``, and the file it came from (if any)."""

    id: str
    text: str
    source: str | None = None
    #: blake3 of the source file's bytes (None for string documents)
    content_hash: str | None = None

    @property
    def text_hash(self) -> str:
        return blake3.blake3(self.text.encode("utf-8")).hexdigest()


def check_id(doc_id: Any) -> str:
    """Validate a document id (any printable string; the registry maps unsafe ones to a digest name)."""
    if not isinstance(doc_id, str) or not doc_id.strip():
        raise DocumentError(f"document id must be a non-empty string, got {doc_id!r}")
    if len(doc_id) > MAX_ID_LENGTH:
        raise DocumentError(f"document id is longer than {MAX_ID_LENGTH} characters: {doc_id[:40]!r}...")
    if any(ord(c) < 32 for c in doc_id):
        raise DocumentError(f"document id {doc_id!r} contains control characters")
    return doc_id


def _read(path: Path, doc_id: str) -> Document:
    try:
        data = path.read_bytes()
    except IsADirectoryError:
        raise DocumentError(f"{path} is a directory; pass the folder itself to warm every file in it") from None
    except OSError as exc:
        raise DocumentError(f"cannot read document {path}: {exc.strerror or exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise DocumentError(f"{path} is not UTF-8 text; warm text documents only") from None
    return Document(check_id(doc_id), text, str(path.resolve()), blake3.blake3(data).hexdigest())


def _walk(root: Path) -> list[Path]:
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if not name.startswith(".") and not name.endswith(_SKIP_SUFFIXES):
                files.append(Path(dirpath) / name)
    return files


def _glob_base(pattern: str) -> Path:
    """The fixed leading part of a glob pattern (the folder ids are relative to)."""
    parts: list[str] = []
    for part in Path(pattern).parts:
        if _glob.has_magic(part):
            break
        parts.append(part)
    return Path(*parts) if parts else Path(".")


def _from_string(arg: str) -> list[Document]:
    path = Path(arg).expanduser()
    if path.is_file():
        return [_read(path, path.name)]
    if path.is_dir():
        files = _walk(path)
        if not files:
            raise DocumentError(f"folder {path} holds no documents")
        return [_read(f, f.relative_to(path).as_posix()) for f in files]
    if _glob.has_magic(arg):
        matches = sorted(Path(p) for p in _glob.glob(os.path.expanduser(arg), recursive=True))
        files = [p for p in matches if p.is_file()]
        if not files:
            raise DocumentError(f"pattern {arg!r} matches no files")
        base = _glob_base(os.path.expanduser(arg))
        return [_read(f, f.relative_to(base).as_posix() if f.is_relative_to(base) else f.name) for f in files]
    raise DocumentError(
        f"{arg!r} is not a file, folder or glob pattern; for text documents pass (id, text) pairs or a dict "
        "{id: text}"
    )


def _pair(doc_id: Any, value: Any) -> Document:
    doc_id = check_id(doc_id)
    if isinstance(value, Path):
        return _read(value.expanduser(), doc_id)
    if isinstance(value, str):
        return Document(doc_id, value)
    raise DocumentError(f"document {doc_id!r}: expected text (str) or a file (Path), got {type(value).__name__}")


def resolve_documents(docs: Any) -> list[Document]:
    """Turn the ``docs`` argument of :func:`~prefixshare.warm.warm` into documents with unique ids."""
    items: list[Document] = []
    if isinstance(docs, Document | str | Path | tuple):
        docs = [docs]
    if isinstance(docs, Mapping):
        items = [_pair(k, v) for k, v in docs.items()]
    elif isinstance(docs, Iterable):
        for item in docs:
            if isinstance(item, Document):
                items.append(Document(check_id(item.id), item.text, item.source, item.content_hash))
            elif isinstance(item, Path):
                items.extend(_from_string(str(item)))
            elif isinstance(item, str):
                items.extend(_from_string(item))
            elif isinstance(item, tuple) and len(item) == 2:
                items.append(_pair(*item))
            else:
                raise DocumentError(f"cannot warm {item!r}: pass paths, globs, (id, text) pairs or Documents")
    else:
        raise DocumentError(f"cannot warm {type(docs).__name__}: pass paths, globs, (id, text) pairs or a dict")
    if not items:
        raise DocumentError("no documents to warm")
    seen: dict[str, Document] = {}
    for doc in items:
        other = seen.get(doc.id)
        if other is not None and other != doc:
            where = " and ".join(d.source or "(text)" for d in (other, doc))
            raise DocumentError(f"two documents have the id {doc.id!r} ({where}); give them distinct ids "
                                "with (id, Path) pairs")
        seen[doc.id] = doc
    return list(seen.values())


def split_text(text: str, fits: Any) -> list[str]:
    """Split ``text`` into consecutive parts for which ``fits(part)`` holds, at paragraph, then line, then
    character boundaries (greedy; parts joined back give the original text)."""
    if fits(text):
        return [text]
    units: list[str] = []
    for sep in ("\n\n", "\n", " "):
        pieces = text.split(sep)
        units = [u for u in (p + sep for p in pieces[:-1]) if u] + ([pieces[-1]] if pieces[-1] else [])
        if len(units) > 1:
            break
    if len(units) <= 1:
        # one unbreakable run: halve until it fits
        mid = len(text) // 2
        if mid == 0:
            raise DocumentError("a single character does not fit the context")
        return split_text(text[:mid], fits) + split_text(text[mid:], fits)
    parts: list[str] = []
    current = ""
    for unit in units:
        candidate = current + unit
        if current and not fits(candidate):
            parts.append(current)
            current = unit
        else:
            current = candidate
    if current:
        parts.append(current)
    out: list[str] = []
    for part in parts:
        out.extend([part] if fits(part) else split_text(part, fits))
    return out
