"""Klotski's constraint-sensitive I/O-compute planner (Klotski §7) and an HRM roofline bound (MoE-Lightning §3).

This module is the *pure* part: given a :class:`Profile` (measured times and sizes) and
:class:`Constraints` (memory budgets), :func:`solve` finds the number of micro-batches ``n`` in a
batch group. Measuring the profile on real hardware is :func:`kinject.plan.profiler.measure_profile`'s job
(it fills a :class:`Profile` and caches it keyed by :meth:`Profile.cache_key`).

Klotski §7, quoted
------------------
Planning goal (eq. 3)::

    min T = T_c + T_b    s.t.  M_usage < M_GPU + M_CPU + M_disk,   M_peak_GPU < M_GPU

"(I) indicates the point where gate computations will begin, (II) marks the start of the
computations for hot experts, (III) signifies the beginning of the computations for cold experts,
and (IV) denotes the initiation of the next attention layer's computations. [...] the
corresponding tensor transmission must be completed before these points"::

    (4)  n*t_cA                                          >= t_IO_G
    (5)  n*(t_cA + t_cG)                                 >= t_IO_G + K*t_IO_E
    (6)  n*(t_cA + t_cG) + t_c_hotE                      >= t_IO_G + (K+1)*t_IO_E
    (7)  n*(t_cA + t_cG) + t_c_hotE + sum_{i in Q} t_cEi >= t_IO_G + (K + len(Q))*t_IO_E + t_IO_A

"Assuming the final result is n >= x, then n = ceil(x). [...] n should be set to the smallest
integer that satisfies the inequality group."

Symbols -> kinject
------------------
==============  ===========================================================  ==========================================
paper           meaning                                                      here
==============  ===========================================================  ==========================================
n               micro-batches in a batch group                               ``n``
bs              micro-batch size (sequences)                                 ``bs`` = ``Profile.bs``
t_cA            attention compute, one layer, one micro-batch                ``Profile.t_attn``
t_cG            gate compute, one layer, one micro-batch                     ``Profile.t_gate``
t_cEi           compute of expert i over the tokens routed to it             ``Profile.t_expert(tokens)`` = a + b*tokens
t_c_hotE        compute of the K hot experts over the whole batch group      ``K*a + b*h*N*k``
sum t_cEi, Q    compute of the activated cold experts (queue Q)              ``len(Q)*a + b*(1-h)*N*k``
t_IO_A          transfer of one layer's attention weights                    ``Profile.t_load_attn``
t_IO_G          transfer of one layer's gate weights                         ``Profile.t_load_gate``
t_IO_E          transfer of one expert's weights                             ``Profile.t_load_expert``
K               prefetched hot experts (default k of top-k)                  ``hot_k`` (default ``Profile.top_k``)
len(Q)          activated cold experts per layer ("based on statistical      ``cold_experts`` (number or callable of N),
                data")                                                       default: uniform-routing estimate below
==============  ===========================================================  ==========================================

with ``N = n*bs*Profile.tokens_per_seq`` tokens in the batch group (``tokens_per_seq`` is 1 for a
decode step, the prompt length for prefill), ``k = Profile.top_k`` and ``h = hot_coverage``.

**How hot_coverage enters.** ``h`` is the expected share of the batch group's ``N*k``
token->expert assignments that land on the K prefetched experts — what
:meth:`kinject.engine.prefetch.PrefetchStats.coverage` measures online (and
:meth:`kinject.engine.prefetch.CorrelationTable.marginal_coverage` estimates from a table). The hot
experts then process ``h*N*k`` tokens, the cold ones ``(1-h)*N*k``, so ``h`` sets how much
compute ``t_c_hotE`` stands in front of the cold experts' transfers in (6)/(7). Default: ``K/E``
(no skew, i.e. no credit for the prefetcher). Paper §7: "In the optimal scenario, all tokens
select hot experts" (``h = 1``, no cold expert, (6) is vacuous); "the worst-case scenario emerges
when all tokens select cold experts [...] t_c_hotE is equal to zero" (``h = 0``).

**Default len(Q).** With ``m = (1-h)*N*k`` cold assignments spread uniformly over ``E_c = E-K``
cold experts, the expected number activated is ``E_c*(1 - (1 - 1/E_c)**m)``; this is what makes
more micro-batches activate more experts (Klotski §1). Pass ``cold_experts`` measured from
routing statistics to override it.

Ambiguities in the paper and how they are resolved
--------------------------------------------------
* The per-micro-batch vs whole-group gate: (5) multiplies ``t_cG`` by ``n``, so ``t_cG`` is per
  micro-batch. kinject's PrefetchGate routes the whole group in one call: the inequalities keep the
  paper's ``n*t_cG``; :func:`predict_step`, which predicts what the engine runs, counts one call.
* (7) has only ``t_IO_A`` for the next layer, while the slides' wording of (IV) adds "the first
  batch's KVCache". The equation is implemented as printed; ``kv_in_eq7=True`` adds
  ``t_load_kv`` to its right side.
* §7 says the optimal case eliminates "inequalities (4) and (5)"; logically the cold-expert
  inequalities (6) and (7) are the ones that lose their cold terms. kinject marks (6) vacuous when
  ``len(Q) = 0`` and keeps (7) (the next attention layer must still arrive).
* ``len(Q)`` is an expectation and may be fractional; it is used as is (not rounded) in (7) and
  rounded up when counting expert buffers for memory.
* The paper gives no memory model beyond eq. 3; the one used here is :func:`memory_usage`.

Roofline (MoE-Lightning §3, eq. 7 and eq. 12)::

    P_x^i = min(P_peak^i, B_peak^i * I_x^i, B_peak^{j,i} * I_x^j)                      (7)
    T(M, H, W, P) = max(comm^{cpu_to_gpu}, T_cpu, T_gpu),  T_x = max(comm_x, comp_x)    (12), (14)

:func:`roofline_bound` returns ``tokens_per_step / max(transfer, compute, ...)`` and which term binds.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from kinject.errors import KinjectError, PlanError
from kinject.kv.spec import STORES_IN_FLIGHT
from kinject.formatting import format_bytes, format_seconds
from kinject.plan.profile import ExpertCost, Profile  # noqa: F401 (re-exported)

_EPS = 1e-12    # relative tolerance on lhs >= rhs (float noise only)


# ====================================================================== constraints / rows / plan
@dataclass
class Constraints:
    """Memory limits (bytes) and what occupies them. ``None`` budget = unlimited."""

    device_budget: int | None = None     # M_GPU: peak device memory the plan must respect
    host_budget: int | None = None       # M_CPU
    kv_bytes_per_seq: int = 0            # KV of ONE sequence over ALL layers at target_len tokens
    target_len: int | None = None        # prompt + generated tokens the KV is sized for (informative)
    resident_bytes: int = 0              # always on device: embeddings, lm_head, norms, pinned layers/experts
    host_resident_bytes: int = 0         # weights kept in the host tier
    activation_bytes_per_seq: int = 0    # hidden states of one sequence for one layer step (all its tokens)
    kv_on_device: bool = False           # KV kept on device (True) or offloaded to host (Klotski's default)
    prefill_by_micro_batch: bool = False # pipeline.prefill: micro_batch: activation_bytes_per_seq for bs sequences
    group_bytes_per_seq: int = 0         # activations per sequence of the whole group whatever the prefill (decode step)
    group_prefill_bytes_per_seq: int = 0 # pipeline.prefill: layer: the group's hidden states each layer keeps (in, out)
                                         # beside one micro-batch's activations


@dataclass
class InequalityRow:
    """One of Klotski's inequalities evaluated at ``n``: ``lhs >= rhs`` (seconds)."""

    name: str        # e.g. "(5) hot experts ready"
    lhs: float       # seconds of compute before the point
    rhs: float       # seconds of transfer that must be done by then
    holds: bool
    formula: str     # the paper's formula
    eq: int = 0      # paper equation number (4..7)
    n: int = 0
    note: str = ""

    @property
    def slack(self) -> float:
        """lhs - rhs: negative = bubble of that length (seconds)."""
        return self.lhs - self.rhs


