"""A decode step's attention forward on a CPU in a few calls instead of a few dozen (docs/architecture.md,
"Host compute").

Why: at batch 1 on a CPU, transformers' attention forward for one new token makes six module calls
(four projections, two per-head norms), four views and transposes, the rotary embedding, the cache
update, the attention function and a reshape. With kinject's one-row kernels attached
(:mod:`~kinject.engine.host_gemv`, :mod:`~kinject.engine.host_norm`, :mod:`~kinject.engine.host_rotary`)
the arithmetic of all of it is a few microseconds, but each call still pays its Python frame, module
machinery, a buffer and ctypes' argument conversion: about 0.37 ms per layer on the bench machine,
3 ms of a 17-23 ms decode step. :class:`DecodeAttention` makes the same calls with those costs paid
once: the three projections, both norms and the rotary in one kernel call
(:meth:`~kinject.engine.host_gemv.HostGemv.attention_inputs`), then the module's own cache update and
attention function, then the output projection through its own kinject forward.

Which modules: those whose class forward (under its decorators) has exactly the code of transformers'
Llama attention forward or of Qwen3's (Llama's plus a per-head RMSNorm of the query and the key, and
the sliding window passed on): the same code, so the same steps by construction, never a guess from a
class name (34 and 7 attention classes of transformers 5 share them: Qwen2-MoE, Qwen3-MoE, PhiMoE,
GraniteMoE, ERNIE-4.5-MoE, dots.llm1 among them). It is attached only where the pieces it fuses were
already attached, and checked by them: each projection has kinject's one-row forward, each norm
kinject's RMSNorm forward (checked against torch's bits when attached), the forward sees the native
rotary (checked likewise). Bits: the fused call runs the same kernel functions on the same inputs as
those forwards, so every value is what the module's own forward gives with them; the attention
function and the cache update are the module's own calls, made with the same arguments.

What it takes: one new token per sequence (``[b, 1, hidden]``, at most :data:`~kinject.engine.host_gemv.ROW_WINDOW`
rows), bfloat16 CPU tensors, no attention mask (a mask, padding, a prefill go the module's own way),
a cache, no gradients, not training, no hooks on the module's parts (a hook would not see a call it
skips). Anything else runs the forward it replaced, unchanged.
"""

from __future__ import annotations

import inspect

import torch

from kinject.engine.host_gemv import ROW_WINDOW, HostGemv, OneRowLinear, load, one_row_exact
from kinject.engine.host_norm import OneRowNorm
from kinject.engine.host_rotary import NativeRotary
from kinject.engine.rebind import code_key, is_rebound

_BF16 = torch.bfloat16
_templates: dict | None = None
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _known_templates() -> dict:
    """code key of an attention forward -> whether it is Qwen3's (per-head norms, sliding window passed on)."""
    global _templates
    if _templates is None:
        found = {}
        try:
            from transformers.models.llama.modeling_llama import LlamaAttention
            found[code_key(inspect.unwrap(LlamaAttention.forward))] = False
        except ImportError:
            pass
        try:
            from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention
            found.setdefault(code_key(inspect.unwrap(Qwen3Attention.forward)), True)
        except ImportError:
            pass
        found.pop(None, None)
        _templates = found
    return _templates


def template_of(module: torch.nn.Module) -> bool | None:
    """Whether ``module``'s class forward is Qwen3's attention forward (True) or Llama's (False); None
    for any other."""
    forward = getattr(type(module), "forward", None)
    if forward is None:
        return None
    return _known_templates().get(code_key(inspect.unwrap(forward)))


