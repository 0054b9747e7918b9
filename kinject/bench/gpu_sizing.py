"""How many sequences each contender of ``kinject bench gpu`` runs per ``generate`` call, and
kinject's prefill micro-batch, so that its weights, KV cache and activations *together* stay
within the one device budget every contender gets (docs/architecture.md, "Benchmarks and bounds").

Why: a contender's weights are bounded by its own placement (accelerate's ``max_memory``,
kinject's store budget), but what a forward allocates beside them grows with the batch. The first
H100 run (transformers 5.17) put the whole group of 128 sequences through transformers' Mixtral
layer in one ``generate`` and ran out of memory asking for 28 GiB. That is not the prefill: on a
non-CPU device ``generate`` switches the experts from ``grouped_mm`` to ``batched_mm`` for its
decode steps (transformers ``generation/utils.py``, ``_optimize_model_for_decode``), and
``batched_mm_experts_forward`` (``integrations/moe.py``) gathers a copy of the weights of every
routed (token, expert) pair: ``gate_up_proj[expert_ids]``, [256 pairs, 28672, 4096] bf16 = 56 GiB,
then ``down_proj[expert_ids]``, [256, 4096, 14336] = the 28 GiB asked for. Per decoding sequence
that is top-k x one expert's bytes (672 MiB for Mixtral-8x7B), more than its prefill's
activations. So a comparison "at equal memory" has to size every contender's batch first, and say
before running when one cannot fit at all.

How, per contender (:class:`Fit`: rows per call, the weights' share, KV, activations):

* accelerate (``acc``): the largest batch whose KV and activations leave room for what
  ``infer_auto_device_map`` keeps on the device plus the largest module its hooks load at once
  (:func:`kinject.bench.contenders.acc_budget_peak`); its ``max_memory`` for the device is that room,
  its host share every weight. The batch group runs as several ``generate`` calls.
* whole-layer rungs (``simple``, ``multibatch``): the store holds the resident tensors and the layer
  in flight; the largest batch (at most ``bs`` for the simple pipeline, the group for multi-batch)
  whose KV (transformers' cache, on the device) and activations fit beside them. The store budget
  is the budget less those.
* Klotski rungs (``hot``, ``klotski``, ``hqq``): the group per call, ``pipeline.prefill: layer``
  (each layer runs one micro-batch at a time, the group's hidden states beside it), the largest
  micro-batch (a divisor of ``bs``) and then the largest ``pipeline.prefill_chunk`` whose peak in the
  planner's memory model (:func:`kinject.plan.planner.memory_usage`, every expert of a layer
  landed) fits the budget; a decode step's attention takes as many micro-batches' KV at once as
  fit what the prefill's activations leave free then (``pipeline.decode_chunk: auto`` within
  ``pipeline.kv_budget``), as ``kinject demo`` does.

Activations are an estimate from the shape (:func:`layer_activation_bytes`, :func:`hf_activation_bytes`):
transformers' layers with their prefill (``grouped_mm``: its output and a masked copy per routed
pair) and, where ``generate`` switches to it, ``batched_mm``'s weight gathers per decoding
sequence; kinject's ``GroupedExperts`` a row per routed pair. On CUDA the bench then measures a
contender's peak at one sequence and at its estimated batch and refits the batch on those two
points (:func:`rows_from_probes`), so the estimate only has to be a starting point.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

FP32 = 4
WHOLE_LAYER = ("simple", "multibatch")
KLOTSKI = ("hot", "klotski", "hqq")


@dataclass
class Fit:
    """One contender's share of the device budget (bytes) and the batch that keeps it inside."""

    key: str
    rows: int                          # sequences per generate call; 0: nothing fits
    sequences: int                     # the batch group it runs (calls = ceil(sequences / rows))
    budget: int                        # the device budget, the same for every contender
    weights: int                       # weight bytes on the device at the peak (its placement's)
    kv: int                            # KV bytes on the device at the peak
    activations: int                   # activation bytes at the peak (estimated, or measured: ``how``)
    host: int = 0                      # host bytes of its weights
    micro_batch: int | None = None     # kinject's micro-batch (Klotski rungs: the prefill's unit)
    prefill_chunk: int = 1             # micro-batches one layer call takes in the prefill (Klotski rungs)
    store_budget: int | None = None    # pipeline.device_budget: what the weights may hold
    kv_room: int | None = None         # pipeline.kv_budget (Klotski rungs): a decode step's KV chunks, in what
                                       # the prefill's activations free (pipeline.decode_chunk: auto)
    max_memory: dict | None = None     # accelerate's
    how: str = "estimated"
    why: str = ""                      # rows == 0: why nothing fits

    @property
    def calls(self) -> int:
        return math.ceil(self.sequences / self.rows) if self.rows else 0

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.activations

    @property
    def fits(self) -> bool:
        return self.rows > 0