@dataclass
class Bound:
    """Result of :func:`roofline_bound`."""

    tokens_per_s: float
    binding: str                 # "transfer" | "compute" | "device-memory" | "cpu"
    step_s: float                # max of the terms
    terms: dict[str, float]      # seconds per step of each term

    def __float__(self) -> float:
        return self.tokens_per_s


@dataclass
class Plan:
    """Solver output: the batch group size ``n`` and everything needed to explain it."""

    n: int
    bs: int
    rows: list[InequalityRow]
    memory: dict[str, int]
    bound_tokens_per_s: float
    bound: Bound
    hot_k: int
    hot_coverage: float
    cold_experts: float
    binding_row: str             # the inequality that required the largest n ("" if n = 1 needs none)
    bubble_free: bool = True     # False only from solve(strict=False) when memory capped n
    split: Split | None = None   # where the layer's experts compute at this n (host compute: the cpu lane)
    notes: list[str] = field(default_factory=list)
    profile: Profile | None = field(default=None, repr=False)
    constraints: Constraints | None = field(default=None, repr=False)
    options: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def tokens_per_group(self) -> int:
        return self.n * self.bs


def _cold_experts(profile: Profile, n_tokens: float, hot_k: int, hot_coverage: float,
                  cold_experts: float | Callable[[float], float] | None) -> float:
    """Expected len(Q): distinct cold experts activated by a batch group of ``n_tokens`` tokens."""
    e_cold = profile.num_experts - hot_k
    if cold_experts is not None:
        q = float(cold_experts(n_tokens)) if callable(cold_experts) else float(cold_experts)
        if q < 0 or q > e_cold:
            raise KinjectError(f"cold_experts={q:g} must be in [0, E-K] = [0, {e_cold}]")
        return q
    m = (1.0 - hot_coverage) * n_tokens * profile.top_k      # cold token->expert assignments
    if e_cold <= 0 or m <= 0:
        return 0.0
    return e_cold * (1.0 - (1.0 - 1.0 / e_cold) ** m)


@dataclass
class Split:
    """Where one layer's experts compute (Fiddler's rule, :meth:`Profile.host_wins`, with the rows a
    hot and a cold expert expect): ``k_dev`` hot and ``q_dev`` cold experts moved to the device, the
    rest computed where they live: ``host_experts`` of them taking ``host_s`` seconds of host compute
    and ``activation_bytes`` over the link (rows in and out). Without a host cost every expert moves."""

    k_dev: float
    q_dev: float
    host_experts: float = 0.0
    host_s: float = 0.0
    activation_bytes: float = 0.0


