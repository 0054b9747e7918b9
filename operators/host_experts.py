"""Experts that compute where they live (hybrid host/device; Fiddler, KTransformers, llama.cpp ``--n-cpu-moe``).

:class:`~operators.experts.GroupedExperts` with ``compute: host`` or ``auto`` hands the experts it
does not move to a :class:`HostExperts`: the routed rows of those experts cross the link (the
hidden states in, the outputs back: a few kilobytes, counted and, on an emulated link, timed), a
host kernel computes them on the experts' host-tier tensors in place (a disk-tier expert: its host
cache, or read now; a stored low-bit format: dequantized on the host by its own codec,
:meth:`kinject.engine.store.TensorStore.host_weights`), and the operator combines the outputs with
the device's in the block's own weighting, in the same sorted-rows buffer. The host kernel is the
operator's own compute site (:mod:`operators.expert_sites`) handed the experts' host weights: on a
CPU device the site that computes every other group, on CUDA called from the host worker.

``auto`` decides per layer, per expert, per step, from measured costs
(:class:`kinject.engine.costs.PlacementCosts`): an expert not on the device computes on the host
when its rows' host compute plus their activations' link time is cheaper than moving its stored
bytes and computing it on the device (Fiddler's rule). A batch group that routes many rows to an
expert makes moving it cheaper, so large groups fall back to Klotski's moves by themselves; the
prefetch of predicted hot experts asks the same question with the rows it expects. On a CPU device
(its link emulated) host and device are the same cores running the same kernel: the compute terms
cancel and the link alone decides (``PlacementCosts.same_cores``), so timing noise cannot flip it.

Host kernels, an ordered chain (docs/architecture.md, "Ordered chains"), first that applies wins:

0. ``kt-kernel``: KTransformers' AMX / AVX-512 MoE kernels (optional extra ``kinject[kt]``,
   :mod:`operators.kt_backend`): one MoE object per layer built once from the host experts'
   weights, the routed rows in, their outputs back; where it is installed, the CPU has AMX or
   AVX-512, and the experts are unbiased bf16 SiLU-gated experts of transformers' fused contract;
0b. ``torch-host``: torch's CPU GEMV and weight-only INT8 / INT4 kernels per expert at memory speed
   (:mod:`operators.host_compute`, :mod:`kinject.engine.host_kernels`), on unbiased ``[out, in]``
   experts of transformers' fused contract; the only one that serves a rule's ``host_format``;
1. ``torch-grouped``: the layout's grouped math (:func:`operators.expert_compute.compute_group`:
   one grouped GEMM per projection over the host experts' ``[E, ...]`` layout, or one mm per
   expert), all of a layer's host experts in one call, never one call per token; it reads no
   module state, so on CUDA it runs on a worker thread beside the device's kernels;
2. ``torch-layout``: the family's own expert math per expert (weights bound to the module), in
   the compute thread; a CPU runtime only (it binds the module's parameters, which the device
   side binds too: on CUDA ``compute: auto`` moves such experts, ``host`` is refused).

CUDA (:meth:`HostExperts.start`): the rows are gathered on the device and copied into a pinned host
buffer on the runtime's experts host lane (:class:`kinject.engine.host_lane.HostLane`: its own
stream, after an event on the compute stream); the worker thread waits for that copy's event only;
the compute thread meanwhile runs the device's groups; the outputs come back through pinned memory
on the lane stream, and the compute stream waits for that copy's event. No global synchronize.
``pipeline.host_threads`` sets the worker's torch
threads (a CPU device shares its threads with the device side and ignores it).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from kinject.engine.costs import PlacementCosts
from kinject.engine.host_lane import HostLane
from kinject.errors import KinjectError
from operators.expert_sites import ExpertComputeSite

if TYPE_CHECKING:
    from kinject.runtime import Runtime
    from operators.expert_step import ExpertSet

logger = logging.getLogger(__name__)

COMPUTE = ("device", "host", "auto")
HOST_CALLS = ("routed", "grouped", "sized")     # layout calls whose experts the operator computes itself


class HostComputeError(KinjectError):
    """No host kernel can compute these experts (the message lists each backend and why it was skipped)."""


# ---------------------------------------------------------------- the backend chain


@dataclass(frozen=True)
class HostBackend:
    """One host kernel: ``skip(layout, cuda, op)`` says why it cannot serve a layout (of the experts
    ``op``, an :class:`~operators.expert_step.ExpertSet`, when known) on a CPU or a CUDA runtime
    (None: it can); ``kernel(host)``, where the
    backend has its own, builds the layer's compute function ``(group, tensors, counts, x) -> [N, H]``
    once (None: the operator's own compute site)."""

    name: str
    skip: Callable[..., str | None]
    kernel: Callable[["HostExperts"], Callable] | None = None
    same_cost_on_cpu: bool = False      # on a CPU device, costs what the device side's kernel costs (or less)


def _grouped_skip(layout, cuda: bool, op=None) -> str | None:
    if getattr(layout, "math", None) is None or layout.call != "routed":
        return f"needs transformers' fused experts contract (layout {layout.name!r} has no grouped math)"
    return None


def _layout_skip(layout, cuda: bool, op=None) -> str | None:
    if layout.call not in HOST_CALLS:
        return (f"layout {layout.name!r} is computed through its block's own {layout.call!r} call, which "
                f"kinject does not split between host and device (host compute serves {', '.join(HOST_CALLS)} calls)")
    if cuda:
        return ("binds the module's parameters to compute, so it cannot run on the host worker while the "
                "GPU computes with the same module (CUDA)")
    return None


def _kt_skip(layout, cuda: bool, op=None) -> str | None:
    from operators import kt_backend
    return kt_backend.skip(layout, cuda, op)


def _kt_kernel(host: "HostExperts") -> Callable:
    from operators.kt_backend import KTKernelExperts
    return KTKernelExperts(host)


def _host_skip(layout, cuda: bool, op=None, host_format: str | None = None) -> str | None:
    from operators.host_compute import skip
    return skip(layout, cuda, op, host_format=host_format)


def _host_kernel(host: "HostExperts") -> Callable:
    from operators.host_compute import expert_kernels
    return expert_kernels(host)


# torch-host first: it computes bfloat16 experts with transformers' own bits, and on the bench machine
# (2 cores, AMX) kt-kernel 0.7.2 decoded ~5x slower (104 ms a token against ~20) with other tokens;
# pipeline.host_kernel: kt-kernel puts it first where a user measured it faster (docs/architecture.md)
BACKENDS: tuple[HostBackend, ...] = (
    HostBackend("torch-host", _host_skip, _host_kernel, same_cost_on_cpu=True),
    HostBackend("kt-kernel", _kt_skip, _kt_kernel),
    HostBackend("torch-grouped", _grouped_skip),
    HostBackend("torch-layout", _layout_skip),
)


def chain(first: str = "auto") -> tuple[HostBackend, ...]:
    """:data:`BACKENDS` with the kernel named ``first`` (``pipeline.host_kernel``) moved to the front
    (``auto``: as they are)."""
    if first == "auto":
        return BACKENDS
    named = [b for b in BACKENDS if b.name == first]
    if not named:
        raise HostComputeError(f"pipeline.host_kernel: no host kernel {first!r} "
                               f"(one of auto, {', '.join(b.name for b in BACKENDS)})")
    return (named[0], *(b for b in BACKENDS if b.name != first))


def choose_backend(layout, *, where: str, cuda: bool = False, op=None, host_format: str | None = None,
                   first: str = "auto") -> HostBackend:
    """The first backend of :func:`chain` (``first``: ``pipeline.host_kernel``) that serves ``layout``
    (of operator ``op``; on a CUDA runtime: ``cuda``), the ones skipped before it logged with why (a
    warning where the skipped one is the kernel the pipeline named); :class:`HostComputeError` naming
    ``where`` and every backend with the reason it was skipped otherwise."""
    reasons = []
    for b in chain(first):
        if not host_format:
            why = b.skip(layout, cuda, op)
        elif b.name == "torch-host":
            why = b.skip(layout, cuda, op, host_format=host_format)
        else:
            why = f"computes the experts' stored form only (host_format {host_format!r} asked)"
        if why is None:
            if reasons:
                log = logger.warning if first == reasons[0][0] else logger.info
                log("%s: host kernel %s (skipped %s)", where, b.name, "; ".join(f"{n}: {w}" for n, w in reasons))
            return b
        reasons.append((b.name, why))
    raise HostComputeError(f"{where}: no host kernel computes these experts "
                           f"({'; '.join(f'{n}: {w}' for n, w in reasons)})")


def check_compute_kwarg(kwargs: dict) -> None:
    """``compute`` of a rule's kwargs is one of :data:`COMPUTE`, and ``host_format`` (the host kernels
    compute in that format, :mod:`operators.host_compute`) one of its formats, with ``compute`` host
    or auto (error ``.key`` the kwarg)."""
    value = kwargs.get("compute", "device")
    if value not in COMPUTE:
        err = ValueError(f"compute must be one of {', '.join(COMPUTE)}, got {value!r}")
        err.key = "compute"
        raise err
    from operators.host_compute import check_host_format
    check_host_format(kwargs.get("host_format"), value)


def placement_costs(runtime: "Runtime") -> PlacementCosts:
    """The runtime's one :class:`PlacementCosts` (link rate from the transfer engine when emulated;
    a CPU device: ``same_cores``, its compute is the host's)."""
    def make() -> PlacementCosts:
        t = runtime.transfer
        rate = t.emulate_bandwidth * 1e9 if t.emulate_bandwidth else None
        return PlacementCosts(link_bytes_per_s=rate, emulated=bool(t.emulated),
                              same_cores=runtime.device.type == "cpu")

    return runtime.shared("placement_costs", make)


# ---------------------------------------------------------------- per-operator host side


class HostExperts(ExpertComputeSite):
    """The host compute site of one experts operator: which experts compute there this step, and
    running them (the other :class:`~operators.expert_sites.ExpertComputeSite` beside the device's).

    ``experts``: the operator's :class:`~operators.expert_step.ExpertSet` (its units, layout, key,
    layer); ``mode``: ``host`` (every expert not on the device) or ``auto`` (Fiddler's rule per
    expert); ``device``: the device's compute site, whose math computes host experts on their host
    tensors where the chosen backend has no kernel of its own.
    """

    def __init__(self, experts: "ExpertSet", mode: str, device: ExpertComputeSite, host_format: str | None = None):
        self.experts, self.mode, self.device = experts, mode, device
        self.host_format = host_format                  # int8 / int4: computed in it (operators.host_compute)
        self.runtime: "Runtime" = experts.runtime
        self.backend = choose_backend(experts.layout, where=f"{experts.key} (compute: {mode})",
                                      cuda=self.runtime.device.type == "cuda", op=experts, host_format=host_format,
                                      first=self.runtime.pipeline.host_kernel)
        self._kernel: Callable | None = None            # the backend's own kernel, built by _settle
        self._settled = False
        self.costs = placement_costs(self.runtime)
        self.chosen: tuple[tuple, frozenset[int]] = ((), frozenset())   # ((step, counts), experts on the host)
        self.stats = {"experts": 0, "rows": 0, "saved_bytes": 0, "activation_bytes": 0, "host_s": 0.0}
        self._worker: _Worker | None = None
        self._row_bytes: int | None = None
        self._calibration: bool | None = None     # None: not tried yet
        self._largest_wire: int | None = None
        self._none_moved: tuple = ((), False)     # moves_none's last (key, answer)
        self._none_at: tuple = ((),) * 6          # moves_none_at's last (tokens, ..., answer)
        self._read_experts: frozenset[int] = frozenset()   # experts the backend's kernel is handed weights of

    @classmethod
    def of(cls, experts: "ExpertSet", mode: str, device: ExpertComputeSite,
           host_format: str | None = None) -> "HostExperts | None":
        """The host side of ``experts`` for ``compute: mode``: None for ``device``; for ``auto`` also None
        (logged) where no host kernel serves its layout, so one rule file serves every family; for
        ``host`` that is a :class:`HostComputeError` listing each backend and why it was skipped."""
        if mode == "device":
            return None
        try:
            return cls(experts, mode, device, host_format)
        except HostComputeError as exc:
            if mode == "host":
                raise
            logger.info("%s; compute: auto computes them on the device", exc)
            return None

    # ------------------------------------------------------------ decisions

    def choose(self, counts: list[int]) -> frozenset[int]:
        """Experts (with rows in ``counts``) that compute on the host this step; decided once per
        step, when the router has routed (before any of them is queued for a load)."""
        key = (self.runtime.scheduler.step, tuple(counts))
        if self.chosen[0] == key:
            return self.chosen[1]
        units = self.experts.units
        cand = self.runtime.store.cold_ids(units, [e for e, n in enumerate(counts[: self.experts.stored]) if n])
        if self.mode == "auto" and cand and not (self._calibration and self.moves_none_at(max(counts))):
            # (not when moves_none_at: the host wins at every row count up to the most any expert has)
            if not self._calibrated(cand[0]):
                cand = []
            else:
                rb, same, wins = self.row_bytes(), self._same_kernel(), self.costs.host_wins
                cand = [e for e in cand if wins(counts[e], units[e].wire_nbytes, rb, same_kernel=same)]
        chosen = frozenset(cand)
        self.chosen = (key, chosen)
        return chosen

    def worth_prefetching(self, experts: list[int], tokens: int | None, top_k: int) -> list[int]:
        """Of the predicted hot experts, those worth moving ahead: all of them under ``device``;
        none under ``host`` (what is not on the device computes where it lives); under ``auto`` the
        ones for which moving beats host compute at the rows a hot expert is expected to get
        (the batch group's ``tokens * top_k`` rows over the predicted experts, at most ``tokens``)."""
        if self.mode == "host" or not experts:
            return []
        rows = max(1, min(tokens or 1, round((tokens or 1) * top_k / len(experts))))
        units = self.experts.units
        if not self._calibrated(experts[0]):
            return experts
        rb, same = self.row_bytes(), self._same_kernel()
        return [e for e in experts if not self.costs.host_wins(rows, units[e].wire_nbytes, rb, same_kernel=same)]

    def moves_none(self, tokens: int | None) -> bool:
        """Whether no expert can be worth moving ahead (so the prediction need not be made): always
        under ``host``; under ``auto``, once calibrated, when Fiddler's rule keeps the largest expert
        on the host at 1 row and at ``tokens`` rows (both sides' costs are lines in the rows, so
        their difference is too: the host wins at every count between)."""
        if self.mode == "host":
            return True
        if self._calibration is not True:
            return False
        same, costs = self._same_kernel(), self.costs
        # asked for every operator ahead, every step: cached until the tokens, the link or the fits change
        # (on the same cores the fits do not count)
        key = (tokens, costs.link_bytes_per_s, -1 if same and costs.same_cores else costs.version)
        if self._none_moved[0] == key:
            return self._none_moved[1]
        if self._largest_wire is None:
            self._largest_wire = max(u.wire_nbytes for u in self.experts.units)
        rb, unit = self.row_bytes(), self._largest_wire
        answer = all(costs.host_wins(rows, unit, rb, same_kernel=same) for rows in {1, max(1, tokens or 1)})
        self._none_moved = (key, answer)
        return answer

    def moves_none_at(self, tokens: int | None) -> bool:
        """:meth:`moves_none` where its answer depends on ``tokens`` alone (``host`` mode, or on the
        same cores with the device's own kernel, where no measured cost enters): what a caller may
        keep for as long as the token count stays; False otherwise."""
        if self.mode == "host":
            return True
        # asked several times per layer-step: kept until the tokens, the calibration, the backend or
        # the link change (nothing else enters it on the same cores)
        got, costs = self._none_at, self.costs
        if got[0] == tokens and got[1] is self._calibration and got[2] is self.backend \
                and got[3] == costs.link_bytes_per_s and got[4] == costs.same_cores:
            return got[5]
        answer = costs.same_cores and self._same_kernel() and self.moves_none(tokens)
        self._none_at = (tokens, self._calibration, self.backend, costs.link_bytes_per_s, costs.same_cores, answer)
        return answer

    def _same_kernel(self) -> bool:
        """Whether a host compute runs the device side's own kernel (the operator's compute site: no
        backend kernel of its own, or one no slower than it there: ``torch-host``), so on the same cores
        (``costs.same_cores``) the link alone decides and timing noise cannot flip it."""
        return self.backend.kernel is None or self.backend.same_cost_on_cpu

    def row_bytes(self) -> int:
        """Bytes of one row's activations (hidden size x the weights' element size)."""
        if self._row_bytes is None:
            t = self.weights(0)
            w = next(v for v in t.values() if v.is_floating_point() and v.dim() >= 2)
            self._row_bytes = self._hidden(t) * w.element_size()
        return self._row_bytes

    def _hidden(self, t: dict[str, torch.Tensor]) -> int:
        """The hidden size the experts read and write: the down projection's output dimension where
        the layout has transformers' math, else the module's ``hidden_size`` (or its config's)."""
        math = getattr(self.experts.layout, "math", None)
        if math is not None and math.down in t:
            w = t[math.down]
            return int(w.shape[-1] if math.transposed else w.shape[-2])
        base = self.experts.module
        hidden = getattr(base, "hidden_size", None) or getattr(getattr(base, "config", None), "hidden_size", None)
        if not isinstance(hidden, int):
            raise HostComputeError(f"{self.experts.key}: cannot tell the experts' hidden size (no hidden_size or "
                                   "config.hidden_size on the module)")
        return hidden

    def _calibrated(self, e: int) -> bool:
        """:meth:`_calibrate`, once; where the layout's own math cannot run on a made-up input (a
        family's kernel wants more than rows), ``auto`` leaves this operator's experts on the device
        (said once in the log): moving them is always correct, only maybe slower."""
        if self._calibration is None:
            try:
                self._calibrate(e)
                self._calibration = True
            except Exception as exc:                       # noqa: BLE001 - the device path stays correct
                logger.warning("%s: host compute not calibrated (%s: %s); compute: auto keeps its experts on "
                               "the device", self.experts.key, type(exc).__name__, exc)
                self._calibration = False
        return self._calibration

    def _calibrate(self, e: int) -> None:
        """Before the first decision: time each side's kernel on the real code path (the operator's
        compute site on a group of up to two experts from ``e``, 1 and 8 rows each; every shape run
        once to warm up, then timed), so no decision is made from nothing; later points come from
        the real computes. Its rows come from a private generator: a sampling run's RNG is untouched."""
        costs = self.costs
        if costs.host.known and costs.device.known and costs.link_bytes_per_s:
            return
        group = sorted({e, (e + 1) % self.experts.stored})
        ts = [self.weights(g) for g in group]
        hidden = self._hidden(ts[0])
        dtype = next(v.dtype for v in ts[0].values() if v.is_floating_point() and v.dim() >= 2)
        gen = torch.Generator().manual_seed(0)                # (the caller's sampling RNG is left alone)
        self._settle()
        for rows in (1, 8):
            x = torch.randn(rows * len(group), hidden, generator=gen).to(dtype)
            n = [rows] * len(group)
            s = _timed(lambda: self.compute(group, ts, n, x))
            costs.add("host", len(group), rows * len(group), s)
            if self.runtime.device.type == "cpu":             # a CPU device runs the site's kernel: the same one
                d = s if self._kernel is None else _timed(lambda: self.device.compute(group, ts, n, x))   # unless own
                costs.add("device", len(group), rows * len(group), d)
        if costs.link_bytes_per_s is None:
            costs.link_bytes_per_s = self._measure_link(e)
        if not costs.device.known:                            # CUDA: a device expert costs its move only (Fiddler's
            costs.add("device", 1, 1, 0.0)                    # approximation: the GPU computes it far faster than it moves)

    def _measure_link(self, e: int) -> float:
        """Host->device bytes/s of one expert's pinned copy (once, before the first decision; not in
        the hot path). A CPU device without an emulated link moves nothing: infinitely fast."""
        rt = self.runtime
        if rt.device.type != "cuda":
            return float("inf")
        src = {k: rt.transfer.pin(v) for k, v in self.weights(e).items()}
        nbytes = sum(v.numel() * v.element_size() for v in src.values())
        stream = torch.cuda.Stream(rt.device)
        with torch.cuda.stream(stream):
            t0 = time.perf_counter()
            for v in src.values():
                v.to(rt.device, non_blocking=True)
            stream.synchronize()                              # this stream only, once
        return nbytes / max(time.perf_counter() - t0, 1e-9)

    # ------------------------------------------------------------ compute

    @property
    def takes_broadcast_rows(self) -> bool:
        """Whether the backend's kernel, once built, reads one row broadcast to every row (torch-host's
        :class:`~kinject.engine.host_kernels.ExpertKernels`); before the first compute: no."""
        return getattr(self._kernel, "takes_broadcast_rows", False)

    def compute(self, group: list[int], tensors: list[dict], counts: list[int], x: torch.Tensor) -> torch.Tensor:
        """Host experts ``group``'s rows ``x`` (grouped by expert, ``counts`` each) -> their unweighted
        outputs ``[N, H]``: the chosen backend's own kernel (built once, on the first call), else the
        device site's math on ``tensors`` (the host weights)."""
        if not self._settled:
            self._settle()
        if self._kernel is None:
            return self.device.compute(group, tensors, counts, x)
        return self._kernel(group, tensors, counts, x)

    def one_token(self, ids: torch.Tensor, weights: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """A decode step's token ``x`` through every routed expert ``ids`` and their weighted sum with
        ``weights``, in one call of the backend's kernel where it has one
        (:meth:`~kinject.engine.host_kernels.ExpertKernels.one_token`); None (nothing computed) otherwise,
        and the interception computes them group by group."""
        if not self._settled:
            self._settle()
        fast = getattr(self._kernel, "one_token", None)
        return None if fast is None else fast(self.experts.stored, ids, weights, x)

    def compute_one(self, e: int, tensors: dict, x: torch.Tensor) -> torch.Tensor:
        """Host expert ``e`` alone on rows ``x`` (layouts whose calls hand over one expert's rows)."""
        self._settle()
        if self._kernel is None:
            return self.device.compute_one(e, tensors, x)
        return self._kernel([e], [tensors], [x.shape[0]], x)

    def reset(self) -> None:
        """Nothing is remembered about the units' tensors (the backend's kernel holds its own copy)."""

    def _settle(self) -> None:
        """Once, in the compute thread, before the first host compute: where the chosen backend has its
        own kernel, the chain is asked again now that the experts' units exist (their tiers and dtypes
        are then certain: a backend that cannot take them after all gives way to the next one, logged
        with why), and the kernel is built, with every expert's kernels where its weights stay put."""
        if self._settled:
            return
        self._settled = True
        if self.backend.kernel is None:
            return
        experts = self.experts
        self.backend = choose_backend(experts.layout, where=f"{experts.key} (compute: {self.mode})",
                                      cuda=self.runtime.device.type == "cuda", op=experts, host_format=self.host_format,
                                      first=self.runtime.pipeline.host_kernel)
        if self.backend.kernel is not None:
            self._kernel = self.backend.kernel(self)
            prepare = getattr(self._kernel, "prepare", None)      # (a backend's kernel may build lazily only)
            if prepare is not None:
                prepare(range(experts.stored))
            needs = getattr(self._kernel, "needs_tensors", None)  # (an expert's tier is fixed: asked once)
            self._read_experts = frozenset(e for e in range(experts.stored) if needs is not None and needs(e))

    def _tensors(self, group: list[int]) -> list[dict[str, torch.Tensor]]:
        """The host weights ``compute`` is handed: none for a backend with its own kernel (it holds
        its copy since it was built), so nothing is read or dequantized per step for it, except the
        experts its ``needs_tensors(e)`` asks for (a disk-tier expert: read here, outside the timed compute)."""
        if not self._settled:
            self._settle()
        if self._kernel is not None:
            read = self._read_experts
            return [self.weights(e) if e in read else {} for e in group] if read else [{}] * len(group)
        return [self.weights(e) for e in group]

    def weights(self, e: int) -> dict[str, torch.Tensor]:
        """Expert ``e``'s weights in host memory (its host tensors, or read / dequantized on the host)."""
        return self.runtime.store.host_weights(self.experts.units[e])

    def run(self, group: list[int], counts: list[int], run_group: Callable[..., None]) -> None:
        """Host experts ``group`` (ascending) computed in the calling thread: ``run_group(group,
        tensors, site)`` is the interception's group function, handed this site (a CPU device: the rows
        are host memory). The rows' activations are counted (and timed, on an emulated link) both ways."""
        rt = self.runtime
        rows = sum([counts[e] for e in group])
        act = rows * (self._row_bytes or self.row_bytes())
        experts = self.experts
        rt.transfer.cross_link(act, channel="ondemand", label=f"{experts.key} host rows in", layer=experts.layer)
        tensors = self._tensors(group)
        saved = self.saved(group)
        t0 = time.perf_counter()
        if rt.tracer.enabled:
            with rt.tracer.span("host_compute", _name(experts.key, group), layer=experts.layer,
                                args={"experts": group, "tokens": rows, "backend": self.backend.name,
                                      "saved_bytes": saved, "step": rt.scheduler.step}):
                run_group(group, tensors, self)
        else:                                  # (untraced: no span arguments built per layer per step)
            run_group(group, tensors, self)
        self.account(group, rows, time.perf_counter() - t0, saved)
        rt.transfer.cross_link(act, channel="kv_store", label=f"{experts.key} host rows out", layer=experts.layer,
                               wait=True)

    def saved(self, group: list[int]) -> int:
        """Bytes the link did not move: the stored bytes of the experts computed where they live."""
        units = self.experts.units
        return sum([units[e].wire_nbytes for e in group])

    def account(self, group: list[int], rows: int, seconds: float, saved: int | None = None) -> None:
        """Count a host compute of ``group`` (``rows`` rows, ``seconds``; ``saved``: its
        :meth:`saved` bytes, if known) in the stats and the costs."""
        s, n = self.stats, len(group)
        s["experts"] += n
        s["rows"] += rows
        s["saved_bytes"] += self.saved(group) if saved is None else saved
        s["activation_bytes"] += 2 * rows * (self._row_bytes or self.row_bytes())
        s["host_s"] += seconds
        self.costs.add("host", n, rows, seconds)

    # ------------------------------------------------------------ CUDA: overlapped with the device

    def start(self, group: list[int], counts: list[int], xs_rows: torch.Tensor,
              math: Callable[[list[int], list[dict], torch.Tensor], torch.Tensor]) -> "HostJob":
        """CUDA: start host experts ``group`` on their rows ``xs_rows`` (device, grouped by expert);
        returns a job whose :meth:`HostJob.result` is their outputs on the device. The rows go to
        pinned host memory on the runtime's host lane (:class:`kinject.engine.host_lane.HostLane`: its
        own stream, after an event on the compute stream), the worker thread waits for that copy's
        event alone and computes, and the compute thread goes on with the device's groups."""
        rt = self.runtime
        if self._worker is None:
            self._worker = _Worker(rt.pipeline)
        lane = rt.shared("experts_host_lane", lambda: HostLane(rt.device))
        pending = lane.to_host([xs_rows], out=[rt.store.buffers.take(xs_rows.shape, xs_rows.dtype)])   # [N, H] pinned
        tensors = self._tensors(group)
        job = HostJob(self, group, int(xs_rows.shape[0]), lane)

        def work() -> torch.Tensor:
            x_host = pending.wait()[0]                                            # this copy's event only
            t0 = time.perf_counter()
            y = math(group, tensors, x_host)                                      # [N, H] on the host
            job.seconds = time.perf_counter() - t0
            rt.store.buffers.give(x_host)
            return y

        job.future = self._worker.submit(work)
        return job

    def close(self) -> None:
        if self._worker is not None:
            self._worker.stop()
            self._worker = None

    def report_line(self) -> str | None:
        s = self.stats
        if not s["experts"]:
            return None
        from kinject.formatting import format_bytes as _fmt
        grouped = getattr(self._kernel, "grouped_calls", 0)
        via = f"{self.backend.name}, kinject's grouped GEMV in {grouped} layer steps" if grouped else self.backend.name
        return (f"  {self.experts.key}: host computed {s['experts']} experts ({s['rows']} rows, "
                f"{via}, {s['host_s'] * 1e3:.1f} ms), saved {_fmt(s['saved_bytes'])} of moves for "
                f"{_fmt(s['activation_bytes'])} of activations")


class HostJob:
    """Host experts in flight on the worker (CUDA); :meth:`result` gives their outputs on the device."""

    def __init__(self, host: HostExperts, group: list[int], rows: int, lane: HostLane):
        self.host, self.group, self.rows, self.lane = host, group, rows, lane
        self.future: queue.SimpleQueue | None = None
        self.seconds = 0.0

    def result(self) -> torch.Tensor:
        """Outputs ``[N, H]`` on the device: waits for the worker (the host compute only), then the
        lane copies them back; the compute stream waits for that copy's event, the host does not."""
        ok, value = self.future.get()
        if not ok:
            raise value
        host = self.host
        y = self.lane.to_device(value)
        host.account(self.group, self.rows, self.seconds)
        tr = host.runtime.tracer
        if tr.enabled:
            end = tr.now()
            tr.record("host_compute", _name(host.experts.key, self.group), end - self.seconds, end, layer=host.experts.layer,
                      args={"experts": self.group, "tokens": self.rows, "backend": host.backend.name,
                            "saved_bytes": host.saved(self.group)})
        return y


class _Worker:
    """One thread running host-kernel jobs in order (CUDA machines): the CPU computes while the GPU does."""

    def __init__(self, pipeline):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        threads = getattr(pipeline, "host_threads", None)
        self._thread = threading.Thread(target=self._loop, args=(threads,), name="kinject-host-experts", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], torch.Tensor]) -> queue.SimpleQueue:
        done: queue.SimpleQueue = queue.SimpleQueue()
        self._q.put((fn, done, torch.is_inference_mode_enabled()))
        return done

    def _loop(self, threads: int | None) -> None:
        if threads:
            torch.set_num_threads(int(threads))
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, done, inference = item
            try:
                with torch.inference_mode(inference), torch.no_grad():
                    done.put((True, fn()))
            except BaseException as exc:       # noqa: BLE001 - handed to the waiting compute thread
                done.put((False, exc))

    def stop(self) -> None:
        self._q.put(None)


def _timed(fn: Callable[[], object]) -> float:
    """Seconds of ``fn``'s second call (the first warms up)."""
    fn()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _name(key: str, group: list[int]) -> str:
    return f"{key}[{','.join(map(str, group))}] host"
