"""The environment every process prefixshare starts or configures gets: usage reports and banners off.

LMCache reports usage to a remote host by default, and vLLM collects usage stats: prefixshare turns both off
for the MP server and for every engine it wires (``doctor`` checks that they are off).
"""

LMCACHE_QUIET: dict[str, str] = {"LMCACHE_TRACK_USAGE": "false", "LMCACHE_DISABLE_BANNER": "1"}
VLLM_QUIET: dict[str, str] = {**LMCACHE_QUIET, "VLLM_NO_USAGE_STATS": "1"}
