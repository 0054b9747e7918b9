"""Attention on the host, over the host-tier KV cache, for ``OffloadedAttention(compute="host")``.

MoE-Lightning's CGOPipe: in decode the attention of a micro-batch reads its whole KV to produce a
few values per row, so where the KV lives in host memory it is cheaper to bring the query to the KV
than the KV to the query. The projections (q / k / v / o weights) stay where the rules put them
and run as the module runs them; only the attention core -- transformers' own attention function,
``eager`` (the family's ``eager_attention_forward``) or ``sdpa`` -- runs on the host:

1. the module's forward calls its cache's ``update`` with the new keys / values: the cache view
   (:class:`kinject.kv.layer.HostView`) queues them into the stored KV on the host lane and
   returns the stored KV itself (host tensors, no copy for full layers);
2. the module looks its attention function up by ``config._attn_implementation``: during the call
   its ``config`` is a shallow copy naming :data:`HOST_IMPL`, registered in transformers'
   ``AttentionInterface`` (the registry made for custom attention functions), whose function
   brings the query, the mask and the other tensor arguments to the host (one lane transfer),
   runs the model's configured function there against the host KV, and hands the output back;
3. the module applies its output projection on the device, as always.

The original ``config`` is put back after each call, so everything else (mask code, the prefill,
other modules sharing the config) sees the model as it is. Attention weights (eager's second
output, which decoder layers drop) stay on the host: bringing them back would move a
context-sized tensor per step.
"""

from __future__ import annotations

import copy
import logging
import sys
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from kinject.errors import KinjectError

if TYPE_CHECKING:
    from kinject.engine.host_lane import HostLane
    from kinject.trace import Tracer

logger = logging.getLogger(__name__)

HOST_IMPL = "kinject_host"
"""The attention implementation name an attention module's config carries while its attention
core runs on the host."""

HOST_IMPLS = (None, "eager", "sdpa")
"""The model's attention implementations the host runs (the others are GPU kernels)."""

_ACTIVE: dict[int, "_Call"] = {}          # id(attention module) -> its host call in progress


def host_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, Any]:
    """transformers' attention-function signature: :data:`HOST_IMPL`'s entry in ``AttentionInterface``."""
    call = _ACTIVE.get(id(module))
    if call is None:
        raise KinjectError(f"{type(module).__name__}: attention implementation {HOST_IMPL!r} is kinject's host "
                           f"attention; it is set only while OffloadedAttention(compute='host') runs the module")
    return call.run(module, query, key, value, attention_mask, kwargs)


def _register() -> None:
    if HOST_IMPL not in AttentionInterface._global_mapping:
        AttentionInterface.register(HOST_IMPL, host_attention_forward)


def _impl(config) -> str | None:
    return getattr(config, "_attn_implementation", None)


class HostAttention:
    """The host side of one ``OffloadedAttention(compute="host")``: checks at construction that
    the host can run the module's attention, swaps the implementation in for a call
    (:meth:`call`), and counts what ran."""

    def __init__(self, base: nn.Module, key: str):
        self.base, self.key = base, key
        config = getattr(base, "config", None)
        impl = _impl(config)
        if config is None:
            raise KinjectError(f"{key}: compute: host runs a transformers attention module's attention function on "
                               f"the host; {type(base).__name__} has no config naming one (not a softmax attention "
                               f"over a KV cache?); keep compute: device for it")
        if impl not in HOST_IMPLS:
            raise KinjectError(f"{key}: compute: host runs the model's attention function on the host: eager or "
                               f"sdpa, not {impl!r} (a GPU kernel); load the model with attn_implementation='sdpa'")
        # the family's own eager function (sinks, soft-capping ...), as the module's forward defaults to it
        self.eager = getattr(sys.modules.get(type(base).__module__), "eager_attention_forward", None)
        if self.eager is None and impl in (None, "eager"):
            raise KinjectError(f"{key}: compute: host with eager attention needs the family's "
                               f"eager_attention_forward in {type(base).__module__}; none found")
        self.stats = {"calls": 0, "kv_bytes_read": 0}
        _register()

    @contextmanager
    def call(self, lane: "HostLane", tracer: "Tracer", label: str, layer: int | None):
        """While the module runs one micro-batch: its attention core runs on the host."""
        base = self.base
        saved = base.config
        host_config = copy.copy(saved)
        # the property's storage, not its setter (which would rewrite shared sub-configs too)
        host_config._attn_implementation_internal = HOST_IMPL
        _ACTIVE[id(base)] = _Call(self, saved, lane, tracer, label, layer)
        base.config = host_config
        try:
            yield
        finally:
            base.config = saved
            _ACTIVE.pop(id(base), None)


class _Call:
    """One micro-batch's host attention (what :func:`host_attention_forward` runs)."""

    __slots__ = ("owner", "config", "lane", "tracer", "label", "layer")

    def __init__(self, owner: HostAttention, config, lane: "HostLane", tracer: "Tracer", label: str, layer):
        self.owner, self.config, self.lane, self.tracer, self.label, self.layer = owner, config, lane, tracer, label, layer

    def run(self, module, query, key, value, attention_mask, kwargs: dict):
        owner = self.owner
        if key.device.type != "cpu" or value.device.type != "cpu":
            raise KinjectError(f"{owner.key}: compute: host: the attention function got keys / values on "
                               f"{key.device}, not the host KV the cache view returned (the module changes them "
                               f"after its cache update); use compute: device for this module")
        names = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
        moved = self.lane.to_host([query, attention_mask, *(kwargs[k] for k in names)]).wait()   # [b, Hq, q, D] ...
        query, attention_mask = moved[0], moved[1]
        kwargs = {**kwargs, **dict(zip(names, moved[2:]))}
        fn = ALL_ATTENTION_FUNCTIONS.get_interface(_impl(self.config) or "eager", owner.eager)
        with self.tracer.span("host_compute", self.label, layer=self.layer):
            out, weights = fn(module, query, key, value, attention_mask, **kwargs)          # out [b, q, Hq, D]
        owner.stats["calls"] += 1
        owner.stats["kv_bytes_read"] += key.numel() * key.element_size() + value.numel() * value.element_size()
        return self.lane.to_device(out), weights
