"""Expert layouts: which tensors form expert ``e``'s store unit, and how the family computes it.

:class:`~operators.experts.GroupedExperts` keeps one store unit per expert and computes experts
one by one (or a group at a time) in the order their weights become ready. What differs between
families is only *where* an expert's weights live and *which code* computes it; a layout adapter
answers both, so the operator never branches on a family:

=================  ==========================================================================
``fused``          transformers' experts contract (``@use_experts_implementation``): 3-D
                   ``gate_up_proj[E, 2I, H]`` (or ``up_proj``) / ``down_proj[E, H, I]``, optional
                   ``*_bias[E, X]``, flags ``has_gate`` / ``is_transposed`` /
                   ``has_post_expert_norm``; computed as ``grouped_mm_experts_forward`` does
                   (the module's own ``_apply_gate``, ``act_fn``, ``post_expert_norm``); only
                   where the class forward *is* the contract's dispatching forward, recognised
                   by its code: a subclass that overrides it with computation of its own
                   (Ergo's per-route, per-expert RMSNorm) is ``fused_module``
``fused_module``   3-D ``[E, ...]`` parameters of any other experts module (Llama-4's
                   ``[E, H, 2I]`` bmm experts, LongCat's zero-compute experts beside real ones
                   in transformers < 5.25, Ergo's experts): the module's **own forward** runs on
                   expert ``e``'s weights
``stacked``        2-D parameters holding every expert along dim 0 (``w1[E*I, H]``, DBRX):
                   the module's own forward on expert ``e``'s rows, bound as a one-expert module
``module_list``    a ``ModuleList`` of per-expert modules (older families, remote code): each
                   child is a unit; the owning block calls the children, a hook binds each one's
                   weights around its call
``block``          a MoE block holding several experts modules (JetMoE's ``input_linear`` +
                   ``output_linear``): one unit per expert spanning all of them; the block's own
                   forward runs, each experts module's call runs on the units of its experts
``loop_block``     a MoE block whose own loop calls a per-expert ``ModuleList``, matched on the
                   block: its forward runs twice (expert inputs recorded, then replayed with the
                   outputs computed in between, hot experts first)
``lookup``         an ``nn.Embedding`` whose rows are experts (product-key experts, Doge):
                   the rows a lookup needs are acquired, the module's own forward runs on them
=================  ==========================================================================

Where expert ``e``'s part of each parameter lies is one table, :meth:`ExpertLayout.rows` (rows
``start .. stop`` of dim 0, dim dropped or not): it slices a loaded parameter and, for a model loaded
with its experts on disk, makes each unit a lazy reference to exactly those rows of the checkpoint
tensor (:meth:`kinject.io.checkpoint.CheckpointIndex.rows_source`), so set-up reads no expert and a
fetch of expert ``e`` reads only ``e``'s bytes, in every layout and checkpoint format.

A layout is found by an ordered chain of small detectors (:data:`DETECTORS`, the default last),
or named in the rule (``kwargs: {layout: stacked}``); when none applies the error lists the
parameters it saw and the layouts it knows. Adding a layout = one class + one detector.

Calls: an experts module is called ``routed`` (``hidden, top_k_index, top_k_weights``: every
transformers 5 fused experts module), ``grouped`` (``x[E*T, H]``, each expert's tokens a
contiguous equal block, router scores already applied: Llama-4), ``sized`` (``x`` sorted by
expert and a list of per-expert row counts: JetMoE's parallel experts), ``lookup``, ``container``
(never called: the block calls the ``ModuleList``'s children) or ``block`` (the block itself).
:meth:`ExpertLayout.compute` returns expert ``e``'s *unweighted* output on rows ``x``;
:meth:`ExpertLayout.compute_sorted` a group of ready experts on their rows sorted by expert
(default: one by one; ``fused`` batches them: one grouped GEMM per projection, or one mm per
expert on slices, :mod:`operators.expert_compute`).
"""

from __future__ import annotations

import functools
import inspect
import re
from typing import Callable, ClassVar

import torch
from torch import nn

from kinject.engine.rebind import code_key
from operators.expert_compute import ExpertMath, compute_group, stacked_views

