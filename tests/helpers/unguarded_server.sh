#!/bin/sh
# Test-only launcher (tests/faults/test_abandoned_stores.py's control): runs the MP server as LMCache ships it,
# without prefixshare's guards. It is handed `PYTHON -m prefixshare.server.plugins.main server ...` and execs
# `PYTHON -m lmcache.cli.main server ...` (the same interpreter, the same arguments, LMCache's own entry).
python="$1"; shift 3
exec "$python" -m lmcache.cli.main "$@"