def kv_bytes(shape, sequences: int, tokens: int) -> int:
    """Keys and values of ``sequences`` sequences of ``tokens`` tokens over every layer."""
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * shape.itemsize * sequences * tokens


def layer_activation_bytes(shape, sequences: int, tokens: int, *, expert_rows: int, eager: bool = False,
                           attention_sequences: int | None = None, gate_up_copies: int = 1) -> int:
    """Peak transient bytes of one decoder-layer call over ``sequences`` x ``tokens`` tokens, and the
    last-token logits ``generate`` keeps.

    The layer's input, its normed copy and output (and the RMS norm's float32 copies), plus the larger
    of attention (q, k, v, its output and o_proj's, per ``attention_sequences`` at once; eager
    attention also its float32 scores and probabilities) and the experts: the router's float32
    logits, then per row -- ``expert_rows`` rows per token -- the gathered input, ``gate_up_copies``
    gate_up outputs, the activation and the product, the down projection, and the float32
    routing-weighted output."""
    e, h, hd = shape.itemsize, shape.hidden, shape.head_dim
    t = sequences * tokens
    a_seq = sequences if attention_sequences is None else attention_sequences
    a = a_seq * tokens
    hidden = 3 * t * h * e + 2 * t * h * FP32
    attention = a * (2 * shape.heads * hd + 2 * shape.kv_heads * hd + h) * e
    if eager:
        attention += 2 * a_seq * shape.heads * tokens * tokens * FP32
    rows = t * expert_rows
    inter = shape.intermediate
    moe = t * shape.experts * FP32 + rows * ((2 * h + 2 * inter * gate_up_copies + 2 * inter) * e + h * FP32)
    return hidden + max(attention, moe) + sequences * shape.vocab * FP32


def batched_decode_bytes(shape, sequences: int) -> int:
    """A decode step of transformers' ``batched_mm`` experts: per routed (token, expert) pair a gathered
    copy of that expert's gate_up and down weights (both alive when the second is made), beside the
    step's own activations."""
    pairs = sequences * shape.top_k
    return pairs * shape.layer_params()["expert"] * shape.itemsize + layer_activation_bytes(
        shape, sequences, 1, expert_rows=shape.top_k)


def hf_activation_bytes(shape, sequences: int, tokens: int, eager: bool = False, batched_decode: bool = False) -> int:
    """transformers' own layer (accelerate, the whole-layer rungs): the prefill (``grouped_mm``: a row per
    routed pair, its gate_up output and the masked copy of it both alive) or, where ``generate``
    decodes with ``batched_mm`` (a CUDA device, transformers' default experts), a decode step's weight
    gathers, whichever is larger."""
    prefill = layer_activation_bytes(shape, sequences, tokens, expert_rows=shape.top_k, eager=eager, gate_up_copies=2)
    return max(prefill, batched_decode_bytes(shape, sequences)) if batched_decode else prefill