# Attribute names families use for "how many experts" (on the module or its config).
_COUNT_ATTRS = ("num_experts", "num_local_experts", "moe_num_experts", "n_routed_experts", "total_experts",
                "num_routed_experts")
_CONFIG_COUNT = ("num_experts", "num_local_experts", "moe_num_experts", "n_routed_experts")

Bind = Callable[[dict[str, torch.Tensor]], "object"]   # op.bound({name: tensor}) -> context manager


class LayoutError(ValueError):
    """No layout fits a module (or the one the rule named does not)."""


def _int_attr(obj, names) -> int | None:
    for n in names:
        v = getattr(obj, n, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def declared_experts(module: nn.Module) -> int | None:
    """The expert count the module (or its config, or a sub-config of it) declares, if any."""
    n = _int_attr(module, _COUNT_ATTRS)
    if n is not None:
        return n
    config = getattr(module, "config", None)
    for c in (config, getattr(config, "ffn_config", None)):
        if c is not None:
            n = _int_attr(c, _CONFIG_COUNT)
            if n is not None:
                return n
    return None


def _shapes(module: nn.Module, recurse: bool = True) -> str:
    return ", ".join(f"{n}{list(p.shape)}" for n, p in module.named_parameters(recurse=recurse)) or "none"


class ExpertLayout:
    """Base: a module's expert weights as one unit per expert, and the math of one expert.

    ``num_experts``: how many experts the router chooses among (zero-compute ones included);
    ``stored``: experts ``0 .. stored-1`` hold weights (one store unit each); ``params``: dotted
    names (relative to the module) of the parameters the store takes; ``call``: how the module is
    called (``routed`` / ``grouped`` / ``sized`` / ``lookup`` / ``container``).
    """

    name: ClassVar[str] = "?"

    def __init__(self, module: nn.Module, *, num_experts: int, stored: int, params: list[str], call: str):
        self.module, self.num_experts, self.stored, self.params, self.call = module, num_experts, stored, params, call

    @classmethod
    def mismatch(cls, module: nn.Module) -> str | None:
        """Why this layout refuses ``module`` though its parameters would fit (None: no such reason);
        the error for a rule that names the layout says it."""
        return None

    def rows(self, name: str, e: int) -> tuple[int, int, bool]:
        """Where expert ``e``'s part of parameter ``name`` lies: rows ``start .. stop`` of its dim 0,
        and whether that dim is dropped (``[E, ...]`` parameters: ``(e, e + 1, True)``, i.e. ``p[e]``).
        One table for both sources of a unit: a view of a loaded parameter (:meth:`part`) and a lazy
        reference to exactly those rows of the checkpoint tensor
        (:meth:`kinject.io.checkpoint.CheckpointIndex.rows_source`)."""
        return e, e + 1, True

    def part(self, name: str, whole: torch.Tensor, e: int) -> torch.Tensor:
        """Expert ``e``'s part of parameter ``name`` (``whole``: the parameter's full data)."""
        start, stop, squeeze = self.rows(name, e)
        return whole[start] if squeeze else whole[start:stop]

    def compute(self, e: int, t: dict[str, torch.Tensor], x: torch.Tensor, bind: Bind) -> torch.Tensor:
        """Expert ``e`` on rows ``x`` [n, H] (``t``: its unit's tensors, on the device) -> [n, H]."""
        raise NotImplementedError

    def compute_sorted(self, experts: list[int], ts: list[dict], counts: list[int], x: torch.Tensor,
                       bind: Bind, *, stacked: dict | None = None) -> torch.Tensor:
        """Several ready experts at once: ``x`` [N, H] holds their rows grouped by expert in
        ``experts`` order (``counts[i]`` rows of ``experts[i]``) -> [N, H] in the same order.
        Default: :meth:`compute` per expert on its slice; a layout may batch (one grouped GEMM).
        ``stacked``: :meth:`stacked_views` of every stored expert, when ``ts`` are among them."""
        ys, start = [], 0
        for e, t, n in zip(experts, ts, counts):
            ys.append(self.compute(e, t, x[start:start + n], bind))
            start += n
        return ys[0] if len(ys) == 1 else torch.cat(ys, dim=0)

    def stacked_views(self, ts: list[dict]) -> dict | None:
        """Role -> ``[E, ...]`` view over the experts' tensors ``ts`` (expert ``e``: ``ts[e]``) when
        they are equally spaced views of one storage and this layout batches over such views; None
        otherwise (the default)."""
        return None

    _pairs = 1   # routing columns a module-call uses (2 where a family's code breaks on top-1)

    def routed_call(self, x: torch.Tensor, e: int) -> torch.Tensor:
        """The module's own routed forward with every row sent to expert ``e`` -> ``[n, H]``: top-1 at
        weight 1, or (a family whose code assumes k > 1, e.g. ``squeeze(0)`` of a [k, n] mask)
        top-2 ``[e, e]`` at weights ``[0.5, 0.5]`` (exact: halving and doubling lose no bits)."""
        if self._pairs == 1:
            try:
                return _routed_call(self.module, x, e, 1)
            except (ValueError, IndexError, RuntimeError):
                self._pairs = 2
        return _routed_call(self.module, x, e, 2)

    def makes_zero_from_zero(self) -> bool:
        """An all-zero input row gives an all-zero output (no biases): ``grouped`` calls may skip
        experts whose rows are all zero (their router score was 0)."""
        return not any("bias" in n for n in self.params)

    def describe(self) -> str:
        shapes = {n: list(dict(self.module.named_parameters())[n].shape) for n in self.params}
        zero = f", {self.num_experts - self.stored} zero-compute" if self.num_experts > self.stored else ""
        return f"{self.name} ({self.stored} experts{zero}, {self.call} call; " + \
            ", ".join(f"{n}{s}" for n, s in shapes.items()) + ")"


# --------------------------------------------------------------------------- layouts


def _three_d(module: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in module.named_parameters(recurse=False) if p.dim() == 3}


@functools.cache
def _contract_forward_key() -> tuple | None:
    """The code of the forward ``@use_experts_implementation`` gives a class (one code object for
    every decorated class: it dispatches to the configured experts implementation or the class's own
    eager forward), read from a probe class decorated here; None without the decorator."""
    try:
        from transformers.integrations.moe import use_experts_implementation
    except ImportError:
        return None
    probe = use_experts_implementation(type("_ContractProbe", (nn.Module,), {"forward": lambda self, *a: None}))
    return code_key(probe.forward)


def _own_forward(module: nn.Module) -> str | None:
    """The qualified name of ``module``'s class forward where it is not the fused experts contract's
    dispatching forward (a subclass of a decorated class that overrides it), else None."""
    contract = _contract_forward_key()
    forward = getattr(type(module), "forward", None)
    if contract is None or code_key(forward) == contract:
        return None
    return getattr(forward, "__qualname__", repr(forward))


def _call_of(module: nn.Module) -> str:
    """``routed`` when the forward takes routing beside the hidden states, else ``grouped``."""
    try:
        sig = inspect.signature(type(module).forward)
    except (TypeError, ValueError):
        return "routed"
    pos = [p for p in list(sig.parameters.values())[1:]
           if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
    if any(p.kind == p.VAR_POSITIONAL for p in pos):
        return "routed"
    if len(pos) >= 3:
        return "routed"
    return "sized" if len(pos) == 2 else "grouped"


class FusedExperts(ExpertLayout):
    """transformers' experts contract (``@use_experts_implementation``), computed like
    ``grouped_mm_experts_forward``: ``up -> _apply_gate / act_fn -> down (-> post_expert_norm)``."""

    name = "fused"

    def __init__(self, module: nn.Module, params: list[str], num_experts: int):
        super().__init__(module, num_experts=num_experts, stored=num_experts, params=params, call="routed")
        self.math = ExpertMath.of(module)      # up / down names, transposition, the module's gate and norm

    @classmethod
    def detect(cls, module: nn.Module) -> "FusedExperts | None":
        if not hasattr(module, "is_transposed") or not hasattr(module, "has_gate"):
            return None
        if cls.mismatch(module) is not None:
            return None
        three = _three_d(module)
        up = "gate_up_proj" if getattr(module, "has_gate", True) else "up_proj"
        if up not in three or "down_proj" not in three:
            return None
        n = three["down_proj"].shape[0]
        if three[up].shape[0] != n:
            return None
        params = [name for name, p in module.named_parameters(recurse=False) if p.dim() >= 2 and p.shape[0] == n]
        return cls(module, params, n)

    @classmethod
    def mismatch(cls, module: nn.Module) -> str | None:
        """Why ``module``, though it carries the contract's flags, is not computed by this layout's math:
        its class forward is not the contract's dispatching forward (the one
        ``@use_experts_implementation`` installs), so it runs code of its own around the projections
        that ``grouped_mm_experts_forward``'s math would drop (Ergo's experts in transformers 5.25:
        one row per route, a learned RMSNorm per expert, then the weighted sum). Such a module falls
        to ``fused_module``, which runs its own forward (docs/architecture.md, "Experts")."""
        own = _own_forward(module)
        if own is None:
            return None
        return (f"its class {type(module).__name__} runs a forward of its own ({own}) instead of the fused experts "
                f"contract's dispatching forward, computation the fused math would not reproduce")

    def compute(self, e, t, x, bind):
        return compute_group(self.math, [t], [e], [x.shape[0]], x)                          # [n, H]

    def compute_sorted(self, experts, ts, counts, x, bind, *, stacked=None):
        return compute_group(self.math, ts, experts, counts, x, stacked=stacked)

    def stacked_views(self, ts):
        return stacked_views(self.math, ts)


class FusedModuleExperts(ExpertLayout):
    """3-D ``[E, ...]`` parameters of an experts module outside transformers' contract: the
    module's own forward computes expert ``e`` with its weights bound in place of all experts
    (``routed``: every index reads expert ``e``'s slice, stride 0; ``grouped`` / ``sized``: bound
    as a one-expert module). Experts past the shortest parameter's count are zero-compute
    (identity and the like): the module's own code path runs them, reading no weight."""

    name = "fused_module"

    def __init__(self, module, params, num_experts, stored, call):
        super().__init__(module, num_experts=num_experts, stored=stored, params=params, call=call)
        self.sizes_tensor: tuple[torch.dtype, torch.device] | None = None   # see :meth:`note_sizes`

    def note_sizes(self, sizes) -> None:
        """Remember the form in which the family's code passes a ``sized`` call's per-expert row
        counts, so :meth:`compute` hands the module's own forward counts it can read: a list (JetMoE's
        parallel experts ``split`` by it) or an integer tensor (a grouped GEMM that calls ``.cpu()`` and
        ``cumsum`` on it, e.g. Aria's ``AriaGroupedExpertsGemm`` in transformers 5.17)."""
        self.sizes_tensor = (sizes.dtype, sizes.device) if isinstance(sizes, torch.Tensor) else None

    def expert_sizes(self, e: int, n: int):
        """Per-expert row counts with all ``n`` rows on expert ``e``, in the noted form."""
        if self.sizes_tensor is None:
            sizes = [0] * self.num_experts
            sizes[e] = n
            return sizes
        dtype, device = self.sizes_tensor
        sizes = torch.zeros(self.num_experts, dtype=dtype, device=device)
        sizes[e] = n                  # filled where it lives: no host->device copy, no sync on a GPU
        return sizes

    @classmethod
    def detect(cls, module: nn.Module) -> "FusedModuleExperts | None":
        three = _three_d(module)
        if not three:
            return None
        counts = {p.shape[0] for p in three.values()}
        stored = min(counts)
        declared = declared_experts(module) or 0
        num = max(max(counts), declared if declared >= stored else 0)
        params = [n for n, p in module.named_parameters(recurse=False) if p.dim() >= 2 and p.shape[0] in counts]
        return cls(module, params, num, stored, _call_of(module))

    def compute(self, e, t, x, bind):
        m = self.module
        if self.call == "grouped":                    # the module views x as [shape[0], T, H]: one expert
            with bind({n: v.unsqueeze(0) for n, v in t.items()}):
                return m(x)                                                                 # [n, H]
        params = dict(m.named_parameters())
        shaped = {n: v.unsqueeze(0).expand(params[n].shape[0], *v.shape) for n, v in t.items()}   # stride 0
        with bind(shaped):
            if self.call == "sized":
                return m(x, self.expert_sizes(e, x.shape[0]))
            return self.routed_call(x, e)

    def compute_zero(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """A zero-compute expert (no weights) through the module's own code path."""
        return self.routed_call(x, e)


class SizedExperts(FusedModuleExperts):
    """Parallel experts (``weight[E, out, in]``, called with rows sorted by expert and their
    counts: JetMoE; Aria's grouped GEMMs in transformers 5.17, counts as a tensor): the module's own
    forward on expert ``e``'s weights, counts ``[n, 0, ...]`` in the form the family passes them."""

    name = "sized"

    @classmethod
    def detect(cls, module):
        found = FusedModuleExperts.detect(module)
        if found is None or found.call != "sized":
            return None
        return cls(module, found.params, found.num_experts, found.stored, "sized")


class BlockExperts(ExpertLayout):
    """A MoE block holding several experts modules (JetMoE's ``input_linear`` and ``output_linear``
    parallel experts): expert ``e``'s unit spans its part of every one of them; the block's own
    forward runs (its routing, its loop) and each experts module's call computes the experts it is
    given on their units' weights (:meth:`child_compute`)."""

    name = "block"

    def __init__(self, module: nn.Module, children: dict[str, ExpertLayout]):
        stored = {lay.stored for lay in children.values()}
        params = [f"{c}.{n}" for c, lay in children.items() for n in lay.params]
        super().__init__(module, num_experts=max(lay.num_experts for lay in children.values()),
                         stored=stored.pop(), params=params, call="block")
        self.children = children          # child name -> its own layout (``sized`` / ``grouped`` calls)

    @classmethod
    def detect(cls, module: nn.Module) -> "BlockExperts | None":
        if _three_d(module) or isinstance(module, nn.ModuleList):
            return None                   # an experts module itself
        found: dict[str, ExpertLayout] = {}
        for name, child in module.named_children():
            lay = SizedExperts.detect(child) or FusedModuleExperts.detect(child)
            if lay is not None and lay.call in ("sized", "grouped") and lay.num_experts == lay.stored:
                found[name] = lay
        if len(found) < 2 or len({(lay.stored, lay.call) for lay in found.values()}) != 1:
            return None
        return cls(module, found)

    def rows(self, name, e):
        child, param = name.split(".", 1)
        return self.children[child].rows(param, e)

    def child_compute(self, child: str, e: int, t: dict[str, torch.Tensor], x: torch.Tensor, bind: Bind) -> torch.Tensor:
        """Experts module ``child`` on expert ``e``'s rows ``x`` (``t``: expert ``e``'s whole unit)."""
        lay = self.children[child]
        mine = {n: t[f"{child}.{n}"] for n in lay.params}
        return lay.compute(e, mine, x, lambda d: bind({f"{child}.{n}": v for n, v in d.items()}))

    def describe(self):
        return f"{self.name} ({self.stored} experts over {len(self.children)} experts modules; " + \
            "; ".join(f"{c}: {lay.describe()}" for c, lay in self.children.items()) + ")"


class StackedExperts(ExpertLayout):
    """Every expert along dim 0 of 2-D parameters (``w1[E*I, H]``, DBRX): expert ``e`` is rows
    ``e*R .. (e+1)*R``; the module's own forward computes it bound as a one-expert module
    (routing index 0)."""

    name = "stacked"

    def __init__(self, module, params, num_experts, rows):
        super().__init__(module, num_experts=num_experts, stored=num_experts, params=params, call=_call_of(module))
        self.expert_rows = rows           # R: rows of dim 0 per expert

    @classmethod
    def detect(cls, module: nn.Module) -> "StackedExperts | None":
        n = declared_experts(module)
        if n is None or n < 2:
            return None
        params = {name: p for name, p in module.named_parameters() if p.dim() == 2 and p.shape[0] % n == 0}
        if not params:
            return None
        rows = {p.shape[0] // n for p in params.values()}
        if len(rows) != 1:
            return None
        return cls(module, list(params), n, rows.pop())

    def rows(self, name, e):
        return e * self.expert_rows, (e + 1) * self.expert_rows, False

    def compute(self, e, t, x, bind):
        with bind(dict(t)):
            return self.routed_call(x, 0) if self.call == "routed" else self.module(x)


class ModuleListExperts(ExpertLayout):
    """A keyed container of per-expert modules: a ``ModuleList`` (expert ``e`` is child ``e``) or a
    ``ModuleDict`` whose keys end in the expert's number, 0 .. E-1 (``expert_0`` ... ``expert_N``:
    Switch Transformers, NLLB-MoE). Expert ``e`` is that child's parameters; whoever calls the
    children (the block that owns a list, or the container's own forward looping over its keys)
    keeps its routing and loop; that forward is replayed as a ``loop_block``'s is (expert inputs
    recorded, the experts computed hot first, each call answered by its output)."""

    name = "module_list"

    def __init__(self, module: nn.Module, keys: list[str], params: list[str]):
        super().__init__(module, num_experts=len(keys), stored=len(keys), params=params, call="container")
        self.keys = keys                                     # expert e -> its child's key
        self._index = {k: e for e, k in enumerate(keys)}

    @classmethod
    def detect(cls, module: nn.Module) -> "ModuleListExperts | None":
        keys = _expert_keys(module)
        if keys is None or len(keys) < 2:
            return None
        children = [module.get_submodule(k) for k in keys]
        if len({type(c) for c in children}) != 1 or not any(True for _ in children[0].parameters()):
            return None
        return cls(module, keys, [n for n, _ in module.named_parameters()])

    def child(self, e: int) -> nn.Module:
        return self.module.get_submodule(self.keys[e])

    def expert_of(self, name: str) -> int:
        """The expert a parameter name (``3.w1.weight``, ``expert_3.wi.weight``) belongs to."""
        return self._index[name.split(".", 1)[0]]

    def expert_params(self, e: int) -> list[str]:
        return [n for n in self.params if n.split(".", 1)[0] == self.keys[e]]

    def describe(self):
        first = {n: list(p.shape) for n, p in self.child(0).named_parameters()}
        return f"{self.name} ({self.stored} x {type(self.child(0)).__name__}; " + \
            ", ".join(f"{n}{s}" for n, s in first.items()) + ")"


_KEY_NUMBER = re.compile(r"(\d+)$")


def _expert_keys(module: nn.Module) -> list[str] | None:
    """Child keys of a per-expert container in expert order: a ``ModuleList``'s indices, or a
    ``ModuleDict``'s keys of its children with weights (not a dropout beside them, NLLB-MoE) when
    each ends in a distinct number and together they are 0 .. E-1."""
    if isinstance(module, nn.ModuleList):
        return [str(i) for i in range(len(module))]
    if not isinstance(module, nn.ModuleDict):
        return None
    numbered = {}
    weighted = [k for k, child in module.items() if any(True for _ in child.parameters())]
    for key in weighted:
        m = _KEY_NUMBER.search(key)
        if m is None:
            return None
        numbered[int(m.group(1))] = key
    if sorted(numbered) != list(range(len(weighted))):
        return None
    return [numbered[e] for e in range(len(weighted))]


class LoopBlockExperts(ExpertLayout):
    """A MoE block whose own loop calls a ``ModuleList`` of per-expert modules (older families,
    remote code), matched on the block: expert ``e`` is list child ``e``. The block's forward runs
    twice, unchanged: once recording every expert call's inputs (the calls answer zeros of the
    right shape, nothing computed), then -- after the recorded experts computed in Klotski's order
    on their units -- once more, each expert call answered by its precomputed output (inputs
    checked equal), so the block's own routing, loop and combination produce the same bits."""

    name = "loop_block"

    def __init__(self, module: nn.Module, list_name: str, experts: nn.ModuleList):
        params = [f"{list_name}.{n}" for n, _ in experts.named_parameters()]
        super().__init__(module, num_experts=len(experts), stored=len(experts), params=params, call="loop_block")
        self.list_name, self.experts = list_name, experts

    def child(self, e: int) -> nn.Module:
        return self.experts[e]

    @classmethod
    def detect(cls, module: nn.Module) -> "LoopBlockExperts | None":
        if isinstance(module, nn.ModuleList) or _three_d(module):
            return None
        lists = [(n, c) for n, c in module.named_children()
                 if isinstance(c, nn.ModuleList) and ModuleListExperts.detect(c) is not None]
        others = [n for n, c in module.named_children() if c is not None and all(c is not m for _, m in lists)]
        if len(lists) != 1 or not others:          # a block: its experts list beside its router
            return None
        return cls(module, *lists[0])

    def expert_of(self, name: str) -> int:
        return int(name[len(self.list_name) + 1:].split(".", 1)[0])

    def expert_params(self, e: int) -> list[str]:
        prefix = f"{self.list_name}.{e}."
        return [n for n in self.params if n.startswith(prefix)]

    def describe(self):
        first = {n: list(p.shape) for n, p in self.experts[0].named_parameters()}
        return f"{self.name} ({self.stored} x {type(self.experts[0]).__name__} in .{self.list_name}, the block's own loop; " + \
            ", ".join(f"{n}{s}" for n, s in first.items()) + ")"


class LookupExperts(ExpertLayout):
    """An ``nn.Embedding`` whose rows are experts (product-key experts): a lookup acquires the
    rows it needs and runs the module's own forward on them, indices renumbered."""

    name = "lookup"

    @classmethod
    def detect(cls, module: nn.Module) -> "LookupExperts | None":
        if not isinstance(module, nn.Embedding):
            return None
        return cls(module, num_experts=module.num_embeddings, stored=module.num_embeddings,
                   params=["weight"], call="lookup")

    def makes_zero_from_zero(self):
        return False


# Ordered chain, default last: the first detector that returns a layout wins.
DETECTORS: list[type[ExpertLayout]] = [LookupExperts, ModuleListExperts, FusedExperts, SizedExperts,
                                       FusedModuleExperts, BlockExperts, LoopBlockExperts, StackedExperts]
LAYOUTS: dict[str, type[ExpertLayout]] = {c.name: c for c in DETECTORS}


def infer_layout(module: nn.Module, key: str = "", layout: str | None = None) -> ExpertLayout:
    """The layout of ``module``: the one named (``layout``), else the first detector that fits."""
    if layout is not None:
        if layout not in LAYOUTS:
            raise LayoutError(f"unknown experts layout {layout!r}; layouts: {', '.join(LAYOUTS)}")
        found = LAYOUTS[layout].detect(module)
        if found is None:
            why = LAYOUTS[layout].mismatch(module)
            raise LayoutError(f"{type(module).__name__} at {key!r} does not fit layout {layout!r} "
                              + (f"({why}; " if why else "(")
                              + f"parameters: {_shapes(module)}); layouts: {', '.join(LAYOUTS)}")
        return found
    for cls in DETECTORS:
        found = cls.detect(module)
        if found is not None:
            return found
    raise LayoutError(
        f"{type(module).__name__} at {key!r}: no experts layout fits (parameters: {_shapes(module)}; "
        f"declared experts: {declared_experts(module)}). Supported: "
        + "; ".join(f"{c.name}: {(c.__doc__ or '').strip().splitlines()[0]}" for c in DETECTORS)
        + ". Name one with `kwargs: {layout: ...}`, or match the module that holds the expert weights")


# --------------------------------------------------------------------------- helpers


def _routed_call(module: nn.Module, x: torch.Tensor, e: int, k: int) -> torch.Tensor:
    """The module's own routed forward with every row sent to expert ``e`` (``k`` columns of
    weight ``1/k``) -> [n, H]."""
    n = x.shape[0]
    index = torch.full((n, k), e, dtype=torch.long, device=x.device)                      # [n, k]
    weight = torch.full((n, k), 1.0 / k, dtype=x.dtype, device=x.device)                  # [n, k]
    return module(x, index, weight).reshape(n, x.shape[-1])
