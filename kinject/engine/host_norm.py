"""transformers' RMSNorm of a decode step's few rows in one compiled call, with torch's bits
(docs/architecture.md, "Host compute").

Why: at batch 1 on a CPU, a model's RMSNorm is eight torch operations on one row (``to``, ``pow``,
``mean``, ``add``, ``rsqrt``, ``mul``, ``to``, ``mul``), each paying its dispatch, and the first after a
weight stream paying again to bring torch's code back into the caches. A Qwen3-MoE layer runs four
of them per token (two around attention, two inside it, on every head's query and key), about
60-80 us each on the 2-core bench machine: ~2 ms of a ~27 ms decode step, for 1 KB of arithmetic.

Which norms: a module whose class's ``forward`` has exactly the code of transformers' Llama RMSNorm
(variant 0: ``weight * x_normed.to(bf16)``; 142 classes of transformers 5 share it, Mixtral, Qwen3-MoE
and DeepSeek-V3's among them) or of GPT-OSS's (variant 1: ``(weight * x_normed).to(bf16)``). Same code
object, same attributes: the same arithmetic by construction, never a guess from a class name. Any
other norm (Gemma's ``1 + weight``, a centred or gated norm) keeps its forward.

Exactness: the kernel (``kinject_rms_norm_bf16`` in ``host_gemv.c``) rounds where torch rounds and sums
the squares in the order of torch's float32 sum kernel (its vector width found when the library
loads, :attr:`~kinject.engine.host_gemv.HostGemv.sum_lanes`). Before a norm's forward is replaced,
each (variant, width, eps) the model uses is computed both ways on random rows and must agree bit for
bit; where not, those norms keep torch's forward (logged). Rows beyond :data:`MAX_NORM_VALUES` values
(a prefill), other dtypes or devices, and calls that record gradients go to the module's own forward.
"""

from __future__ import annotations

import logging

import torch

from kinject.engine.host_gemv import HostGemv, load
from kinject.engine.rebind import code_key

logger = logging.getLogger(__name__)

# torch reduces fewer values than its grain size (32768) serially, in the order the kernel follows;
# above it, and for a prefill's many rows, torch's own call is the faster one anyway
MAX_NORM_VALUES = 1 << 15
_BF16 = torch.bfloat16
_variants: dict | None = None


def _known_variants() -> dict:
    """code key -> variant, from transformers' own RMSNorm classes (a family without one is skipped)."""
    global _variants
    if _variants is None:
        found = {}
        try:
            from transformers.models.llama.modeling_llama import LlamaRMSNorm
            found[code_key(LlamaRMSNorm.forward)] = 0
        except ImportError:
            pass
        try:
            from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm
            found.setdefault(code_key(GptOssRMSNorm.forward), 1)
        except ImportError:
            pass
        _variants = found
    return _variants


def norm_variant(module: torch.nn.Module) -> int | None:
    """The kernel variant that computes ``module``'s forward (see the module docstring), else None:
    its class's forward is not one of the known codes, it has an instance ``forward``, or it lacks the
    ``weight`` / ``variance_epsilon`` the code reads."""
    forward = getattr(type(module), "forward", None)
    if forward is None or not hasattr(forward, "__code__") or "forward" in module.__dict__:
        return None
    if not isinstance(getattr(module, "weight", None), torch.Tensor) \
            or not isinstance(getattr(module, "variance_epsilon", None), float):
        return None
    return _known_variants().get(code_key(forward))


class OneRowNorm:
    """The ``forward`` kinject gives a recognised RMSNorm on a CPU: a decode step's bfloat16 rows in
    one kernel call; anything else through the module's own forward. The weight is read from the
    module's parameters at each call (the store may bind another tensor), from their dict rather than
    through ``nn.Module.__getattr__``; the checks are the tensors' cheapest attributes (33 calls per
    decode step of the bench model)."""

    __slots__ = ("module", "params", "own", "gemv", "variant")

    def __init__(self, module: torch.nn.Module, gemv: HostGemv, variant: int):
        self.module, self.params, self.gemv, self.variant = module, module._parameters, gemv, variant
        self.own = type(module).forward.__get__(module)

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        w = self.params.get("weight")
        if w is None:                              # (not a registered parameter any more)
            w = self.module.weight
        if hidden_states.dtype is _BF16 and w.dtype is _BF16 and hidden_states.is_cpu and w.is_cpu \
                and hidden_states.numel() <= MAX_NORM_VALUES and hidden_states.is_contiguous() \
                and w.is_contiguous() and w.dim() == 1 and w.shape[0] == hidden_states.shape[-1] \
                and not (torch.is_grad_enabled() and (w.requires_grad or hidden_states.requires_grad)):
            return self.gemv.rms_norm_checked(hidden_states, w, self.module.variance_epsilon, self.variant)
        return self.own(hidden_states)


def _agrees(gemv: HostGemv, module: torch.nn.Module, variant: int, n: int, eps: float) -> bool:
    """The kernel and the class's forward on random rows of width ``n`` (1, 3 and 16 rows, values
    from 1e-3 to 1e3, a random weight): equal bits everywhere."""
    g = torch.Generator().manual_seed(n)
    own = type(module).forward
    probe = torch.nn.Module()
    probe.variance_epsilon = eps
    for rows, scale in ((1, 1.0), (3, 1e-3), (16, 1e3), (1, 1e-2), (2, 10.0)):
        probe.weight = torch.randn(n, generator=g).to(torch.bfloat16)
        x = (torch.randn(rows, n, generator=g) * scale).to(torch.bfloat16)
        with torch.no_grad():
            if not torch.equal(gemv.rms_norm(x, probe.weight, eps, variant).view(torch.int16),
                               own(probe, x).view(torch.int16)):
                return False
    return True


def attach_norms(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Give every recognised bfloat16 RMSNorm of ``model`` a :class:`OneRowNorm` forward (an instance
    attribute; :func:`detach_norms` removes it), where its (variant, width, eps) passed the check; none
    where the kernel or torch's sum order is unavailable."""
    gemv = load()
    if gemv is None or gemv.sum_lanes is None:
        return []
    checked: dict[tuple, bool] = {}
    done = []
    for m in model.modules():
        variant = norm_variant(m)
        if variant is None or m.weight.dim() != 1 or not 0 < m.weight.numel() <= 16384 \
                or m.weight.dtype is not torch.bfloat16:      # (a float32 norm would only pay for the check)
            continue
        key = (type(m).forward, variant, m.weight.numel(), m.variance_epsilon)
        if key not in checked:
            checked[key] = _agrees(gemv, m, variant, m.weight.numel(), m.variance_epsilon)
            if not checked[key]:
                logger.info("host compute: %s (width %d, eps %g) differs from torch's bits here; it stays "
                            "with torch", type(m).__name__, m.weight.numel(), m.variance_epsilon)
        if checked[key]:
            m.forward = OneRowNorm(m, gemv, variant)
            done.append(m)
    return done


def detach_norms(modules: list[torch.nn.Module]) -> None:
    """Exact inverse of :func:`attach_norms`."""
    for m in modules:
        if isinstance(m.__dict__.get("forward"), OneRowNorm):
            del m.forward