def split_experts(profile: Profile, n_tokens: float, hot_k: int, hot_coverage: float, q: float) -> Split:
    """:class:`Split` of a batch group of ``n_tokens`` tokens (``q`` = len(Q) cold experts)."""
    k = profile.top_k
    hot_rows = hot_coverage * n_tokens * k / hot_k if hot_k else 0.0
    cold_rows = (1.0 - hot_coverage) * n_tokens * k / q if q > 0 else 0.0
    hot_host, cold_host = profile.host_wins(hot_rows), profile.host_wins(cold_rows)
    out = Split(k_dev=0.0 if hot_host else float(hot_k), q_dev=0.0 if cold_host else q)
    for host, count, rows in ((hot_host, hot_k, hot_rows), (cold_host, q, cold_rows)):
        if host and count:
            out.host_experts += count
            out.host_s += count * profile.t_host_expert(rows)
            out.activation_bytes += 2 * count * rows * profile.activation_bytes_per_row
    return out


def _check_inputs(profile: Profile, n: int, bs: int | None, hot_k: int | None,
                  hot_coverage: float | None) -> tuple[int, int, float]:
    if not isinstance(n, int) or n < 1:
        raise KinjectError(f"n must be a positive integer, got {n!r}")
    if bs is not None and bs != profile.bs:
        raise KinjectError(f"the profile was measured at micro-batch size bs={profile.bs}; cannot plan bs={bs} "
                           f"with it (re-profile at bs={bs})")
    k = profile.top_k if hot_k is None else hot_k
    if not isinstance(k, int) or not 0 <= k <= profile.num_experts:
        raise KinjectError(f"hot_k must be in [0, {profile.num_experts}], got {hot_k!r}")
    h = (k / profile.num_experts) if hot_coverage is None else float(hot_coverage)
    if not 0.0 <= h <= 1.0:
        raise KinjectError(f"hot_coverage must be in [0, 1], got {hot_coverage!r}")
    if k == 0 and h > 0:
        raise KinjectError(f"hot_coverage={h:g} with hot_k=0: no prefetched expert can cover tokens")
    return k, profile.bs, h


def inequality_rows(profile: Profile, n: int, bs: int | None = None, hot_coverage: float | None = None, *,
                    hot_k: int | None = None, cold_experts: float | Callable[[float], float] | None = None,
                    kv_in_eq7: bool = False) -> list[InequalityRow]:
    """Klotski eqs. (4)-(7) at ``n`` micro-batches, each with its two sides (seconds).

    See the module docstring for the symbol mapping. With ``a, b`` the :class:`ExpertCost`
    coefficients, ``N = n*bs*tokens_per_seq``, ``h = hot_coverage``::

        t_c_hotE      = K*t_E(h*N*k/K)            (= K*a + b*h*N*k)
        sum_Q t_cEi   = len(Q)*t_E((1-h)*N*k/len(Q))   (= len(Q)*a + b*(1-h)*N*k)
    """
    K, bs, h = _check_inputs(profile, n, bs, hot_k, hot_coverage)
    k = profile.top_k
    N = n * bs * profile.tokens_per_seq                         # tokens in the batch group
    q = _cold_experts(profile, N, K, h, cold_experts)           # len(Q)
    sp = split_experts(profile, N, K, h, q)                     # experts computed on the host need no transfer
    t_cA, t_cG = profile.t_attn, profile.t_gate
    t_G, t_E, t_A = profile.t_load_gate, profile.t_load_expert, profile.t_load_attn
    hot_tokens, cold_tokens = h * N * k, (1.0 - h) * N * k
    t_hot = sp.k_dev * profile.expert_time(hot_tokens / K) if K else 0.0
    t_cold = sp.q_dev * profile.expert_time(cold_tokens / q) if q > 0 else 0.0
    K, q = sp.k_dev, sp.q_dev                                   # the experts the link moves
    base = n * (t_cA + t_cG)

    def row(eq: int, name: str, lhs: float, rhs: float, formula: str, note: str = "") -> InequalityRow:
        holds = lhs >= rhs - _EPS * max(1.0, abs(rhs))
        return InequalityRow(name=name, lhs=lhs, rhs=rhs, holds=holds, formula=formula, eq=eq, n=n, note=note)

    rows = [
        row(4, "(4) gate ready", n * t_cA, t_G, "n*t_cA >= t_IO_G"),
        row(5, "(5) hot experts ready", base, t_G + K * t_E, "n*(t_cA+t_cG) >= t_IO_G + K*t_IO_E"),
    ]
    r6 = row(6, "(6) first cold expert ready", base + t_hot, t_G + (K + 1) * t_E,
             "n*(t_cA+t_cG) + t_c_hotE >= t_IO_G + (K+1)*t_IO_E")
    if q == 0:
        r6.holds, r6.note = True, ("vacuous: every cold expert computes on the host" if sp.host_experts
                                   else "vacuous: no cold expert is activated (len(Q) = 0)")
    rows.append(r6)
    rhs7 = t_G + (K + q) * t_E + t_A
    formula7 = "n*(t_cA+t_cG) + t_c_hotE + sum_Q t_cEi >= t_IO_G + (K+len(Q))*t_IO_E + t_IO_A"
    if kv_in_eq7:
        rhs7 += profile.t_load_kv
        formula7 += " + t_IO_KV"
    note7 = f"len(Q) = {q:.2f}" + (f" moved; {sp.host_experts:.2f} experts computed on the host "
                                   f"({format_seconds(sp.host_s)}, the roofline's cpu term)" if sp.host_experts else "")
    rows.append(row(7, "(7) next attention ready", base + t_hot + t_cold, rhs7, formula7, note=note7))
    return rows