class DecodeAttention:
    """The instance ``forward`` of a recognised attention module (see the module docstring): a decode
    step through :meth:`~kinject.engine.host_gemv.HostGemv.attention_inputs`, the module's cache
    update and attention function, and its output projection's forward; anything else through
    ``replaced``, the forward it was given before."""

    def __init__(self, module: torch.nn.Module, replaced, gemv: HostGemv, fast: bool, normed: bool,
                 globals_: dict, cache_name: str):
        self.module, self.replaced, self.gemv, self.fast, self.normed = module, replaced, gemv, fast, normed
        self.functions = globals_["ALL_ATTENTION_FUNCTIONS"]     # (the rebound forward's: host attention under fast)
        self.eager = globals_["eager_attention_forward"]
        self.cache_name = cache_name
        self.projections = [getattr(module, n) for n in _PROJECTIONS]
        self.params = [p._parameters for p in self.projections]
        self.linears = [p.__dict__["forward"] for p in self.projections]
        self.norms = [module.q_norm, module.k_norm] if normed else []
        self.norm_params = [n._parameters for n in self.norms]
        self.norm_forwards = [n.__dict__["forward"] for n in self.norms]
        self.variant = self.norm_forwards[0].variant if normed else 0
        self.eps = float(module.q_norm.variance_epsilon) if normed else 0.0
        self.hooks = [d for m in self.projections + self.norms
                      for d in (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks, m._backward_pre_hooks)]
        from torch.nn.modules import module as nn_module
        self.global_hooks = [nn_module._global_forward_hooks, nn_module._global_forward_pre_hooks,
                             nn_module._global_backward_hooks, nn_module._global_backward_pre_hooks]
        self.heads = module.config.num_attention_heads
        self.kv_heads = module.config.num_key_value_heads
        self.head_dim = module.head_dim

    def __call__(self, *args, **kwargs):
        step = self._inputs(args, kwargs)
        if step is None:
            return self.replaced(*args, **kwargs)
        x, weights, norms, cos, sin, exact = step
        m = self.module
        q, k, v = self.gemv.attention_inputs(x, weights[0], weights[1], weights[2], self.heads, self.kv_heads,
                                             self.head_dim, norms[0], norms[1], self.eps, self.variant, cos, sin,
                                             exact)
        cache = kwargs.pop(self.cache_name)
        for name in ("hidden_states", "position_embeddings", "attention_mask"):
            kwargs.pop(name, None)
        k, v = cache.update(k, v, m.layer_idx, kwargs=kwargs)
        if self.normed:                        # (Qwen3's forward passes its sliding window on; Llama's has none)
            kwargs["sliding_window"] = m.sliding_window
        interface = self.functions.get_interface(m.config._attn_implementation, self.eager)
        out, weights_out = interface(m, q, k, v, None, dropout=0.0, scaling=m.scaling, **kwargs)
        out = out.reshape(x.shape[0], 1, -1).contiguous()
        return self.linears[3](out), weights_out

    def _inputs(self, args: tuple, kwargs: dict):
        """This call's (hidden states ``[b, hidden]``, projection weights, norm weights, cos, sin, exact)
        where the fused step takes it, else None."""
        if args or torch.is_grad_enabled() or self.module.training or kwargs.get("attention_mask") is not None \
                or kwargs.get(self.cache_name) is None or any(self.hooks) or any(self.global_hooks) \
                or "sliding_window" in kwargs:       # (the forward passes its own: the replaced one says so)
            return None
        x, pe = kwargs.get("hidden_states"), kwargs.get("position_embeddings")
        if not isinstance(x, torch.Tensor) or pe is None or x.dtype is not _BF16 or not x.is_cpu or x.dim() != 3 \
                or x.shape[1] != 1 or not x.is_contiguous() or len(pe) != 2:
            return None
        rows, cols = x.shape[0], x.shape[2]
        gemv = self.gemv
        exact = one_row_exact(gemv, self.fast, rows, cols)
        if exact is None or rows > ROW_WINDOW:
            return None
        for p, f, own in zip(self.projections, self.linears, self.params):
            if p.__dict__.get("forward") is not f:      # (someone replaced kinject's forward since)
                return None
        weights = [own.get("weight") for own in self.params]
        nq, nk = self.heads * self.head_dim, self.kv_heads * self.head_dim
        for w, out in zip(weights[:3], (nq, nk, nk)):
            if w is None or w.dtype is not _BF16 or not w.is_cpu or not w.is_contiguous() or w.shape != (out, cols):
                return None
        norms = [None, None]
        if self.normed:
            if gemv.sum_lanes is None:
                return None
            for i, (n, f, own) in enumerate(zip(self.norms, self.norm_forwards, self.norm_params)):
                w = own.get("weight")
                if n.__dict__.get("forward") is not f or w is None or w.dtype is not _BF16 or not w.is_cpu \
                        or not w.is_contiguous() or w.shape != (self.head_dim,):
                    return None
                norms[i] = w
        cos, sin = pe
        shape = (rows, 1, self.head_dim)
        if not isinstance(cos, torch.Tensor) or not isinstance(sin, torch.Tensor) or cos.dtype is not _BF16 \
                or sin.dtype is not _BF16 or not cos.is_cpu or not sin.is_cpu or cos.shape != shape \
                or sin.shape != shape or not cos.is_contiguous() or not sin.is_contiguous():
            return None
        return x.view(rows, cols), weights, norms, cos, sin, exact


