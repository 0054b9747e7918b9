"""A decode step's top-k router on a CPU in one call instead of eight (docs/architecture.md, "Host compute").

Why: transformers' top-k router of one token is a linear (kinject's one-row GEMV, through the
router's rebound ``F.linear``), a conversion and a softmax in float32, ``topk``, a sum, a division and a
conversion back to bfloat16: seven torch operations after the GEMV, each of which, right after the
previous layer's experts streamed through the caches, costs 10-20 us: about 120 us a layer on the
bench machine, 1 ms of a 20 ms decode step. :class:`DecodeRouter` computes the same in one kernel call
(:meth:`~kinject.engine.host_gemv.HostGemv.route_topk`).

Which modules: those whose class forward (under its decorators) has exactly the code of transformers'
Qwen3-MoE top-k router (9 router classes of transformers 5 share it: Qwen2-MoE, Qwen3-MoE,
Qwen3-Next, Qwen3-Omni, OLMoE, FlexOlmo among them), with no instance forward but the one kinject's
one-row GEMV rebinds (:func:`~kinject.engine.host_gemv.attach_linears`, for routers of at least
``MIN_FUNCTIONAL_WEIGHTS``). Bits: the logits through that GEMV (torch's bits, as the one-row linear
computes them), then torch's softmax, selection, sum and quotients in its
arithmetic, checked against torch's own operations when the library loads
(:attr:`~kinject.engine.host_gemv.HostGemv.route_exact`; without it no router is attached).

What it takes: one token (``[1, hidden]`` after the forward's reshape), bfloat16 CPU tensors, no
gradients, not training, no hooks. Where ``topk``'s order could be another (ties among the chosen
probabilities, or with the first one left out) or a logit is NaN, and for anything else, the forward
it replaced runs, unchanged.
"""

from __future__ import annotations

import inspect

import torch

from kinject.engine.host_gemv import HostGemv, load, one_row_exact
from kinject.engine.rebind import code_key, is_rebound

_BF16 = torch.bfloat16
_template: tuple | None | bool = False      # the code key of the recognised router forward (None: not found)


def _known_template():
    global _template
    if _template is False:
        try:
            from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter
            _template = code_key(inspect.unwrap(Qwen3MoeTopKRouter.forward))
        except ImportError:
            _template = None
    return _template


def recognised(module: torch.nn.Module) -> bool:
    """Whether ``module``'s class forward is transformers' Qwen3-MoE top-k router forward."""
    forward = getattr(type(module), "forward", None)
    key = _known_template()
    return forward is not None and key is not None and code_key(inspect.unwrap(forward)) == key


class DecodeRouter:
    """The instance ``forward`` of a recognised router (see the module docstring): one token through
    :meth:`~kinject.engine.host_gemv.HostGemv.route_topk`; anything else through ``replaced``, the
    forward it was given before (kinject's rebound one)."""

    __slots__ = ("module", "replaced", "instance", "gemv", "fast", "params", "top_k", "norm", "experts", "hidden",
                 "hooks", "global_hooks")

    def __init__(self, module: torch.nn.Module, gemv: HostGemv, fast: bool):
        own = module.__dict__.get("forward")
        self.instance = own is not None              # (detach puts an instance forward back, else removes its own)
        self.module, self.replaced = module, own if own is not None else type(module).forward.__get__(module)
        self.gemv, self.fast = gemv, fast
        self.params = module._parameters
        self.top_k, self.norm = int(module.top_k), bool(module.norm_topk_prob)
        self.experts, self.hidden = int(module.num_experts), int(module.hidden_dim)
        self.hooks = (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks,
                      module._backward_pre_hooks)
        from torch.nn.modules import module as nn_module
        self.global_hooks = (nn_module._global_forward_hooks, nn_module._global_forward_pre_hooks,
                             nn_module._global_backward_hooks, nn_module._global_backward_pre_hooks)

    def __call__(self, *args, **kwargs):
        x = args[0] if len(args) == 1 and not kwargs else kwargs.get("hidden_states") if not args and len(kwargs) == 1 \
            else None
        w = self.params.get("weight")
        if x is None or w is None or torch.is_grad_enabled() or self.module.training or any(self.hooks) \
                or any(self.global_hooks) or x.dtype is not _BF16 or not x.is_cpu or x.numel() != self.hidden \
                or not x.is_contiguous() or w.dtype is not _BF16 or not w.is_cpu or not w.is_contiguous() \
                or w.shape != (self.experts, self.hidden):
            return self.replaced(*args, **kwargs)
        exact = one_row_exact(self.gemv, self.fast, 1, self.hidden)
        out = None if exact is None else self.gemv.route_topk(x, w, self.top_k, self.norm, exact)
        return out if out is not None else self.replaced(*args, **kwargs)


def _takes(module: torch.nn.Module) -> bool:
    """Whether ``module`` has what :class:`DecodeRouter` reads, and no instance forward but kinject's rebound one."""
    forward = module.__dict__.get("forward")
    w = module._parameters.get("weight")
    return (forward is None or is_rebound(forward)) and w is not None and w.dim() == 2 and all(
        isinstance(getattr(module, a, None), int) for a in ("top_k", "num_experts", "hidden_dim")) \
        and isinstance(getattr(module, "norm_topk_prob", None), bool) and 0 < module.top_k <= min(64, module.num_experts) \
        and module.num_experts <= 1024 and tuple(w.shape) == (module.num_experts, module.hidden_dim)


def attach_routers(model: torch.nn.Module, fast: bool = False) -> list[torch.nn.Module]:
    """Give every recognised router of ``model`` (:func:`recognised`, :func:`_takes`) a :class:`DecodeRouter`
    forward over the one it has (:func:`detach_routers` puts that back); none where the kernel is unavailable
    or its router arithmetic is not torch's here. Runs after the linears are attached."""
    gemv = load()
    if gemv is None or not gemv.route_exact:
        return []
    done = []
    for m in model.modules():
        if recognised(m) and _takes(m):
            m.forward = DecodeRouter(m, gemv, fast)
            done.append(m)
    return done


def detach_routers(modules: list[torch.nn.Module]) -> None:
    """Exact inverse of :func:`attach_routers`."""
    for m in modules:
        own = m.__dict__.get("forward")
        if isinstance(own, DecodeRouter):
            if own.instance:
                m.forward = own.replaced
            else:
                del m.forward