def _largest(lo: int, hi: int, ok) -> int:
    """The largest r in [lo, hi] with ok(r) (ok monotone: true up to some r), or lo - 1."""
    if hi < lo or not ok(lo):
        return lo - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def size_accelerate(shape, skeleton, budget: int, sequences: int, prompt_len: int, new_tokens: int, *,
                    device_key, eager: bool = False, batched_decode: bool = False) -> Fit:
    """The largest batch accelerate's ``device_map`` offload runs within ``budget``: its KV and
    activations on the device, its weights in the room they leave (``skeleton``: the model on the
    meta device, placed by accelerate's own ``infer_auto_device_map``). ``max_memory`` =
    ``{device_key: room, "cpu": every weight's bytes + its largest no-split module}`` (the room
    accelerate keeps free on the host, so that nothing goes to disk)."""
    from kinject.bench.contenders import acc_budget_peak

    def need(r: int) -> tuple[int, int]:
        return (kv_bytes(shape, r, prompt_len + new_tokens),
                hf_activation_bytes(shape, r, prompt_len, eager, batched_decode))

    def ok(r: int) -> bool:
        kv, act = need(r)
        room = budget - kv - act
        return room > 0 and acc_budget_peak(skeleton, room) <= room

    host = shape.model_bytes()
    # infer_auto_device_map keeps room for its largest no-split module free on every device but the
    # last (disk): a "cpu" of exactly every weight's bytes sends the last modules (lm_head) to disk,
    # which needs an offload_dir and is not the placement compared here
    host_ceiling = host + largest_no_split_bytes(skeleton)
    rows = _largest(1, sequences, ok)
    if rows < 1:
        kv, act = need(1)
        return Fit("acc", 0, sequences, budget, 0, kv, act, host=host,
                   why=f"one sequence's KV and activations ({_gib(kv + act)}) leave no room for what accelerate "
                       f"keeps and loads at once")
    kv, act = need(rows)
    room = budget - kv - act
    return Fit("acc", rows, sequences, budget, acc_budget_peak(skeleton, room), kv, act, host=host,
               store_budget=room, max_memory={device_key: room, "cpu": host_ceiling})


def largest_no_split_bytes(model) -> int:
    """Weight bytes of the largest piece accelerate places whole: a module of its ``_no_split_modules``
    classes (a decoder layer) or a leaf module (``lm_head``), as its ``get_max_layer_size`` counts them."""
    classes = set(getattr(model, "_no_split_modules", None) or [])
    sizes = [sum(p.numel() * p.element_size() for p in m.parameters())
             for m in model.modules() if type(m).__name__ in classes or next(m.children(), None) is None]
    return max(sizes, default=0)


def size_whole_layer(key: str, shape, budget: int, sequences: int, cap: int, prompt_len: int, new_tokens: int, *,
                     eager: bool = False, batched_decode: bool = False) -> Fit:
    """A rung whose units are whole decoder layers (transformers' layer runs inside): the store holds
    the resident tensors and one layer (its floor), transformers' KV cache stays on the device; the
    largest batch <= ``cap`` whose KV and activations fit beside that floor."""
    floor = shape.resident_bytes() + shape.layer_bytes() * 65 // 64
    host = shape.layers * shape.layer_bytes()

    def need(r: int) -> tuple[int, int]:
        return (kv_bytes(shape, r, prompt_len + new_tokens),
                hf_activation_bytes(shape, r, prompt_len, eager, batched_decode))

    rows = _largest(1, min(cap, sequences), lambda r: floor + sum(need(r)) <= budget)
    if rows < 1:
        kv, act = need(1)
        return Fit(key, 0, sequences, budget, floor, kv, act, host=host,
                   why=f"the resident tensors and one layer ({_gib(floor)}) and one sequence's KV and activations "
                       f"({_gib(kv + act)}) exceed the budget")
    kv, act = need(rows)
    return Fit(key, rows, sequences, budget, floor, kv, act, host=host, store_budget=budget - kv - act)


