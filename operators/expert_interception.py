"""How a block's call reaches :class:`~operators.experts.GroupedExperts`: one interception per layout.

Each layout's calls have their own *interception* object (vLLM's modular fused-MoE kernel calls the
same role prepare / finalize): it gathers each expert's rows from the call, has the order policy
(:class:`~operators.expert_order.ExpertOrder`) run the experts group by group on a compute site
(:mod:`operators.expert_sites`, chosen per expert by :class:`~operators.expert_placement.ExpertSites`),
and puts the outputs back the way the call expects them:

* :class:`FusedCalls`: fused experts called as transformers calls them (``(hidden_states,
  top_k_index, top_k_weights)``: rows sorted by expert once; ``x[E*T, H]``: ``grouped``; rows sorted
  with their counts: ``sized``);
* :class:`LookupCalls`: an expert table (rows looked up);
* :class:`BlockCalls`: several experts modules in one block (``block``): each module's call is served
  by the experts it is given, the units held until the block returns;
* :class:`ReplayCalls`: a block looping over a per-expert list (``loop_block``, ``module_list``): the
  block runs twice, the first pass records each expert call's inputs, the second is answered from the
  outputs computed in between.

Each is composed with what it reads: the experts (:class:`~operators.expert_step.ExpertSet`), the
order policy, the compute sites and the operator's :class:`~operators.expert_step.LayerStep`; the
operator picks one by the layout's call (:func:`calls_for`) and forwards every call to it.
"""

from __future__ import annotations

import functools
import itertools
from array import array
from typing import TYPE_CHECKING

import torch
from torch import nn

from kinject.engine.transfer import host_to_device, reading_syncs
from operators.base import Operator
from operators.expert_routing import _ROUTING_KWARGS, _flat_ids, _is_sizes, _routing_args

if TYPE_CHECKING:
    from operators.expert_order import ExpertOrder
    from operators.expert_placement import ExpertSites
    from operators.expert_step import ExpertSet, LayerStep


class ExpertCalls:
    """How one layout's calls reach the experts (base). ``top_k_seen``: k of the last routed call (a
    logits-only gate reads it); ``sorts_loads``: whether this interception orders the compute (the
    gate then queues cold loads most tokens first; else in expert index order, the order a family's
    own loop consumes them)."""

    sorts_loads = True

    def __init__(self, experts: "ExpertSet", order: "ExpertOrder", sites: "ExpertSites", step: "LayerStep"):
        self.experts, self.order, self.sites, self.step = experts, order, sites, step
        self.top_k_seen: int | None = None
        self._wrapped: list[nn.Module] = []     # modules whose calls this interception serves

    def __call__(self, *args, **kwargs):
        raise NotImplementedError

    def install(self) -> None:
        """The units exist (attach): route the calls of the modules this layout serves to it."""

    def uninstall(self) -> None:
        """Exact inverse of :meth:`install` (detach)."""
        for child in self._wrapped:
            child.__dict__.pop("forward", None)
        self._wrapped = []

    def _serve_calls(self, child: nn.Module, serve) -> None:
        """Route ``child``'s calls to ``serve(own_forward, args, kwargs)``: an instance ``forward``
        (hooks still run), removed by :meth:`uninstall`."""
        own = type(child).forward.__get__(child)
        child.forward = lambda *args, **kwargs: serve(own, args, kwargs)
        self._wrapped.append(child)

    def _one_by_one(self, run):
        """(group function, zero-compute function) that call ``run(e, y_of)`` per expert with
        ``y_of(x) -> expert e on rows x`` on the group's compute site (the layout's per-expert math)."""
        layout = self.experts.layout

        def run_group(group: list[int], tensors: list[dict], site) -> None:
            for e, t in zip(group, tensors):
                run(e, lambda xs, e=e, t=t: site.compute_one(e, t, xs))

        def run_zero(e: int) -> None:
            run(e, lambda xs: layout.compute_zero(e, xs))

        return run_group, run_zero