def memory_usage(profile: Profile, constraints: Constraints, n: int, *, hot_k: int | None = None,
                 cold_experts_q: float = 0.0) -> dict[str, int]:
    """Peak device and host bytes of the pipeline with ``n`` micro-batches (kinject's memory model).

    device = resident_bytes
           + attn_bytes + gate_bytes                          (the layer in flight; the next one's attention
                                                               loads while its experts run, experts freed after use)
           + min(E, K + ceil(len(Q))) * expert_bytes          (one layer's hot + cold experts, worst case all landed)
           + KV: n*bs*kv_bytes_per_seq                        if kv_on_device
                 (2+S)*bs*kv_bytes_per_seq/num_layers         else (micro-batch k computing, k+1 loading, the S =
                                                               STORES_IN_FLIGHT before it storing)
           + n*bs*activation_bytes_per_seq                    (experts run on the whole batch group at once)
             or max(bs*activation_bytes_per_seq,             (pipeline.prefill: micro_batch: one micro-batch's
                    + n*bs*group_prefill_bytes_per_seq,         prefill at a time, the group's decode step; layer:
                    n*bs*group_bytes_per_seq)                  plus the group's hidden states at each layer)
    host   = host_resident_bytes
           + n*bs*kv_bytes_per_seq                            if KV is offloaded
           + n*bs*activation_bytes_per_seq                    (hidden states staged between layers, Algorithm 1)

    Weights count their device bytes while in use (``*_device_bytes``: a unit stored quantized, FP8
    or HQQ, holds its stored bytes and its dequantized weights), the link their stored bytes.
    """
    K = profile.top_k if hot_k is None else hot_k
    bs = profile.bs
    h = K / profile.num_experts if profile.num_experts else 0.0
    sp = split_experts(profile, n * bs * profile.tokens_per_seq, K, h, cold_experts_q)
    experts = min(profile.num_experts, math.ceil(sp.k_dev + sp.q_dev - 1e-9))
    weights = (profile.attn_device_bytes or profile.attn_bytes) + (profile.gate_device_bytes or profile.gate_bytes) \
        + experts * (profile.expert_device_bytes or profile.expert_bytes)
    c = constraints
    kv_dev = n * bs * c.kv_bytes_per_seq if c.kv_on_device else math.ceil((2 + STORES_IN_FLIGHT) * bs * c.kv_bytes_per_seq
                                                                            / profile.num_layers)
    act = max(bs * c.activation_bytes_per_seq + n * bs * c.group_prefill_bytes_per_seq,
              n * bs * c.group_bytes_per_seq) if c.prefill_by_micro_batch \
        else n * bs * c.activation_bytes_per_seq
    kv_host = 0 if c.kv_on_device else n * bs * c.kv_bytes_per_seq
    return {"device_peak": c.resident_bytes + weights + kv_dev + act,
            "device_resident": c.resident_bytes, "device_weights": weights, "device_kv": kv_dev,
            "device_activations": act, "host_peak": c.host_resident_bytes + kv_host + act,
            "host_weights": c.host_resident_bytes, "host_kv": kv_host, "host_activations": act}


# ====================================================================== roofline
def roofline_bound(*, tokens_per_step: float, bytes_per_step: float | None = None, bandwidth: float | None = None,
                   flops_per_step: float | None = None, peak_flops: float | None = None,
                   transfer_s: float | None = None, compute_s: float | None = None,
                   device_bytes_per_step: float = 0.0, device_bandwidth: float | None = None,
                   cpu_s: float = 0.0) -> Bound:
    """HRM-style upper bound on throughput (MoE-Lightning §3, eqs. 7, 12, 14)::

        transfer = bytes_per_step / bandwidth               (comm^{cpu_to_gpu}: bytes over b_cg)
        compute  = flops_per_step / peak_flops              (comp^g = flops/p_g)
        device   = device_bytes_per_step / device_bandwidth (comm^g = bytes/b_g, GPU memory roof)
        T        = max(transfer, compute, device, cpu_s)    (eq. 12 with T_gpu = max(comm^g, comp^g))
        tokens/s <= tokens_per_step / T

    ``transfer_s`` / ``compute_s`` may replace a bytes/bandwidth or flops/peak pair with a measured
    time. Aggregating a step's bytes and flops before taking the max gives T no larger than
    eq. 12's per-operator sum of maxes, so the result is still a valid (possibly looser) upper
    bound. Returns a :class:`Bound` (``float(bound)`` = tokens/s) naming the binding term.
    """
    def side(name: str, amount: float | None, rate: float | None, seconds: float | None) -> float:
        if seconds is not None:
            if amount is not None:
                raise KinjectError(f"roofline_bound: give either {name} seconds or amount/rate, not both")
            return float(seconds)
        if amount is None:
            return 0.0
        if not rate or rate <= 0:
            raise KinjectError(f"roofline_bound: {name} needs a positive rate (got {rate!r})")
        return float(amount) / float(rate)

    if tokens_per_step <= 0:
        raise KinjectError(f"roofline_bound: tokens_per_step must be > 0, got {tokens_per_step}")
    terms = {"transfer": side("transfer", bytes_per_step, bandwidth, transfer_s),
             "compute": side("compute", flops_per_step, peak_flops, compute_s),
             "device-memory": side("device-memory", device_bytes_per_step or None, device_bandwidth, None),
             "cpu": float(cpu_s)}
    if any(t < 0 for t in terms.values()):
        raise KinjectError(f"roofline_bound: negative time in {terms}")
    binding = max(terms, key=lambda key: terms[key])
    step = terms[binding]
    if step <= 0:
        raise KinjectError("roofline_bound: every term is zero; nothing bounds the throughput")
    return Bound(tokens_per_s=tokens_per_step / step, binding=binding, step_s=step, terms=terms)


