"""transformers' rotary embedding of a decode step's query and key in one compiled call each, with
torch's bits (docs/architecture.md, "Host compute").

Why: Llama's ``apply_rotary_pos_emb`` (118 families of transformers 5 have exactly its code, with
its ``rotate_half``) is sixteen torch operations per attention (two ``unsqueeze``, four ``mul``, two
``add``, and in each ``rotate_half`` two slices, a ``neg`` and a ``cat``) on a few hundred values at
batch 1: ~70 us per layer per token on the bench machine. ``kinject_rotary_bf16`` (``host_gemv.c``)
computes ``x * cos + rotate_half(x) * sin`` rounding where torch rounds (each product to bfloat16,
their sum in float32 then to bfloat16); it is elementwise, so no order to follow.

How it is reached: an attention module whose class forward calls a global bound to a Llama-identical
``apply_rotary_pos_emb`` gets a copy of that forward (:mod:`kinject.engine.rebind`) in which the name
is bound to :class:`NativeRotary`; the call shapes it does not take (another ``unsqueeze_dim``, a
prefill's transposed, non-contiguous query, other dtypes or devices, gradients) go to the original
function. Each original function is computed both ways on random rows once before it is replaced.
"""

from __future__ import annotations

import logging

import torch

from kinject.engine import host_sdpa
from kinject.engine.host_gemv import HostGemv, load
from kinject.engine.rebind import code_key, hub_wrapped, is_rebound, plain_forward, rebound_forward

logger = logging.getLogger(__name__)
_llama: tuple | None = None


def _llama_keys() -> tuple:
    """The code keys of transformers' Llama ``apply_rotary_pos_emb`` and ``rotate_half``."""
    global _llama
    if _llama is None:
        from transformers.models.llama import modeling_llama
        _llama = (code_key(hub_wrapped(modeling_llama.apply_rotary_pos_emb)), code_key(modeling_llama.rotate_half))
    return _llama


def is_llama_rotary(fn) -> bool:
    """Whether ``fn`` has exactly the code of Llama's ``apply_rotary_pos_emb`` and calls a ``rotate_half``
    with exactly the code of Llama's (the same arithmetic by construction); ``fn`` may be the hub-kernel
    layer that wraps such a function (:func:`~kinject.engine.rebind.hub_wrapped`)."""
    fn = hub_wrapped(fn)
    key = code_key(fn)
    if key is None:
        return False
    apply_key, rotate_key = _llama_keys()
    return key == apply_key and code_key(getattr(fn, "__globals__", {}).get("rotate_half")) == rotate_key


class NativeRotary:
    """``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` through the kernel where it takes the
    call (:func:`_takes`, :meth:`~kinject.engine.host_gemv.HostGemv.rotary`), else ``original``."""

    __slots__ = ("original", "gemv")

    def __init__(self, original, gemv: HostGemv):
        self.original, self.gemv = original, gemv

    def __call__(self, q, k, cos, sin, *args, **kwargs):
        if not kwargs and (not args or args == (1,)) and _takes(q, k, cos, sin):
            return self.gemv.rotary(q, k, cos, sin)
        return self.original(q, k, cos, sin, *args, **kwargs)


_BF16 = torch.bfloat16


def _takes(q, k, cos, sin) -> bool:
    """Whether the kernel takes this call: four contiguous bfloat16 CPU tensors, ``q`` / ``k`` ``[b, h, s, d]``
    with ``d`` even, ``cos`` / ``sin`` ``[b, s, d]``, no gradients recorded (checked in this order, cheapest
    first: it runs twice per layer per token)."""
    try:
        if q.dtype is not _BF16 or k.dtype is not _BF16 or cos.dtype is not _BF16 or sin.dtype is not _BF16 \
                or q.device.type != "cpu" or k.device.type != "cpu" or cos.device.type != "cpu" \
                or sin.device.type != "cpu":
            return False
        b, _, s, d = q.shape
        kb, _, ks, kd = k.shape
    except (AttributeError, ValueError):
        return False
    if d % 2 or (kb, ks, kd) != (b, s, d) or cos.shape != (b, s, d) or sin.shape != (b, s, d):
        return False
    if not (q.is_contiguous() and k.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()):
        return False
    return not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or cos.requires_grad
                                             or sin.requires_grad))


def _agrees(gemv: HostGemv, original) -> bool:
    """The kernel and ``original`` on random queries and keys (head sizes 64 and 128, 1 and 3 positions)."""
    g = torch.Generator().manual_seed(0)
    for d, s in ((64, 1), (128, 3)):
        q = torch.randn(1, 4, s, d, generator=g).to(torch.bfloat16)
        k = torch.randn(1, 2, s, d, generator=g).to(torch.bfloat16)
        angle = torch.randn(1, s, d, generator=g) * 3
        cos, sin = angle.cos().to(torch.bfloat16), angle.sin().to(torch.bfloat16)
        with torch.no_grad():
            ref = original(q, k, cos, sin)
            got = gemv.rotary(q, k, cos, sin)
        if not all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(got, ref)):
            return False
    return True


def attach_rotary(model: torch.nn.Module, attention: bool = False) -> list[torch.nn.Module]:
    """Give every module of ``model`` with bfloat16 weights (its own or its children's: an attention's
    projections) whose class forward calls a Llama-identical ``apply_rotary_pos_emb`` a copy of that
    forward calling :class:`NativeRotary` instead (:func:`detach_rotary` removes it); with
    ``attention`` (``host_gemv: fast``), a forward that looks its attention function up in
    transformers' ``ALL_ATTENTION_FUNCTIONS`` also sees an interface whose ``sdpa`` is
    :class:`~kinject.engine.host_sdpa.HostSdpa` (one copy of the forward takes both);
    none where the kernel is unavailable."""
    gemv = load()
    if gemv is None:
        return []
    checked: dict[int, NativeRotary | None] = {}
    interfaces: dict[int, object] = {}

    def replace(name: str, value):
        if attention and name == host_sdpa.NAME:
            if id(value) not in interfaces:
                interfaces[id(value)] = host_sdpa.interface_with_host_sdpa(value, gemv)
            return interfaces[id(value)]
        if not callable(value) or not is_llama_rotary(value):
            return None
        if id(value) not in checked:
            ok = _agrees(gemv, value)
            if not ok:
                logger.info("host compute: the rotary kernel differs from %s here; it stays with torch",
                            hub_wrapped(value).__module__)
            checked[id(value)] = NativeRotary(value, gemv) if ok else None
        return checked[id(value)]

    done = []
    for m in model.modules():
        if plain_forward(m) is None or not any(p.dtype is torch.bfloat16 for p in m.parameters(recurse=False)) \
                and not any(p.dtype is torch.bfloat16 for c in m.children() for p in c.parameters(recurse=False)):
            continue                # (a float32 attention would only pay for the check)
        forward = rebound_forward(m, replace)
        if forward is not None:
            m.forward = forward
            done.append(m)
    return done


def detach_rotary(modules: list[torch.nn.Module]) -> None:
    """Exact inverse of :func:`attach_rotary`."""
    for m in modules:
        if is_rebound(m.__dict__.get("forward")):
            del m.forward
