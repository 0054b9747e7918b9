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
other modules sharing the config) sees the model as it is.

Overlap (CGOPipe). Where the device is not the host (CUDA), a step's micro-batches are pipelined
(:meth:`HostAttention.overlapping`): each micro-batch's module call runs on a host-lane worker
thread, and the next one is started as soon as the current one has queued its query for the host,
so the device computes micro-batch j+1's projections and j-1's output projection while the host
computes j's attention. Each worker runs on the caller's CUDA stream (kernels keep their order per
micro-batch; the data of different micro-batches is disjoint). Attention weights (eager's second
output, which decoder layers drop) stay on the host: bringing them back would move a
context-sized tensor per step.
"""

from __future__ import annotations

import copy
import logging
import sys
import threading
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

_CALLS = threading.local()               # .active: id(attention module) -> this thread's host call in progress


def _active() -> dict:
    if not hasattr(_CALLS, "active"):
        _CALLS.active = {}
    return _CALLS.active


def host_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, Any]:
    """transformers' attention-function signature: :data:`HOST_IMPL`'s entry in ``AttentionInterface``."""
    call = _active().get(id(module))
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
        self._lock = threading.Lock()          # host-lane workers count calls concurrently
        self._host_tensors: dict[str, torch.Tensor] | None = None   # the module's own tensors, host copies
        self.overlap: bool | None = None    # pipeline the micro-batches on host-lane workers; None: on CUDA
        _register()

    def count_call(self, kv_bytes: int) -> None:
        """One host attention call that read ``kv_bytes`` of keys and values (from any worker)."""
        with self._lock:
            self.stats["calls"] += 1
            self.stats["kv_bytes_read"] += kv_bytes

    def as_seen_on_host(self, module: nn.Module) -> nn.Module:
        """``module`` as its attention function reads it on the host: the module's own tensors (not
        its sub-modules', e.g. gpt-oss's attention ``sinks``) from host copies made on first use
        (inference weights do not change), every other attribute from the module itself."""
        with self._lock:
            if self._host_tensors is None:
                own = {**module._parameters, **module._buffers}
                self._host_tensors = {name: t.detach().to("cpu") for name, t in own.items()
                                      if t is not None and t.device.type != "cpu"}
            tensors = self._host_tensors
        return _HostTensorsView(module, tensors) if tensors else module

    def overlaps(self, lane: "HostLane", chunks: int) -> bool:
        """Whether :meth:`overlapping` serves a step of ``chunks`` micro-batches: with several, where
        the device is another processor than the host (CUDA), unless :attr:`overlap` says otherwise."""
        return chunks > 1 and (lane.cuda if self.overlap is None else self.overlap)

    @contextmanager
    def _host_config(self):
        """The module's config names :data:`HOST_IMPL` while it runs."""
        base = self.base
        saved = base.config
        host_config = copy.copy(saved)
        # the property's storage, not its setter (which would rewrite shared sub-configs too)
        host_config._attn_implementation_internal = HOST_IMPL
        base.config = host_config
        try:
            yield saved
        finally:
            base.config = saved

    @contextmanager
    def call(self, lane: "HostLane", tracer: "Tracer", label: str, layer: int | None):
        """While the module runs one micro-batch (in this thread): its attention core runs on the host."""
        active = _active()
        with self._host_config() as saved:
            active[id(self.base)] = _Call(self, saved, lane, tracer, label, layer)
            try:
                yield
            finally:
                active.pop(id(self.base), None)

    @contextmanager
    def overlapping(self, lane: "HostLane", tracer: "Tracer", layer: int | None):
        """While one step's micro-batches run pipelined: yields ``start(fn, label)``, which runs
        ``fn()`` (the module on one micro-batch) on a host-lane worker and returns its future once
        the micro-batch has handed its query to the host (or ended). Workers run under the caller's
        grad / inference mode and, on CUDA, its device and stream."""
        inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()
        stream = torch.cuda.current_stream(lane.device) if lane.cuda else None
        pool = lane.workers()

        def start(fn, label: str):
            ready = threading.Event()

            def job():
                active = _active()
                active[id(self.base)] = _Call(self, saved, lane, tracer, label, layer, ready)
                try:
                    with torch.inference_mode(inference), torch.set_grad_enabled(grad), _on_stream(stream):
                        return fn()
                finally:
                    active.pop(id(self.base), None)
                    ready.set()

            future = pool.submit(job)
            ready.wait()
            return future

        with self._host_config() as saved:
            yield start


class _HostTensorsView:
    """An attention module whose own tensors read from host copies (see
    :meth:`HostAttention.as_seen_on_host`); attribute reads otherwise pass through to it."""

    __slots__ = ("_module", "_tensors")

    def __init__(self, module: nn.Module, tensors: dict[str, torch.Tensor]):
        self._module, self._tensors = module, tensors

    def __getattr__(self, name: str):
        tensor = self._tensors.get(name)
        return tensor if tensor is not None else getattr(self._module, name)


@contextmanager
def _on_stream(stream):
    """A worker thread on the caller's CUDA device and stream (both are per thread)."""
    if stream is None:
        yield
        return
    with torch.cuda.device(stream.device), torch.cuda.stream(stream):
        yield


class _Call:
    """One micro-batch's host attention (what :func:`host_attention_forward` runs); ``ready`` is set
    once its query is on its way to the host (the next micro-batch may start)."""

    __slots__ = ("owner", "config", "lane", "tracer", "label", "layer", "ready")

    def __init__(self, owner: HostAttention, config, lane: "HostLane", tracer: "Tracer", label: str, layer,
                 ready: threading.Event | None = None):
        self.owner, self.config, self.lane, self.tracer, self.label, self.layer = owner, config, lane, tracer, label, layer
        self.ready = ready

    def run(self, module, query, key, value, attention_mask, kwargs: dict):
        owner = self.owner
        if key.device.type != "cpu" or value.device.type != "cpu":
            raise KinjectError(f"{owner.key}: compute: host: the attention function got keys / values on "
                               f"{key.device}, not the host KV the cache view returned (the module changes them "
                               f"after its cache update); use compute: device for this module")
        names = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
        pending = self.lane.to_host([query, attention_mask, *(kwargs[k] for k in names)])
        if self.ready is not None:
            self.ready.set()                                   # the next micro-batch's device work may start
        moved = pending.wait()                                 # [b, Hq, q, D], mask, ...
        query, attention_mask = moved[0], moved[1]
        kwargs = {**kwargs, **dict(zip(names, moved[2:]))}
        fn = ALL_ATTENTION_FUNCTIONS.get_interface(_impl(self.config) or "eager", owner.eager)
        tracer = self.tracer
        t0 = tracer.now() if tracer.enabled else 0.0
        out, weights = fn(owner.as_seen_on_host(module), query, key, value, attention_mask,
                          **kwargs)                                                 # out [b, q, Hq, D]
        if tracer.enabled:                  # host time (a CUDA-timed span would time the device's stream)
            tracer.record("host_compute", self.label, t0, tracer.now(), layer=self.layer, args={"timing": "host"})
        owner.count_call(key.numel() * key.element_size() + value.numel() * value.element_size())
        return self.lane.to_device(out), weights