def plan_bound(profile: Profile, n: int, *, hot_k: int | None = None, hot_coverage: float | None = None,
               cold_experts: float | Callable[[float], float] | None = None,
               kv_offloaded: bool = True) -> Bound:
    """Roofline bound of one step of the pipelined group (``n*bs`` sequences, one new token each).

    transfer per layer = attn + gate + (K + len(Q)) experts [+ n micro-batches' KV if offloaded]
    (bytes / ``bandwidth`` when known, else the measured ``t_load_*``); compute per layer =
    ``n*(t_cA+t_cG) + t_c_hotE + sum_Q t_cEi`` (measured), or ``flops_per_token*N / peak_flops`` when
    both are known (the physical roof); times ``num_layers``, plus the extras. With a measured host
    cost (``Profile.t_host_expert``) the experts Fiddler's rule keeps on the host (:func:`split_experts`)
    leave the link and the device: their rows' activations cross the link instead, and their host
    compute is the third resource (``cpu``), the bound the max over all three.
    """
    K, bs, h = _check_inputs(profile, n, None, hot_k, hot_coverage)
    N = n * bs * profile.tokens_per_seq
    q = _cold_experts(profile, N, K, h, cold_experts)
    L = profile.num_layers
    kv = n if kv_offloaded else 0
    sp = split_experts(profile, N, K, h, q)
    moved = sp.k_dev + sp.q_dev
    if profile.bandwidth:
        nbytes = L * (profile.attn_bytes + profile.gate_bytes + moved * profile.expert_bytes
                      + kv * profile.kv_bytes + sp.activation_bytes) + profile.extra_bytes_per_step
        transfer = {"bytes_per_step": nbytes, "bandwidth": profile.bandwidth}
    else:
        t = L * (profile.t_load_attn + profile.t_load_gate + moved * profile.t_load_expert
                 + kv * profile.t_load_kv)
        transfer = {"transfer_s": t}
    if profile.flops_per_token and profile.peak_flops and not sp.host_experts:
        compute = {"flops_per_step": profile.flops_per_token * N * L, "peak_flops": profile.peak_flops}
    else:
        rows = inequality_rows(profile, n, None, h, hot_k=K, cold_experts=q)
        compute = {"compute_s": L * rows[-1].lhs + profile.extra_compute_s}
    return roofline_bound(tokens_per_step=n * bs, **transfer, **compute, cpu_s=L * sp.host_s)


def experts_moved(profile: Profile, n: int, *, hot_k: int | None = None,
                  hot_probability: float | None = None) -> float:
    """Expected experts one layer moves per step under the prefetch policy, uniform routing: the K hot
    ones, every expert the group uses with probability >= ``hot_probability`` (each of the
    ``n*bs*tokens_per_seq`` tokens picks ``top_k`` of ``E``: P(used) = 1 - (1 - k/E)^N; at or above
    it every expert is prefetched, used or not), else the cold experts the tokens use."""
    K = profile.top_k if hot_k is None else hot_k
    E, N = profile.num_experts, n * profile.bs * profile.tokens_per_seq
    used = 1.0 - (1.0 - profile.top_k / E) ** N
    if hot_probability is not None and used >= hot_probability:
        return float(E)
    return K + (E - K) * used


