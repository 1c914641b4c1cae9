"""The connector's former module path, kept so that `vllm serve` flags copied from earlier versions keep working."""

from prefixshare.adapters.vllm.connector import PrefixShareConnector as PrefixShareConnector  # noqa: F401
