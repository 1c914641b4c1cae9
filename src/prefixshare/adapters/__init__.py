"""Adapters wire a Policy into engines through LMCache's MP server: :class:`PrefixShare`."""

from prefixshare.adapters._share import PrefixShare

__all__ = ["PrefixShare"]
