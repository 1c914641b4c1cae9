"""The node's LMCache multiprocess (MP) server, started and stopped from a Policy."""

from prefixshare.server._process import LMCacheServer, shm_path

__all__ = ["LMCacheServer", "shm_path"]
