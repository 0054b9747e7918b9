"""Grouped expert compute: every ready expert of a layer in one call, tokens sorted once.

:class:`~operators.experts.GroupedExperts` sorts the layer's (token, expert) pairs by expert
once per step (``torch.argsort``: the rows of expert ``e`` are one contiguous slice of the
sorted order) and, each time a set of experts has its weights on the device, calls
:func:`compute_group` with those experts' weight tensors and their rows. The same math as
transformers' ``grouped_mm_experts_forward``:

    h = x @ W_up[e].T (+ b_up[e]);  h = gate(h) or act(h);  y = h @ W_down[e].T (+ b_down[e]);  y = norm(y)

Backends, an ordered chain (docs/architecture.md, "Ordered chains"), chosen per group:

1. ``grouped_mm`` — the experts' tensors of each role are equally spaced views of one storage
   (a *stacked view*: the fused ``[E, ...]`` parameter a host-tier unit on a CPU points into, by
   expert id; or the landing slab / dequantization workspace the store put a batch of moved units
   in, :mod:`kinject.engine.slabs`, by slot): one ``torch.nn.functional.grouped_mm``
   (``torch._grouped_mm``) per projection over that view, experts (slots) in the span that are not
   in the group get zero rows. On CUDA this needs SM80+ (transformers' ``_can_use_grouped_mm``
   decides); on CPU torch >= 2.9.
2. ``loop`` — anything else (units with tensors of their own, e.g. a CPU's host-cache hits, no
   grouped GEMM, a group spread thin over its span on a CPU, whose grouped GEMM pays for every empty expert):
   one ``torch.mm`` per expert on a slice of the sorted rows (no gathers or scatters), still one
   activation call for the whole group, like transformers' ``_grouped_mm_fallback``.

Both give the same bits as a per-expert ``x @ W.T`` on the same rows (checked in the tests:
identical greedy tokens to the untouched model). Nothing here synchronises a CUDA device:
offsets are built on the host from token counts the caller already has, and go to the device
from pinned memory (:func:`~kinject.engine.transfer.host_to_device`).
"""

from __future__ import annotations

import functools
import itertools
import logging
from array import array
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from kinject.engine.transfer import host_to_device

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExpertMath:
    """How one family's experts compute (read from the fused experts module, never copied)."""

    up: str                                   # "gate_up_proj" (gated) or "up_proj"
    down: str                                 # "down_proj"
    transposed: bool                          # weights laid out [in, out] (GPT-OSS)
    activation: Callable[[torch.Tensor], torch.Tensor]   # the module's _apply_gate or act_fn
    post: Callable[[torch.Tensor], torch.Tensor] | None   # post_expert_norm, if any

    @classmethod
    def of(cls, base: nn.Module) -> "ExpertMath":
        has_gate = bool(getattr(base, "has_gate", True))
        post = base.post_expert_norm if getattr(base, "has_post_expert_norm", False) else None
        if has_gate and is_default_silu_gate(base):
            activation = SiluGate(type(base)._apply_gate, base)
        else:
            activation = base._apply_gate if has_gate else base.act_fn
        return cls(up="gate_up_proj" if has_gate else "up_proj", down="down_proj",
                   transposed=bool(getattr(base, "is_transposed", False)), activation=activation, post=post)


class SiluGate(functools.partial):
    """transformers' default gate of a fused experts module, ``act_fn(gate) * up`` (the gate half first)
    with ``act_fn`` SiLU, called as it is (a ``partial``: no Python frame of its own per call).
    ``fused = "silu"`` says so to a host kernel, which may then compute it between the two projections
    itself (:meth:`kinject.engine.host_gemv.HostGemv.swiglu`, only where its bits are torch's)."""

    fused = "silu"


def is_default_silu_gate(base: nn.Module) -> bool:
    """Whether ``base``'s gate is transformers' ``_default_apply_gate`` as its class has it, its
    ``act_fn`` a plain SiLU module (no forward of its own on the instance, no hooks): a family with a
    gate of its own (GPT-OSS's clamped one) or another activation is not."""
    try:
        from transformers.activations import SiLUActivation
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:
        return False
    if getattr(type(base), "_apply_gate", None) is not _default_apply_gate or "_apply_gate" in vars(base):
        return False
    act = getattr(base, "act_fn", None)
    return (type(act) in (SiLUActivation, nn.SiLU) and "forward" not in vars(act) and not act._forward_hooks
            and not act._forward_pre_hooks)