class FusedCalls(ExpertCalls):
    """A fused experts module called routed (``hidden, top_k_index, top_k_weights``), ``grouped``
    (``x[E*T, H]``) or ``sized`` (rows sorted by expert and their counts)."""

    def __call__(self, *args, **kwargs):
        call = self.experts.layout.call
        if call == "routed" and len(args) == 3 and not kwargs:     # transformers' call, as it is
            return self._routed(*args)
        args = list(args)
        hidden_states = args.pop(0) if args else kwargs.pop(next(k for k in kwargs if k not in _ROUTING_KWARGS))
        if call == "sized" and args and _is_sizes(args[0]):
            self.experts.layout.note_sizes(args[0])
            return self._sized(hidden_states, args[0])
        if call == "grouped" and not args and not set(kwargs) & set(_ROUTING_KWARGS):
            return self._grouped(hidden_states)
        return self._routed(hidden_states, *args, **kwargs)

    def _routed(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """Called as transformers' experts are: ``(hidden_states, top_k_index, top_k_weights)``.
        The (token, expert) pairs are sorted by expert once; expert ``e``'s rows are one slice of
        the sorted order, and a group of ready experts is one call on their slices."""
        top_k_index, top_k_weights = args if len(args) == 2 and not kwargs else _routing_args(tuple(args), kwargs)
        experts = self.experts
        shape = hidden_states.shape
        T, k = top_k_index.shape[0], top_k_index.shape[-1]
        self.top_k_seen = k
        counts = experts.routing.route(experts.layer, top_k_index)[: experts.num_experts]   # [E] tokens per expert
        if T == 1 and (self.sites.host is None or not hidden_states.is_cuda):
            final = self._one_token(hidden_states, top_k_index, top_k_weights, counts)
            if final is not None:
                return final
        x = hidden_states.reshape(-1, shape[-1])                                  # [T, H]
        flat = top_k_index.reshape(-1)                                            # [S = T*k]
        perm = torch.argsort(flat, stable=True)                                   # [S], grouped by expert
        # index_select, not x[perm]: the same rows, several times faster on a CPU for many rows
        xs = x.index_select(0, torch.div(perm, k, rounding_mode="floor"))          # [S, H] one gather
        ws = top_k_weights.reshape(-1).index_select(0, perm).unsqueeze(-1)        # [S, 1]
        starts = [0, *itertools.accumulate(counts)]   # ids >= E (EP sentinels) sort last, stay zero
        out_dtype = _promoted(experts.units[0].compute_dtype, ws.dtype)
        S = flat.numel()
        ys = None                          # [S, H] in sorted order; zeros made on the first partial write

        def buffer() -> torch.Tensor:
            nonlocal ys
            if ys is None:
                ys = x.new_zeros((S, shape[-1]), dtype=out_dtype)
            return ys

        def rows_of(group: list[int]):
            n = [counts[e] for e in group]
            if starts[group[-1] + 1] - starts[group[0]] == sum(n):                # one slice of the sorted rows
                return slice(starts[group[0]], starts[group[-1] + 1]), n
            return host_to_device(_slices_index([starts[e] for e in group], n), xs.device), n

        def run_group(group: list[int], tensors: list[dict], site) -> None:
            nonlocal ys
            rows, n = rows_of(group)
            if isinstance(rows, slice) and rows.start == 0 and rows.stop == S:        # every row: no buffer
                y = site.compute(group, tensors, n, xs) * ws
                ys = y if y.dtype == out_dtype else y.to(out_dtype)
                return
            buffer()[rows] = site.compute(group, tensors, n, xs[rows]) * ws[rows]

        def run_zero(e: int) -> None:
            rows, _ = rows_of([e])
            buffer()[rows] = experts.layout.compute_zero(e, xs[rows]) * ws[rows]

        start_host = None
        host = self.sites.host
        if host is not None and xs.device.type == "cuda":
            def start_host(group: list[int]):
                """CUDA: this group's rows to the host worker now, their weighted outputs added later."""
                rows, n = rows_of(group)
                job = host.start(group, counts, xs[rows], lambda g, ts, x: host.compute(g, ts, n, x))

                def finish() -> None:
                    buffer()[rows] = job.result() * ws[rows]
                return finish

        self.order.schedule(self.step, counts, run_group, run_zero, start_host=start_host)
        buffer()
        # back to (token, slot) order: a gather by the inverse permutation (a scatter of whole rows,
        # out[perm] = ys, is several times slower on a CPU for a prefill's thousands of rows); the
        # inverse of a decode step's few pairs is one argsort, of many a scatter (linear, not S log S)
        inverse = torch.argsort(perm) if S <= 4096 else \
            torch.empty_like(perm).scatter_(0, perm, torch.arange(S, device=perm.device))
        final = ys.index_select(0, inverse).view(T, k, shape[-1]).sum(dim=1)      # [T, H]
        return (final if final.dtype == hidden_states.dtype else final.to(hidden_states.dtype)).reshape(shape)

    def _one_token(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                   counts: list[int]) -> torch.Tensor | None:
        """A decode step's one token (``hidden_states [..., H]``, one row): :meth:`_routed`'s values and
        order of operations without its tensor bookkeeping, returned in ``hidden_states``' shape and dtype.
        The token's k experts are distinct, so the sort by expert is a Python sort of k ids, every row is
        the token itself (a stride-0 view where the site's kernel reads one, else one copy), and the
        outputs are weighted after the one gather back to slot order. At batch 1 each torch operation
        after the experts' weights have streamed through the caches costs tens of microseconds, several
        times its work. None (the general path) where an id is out of range (expert parallelism's
        sentinels)."""
        experts = self.experts
        k, H = top_k_index.shape[-1], hidden_states.shape[-1]
        if hidden_states.numel() != H or top_k_index.numel() != k:
            return None
        ids = _flat_ids(top_k_index)
        order = sorted(ids)
        if order[0] < 0 or order[-1] >= experts.num_experts:
            return None
        row = {e: i for i, e in enumerate(order)}                                # expert -> its row
        if len(row) != k:
            return None
        # the token once per expert, a view: one operation, no copy
        broadcast = hidden_states.as_strided((k, H), (0, hidden_states.stride(-1)))
        xs = None                          # real rows, made for a site that needs them (grouped_mm refuses a view)
        out_dtype = _promoted(experts.units[0].compute_dtype, top_k_weights.dtype)
        ys = None       # [k, H] unweighted, rows ascending by expert; a partial write's buffer in out_dtype
                        # (the compute dtype's values exactly: the products below are the general path's)
        final = None    # the weighted sum, where the site computed every expert and the sum in one call
        cpu = hidden_states.is_cpu

        def run_group(group: list[int], tensors: list[dict], site, zero: bool = False) -> None:
            # (one frame per group: batch 1's Python calls are counted, kinject bench hybrid)
            nonlocal ys, xs, final
            first, n = row[group[0]], len(group)
            if n == k and not zero and cpu:
                whole = getattr(site, "one_token", None)          # every expert and their sum in one call
                final = whole(top_k_index, top_k_weights, hidden_states) if whole is not None else None
                if final is not None:
                    return
            if row[group[-1]] - first == n - 1:
                rows = slice(first, first + n)
            else:
                rows = torch.tensor([row[e] for e in group])
                rows = rows if cpu else host_to_device(rows, hidden_states.device)
            if not zero and getattr(site, "takes_broadcast_rows", False):
                given = broadcast if n == k else broadcast[rows]
            else:
                if xs is None:
                    xs = broadcast.contiguous()
                given = xs[rows]
            y = experts.layout.compute_zero(group[0], given) if zero else site.compute(group, tensors, [1] * n, given)
            if n == k:
                ys = y
                return
            if ys is None:
                ys = hidden_states.new_zeros((k, H), dtype=out_dtype)
            ys[rows] = y

        self.order.schedule(self.step, counts, run_group, lambda e: run_group([e], None, None, True))
        if final is not None:
            return final
        if ys is None:
            ys = hidden_states.new_zeros((k, H), dtype=out_dtype)
        combine = self.sites.weighted_rows
        shape = hidden_states.shape
        if combine is not None and ys.dtype == top_k_weights.dtype == hidden_states.dtype == torch.bfloat16 and cpu \
                and ys.is_contiguous() and top_k_weights.is_contiguous():
            return combine(ys, [row[e] for e in ids], top_k_weights, shape)      # the same bits, one call
        back = torch.tensor([row[e] for e in ids])
        weighted = ys.index_select(0, back if cpu else host_to_device(back, hidden_states.device)) * \
            top_k_weights.reshape(k, 1)                                          # [k, H] in slot order
        if weighted.dtype != out_dtype:
            weighted = weighted.to(out_dtype)
        final = weighted.view(1, k, H).sum(dim=1)
        return (final if final.dtype == hidden_states.dtype else final.to(hidden_states.dtype)).reshape(shape)

    def _grouped(self, x: torch.Tensor) -> torch.Tensor:
        """Called with ``x[E*T, H]``: each expert's T rows, router scores already applied (0 for a
        token that did not pick it); an expert whose rows are all zero is skipped when zero rows
        give zero (no biases), otherwise every expert runs."""
        E = self.experts.num_experts
        groups = x.reshape(E, -1, x.shape[-1])                                     # [E, T, H]
        counts = (groups != 0).any(-1).sum(-1).tolist()                           # [E] tokens per expert
        if not self.experts.layout.makes_zero_from_zero():
            counts = [max(n, 1) for n in counts]
        out = torch.zeros_like(groups)                                            # [E, T, H]

        def run(e: int, y_of) -> None:
            out[e] = y_of(groups[e]).to(out.dtype)

        self.order.schedule(self.step, counts, *self._one_by_one(run))
        return out.reshape(x.shape)

    def _sized(self, x: torch.Tensor, given) -> torch.Tensor:
        """Called with rows sorted by expert and their counts (parallel experts; ``given``: a list
        or an integer tensor, handed back as it is when there are no rows)."""
        sizes = _as_ints(given)
        starts = [0, *itertools.accumulate(sizes)]
        ys: dict[int, torch.Tensor] = {}

        def run(e: int, y_of) -> None:
            ys[e] = y_of(x[starts[e]: starts[e + 1]])

        self.order.schedule(self.step, list(sizes), *self._one_by_one(run))
        if not ys:
            return self.experts.module(x, given)    # no rows at all: the module's own (empty) result
        like = next(iter(ys.values()))
        return torch.cat([ys.get(e, like.new_zeros((0, like.shape[-1]))) for e in range(len(sizes))], dim=0)


class LookupCalls(ExpertCalls):
    """Rows of an expert table: acquire the rows looked up, run the module's own lookup on them."""

    def __call__(self, indices: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        experts = self.experts
        flat = indices.reshape(-1).to("cpu", torch.long)
        counts = torch.bincount(flat, minlength=experts.num_experts).tolist()
        used = [e for e, n in enumerate(counts) if n]
        rows: dict[int, torch.Tensor] = {}

        def run_group(group: list[int], tensors: list[dict], site) -> None:
            for e, t in zip(group, tensors):
                rows[e] = t["weight"]

        self.order.schedule(self.step, counts, run_group, None, keep=True)
        try:
            table = torch.stack([rows[e] for e in used]) if used else None        # [u, H]
            remap = torch.zeros(experts.num_experts, dtype=torch.long, device=indices.device)
            remap[host_to_device(torch.tensor(used), indices.device)] = torch.arange(len(used), device=indices.device)
            if table is None:
                return experts.module(indices, *args, **kwargs)
            with experts.bound({"weight": table}):
                return experts.module(remap[indices], *args, **kwargs)
        finally:
            self.order.release_kept(self.step)


class BlockCalls(ExpertCalls):
    """``block`` (several experts modules in one block, JetMoE's ``input_linear`` + ``output_linear``):
    the block's own forward runs; each experts module's call is served on the units of the experts
    it is given (:meth:`_child_call`), held from the first module call until the block returns."""

    def __init__(self, experts, order, sites, step):
        super().__init__(experts, order, sites, step)
        self._inside = False                 # inside a layout compute (the module's own forward runs)

    def install(self) -> None:
        """Each experts module's call computes the experts it is given on their units."""
        for name in self.experts.layout.children:
            def serve(own, args, kwargs, name=name):
                if self._inside:           # the layout's compute calls the module's own forward
                    return own(*args, **kwargs)
                return self._child_call(name, own, *args, **kwargs)

            self._serve_calls(self.experts.module.get_submodule(name), serve)

    def __call__(self, *args, **kwargs):
        """The block's own forward (its routing, its loop over its experts modules); the units its
        first experts-module call acquires are held until the block returns, so the later calls
        (``output_linear`` after ``input_linear``) find them on the device."""
        step, experts = self.step, self.experts
        step.held, step.used = {}, None
        hidden = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.is_floating_point()),
                      None)
        step.tokens = hidden[..., 0].numel() if hidden is not None and hidden.dim() > 1 else None
        try:
            return experts.module(*args, **kwargs)
        finally:
            for e in step.held:
                experts.runtime.scheduler.release(experts.units[e])
            step.held = {}
            if step.used is not None:
                self.order.after_layer(step, step.used)

    def _child_call(self, child: str, own, x: torch.Tensor, *rest):
        """Experts module ``child`` called by the block (``sized``: rows sorted by expert and their
        counts; ``grouped``: ``x[E*T, H]``): each expert it is given, on its unit's weights."""
        experts, step = self.experts, self.step
        layout = experts.layout.children[child]
        grouped = layout.call == "grouped"
        if grouped:
            groups = x.reshape(experts.num_experts, -1, x.shape[-1])              # [E, T, H]
            counts = (groups != 0).any(-1).sum(-1).tolist()                       # [E] tokens per expert
            if not layout.makes_zero_from_zero():
                counts = [max(n, 1) for n in counts]
            elif not any(counts):
                counts[0] = 1                      # all rows zero: expert 0 gives the (zero) output's shape
            rows = list(groups)
        else:
            layout.note_sizes(rest[0])                                            # a list or a tensor
            counts = _as_ints(rest[0])
            T = step.tokens
            if step.used is None and T and sum(counts) % T == 0:
                # the block's k (every token's rows, once per choice): a gate that returns only
                # logits (a plain Linear router) routes with it from the next step on
                self.top_k_seen = sum(counts) // T or None
            rows = list(x.split(counts, dim=0))                                   # per expert [n_e, H]
        ys: dict[int, torch.Tensor] = {}
        tracer = experts.runtime.tracer
        for e in self.order.block_order(step, counts):
            tensors = step.held[e]
            self._inside = True
            try:
                with tracer.span("compute", f"{experts.units[e].name} {child}", layer=experts.layer,
                                 args={"expert": e, "tokens": counts[e]}):
                    ys[e] = experts.layout.child_compute(child, e, tensors, rows[e], experts.bound)
            finally:
                self._inside = False
        if grouped:
            like = next(iter(ys.values()))
            out = groups.new_zeros((groups.shape[0], groups.shape[1], like.shape[-1]))   # [E, T, out]
            for e, y in ys.items():
                out[e] = y.to(out.dtype)
            return out.reshape(-1, like.shape[-1])
        if not ys:
            self._inside = True
            try:
                return own(x, *rest)       # no rows at all: the module's own (empty) result
            finally:
                self._inside = False
        like = next(iter(ys.values()))
        return torch.cat([ys.get(e, like.new_zeros((0, like.shape[-1]))) for e in range(len(counts))], dim=0)


