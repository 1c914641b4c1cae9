"""KV arithmetic for deciding whether sharing a prefix's KV cache can pay off, before building anything.

>>> from prefixshare.plan import plan
>>> p = plan("qwen3-8b", prompt_lengths=[4096], links=["2.5GbE"], prefill_tokens_per_s=5000)
>>> p.kv_bytes_per_token, p.rows[0].kv_bytes
(147456, 603979776)
>>> round(p.rows[0].transfer("2.5GbE").load_s, 2), p.rows[0].transfer("2.5GbE").verdict
(1.93, 'prefill is faster')

Only the standard library is used: importing this package never pulls in torch, transformers,
LMCache or an engine.
"""

from __future__ import annotations

from prefixshare.plan._errors import PlanError
from prefixshare.plan._link import LINK_PRESETS, Link, link_from_gbps, parse_link
from prefixshare.plan._plan import (
    DEFAULT_LINKS,
    DEFAULT_PROMPT_LENGTHS,
    PREFILL_WINS,
    SHARING_WINS,
    Plan,
    PlanRow,
    Transfer,
    Verdict,
    parse_prompt_lengths,
    plan,
)
from prefixshare.plan._shape import (
    DTYPE_BYTES,
    ModelShape,
    bytes_per_element,
    kv_bytes_per_token,
    list_shapes,
    normalize_dtype,
    shape_from_config,
    shapes_dir,
)

from prefixshare.plan._plan import format_bytes, format_seconds

__all__ = [
    "DEFAULT_LINKS",
    "DEFAULT_PROMPT_LENGTHS",
    "DTYPE_BYTES",
    "LINK_PRESETS",
    "Link",
    "ModelShape",
    "PREFILL_WINS",
    "Plan",
    "PlanError",
    "PlanRow",
    "SHARING_WINS",
    "Transfer",
    "Verdict",
    "bytes_per_element",
    "format_bytes",
    "format_seconds",
    "kv_bytes_per_token",
    "link_from_gbps",
    "list_shapes",
    "normalize_dtype",
    "parse_link",
    "parse_prompt_lengths",
    "plan",
    "shape_from_config",
    "shapes_dir",
]