def _fusable(module: torch.nn.Module, normed: bool) -> tuple | None:
    """(globals, cache parameter name) where every piece the fused step replaces has kinject's
    forward attached, else None."""
    forward = module.__dict__.get("forward")
    if not is_rebound(forward):
        return None
    inner = inspect.unwrap(forward.__func__)
    names = inner.__globals__
    if not isinstance(names.get("apply_rotary_pos_emb"), NativeRotary) or "ALL_ATTENTION_FUNCTIONS" not in names \
            or "eager_attention_forward" not in names:
        return None
    for name in _PROJECTIONS:
        p = getattr(module, name, None)
        if not isinstance(p, torch.nn.Linear) or not isinstance(p.__dict__.get("forward"), OneRowLinear):
            return None
    if normed:
        for name in ("q_norm", "k_norm"):
            n = getattr(module, name, None)
            if not isinstance(n, torch.nn.Module) or not isinstance(n.__dict__.get("forward"), OneRowNorm):
                return None
        if n.__dict__["forward"].variant != module.q_norm.__dict__["forward"].variant \
                or module.q_norm.variance_epsilon != module.k_norm.variance_epsilon:
            return None
    params = list(inspect.signature(inner).parameters)
    if len(params) < 5 or params[:4] != ["self", "hidden_states", "position_embeddings", "attention_mask"]:
        return None
    config = getattr(module, "config", None)
    if not all(isinstance(getattr(config, a, None), int) for a in ("num_attention_heads", "num_key_value_heads")) \
            or not isinstance(getattr(module, "head_dim", None), int) or not isinstance(module.layer_idx, int):
        return None
    return names, params[4]


def attach_attention(model: torch.nn.Module, fast: bool = False) -> list[torch.nn.Module]:
    """Give every recognised attention module of ``model`` (:func:`template_of`) whose parts have
    kinject's forwards (:func:`_fusable`) a :class:`DecodeAttention` forward over the one it had
    (:func:`detach_attention` puts that back); none where the kernel is unavailable. Runs after the
    linears, norms and rotary are attached."""
    gemv = load()
    if gemv is None:
        return []
    done = []
    for m in model.modules():
        normed = template_of(m)
        if normed is None:
            continue
        found = _fusable(m, normed)
        if found is None:
            continue
        globals_, cache_name = found
        m.forward = DecodeAttention(m, m.__dict__["forward"], gemv, fast, normed, globals_, cache_name)
        done.append(m)
    return done


def detach_attention(modules: list[torch.nn.Module]) -> None:
    """Exact inverse of :func:`attach_attention`."""
    for m in modules:
        own = m.__dict__.get("forward")
        if isinstance(own, DecodeAttention):
            m.forward = own.replaced