def compute_group(math: ExpertMath, weights: Sequence[dict[str, torch.Tensor]], ids: Sequence[int],
                  counts: Sequence[int], x: torch.Tensor, *, backend: str | None = None,
                  stacked: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """Experts ``ids`` (ascending) on their rows of ``x``.

    ``weights[i]``: expert ``ids[i]``'s tensors by role; ``counts[i]``: its number of rows;
    ``x`` ``[N, H]``: the rows, grouped by expert in ``ids`` order (``N = sum(counts)``).
    Returns ``[N, H]`` in the same row order, in the weights' dtype. ``backend``: force
    ``"grouped_mm"`` or ``"loop"`` (default: the first of the chain that applies).
    ``stacked``: role -> ``[E, ...]`` view (:func:`stacked_views`) whose index ``e`` *is*
    expert ``e``'s tensor in ``weights``, when the caller knows that (by identity): the grouped
    GEMM runs over its slice ``ids[0]..ids[-1]`` (experts in it not in ``ids`` get no rows)
    instead of checking every expert's addresses. On a CPU a group spread thin over its span
    runs one mm per expert instead (:func:`_spread_thin`).
    """
    views, first, slots = None, ids[0], ids
    if backend != "loop" and len(ids) > 1 and _grouped_mm_kernel(weights[0][math.up], x):
        thin = backend != "grouped_mm" and _spread_thin(ids, x.device)
        if stacked is not None:                                   # the group's span of it: others get no rows
            if not thin:
                first, last = ids[0], ids[-1] + 1
                views = stacked if last - first == stacked[math.up].shape[0] else \
                    {role: v[first:last] for role, v in stacked.items()}
        else:
            views = None if thin else _stacked_views(math, weights, ids)   # role -> [span, ...] view, or None
            if views is None:                                     # moved units in one slab: by their slots
                slots = _slot_ids([w[math.up] for w in weights])
                if slots is not None and (backend == "grouped_mm" or not _spread_thin(slots, x.device)):
                    views = _stacked_views(math, weights, slots)
                    first = slots[0]
                if views is None:
                    slots = ids
    if backend == "grouped_mm" and views is None:
        views = _stacked_views(math, weights, ids, strict=True)
    if views is not None:
        try:
            return _grouped(math, views, slots, counts, x, first)
        except (RuntimeError, NotImplementedError) as exc:       # no kernel, or these inputs refused
            if backend == "grouped_mm":
                raise
            w = weights[0][math.up]
            if _kernel_runs(w):                                   # refused these tensors (strides, alignment)
                logger.debug("grouped_mm refused this call's tensors (%s): one mm per expert for it", exc)
            else:
                _KERNEL_OK[_kernel_key(w, x)] = False
                logger.info("grouped_mm unavailable for %s %s (%s): one mm per expert from now on",
                            w.device, w.dtype, exc)
    return _loop(math, weights, counts, x)


# CPU grouped GEMM: one mm per group of the span, empty or not. Measured (torch 2.13 CPU, 1
# thread, H=256, I=64, one row per expert): ~14 us + ~5.3 us per expert with rows + ~1.5 us per
# empty expert in the span, against ~10.8 us per expert for one mm per expert (``_loop``). So a
# group spread over more than ~4x its size (a few cold experts landing among 64) loops.
_CPU_SPREAD = 4


def _spread_thin(ids: Sequence[int], device: torch.device) -> bool:
    """Whether experts ``ids`` are too far apart for a CPU grouped GEMM over their span to pay
    (see ``_CPU_SPREAD``). Never on an accelerator, where empty groups cost next to nothing and
    one launch per expert is what the grouped kernel saves."""
    return device.type == "cpu" and ids[-1] - ids[0] + 1 > _CPU_SPREAD * len(ids)


# ---------------------------------------------------------------- backends


def _loop(math: ExpertMath, weights, counts, x: torch.Tensor) -> torch.Tensor:
    """One mm per expert on its slice of the sorted rows; one activation for all of them."""
    up_w = weights[0][math.up]
    x = x.to(up_w.dtype)
    h = _per_expert(x, [w[math.up] for w in weights], _biases(weights, math.up), counts, math.transposed)  # [N, 2I]
    h = math.activation(h)                                                                 # [N, I]
    down_w = weights[0][math.down]
    y = _per_expert(h.to(down_w.dtype), [w[math.down] for w in weights], _biases(weights, math.down), counts,
                    math.transposed)                                                       # [N, H]
    return math.post(y) if math.post is not None else y


def _biases(weights, role: str) -> list | None:
    """Each expert's bias of ``role``, or None when the experts have none (asked per layer-step)."""
    key = role + "_bias"
    return [w.get(key) for w in weights] if key in weights[0] else None


def _per_expert(x: torch.Tensor, ws: list, biases: list | None, counts, transposed: bool) -> torch.Tensor:
    """One mm per expert with rows (``x @ W.T``; ``x @ W`` for an ``[in, out]`` layout), joined in
    order. The rows are split once (one call, not a slice and a view per expert: at DeepSeek-V3's
    counts a decode step's experts are ~50 per layer spread over 256, and the per-expert Python
    around each tiny mm was as long as the mm)."""
    parts = x.split_with_sizes(list(counts))
    if transposed:
        outs = [torch.mm(xi, w) for xi, w, n in zip(parts, ws, counts) if n]              # [n, out] each
    else:
        outs = [F.linear(xi, w) for xi, w, n in zip(parts, ws, counts) if n]
    if biases is not None:
        for y, b in zip(outs, [b for b, n in zip(biases, counts) if n]):
            if b is not None:
                y += b
    if not outs:
        return x.new_empty((0, ws[0].shape[-1] if transposed else ws[0].shape[-2]))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _grouped(math: ExpertMath, views: dict, ids, counts, x: torch.Tensor, first: int) -> torch.Tensor:
    """One grouped GEMM per projection over the stacked views, whose index 0 is expert ``first``
    (``ids[0]``, or 0 for views over every expert) and which reach at least ``ids[-1]``."""
    span = views[math.up].shape[0]                                 # groups of the GEMM: one per view index
    per = [0] * span                                               # rows per expert of the span
    for e, n in zip(ids, counts):
        per[e - first] = n
    offs = host_to_device(torch.frombuffer(array("i", itertools.accumulate(per)), dtype=torch.int32),
                          x.device)                                # [span] (frombuffer: cheaper than torch.tensor)
    h = _grouped_linear(math, math.up, views, x, offs, per)                               # [N, 2I] / [N, I]
    h = math.activation(h)
    y = _grouped_linear(math, math.down, views, h, offs, per)                             # [N, H]
    return math.post(y) if math.post is not None else y


def _grouped_linear(math: ExpertMath, role: str, views: dict, x: torch.Tensor, offs: torch.Tensor,
                    per: list[int]) -> torch.Tensor:
    w = views[role]                                                                       # [span, out, in]
    if x.dtype != w.dtype:
        x = x.to(w.dtype)
    out = _gmm(x, w if math.transposed else w.transpose(-2, -1), offs)
    b = views.get(role + "_bias")                                                         # [span, out]
    if b is not None:
        rows = torch.repeat_interleave(torch.arange(len(per)), torch.tensor(per))      # [N] expert of each row (host)
        out.add_(b[host_to_device(rows, b.device)])
    return out


def _gmm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return _GROUPED_MM(x, w, offs=offs)


#: torch's grouped GEMM: the public ``F.grouped_mm`` where this torch has it (looked up once, not per call)
_GROUPED_MM = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm


# ---------------------------------------------------------------- stacked views


def stacked_view(ts: Sequence[torch.Tensor], ids: Sequence[int]) -> torch.Tensor:
    """``[ids[-1] - ids[0] + 1, *shape]`` view over the storage the per-expert tensors ``ts``
    share (expert ``ids[i]`` at index ``ids[i] - ids[0]``); ValueError when they are not equally
    spaced views of one storage (use :func:`has_stacked_view` to ask first)."""
    view = _view_over(ts, ids)
    if view is None:
        raise ValueError("expert tensors are not equally spaced views of one storage")
    return view


def _view_over(ts: Sequence[torch.Tensor], ids: Sequence[int]) -> torch.Tensor | None:
    """:func:`stacked_view`, or None when there is none."""
    step = _spacing(ts, ids)
    if step is None:
        return None
    t0 = ts[0]
    return t0.as_strided((ids[-1] - ids[0] + 1, *t0.shape), (step, *t0.stride()), t0.storage_offset())


def _slot_ids(ts: Sequence[torch.Tensor]) -> list[int] | None:
    """Slots of ``ts`` in one ``[n, *shape]`` allocation (a landing slab or a dequantization
    workspace, :mod:`kinject.engine.slabs`), counted from ``ts[0]``'s: contiguous tensors of one
    shape and dtype in one storage whose offsets from the first are ascending multiples of one
    tensor's size; None otherwise. (Their expert ids need not be equally spaced: a batch of moved
    experts takes consecutive slots.)"""
    t0 = ts[0]
    n, shape, dtype, base = t0.numel(), t0.shape, t0.dtype, t0.storage_offset()
    if n == 0 or not t0.is_contiguous():
        return None
    storage, slots = t0.untyped_storage().data_ptr(), []
    for t in ts:
        d = t.storage_offset() - base
        if d % n or t.shape != shape or t.dtype != dtype or not t.is_contiguous() \
                or t.untyped_storage().data_ptr() != storage or (slots and d // n <= slots[-1]):
            return None
        slots.append(d // n)
    return slots


def has_stacked_view(ts: Sequence[torch.Tensor], ids: Sequence[int]) -> bool:
    return _spacing(ts, ids) is not None


def _spacing(ts: Sequence[torch.Tensor], ids: Sequence[int]) -> int | None:
    """Elements between consecutive experts when ``ts`` are views of one storage laid out
    ``[E, ...]`` (each tensor of the same dtype/shape/strides, addresses linear in the expert id).
    Addresses are compared (``data_ptr``, cheap) and the whole span must lie inside the first
    tensor's storage, so the view over it reads exactly these tensors' memory."""
    t0 = ts[0]
    if len(ts) == 1:
        return max(t0.numel(), 1)
    shape, stride, dtype = t0.shape, t0.stride(), t0.dtype
    step = (ts[1].storage_offset() - t0.storage_offset()) // max(ids[1] - ids[0], 1)
    if step < t0.numel():                  # overlapping or backwards: not an [E, ...] layout
        return None
    base, e0, pitch = t0.data_ptr(), ids[0], step * t0.element_size()
    for t, e in zip(ts, ids):
        if t.data_ptr() != base + (e - e0) * pitch or t.shape != shape or t.stride() != stride or t.dtype != dtype:
            return None
    extent = 1 + sum((n - 1) * st for n, st in zip(shape, stride))                 # elements one tensor spans
    last = t0.storage_offset() + (ids[-1] - e0) * step + extent
    return step if last * t0.element_size() <= t0.untyped_storage().nbytes() else None


def stacked_views(math: ExpertMath, weights: Sequence[dict[str, torch.Tensor]]) -> dict | None:
    """Role -> ``[E, ...]`` view over every expert's tensors (``weights[e]``: expert ``e``'s), or
    None when they are not equally spaced views of one storage."""
    if not weights or math.up not in weights[0]:         # none, or HQQ-packed roles
        return None
    return _stacked_views(math, weights, range(len(weights)))


def _roles(math: ExpertMath, weights) -> list[str]:
    return [r for r in (math.up, math.down, math.up + "_bias", math.down + "_bias") if r in weights[0]]


def _stacked_views(math: ExpertMath, weights, ids, *, strict: bool = False) -> dict | None:
    """Role -> stacked view over ``ids[0]..ids[-1]`` for every role, or None (ValueError if ``strict``)."""
    views = {}
    for role in _roles(math, weights):
        view = _view_over([t[role] for t in weights], ids)
        if view is None:
            if strict:
                raise ValueError(f"expert tensors of {role!r} are not equally spaced views of one storage")
            return None
        views[role] = view
    return views


_KERNEL_OK: dict = {}   # (device, weight dtype, input dtype) -> a grouped GEMM kernel applies (False once one raised)


def _kernel_key(w: torch.Tensor, x: torch.Tensor) -> tuple:
    return (w.device, w.dtype, x.dtype)


def _grouped_mm_kernel(w: torch.Tensor, x: torch.Tensor) -> bool:
    """A grouped GEMM kernel for this device and dtype (asked once per device and dtype)."""
    key = _kernel_key(w, x)
    ok = _KERNEL_OK.get(key)
    if ok is None:
        ok = _KERNEL_OK[key] = _kernel_applies(w, x)
    return ok


def _kernel_runs(w: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM computes on fresh contiguous tensors of ``w``'s device and dtype:
    after a call raised, it tells a kernel missing for them (switched off for the process) from
    inputs it refused (strides, alignment: that call alone takes the loop)."""
    try:
        a = torch.zeros(2, 16, dtype=w.dtype, device=w.device)
        b = torch.zeros(2, 16, 16, dtype=w.dtype, device=w.device)
        _gmm(a, b, torch.tensor([1, 2], dtype=torch.int32, device=w.device))
        return True
    except (RuntimeError, NotImplementedError):
        return False


def _kernel_applies(w: torch.Tensor, x: torch.Tensor) -> bool:
    if not (hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm")):
        return False
    if w.device.type == "cuda":
        try:                               # transformers' own test (a private helper: may move or change)
            from transformers.integrations.moe import _can_use_grouped_mm
            return bool(_can_use_grouped_mm(x, w, None))
        except Exception:                  # noqa: BLE001 - missing or another signature: bf16 on Hopper+ only
            return w.dtype == torch.bfloat16 and torch.cuda.get_device_capability(w.device)[0] >= 9
    return w.device.type == "cpu" and tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 9)
