"""Code that runs inside the LMCache MP server, loaded by dotted path through LMCache's ``plugin`` L2 adapter
type (the policy renders ``{"type": "plugin", "module_path": ..., "class_name": ...}``):

* :mod:`.fs` — the checked fs tier: LMCache's fs adapter plus integrity data on every chunk, checked on load;
* :mod:`.mooncake` — a Mooncake Store tier over Mooncake's Python client;
* :mod:`.integrity` — the integrity trailer's format (also read by ``doctor``/``gc --verify``; imports no LMCache);
* :mod:`.valkey_auth` — a password-protected Valkey tier authenticates (LMCache's pool swaps glide's arguments);
* :mod:`.main` — the server's entry point (``Policy.server_argv()``): LMCache's command line with
  :mod:`.guards` installed first (an engine's abandoned store is discarded, never admitted as a hit).

``fs`` and ``mooncake`` import LMCache (and their store's client) at top level: no prefixshare module imports
them at module level (``tests/test_imports.py``). Importing this package imports none of them.
"""