def klotski_memory(shape, budget: int, sequences: int, micro_batch: int, chunk: int, prompt_len: int,
                   new_tokens: int, eager: bool = False) -> dict[str, int]:
    """The planner's memory model (:func:`kinject.plan.planner.memory_usage`, every expert of a layer
    landed) for a Klotski rung with KV in the host tier and ``pipeline.prefill: layer``: one layer
    call runs ``chunk`` micro-batches of ``micro_batch`` (attention one micro-batch at a time, the
    experts a row per routed pair) beside the group's hidden states in and out of that layer."""
    from kinject.plan.planner import Constraints, memory_usage
    from kinject.plan.profile import Profile

    p, e = shape.layer_params(), shape.itemsize
    profile = Profile(bs=micro_batch, t_attn=0.0, t_gate=0.0, t_expert=(0.0, 0.0), num_experts=shape.experts,
                      top_k=shape.top_k, num_layers=shape.layers, tokens_per_seq=prompt_len,
                      attn_bytes=(p["attention"] + p["norms"]) * e, gate_bytes=p["gate"] * e,
                      expert_bytes=p["expert"] * e, bandwidth=1.0)
    prefill = layer_activation_bytes(shape, chunk * micro_batch, prompt_len, expert_rows=shape.top_k, eager=eager,
                                     attention_sequences=micro_batch)
    decode = layer_activation_bytes(shape, micro_batch, 1, expert_rows=shape.top_k)
    target = prompt_len + new_tokens
    constraints = Constraints(device_budget=budget, resident_bytes=shape.resident_bytes(),
                              kv_bytes_per_seq=kv_bytes(shape, 1, target), target_len=target,
                              activation_bytes_per_seq=math.ceil(prefill / micro_batch), kv_on_device=False,
                              prefill_by_micro_batch=True, group_bytes_per_seq=math.ceil(decode / micro_batch),
                              group_prefill_bytes_per_seq=2 * prompt_len * shape.hidden * e)
    n = max(1, sequences // micro_batch)
    return memory_usage(profile, constraints, n, cold_experts_q=shape.experts - shape.top_k)


def size_klotski(key: str, shape, budget: int, sequences: int, bs: int, prompt_len: int, new_tokens: int, *,
                 eager: bool = False) -> Fit:
    """A Klotski rung: the group per call; the largest micro-batch (a divisor of ``bs``, so it divides
    the group) and then the largest prefill chunk whose peak in the planner's memory model fits."""
    host = shape.layers * shape.layer_bytes()
    for mb in (d for d in range(bs, 0, -1) if bs % d == 0):
        n = max(1, sequences // mb)
        chunk = _largest(1, n, lambda c: klotski_memory(shape, budget, sequences, mb, c, prompt_len, new_tokens,
                                                        eager)["device_peak"] <= budget)
        if chunk >= 1:
            m = klotski_memory(shape, budget, sequences, mb, chunk, prompt_len, new_tokens, eager)
            decode = n * mb * math.ceil(layer_activation_bytes(shape, mb, 1, expert_rows=shape.top_k) / mb)
            return Fit(key, sequences, sequences, budget, m["device_resident"] + m["device_weights"], m["device_kv"],
                       m["device_activations"], host=host, micro_batch=mb, prefill_chunk=chunk,
                       store_budget=budget - m["device_kv"] - m["device_activations"],
                       kv_room=m["device_kv"] + m["device_activations"] - decode)
    m = klotski_memory(shape, budget, sequences, 1, 1, prompt_len, new_tokens, eager)
    return Fit(key, 0, sequences, budget, m["device_resident"] + m["device_weights"], m["device_kv"],
               m["device_activations"], host=host, micro_batch=1,
               why=f"at micro-batch 1 the planner's memory model needs {_gib(m['device_peak'])} (resident, one layer "
                   f"with every expert landed, KV working buffers, the group's hidden states)")


GROWTH = 8      # a refit batch is at most this many times the larger probe: a line is no licence to jump far


def rows_from_probes(budget: int, one: int, at: int, rows_at: int, cap: int) -> int:
    """The largest batch (<= ``cap``, <= GROWTH x ``rows_at``) whose peak stays within ``budget``, on a
    line through two measured peaks: ``one`` at one sequence, ``at`` at ``rows_at`` sequences
    (``rows_at`` > 1). 0: not even one. A line that does not rise (``at <= one``: the allocator's
    noise, not a free sequence) says nothing beyond ``rows_at``, which was measured."""
    if one > budget:
        return 0
    if at <= one:
        return min(cap, rows_at) if at <= budget else 1
    per_row = (at - one) / (rows_at - 1)
    return max(1, min(cap, GROWTH * rows_at, 1 + int((budget - one) // per_row)))


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f} GiB" if abs(b) >= 2**30 else f"{b / 2**20:.1f} MiB"
