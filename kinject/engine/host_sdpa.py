"""A decode step's attention on a CPU in one compiled call (docs/architecture.md, "Host compute").

Why: transformers' ``sdpa`` attention function calls torch's CPU flash kernel, which for one query
row runs a dozen library calls and buffer allocations per head: at batch 1 on the bench machine
50-70 us per layer for a few dozen cached keys, 0.5 ms at 600 and 1.8 ms at 2048 (2-3 GMAC/s), so
in a long chat it costs more than the experts. ``kinject_attend_bf16`` (``host_gemv.c``) computes
the same algorithm (blocks of 512 keys, torch's ``fexp_u20``, probabilities rounded to bfloat16) in
one call, 3.5-6x faster; the float32 order of its two products is not torch's GEMM's, so about one
output in 10^3-10^4 is a bfloat16 ulp off torch's, and it runs only under ``pipeline.host_gemv:
fast`` (the default ``exact`` keeps torch's bits).

How it is reached: an attention module's class forward looks its attention function up by name in
the ``ALL_ATTENTION_FUNCTIONS`` global of its modeling file; the rebound copy of that forward
(:mod:`kinject.engine.rebind`, the same copy that takes the rotary kernel) sees an interface of its
own whose ``sdpa`` is :class:`HostSdpa`. Every call it does not take (a mask, a query of
several rows, dropout, a softcap or sinks, gradients, other dtypes or devices) goes to the original
function; nothing outside the instance changes.
"""

from __future__ import annotations

import torch

from kinject.engine.host_gemv import HostGemv

_BF16 = torch.bfloat16
NAME = "ALL_ATTENTION_FUNCTIONS"        # the global transformers' attention forwards look the function up in


class HostSdpa:
    """transformers' ``sdpa_attention_forward(module, query, key, value, attention_mask, ...)`` through
    :meth:`HostGemv.attend` where it takes the call (:func:`takes`), else ``original``."""

    __slots__ = ("original", "gemv")

    def __init__(self, original, gemv: HostGemv):
        self.original, self.gemv = original, gemv

    def __call__(self, module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                 is_causal=None, **kwargs):
        if attention_mask is None and not dropout and takes(self.gemv, query, key, value, kwargs):
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            return self.gemv.attend(query, key, value, float(scale)), None
        return self.original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                             is_causal=is_causal, **kwargs)


def takes(gemv: HostGemv, q, k, v, kwargs: dict) -> bool:
    """One query row per sequence, bfloat16 CPU ``[b, h, 1, d]`` / ``[b, hk, n, d]`` tensors with their last
    dimension contiguous, ``h`` a multiple of ``hk``, no extra term (softcap, sinks, a position bias), no
    gradients recorded."""
    if any(kwargs.get(name) is not None for name in ("softcap", "s_aux", "sinks", "position_bias")) \
            or kwargs.get("output_attentions"):
        return False
    if q.dtype is not _BF16 or k.dtype is not _BF16 or v.dtype is not _BF16 or not q.is_cpu or not k.is_cpu \
            or not v.is_cpu or q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return False
    b, h, s, d = q.shape
    kb, hk, n, kd = k.shape
    if s != 1 or kb != b or v.shape != k.shape or kd != d or hk < 1 or h % hk:
        return False
    if q.stride(3) != 1 or k.stride(3) != 1 or v.stride(3) != 1 or not gemv.attend_takes(n, d):
        return False
    return not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))


def interface_with_host_sdpa(interface, gemv: HostGemv):
    """A copy of transformers' attention interface ``interface`` (an ``AttentionInterface``: every
    function it maps, its file's own overrides included) whose ``sdpa`` is :class:`HostSdpa` over
    transformers' ``sdpa_attention_forward``; None where its ``sdpa`` is another function (a family's
    own, whose arithmetic the kernel does not follow) or it is no such interface."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    try:
        if interface["sdpa"] is not sdpa_attention_forward:
            return None
        copy = type(interface)()
        for key in interface:
            copy[key] = interface[key]          # (the copy's own mapping: nothing outside it changes)
    except (KeyError, TypeError, AttributeError):
        return None
    copy["sdpa"] = HostSdpa(sdpa_attention_forward, gemv)
    return copy
