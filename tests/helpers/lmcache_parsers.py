"""Feed our renderings to LMCache's own parsers, exactly as ``lmcache server`` would parse them."""

from __future__ import annotations

import argparse
from typing import Any


def parse_server_argv(argv: list[str]) -> dict[str, Any]:
    """Parse an ``lmcache server`` argv (without executable and 'server') into LMCache's config objects."""
    from lmcache.cli.commands.server import ServerCommand
    from lmcache.v1.distributed.config import parse_args_to_config
    from lmcache.v1.mp_observability.config import parse_args_to_observability_config
    from lmcache.v1.multiprocess.config import (
        parse_args_to_http_frontend_config,
        parse_args_to_mp_server_config,
    )

    parser = argparse.ArgumentParser(prog="lmcache server", exit_on_error=False)
    ServerCommand().add_arguments(parser)
    # add_arguments silently adds nothing when LMCache's server modules fail to import.
    assert any("--l2-adapter" in a.option_strings for a in parser._actions), "LMCache server args missing"
    args = parser.parse_args(argv)
    return {
        "mp": parse_args_to_mp_server_config(args),
        "storage": parse_args_to_config(args),
        "http": parse_args_to_http_frontend_config(args),
        "observability": parse_args_to_observability_config(args),
    }


def parse_adapter(cfg: dict[str, Any]) -> Any:
    from lmcache.v1.distributed.l2_adapters.config import get_l2_adapter_config_class

    return get_l2_adapter_config_class(cfg["type"]).from_dict(cfg)