def predict_step(profile: Profile, n: int, *, context: int, hot_k: int | None = None,
                 hot_coverage: float | None = None, hot_probability: float | None = None) -> dict[str, float]:
    """Seconds of one decode step of ``n`` micro-batches at ``context`` tokens per sequence, as the
    engine runs it, from the profile's measured terms. Each layer runs on two lanes side by side, and
    takes the longer of them (a term counts only on the lane where it is on the critical path):

    * link: attention, gate, the experts the prefetch policy moves (:func:`experts_moved`,
      ``hot_probability`` default ``meta["hot_probability"]``) and every micro-batch's KV at ``context``;
    * thread (the one that computes): inequality (7)'s left side with the layer's attention over the
      group measured as a line in ``n`` (``meta["attn_first_s"]`` + ``(n-1)*meta["attn_per_micro_batch_s"]``,
      else ``n*t_attn``) and one gate call for the whole group (kinject's gate routes the group at
      once: ``t_gate``, not ``n*t_gate``), then hot and cold experts;
      the layer's share of the untraced work inside the layers (Python between operators and
      micro-batches, KV bookkeeping: it runs while transfers are in flight); and the wait for the
      layer's weights, ``max(0, weights + one micro-batch's KV - overlap)`` with ``overlap =
      meta["link_overlap_s"]`` (the thread's work beside a layer's weights in the calibration runs): the
      weights go over the link in one burst and the next micro-batch's KV queues behind them, so even a
      compute-bound layer waits that long.

    The step is the layers plus the untraced work at its boundary (embeddings, lm_head, ``generate``'s
    loop: ``meta["untraced_boundary_s"]`` at one micro-batch, ``..._per_micro_batch_s`` per further
    one), which waits for the last layer. The untraced work in all is ``extra_compute_s`` at one
    micro-batch and ``meta["untraced_per_micro_batch_s"]`` per further one; a profile without the
    boundary terms (hand-made) counts all of it at the boundary, one without ``link_overlap_s`` no wait.
    Returns ``step_s`` = ``compute_s + stall_s + extra_s`` (``stall_s``: the thread's wait for the link)
    and the parts (seconds per step)."""
    rows = inequality_rows(profile, n, hot_coverage=hot_coverage, hot_k=hot_k)
    meta, layers = profile.meta, profile.num_layers
    attention = n * profile.t_attn
    if "attn_first_s" in meta:
        attention = meta["attn_first_s"] + (n - 1) * meta.get("attn_per_micro_batch_s", profile.t_attn)
    compute = rows[-1].lhs - n * (profile.t_attn + profile.t_gate) + attention + profile.t_gate
    if hot_probability is None:
        hot_probability = profile.meta.get("hot_probability")
    moved = experts_moved(profile, n, hot_k=hot_k, hot_probability=hot_probability)
    per_token = profile.meta.get("kv_bytes_per_token_layer", 0.0)
    kv_one = profile.bs * context * per_token / profile.bandwidth if profile.bandwidth else (profile.t_load_kv or 0.0)
    weights = profile.t_load_attn + profile.t_load_gate + moved * profile.t_load_expert
    transfer = weights + n * kv_one
    overlap = profile.meta.get("link_overlap_s")
    stall = 0.0 if overlap is None else max(weights + kv_one - overlap, 0.0)
    extra = profile.extra_compute_s + (n - 1) * meta.get("untraced_per_micro_batch_s", 0.0)
    if "untraced_boundary_s" in meta:
        edge = meta["untraced_boundary_s"] + (n - 1) * meta.get("untraced_boundary_per_micro_batch_s", 0.0)
        edge = min(max(edge, 0.0), extra)
    else:
        edge = extra
    inside = (extra - edge) / layers
    layer = max(compute + inside + stall, transfer)
    return {"step_s": layers * layer + edge, "compute_s": layers * compute,
            "stall_s": layers * (layer - compute - inside), "transfer_s": layers * transfer,
            "kv_s": layers * n * kv_one, "experts_moved": moved, "extra_s": extra, "boundary_s": edge}


AUTO_TOLERANCE = 0.02    # throughput_n's default: a predicted gain :func:`predict_step` can tell from noise.
# Its measured / predicted ratio moves by 1-2 % between neighbouring n where the choice is made (n = 8..16
# in `kinject bench plan`), though it lies anywhere in 0.86-1.10 over n = 1..16: an n predicted within 2 %
# of the best is one the model cannot rank below it. A wider tolerance spends the
# "auto within 10 % of the best" budget on the pick itself: the old 5 % chose n = 14 predicted 4 % below
# n = 16, which measured 11 % below it.


def throughput_n(profile: Profile, constraints: Constraints | None = None, *, n_max: int, context: int,
                 tolerance: float = AUTO_TOLERANCE, hot_k: int | None = None, hot_coverage: float | None = None) -> int:
    """The ``n`` that ``pipeline.n_batches: auto`` runs: the smallest ``n`` (1..``n_max``) whose predicted
    tokens/s (``n*bs`` over :func:`predict_step`'s step) is within ``tolerance`` (:data:`AUTO_TOLERANCE`:
    what the model resolves) of the best predicted one among the ``n`` whose memory fits. A step's fixed costs (every
    expert's weights, the untraced
    work) keep shrinking per sequence as the group grows, long after Klotski's inequalities hold
    (:func:`solve`'s smallest bubble-free ``n``); past the knee a larger group only adds latency.
    Raises :class:`PlanError` when no ``n`` fits the memory."""
    if not isinstance(n_max, int) or n_max < 1:
        raise KinjectError(f"n_max must be a positive integer, got {n_max!r}")
    if not 0.0 <= tolerance < 1.0:
        raise KinjectError(f"tolerance must be in [0, 1), got {tolerance!r}")
    constraints = constraints or Constraints()
    K = profile.top_k if hot_k is None else hot_k
    h = (K / profile.num_experts) if hot_coverage is None else hot_coverage
    rates = {}
    for n in range(1, n_max + 1):
        q = _cold_experts(profile, n * profile.bs * profile.tokens_per_seq, K, h, None)
        m = memory_usage(profile, constraints, n, hot_k=K, cold_experts_q=q)
        if constraints.device_budget is not None and m["device_peak"] > constraints.device_budget:
            continue
        if constraints.host_budget is not None and m["host_peak"] > constraints.host_budget:
            continue
        step = predict_step(profile, n, context=context, hot_k=K, hot_coverage=h)["step_s"]
        rates[n] = n * profile.bs / step if step > 0 else math.inf
    if not rates:
        raise PlanError(f"no n <= {n_max} fits the memory budgets (device {format_bytes(constraints.device_budget or 0)}, "
                        f"bs={profile.bs}); lower bs or raise the budget")
    best = max(rates.values())
    return min(n for n, r in rates.items() if r >= (1.0 - tolerance) * best)


# ====================================================================== solver
def _row_n_min(profile: Profile, eq: int, n_max: int, opts: dict[str, Any]) -> int | None:
    for n in range(1, n_max + 1):
        if inequality_rows(profile, n, **opts)[eq - 4].holds:
            return n
    return None


def _extrapolate(row_lo: InequalityRow, row_hi: InequalityRow) -> str:
    """'would need n >= x' from the slack's slope between two n (linear in n for fixed len(Q))."""
    dn = row_hi.n - row_lo.n
    slope = (row_hi.slack - row_lo.slack) / dn if dn else 0.0
    if slope <= 0:
        return "no n makes it hold (its left side does not grow with n)"
    x = row_hi.n - row_hi.slack / slope
    return f"would need n >= {x:.1f}"


