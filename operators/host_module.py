"""A whole module computed where its weights live (``OffloadedModule(compute: host | auto)``).

Embeddings and lm_head run every step and are large (a vocabulary of rows), while what they read
and write per step is small: token ids in, a hidden state out; a hidden state in, one row of
logits out. Where the device budget does not keep them (:mod:`kinject.engine.residency`), moving
their weights every step costs far more link time than moving their activations. So, like the
experts of :mod:`operators.host_experts` and the attention core of :mod:`operators.host_attention`,
the module can run on the host on its host-tier weights: its tensor inputs cross the link to the
host (:class:`kinject.engine.host_lane.HostLane`), its own forward runs there with the parameters
bound to :meth:`TensorStore.host_weights <kinject.engine.store.TensorStore.host_weights>`, and its
output comes back. The bytes are counted (and timed on an emulated link) like the experts' rows.

``host``: always, while the unit is not on the device. ``auto``: Fiddler's rule on the link: on
the host when its activations (input bytes, and the output bytes per input row it produced
before) cost less than moving its stored bytes, or when they do not fit the budget beside what it
keeps; else moved as ``device`` moves it (a long prefill through lm_head: logits outweigh the
weights). A unit the residency plan kept computes on the device. CUDA: the lane's pinned copies on
its own stream, ordered by events (no global synchronize); the host computes in the caller's thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from kinject.engine.host_lane import HostLane
from kinject.engine.transfer_handles import for_each_tensor
from kinject.formatting import format_bytes

if TYPE_CHECKING:
    from kinject.runtime import Runtime
    from operators.base import ParamBinding


class HostModule:
    """The host side of one :class:`~operators.offload.OffloadedModule` (module docstring): its
    ``base`` module run on the weights its ``binding`` holds, under the operator's ``key``."""

    def __init__(self, mode: str, *, key: str, base: nn.Module, binding: "ParamBinding", runtime: "Runtime"):
        self.mode, self.key, self.base, self.binding, self.runtime = mode, key, base, binding, runtime
        self.out_per_row: float | None = None          # output bytes per input row, measured
        self.stats = {"calls": 0, "activation_bytes": 0, "saved_bytes": 0}
        self._lane: HostLane | None = None              # the runtime's lane for modules computed on the host

    def here(self, args: tuple, kwargs: dict) -> bool:
        """Whether this call computes on the host (module docstring)."""
        unit, store = self.binding.unit, self.runtime.store
        if unit is None or not store.offloaded(unit) or store.placed(unit):
            return False                                # on the device (kept, resident) or on its way: use it
        if self.mode == "host" or not store.fits(unit.nbytes):
            return True
        nbytes, rows = _input_size(args, kwargs)
        out = rows * self.out_per_row if self.out_per_row is not None else nbytes
        return nbytes + out < unit.wire_nbytes

    def run(self, args: tuple, kwargs: dict, layer: int | None):
        """The module on the host: inputs to the host, its forward on the host weights, output back
        (``layer``: the operator's position, for the transfer and trace labels). The common call, one
        tensor in and one out (token ids to embeddings, a hidden state to logits), skips the walks
        over nested arguments and outputs (once per step for each of them)."""
        rt, key, binding = self.runtime, self.key, self.binding
        unit = binding.unit
        lane = self._lane
        if lane is None:
            lane = self._lane = rt.shared("modules_host_lane", lambda: HostLane(rt.device))
        single = not kwargs and len(args) == 1 and isinstance(args[0], torch.Tensor)
        if single:
            flat = [args[0]]
        else:
            flat = []
            for_each_tensor((args, kwargs), flat.append)
        in_bytes = sum([_nbytes(t) for t in flat])
        rt.transfer.cross_link(in_bytes, channel="ondemand", label=f"{key} host in", layer=layer)
        on_host = lane.to_host(flat).wait()
        if single:
            h_args, h_kwargs = on_host, kwargs
        else:
            it = iter(on_host)
            h_args, h_kwargs = _rebuild((args, kwargs), lambda _: next(it))
        binding.bind(rt.store.host_weights(unit))
        try:
            tracer = rt.tracer
            if tracer.enabled:
                with tracer.span("host_compute", f"{key} host", layer=layer,
                                 args={"saved_bytes": unit.wire_nbytes, "step": rt.scheduler.step}):
                    out = self.base(*h_args, **h_kwargs)
            else:
                out = self.base(*h_args, **h_kwargs)
        finally:
            binding.unbind()
        if isinstance(out, torch.Tensor):
            outs = [out]
        else:
            outs = []
            for_each_tensor(out, outs.append)
        out_bytes = sum([_nbytes(t) for t in outs])
        rt.transfer.cross_link(out_bytes, channel="kv_store", label=f"{key} host out", layer=layer, wait=True)
        rows = _rows(flat[0]) if flat else 0
        if rows:
            self.out_per_row = out_bytes / rows
        s = self.stats
        s["calls"] += 1
        s["activation_bytes"] += in_bytes + out_bytes
        s["saved_bytes"] += unit.wire_nbytes
        if outs and outs[0] is out:
            return lane.to_device(out)
        back = iter([lane.to_device(t) for t in outs])
        return _rebuild(out, lambda _: next(back))

    def report_line(self) -> str | None:
        s = self.stats
        if not s["calls"]:
            return None
        return (f"  {self.key}: computed on the host {s['calls']} times, saved {format_bytes(s['saved_bytes'])} of moves "
                f"for {format_bytes(s['activation_bytes'])} of activations")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _input_size(args: tuple, kwargs: dict) -> tuple[int, int]:
    """(bytes of every tensor input, rows of the first one): its elements but the last dimension for
    a floating tensor (hidden states), all of them for an integer one (token ids)."""
    flat: list[torch.Tensor] = []
    for_each_tensor((args, kwargs), flat.append)
    return (sum(_nbytes(t) for t in flat), _rows(flat[0])) if flat else (0, 0)


def _rows(first: torch.Tensor) -> int:
    """Rows of an input: its elements but the last dimension (floating: hidden states), all (token ids)."""
    n = first.numel()
    return n // (first.shape[-1] or 1) if first.dtype.is_floating_point and first.ndim else n


def _rebuild(obj: Any, swap: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` with every tensor replaced by ``swap(tensor)``, in :func:`for_each_tensor`'s order."""
    if isinstance(obj, torch.Tensor):
        return swap(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_rebuild(v, swap) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_rebuild(v, swap) for v in obj)
    if isinstance(obj, dict):
        out = {k: _rebuild(v, swap) for k, v in obj.items()}
        if type(obj) is dict:
            return out
        return type(obj)(**out) if hasattr(obj, "to_tuple") else type(obj)(out)   # a ModelOutput takes fields
    return obj
