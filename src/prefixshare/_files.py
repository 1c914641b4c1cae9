"""Private files beside the store: created 0o640 in 0o750 directories whatever the umask, written atomically.

Manifests and the document registry live in a store that other hosts read; they must never be world
readable (they name models, documents and hosts) and a reader must never see half a file.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

FILE_MODE = 0o640
DIR_MODE = 0o750


def make_private_dirs(directory: Path, stop: Path | None = None) -> None:
    """Create ``directory`` and its missing parents (up to ``stop``, when given) with mode 0o750."""
    missing: list[Path] = []
    current = directory
    while not current.exists() and (stop is None or current != stop.parent):
        missing.append(current)
        current = current.parent
    for path in reversed(missing):
        try:
            path.mkdir(mode=DIR_MODE)
        except FileExistsError:
            continue
        os.chmod(path, DIR_MODE)


def write_private_atomic(path: Path, data: bytes, *, stop: Path | None = None, fsync: bool = True) -> None:
    """Write ``data`` to ``path`` (mode 0o640) through a temporary file and an atomic rename."""
    make_private_dirs(path.parent, stop)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem[:16]}-", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            if fsync:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
