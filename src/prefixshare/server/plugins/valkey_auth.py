"""A password-protected Valkey/Redis tier authenticates: LMCache's Valkey client pool builds glide's credentials as
``ServerCredentials(username, password)``, while glide's signature is ``ServerCredentials(password, username)``.
The password travels as the user name, the server sees no password (``NOAUTH``) or a wrong pair (``WRONGPASS``),
and the node's server exits at start.

:func:`install` puts, in this (the MP server's) process only, a ``ServerCredentials`` that reads two positional
arguments in LMCache's order; keyword calls mean what they say, and an empty user name is glide's None (the
default user). It installs only where both facts hold: LMCache's pool makes that very call (its source is
checked) and glide's first parameter is ``password``. Verified against LMCache 0.5.6
(``lmcache.v1.storage_backend.valkey.worker_pool.ValkeyWorkerPool``) and valkey-glide-sync 2.3.
"""

from __future__ import annotations

import inspect
from typing import Any

#: the call in LMCache's pool that swaps the arguments
LMCACHE_CALL = "glide_sync.ServerCredentials(self._username, self._password)"


def install() -> bool:
    """True when the fix is in place (installed now or before); False where it does not apply."""
    try:
        import glide_sync
        from lmcache.v1.storage_backend.valkey import worker_pool
    except ImportError:
        return False
    original = glide_sync.ServerCredentials
    if getattr(original, "prefixshare_lmcache_order", False):
        return True
    try:
        swapped = LMCACHE_CALL in inspect.getsource(worker_pool)
        first = list(inspect.signature(original.__init__).parameters)[1]
    except (OSError, TypeError, ValueError, IndexError):
        return False
    if not swapped or first != "password":
        return False

    class ServerCredentials(original):  # type: ignore[misc, valid-type]
        prefixshare_lmcache_order = True

        def __init__(self, username: str | None = None, password: str | None = None, **kwargs: Any) -> None:
            super().__init__(password=password or None, username=username or None, **kwargs)

    glide_sync.ServerCredentials = ServerCredentials
    return True