class ReplayCalls(ExpertCalls):
    """``loop_block`` (a block looping over a ``ModuleList``, the rule on the block) and ``module_list``
    (a per-expert ``ModuleList`` / ``ModuleDict``, the rule on the list): whoever loops over the experts
    -- the block, its parent, or the container's own forward -- is replayed (:meth:`_replay`): the
    first pass records each expert call's inputs, the experts compute in Klotski's order, the second
    pass gets every expert call answered by its output (:meth:`_loop_call`). Where the loop cannot be
    replayed (the block is another operator's), each expert computes on its unit when the loop calls
    it, and the gate queues loads in expert index order (``sorts_loads`` False)."""

    def __init__(self, experts, order, sites, step):
        super().__init__(experts, order, sites, step)
        self._loop: tuple | None = None      # ("record", calls) / ("replay", calls, outputs, cursor, unchecked)
        self.replays = experts.layout.call == "loop_block"   # the loop over the experts is replayed
        #                                      (``module_list``: once its own loop or its block's is served)

    @property
    def sorts_loads(self) -> bool:
        return self.replays

    def loops_itself(self) -> bool:
        """``module_list``: the container has a forward of its own that loops over its experts."""
        return type(self.experts.module).forward not in (nn.ModuleList.forward, nn.ModuleDict.forward,
                                                         nn.Module.forward)

    def install(self) -> None:
        """Every expert's call is answered by :meth:`_loop_call`; a ``module_list`` whose block loops over
        it replays that block once the model is whole."""
        experts = self.experts
        for e in range(experts.stored):
            self._serve_calls(experts.layout.child(e), lambda own, args, kwargs, e=e: self._loop_call(e, own, args, kwargs))
        if experts.layout.call == "container":
            if self.loops_itself():
                self.replays = True
            else:                           # the block owning the list: once the model is whole
                experts.runtime.on_model(self._replay_parent, lambda model: None)

    def uninstall(self) -> None:
        super().uninstall()
        self.replays = self.experts.layout.call == "loop_block"

    def __call__(self, *args, **kwargs):
        """``loop_block`` (the block), ``module_list`` with its own loop (a container's forward)."""
        experts = self.experts
        if experts.layout.call == "container" and not self.loops_itself():
            raise TypeError(f"{experts.key}: a ModuleList of experts is not called; its block calls each expert")
        return self._replay(experts.module, args, kwargs)

    def _replay_parent(self, model: nn.Module) -> None:
        """``module_list`` (a per-expert list its block loops over, the rule on the list): once the
        model is whole, the block that owns the list replays like a ``loop_block``
        (:meth:`_replay`: expert inputs recorded, the experts computed hot first then as they land,
        the block's loop answered), so the family's loop order no longer orders the compute. A
        block that is itself another operator's (or whose forward another list's operator serves)
        keeps its loop: each expert then computes on its unit when the loop calls it (:meth:`_loop_call`)."""
        name = self.experts.key.rpartition(".")[0]
        parent = model.get_submodule(name) if name else model
        module = self.experts.module
        if isinstance(parent, Operator) or "forward" in parent.__dict__ or \
                not any(isinstance(c, Operator) and c.base is module for c in parent.children()):
            return                          # (another operator's block, or one whose forward is served already)
        self._serve_calls(parent, lambda own, args, kwargs: self._replay(own, args, kwargs))
        self.replays = True

    def _replay(self, forward, args: tuple, kwargs: dict):
        """A block's own ``forward`` twice: the first pass records each expert call's inputs, the
        recorded experts then compute in Klotski's order (:meth:`ExpertOrder.schedule`), the second pass
        gets every expert call answered by its output. Costs the block's routing and combination twice
        (not its experts); the gate's routing of the second pass is the first's (no new loads).
        Where the second pass's inputs could not be compared by value call by call (GPU tensors,
        :func:`_same_call`), they are read once after it; if any differs (an expert's input
        depended on another's output, zeros in the first pass), the block runs once more with every
        expert call computed on its unit."""
        experts = self.experts
        calls: dict[int, list] = {}
        self._loop = ("record", calls)
        try:
            forward(*args, **kwargs)
            counts = [sum(_call_rows(c) for c in calls.get(e, ())) for e in range(experts.num_experts)]
            results: dict[int, list] = {e: [] for e in calls}

            def run_group(group: list[int], tensors: list[dict], site) -> None:
                for e, t in zip(group, tensors):
                    child = experts.layout.child(e)
                    own = type(child).forward.__get__(child)
                    with experts.bound(t):
                        results[e] += [own(*a, **kw) for a, kw in calls[e]]

            self.order.schedule(self.step, counts, run_group, None)
            unchecked: list[torch.Tensor] = []
            self._loop = ("replay", calls, results, dict.fromkeys(calls, 0), unchecked)
            out = forward(*args, **kwargs)
            if unchecked and not bool(torch.stack(unchecked).all()):          # one device sync per block call
                self._loop = None
                out = forward(*args, **kwargs)
            return out
        finally:
            self._loop = None

    def _loop_call(self, e: int, own, args: tuple, kwargs: dict):
        """Expert ``e`` called by its block: recorded (zeros of its output's shape, from one row
        on the weightless placeholders), answered from the precomputed outputs, or -- outside the
        two passes, or when the block's second pass gives other inputs -- computed on its unit."""
        mode = self._loop
        if mode is not None and mode[0] == "shape":
            return own(*args, **kwargs)
        rows = _call_rows((args, kwargs))
        if mode is not None and mode[0] == "record":
            mode[1].setdefault(e, []).append((args, kwargs))
            if rows == 0:
                return own(*args, **kwargs)
            return self._zeros_like_output(e, args, kwargs)
        if mode is not None:
            _, calls, results, seen, unchecked = mode
            i = seen.get(e, 0)
            if i < len(results.get(e, ())) and _same_call(calls[e][i], (args, kwargs), unchecked):
                seen[e] = i + 1
                return results[e][i]
        if rows == 0:
            return own(*args, **kwargs)
        experts, step = self.experts, self.step
        sched = experts.runtime.scheduler
        if step.entered != sched.step:     # outside a replay: the block's first expert this step
            self.order.enter(step)
        unit = experts.units[e]
        tensors = sched.acquire(unit)
        try:
            with experts.bound(tensors):
                return own(*args, **kwargs)
        finally:
            sched.release(unit)

    def _zeros_like_output(self, e: int, args: tuple, kwargs: dict):
        """Zeros shaped like expert ``e``'s output on these inputs: its forward on the meta device
        (meta parameters and inputs: shapes only, nothing computed, no weight read)."""
        child, saved = self.experts.layout.child(e), self._loop
        params = {n: torch.empty(p.shape, dtype=p.dtype, device="meta") for n, p in child.named_parameters()}
        meta = lambda v: v.to("meta") if isinstance(v, torch.Tensor) else v          # noqa: E731
        self._loop = ("shape",)
        try:
            out = torch.func.functional_call(child, params, tuple(meta(a) for a in args),
                                             {k: meta(v) for k, v in kwargs.items()})
        finally:
            self._loop = saved
        device = next(v.device for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor))
        if isinstance(out, torch.Tensor):
            return torch.zeros(out.shape, dtype=out.dtype, device=device)
        return type(out)(torch.zeros(o.shape, dtype=o.dtype, device=device) if isinstance(o, torch.Tensor) else o
                         for o in out)