def solve(profile: Profile, constraints: Constraints | None = None, *, bs: int | None = None,
          hot_coverage: float | None = None, hot_k: int | None = None,
          cold_experts: float | Callable[[float], float] | None = None, n_max: int = 64,
          kv_in_eq7: bool = False, strict: bool = True) -> Plan:
    """Smallest ``n`` (1..``n_max``) for which all four Klotski inequalities hold and memory fits.

    Raises :class:`PlanError` naming the failing constraint and the shortfall (with units) when no
    ``n <= n_max`` satisfies the inequalities, or when the smallest such ``n`` exceeds the device or
    host budget (memory grows with ``n``, so no larger ``n`` can fit either). With
    ``strict=False`` the memory case instead returns the largest ``n`` that fits, with
    ``bubble_free=False`` and the failing rows marked.
    """
    constraints = constraints or Constraints()
    K, bs, h = _check_inputs(profile, 1, bs, hot_k, hot_coverage)
    if not isinstance(n_max, int) or n_max < 1:
        raise KinjectError(f"n_max must be a positive integer, got {n_max!r}")
    opts = {"bs": bs, "hot_coverage": h, "hot_k": K, "cold_experts": cold_experts, "kv_in_eq7": kv_in_eq7}

    def mem(n: int) -> dict[str, int]:
        q = _cold_experts(profile, n * bs * profile.tokens_per_seq, K, h, cold_experts)
        return memory_usage(profile, constraints, n, hot_k=K, cold_experts_q=q)

    def mem_fail(m: dict[str, int]) -> list[tuple[str, int, int]]:
        out = []
        if constraints.device_budget is not None and m["device_peak"] > constraints.device_budget:
            out.append(("device memory", m["device_peak"], constraints.device_budget))
        if constraints.host_budget is not None and m["host_peak"] > constraints.host_budget:
            out.append(("host memory", m["host_peak"], constraints.host_budget))
        return out

    n_time = next((n for n in range(1, n_max + 1) if all(r.holds for r in inequality_rows(profile, n, **opts))),
                  None)
    if n_time is None:
        lo = inequality_rows(profile, max(1, n_max - 1), **opts)
        hi = inequality_rows(profile, n_max, **opts)
        failing = sorted((r for r in hi if not r.holds), key=lambda r: r.slack)
        parts = [f"{r.name} [{r.formula}]: at n={n_max} compute side {format_seconds(r.lhs)} < transfer side "
                 f"{format_seconds(r.rhs)}, short by {format_seconds(-r.slack)}; {_extrapolate(lo[r.eq - 4], r)}"
                 for r in failing]
        raise PlanError(f"no n <= n_max={n_max} overlaps transfers with compute (bs={bs}, K={K}, "
                        f"hot_coverage={h:.2f}): " + "; ".join(parts)
                        + ". Transfers are too slow for this micro-batch size: raise n_max or bs, quantize, "
                        "or keep more weights on the device.")

    n, notes, bubble_free = n_time, [], True
    m = mem(n)
    fails = mem_fail(m)
    if fails:
        fits = [x for x in range(n_time - 1, 0, -1) if not mem_fail(mem(x))]
        detail = "; ".join(f"{what}: needs {format_bytes(need)} at n={n_time}, budget {format_bytes(have)}, "
                           f"short by {format_bytes(need - have)}" for what, need, have in fails)
        binding = max((_row_n_min(profile, r.eq, n_time, opts) or n_time, r.name)
                      for r in inequality_rows(profile, n_time, **opts))[1]
        if strict or not fits:
            m1 = mem(1)
            extra = ("" if fits else " (even n=1 needs " + ", ".join(
                f"{what.split()[0]} {format_bytes(m1[what.split()[0] + '_peak'])}" for what, _, _ in fails) + ")")
            fallback = (f" n={fits[0]} fits but leaves pipeline bubbles (solve(..., strict=False))." if fits
                        else "")
            raise PlanError(f"the smallest bubble-free n is {n_time} (set by {binding}), but it does not fit: "
                            f"{detail}{extra}. Memory grows with n, so no larger n fits.{fallback} To fix: lower "
                            f"bs, quantize, offload the KV cache, or raise the budget.")
        n, bubble_free = fits[0], False
        m = mem(n)
        notes.append(f"memory caps n at {n} < {n_time} needed for a bubble-free pipeline ({detail})")

    rows = inequality_rows(profile, n, **opts)
    need = [(_row_n_min(profile, r.eq, n_time, opts) or n_time, r.name) for r in rows]
    binding_row = max(need)[1] if n_time > 1 else ""
    q = _cold_experts(profile, n * bs * profile.tokens_per_seq, K, h, cold_experts)
    bound = plan_bound(profile, n, hot_k=K, hot_coverage=h, cold_experts=cold_experts,
                       kv_offloaded=not constraints.kv_on_device)
    return Plan(n=n, bs=bs, rows=rows, memory=m, bound_tokens_per_s=bound.tokens_per_s, bound=bound, hot_k=K,
                hot_coverage=h, cold_experts=q, binding_row=binding_row, bubble_free=bubble_free, notes=notes,
                split=split_experts(profile, n * bs * profile.tokens_per_seq, K, h, q),
                profile=profile, constraints=constraints, options=opts)


