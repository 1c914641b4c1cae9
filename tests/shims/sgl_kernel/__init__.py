"""TEST-ONLY stand-in for SGLang's ``sgl_kernel`` package (never shipped; tests put it on PYTHONPATH).

Why: SGLang's CPU engine imports its compiled kernel package, and no wheel of it exists for our AVX2 build
machines (its CPU kernels target AVX512/AMX). With the torch-native attention backend the CPU path calls
exactly one op, ``assign_req_to_token_pool_cpu`` (write each request's new KV slot indices into its row of
the request-to-token table); here it is in plain torch indexing. Every other name SGLang imports from
``sgl_kernel`` resolves to a stub that raises if it is ever called, so an unexpected kernel use fails loudly.
"""

import os

import torch


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset,
                                 out_cache_loc, pool_len=None):
    # Row req_pool_indices[i], columns [start_offset[i], end_offset[i]) get the next
    # (end-start) entries of out_cache_loc, requests laid out back to back.
    pos = 0
    for r, s, e in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = e - s
        req_to_token[r, s:e] = out_cache_loc[pos:pos + n].to(req_to_token.dtype)
        pos += n


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    log = os.environ.get("SGL_KERNEL_SHIM_LOG")
    if log:
        with open(log, "a") as f:
            f.write(name + "\n")

    def _stub(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel shim: {name} is not implemented (test-only shim)")

    _stub.__name__ = name
    return _stub
