"""The MP server's entry point: LMCache's command line (``lmcache server ...``) with prefixshare's guards
(:mod:`prefixshare.server.plugins.guards`) installed first. ``Policy.server_argv()`` runs the server this way::

    python -m prefixshare.server.plugins.main server --port 5555 --l2-adapter '{...}' ...
"""

from __future__ import annotations


def main() -> None:
    from prefixshare._log import configure_from_environment
    from prefixshare.server.plugins import guards

    configure_from_environment()
    guards.install()
    from lmcache.cli.main import main as lmcache_main

    lmcache_main()


if __name__ == "__main__":
    main()