def best_n(profile: Profile, constraints: Constraints, *, n_max: int, hot_k: int | None = None,
           hot_coverage: float | None = None) -> tuple[int, Bound]:
    """The ``n`` (1..``n_max``) of the highest roofline bound (:func:`plan_bound`) whose memory fits
    ``constraints`` (the smallest of equal bounds), and that bound: the throughput-best batch group
    under a budget, where :func:`solve` gives the smallest bubble-free one. They differ where a step's
    fixed costs (each expert's weights and its per-call compute, paid once per step whatever the group)
    keep shrinking per sequence as the group grows. The KV on the link is sized for
    ``constraints.target_len`` (``kv_bytes_per_seq``, all layers), not the profiled context.
    Raises :class:`PlanError` when no ``n`` fits, with the numbers."""
    K = profile.top_k if hot_k is None else hot_k
    h = (K / profile.num_experts) if hot_coverage is None else hot_coverage
    if constraints.kv_bytes_per_seq and profile.bandwidth:
        kv = math.ceil(constraints.kv_bytes_per_seq * profile.bs / profile.num_layers)
        profile = dataclasses.replace(profile, kv_bytes=kv, t_load_kv=None, t_store_kv=None)
    best, fits = None, []
    for n in range(1, n_max + 1):
        q = _cold_experts(profile, n * profile.bs * profile.tokens_per_seq, K, h, None)
        m = memory_usage(profile, constraints, n, hot_k=K, cold_experts_q=q)
        if constraints.device_budget is not None and m["device_peak"] > constraints.device_budget:
            continue
        fits.append(n)
        bound = plan_bound(profile, n, hot_k=K, hot_coverage=h, kv_offloaded=not constraints.kv_on_device)
        if best is None or bound.tokens_per_s > best[1].tokens_per_s * (1 + 1e-9):
            best = (n, bound)
    if best is None:
        m1 = memory_usage(profile, constraints, 1, hot_k=K, cold_experts_q=profile.num_experts)
        raise PlanError(f"no n fits the device budget {format_bytes(constraints.device_budget)}: n=1 needs "
                        f"{format_bytes(m1['device_peak'])} (bs={profile.bs}); lower bs or raise the budget")
    return best


# ====================================================================== table
def format_table(plan: Plan, neighbours: Iterable[int] = (-1, 0, 1)) -> str:
    """Plain-text table of the four inequalities at ``n + d`` for ``d`` in ``neighbours`` (both sides,
    ✓/✗), then memory and the roofline bound."""
    ns = sorted({plan.n + d for d in neighbours if plan.n + d >= 1})
    cols = {n: (plan.rows if n == plan.n or plan.profile is None
                else inequality_rows(plan.profile, n, **plan.options)) for n in ns}
    cells = {n: [f"{format_seconds(r.lhs)} >= {format_seconds(r.rhs)} {'✓' if r.holds else '✗'}" for r in cols[n]] for n in ns}
    heads = [f"n={n}" + (" (chosen)" if n == plan.n else "") for n in ns]
    name_w = max(len(r.name) for r in plan.rows)
    form_w = max(len(r.formula) for r in plan.rows)
    col_w = [max(len(h), *(len(c) for c in cells[n])) for h, n in zip(heads, ns)]
    lines = [f"Klotski planner: n = {plan.n} micro-batches of bs = {plan.bs} "
             f"(K = {plan.hot_k} hot experts, hot coverage {plan.hot_coverage:.2f}, "
             f"len(Q) = {plan.cold_experts:.2f} cold experts)"
             + (f", bound by {plan.binding_row}" if plan.binding_row else ""),
             "  ".join(["inequality".ljust(name_w), "formula".ljust(form_w)]
                       + [h.ljust(w) for h, w in zip(heads, col_w)])]
    for i, r in enumerate(plan.rows):
        lines.append("  ".join([r.name.ljust(name_w), r.formula.ljust(form_w)]
                               + [cells[n][i].ljust(w) for n, w in zip(ns, col_w)]).rstrip())
    for r in plan.rows:
        if r.note:
            lines.append(f"  note {r.name}: {r.note}")
    m, c = plan.memory, plan.constraints or Constraints()
    budget = lambda b: "unlimited" if b is None else format_bytes(b)  # noqa: E731
    lines.append(f"device memory: {format_bytes(m['device_peak'])} peak (budget {budget(c.device_budget)}) = "
                 f"resident {format_bytes(m['device_resident'])} + weights {format_bytes(m['device_weights'])} + "
                 f"KV {format_bytes(m['device_kv'])} + activations {format_bytes(m['device_activations'])}")
    lines.append(f"host memory: {format_bytes(m['host_peak'])} peak (budget {budget(c.host_budget)})")
    b = plan.bound
    lines.append(f"roofline bound: {b.tokens_per_s:.1f} tokens/s ({b.binding}-bound; per step "
                 + ", ".join(f"{k} {format_seconds(v)}" for k, v in b.terms.items() if v) + ")")
    sp = plan.split
    if sp is not None and sp.host_experts:
        saved = sp.host_experts * (plan.profile.expert_bytes if plan.profile else 0)
        lines.append(f"host compute: {sp.host_experts:.2f} experts per layer computed where they live "
                     f"({format_seconds(sp.host_s)} per layer), {sp.k_dev + sp.q_dev:.2f} moved; saves "
                     f"{format_bytes(saved)} of expert moves per layer for {format_bytes(sp.activation_bytes)} of activations")
    lines.extend(f"warning: {note}" for note in plan.notes)
    return "\n".join(lines)