#: The interception of each layout call (:attr:`ExpertLayout.call`).
CALLS: dict[str, type[ExpertCalls]] = {"routed": FusedCalls, "grouped": FusedCalls, "sized": FusedCalls,
                                      "lookup": LookupCalls, "block": BlockCalls, "loop_block": ReplayCalls,
                                      "container": ReplayCalls}


def calls_for(experts: "ExpertSet", order: "ExpertOrder", sites: "ExpertSites", step: "LayerStep") -> ExpertCalls:
    """The interception of ``experts``' layout, composed with the order policy, sites and layer step."""
    return CALLS[experts.layout.call](experts, order, sites, step)


# ---------------------------------------------------------------- helpers


def _call_rows(call: tuple) -> int:
    """Rows of an expert call ``(args, kwargs)``: the first dimension of its first tensor."""
    args, kwargs = call
    t = next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), None)
    return int(t.shape[0]) if t is not None and t.dim() > 0 else 0


def _same_call(a: tuple, b: tuple, unchecked: list[torch.Tensor]) -> bool:
    """Whether a replayed expert call (``b``) got the inputs of the recorded call ``a``: the same
    arguments, tensors of the same shapes, dtypes and devices, equal other values -- and equal tensor
    values. Those are compared here only where that is free (CPU tensors): on a GPU ``torch.equal``
    makes the host wait for the device, once per expert call. There the comparison is queued
    instead (a 0-dim bool appended to ``unchecked``) and the block reads all of them at once after its
    second pass (:meth:`ReplayCalls._replay`)."""
    (aa, ak), (ba, bk) = a, b
    if len(aa) != len(ba) or set(ak) != set(bk):
        return False
    queued = []
    for x, y in zip((*aa, *(ak[k] for k in sorted(ak))), (*ba, *(bk[k] for k in sorted(bk)))):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape
                    and x.dtype == y.dtype and x.device == y.device):
                return False
            if reading_syncs(x):
                queued.append(torch.eq(x, y).all())
            elif not torch.equal(x, y):
                return False
        elif x != y:
            return False
    unchecked += queued
    return True


def _as_ints(sizes) -> list[int]:
    """Per-expert row counts as Python ints: a tensor in one ``tolist`` (one device sync on a GPU,
    not one per expert), a list as it is."""
    return sizes.tolist() if isinstance(sizes, torch.Tensor) else [int(n) for n in sizes]


def _slices_index(starts: list[int], counts: list[int]) -> torch.Tensor:
    """Row indices of the slices ``[starts[i], starts[i] + counts[i])``, concatenated (CPU)."""
    if sum(counts) <= 1024:                # a decode step's few rows: one tensor from a list (six ops cost more)
        rows = array("q", [r for a, c in zip(starts, counts) for r in range(a, a + c)])
        return torch.frombuffer(rows, dtype=torch.long) if rows else torch.empty(0, dtype=torch.long)
    n = torch.tensor(counts)
    shift = torch.tensor(starts) - (torch.cumsum(n, 0) - n)          # [g] start minus its place in the output
    return torch.repeat_interleave(shift, n) + torch.arange(int(n.sum()))


@functools.lru_cache(maxsize=64)
def _promoted(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """``torch.promote_types``, remembered (asked per layer-step with the same two dtypes)."""
    return torch.promote_types(a, b)


