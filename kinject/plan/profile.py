"""What the planner plans from: a :class:`Profile` of measured times and sizes (Klotski §7 stage 1).

The profiler (:mod:`kinject.plan.profiler`) measures one; the planner (:mod:`kinject.plan.planner`)
solves Klotski's inequalities over one. Neither imports the other: both import this module.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kinject.errors import KinjectError

_EPS = 1e-12    # relative tolerance on lhs >= rhs (float noise only)


# ====================================================================== formatting helpers
# ====================================================================== profile
@dataclass
class ExpertCost:
    """Compute time of one expert as a function of its token count: ``t(tokens) = fixed_s + per_token_s*tokens``
    (``t(0) = 0``: an expert with no token is not run)."""

    fixed_s: float
    per_token_s: float

    def __call__(self, tokens: float) -> float:
        return 0.0 if tokens <= 0 else self.fixed_s + self.per_token_s * tokens

    @classmethod
    def fit(cls, tokens: Sequence[float], seconds: Sequence[float]) -> ExpertCost:
        """Least-squares line through measured (tokens, seconds) points (clamped to non-negative)."""
        if len(tokens) != len(seconds) or not tokens:
            raise KinjectError("ExpertCost.fit: need as many token counts as timings, at least one")
        if len(tokens) == 1:
            return cls(0.0, seconds[0] / tokens[0] if tokens[0] else 0.0)
        mx, my = sum(tokens) / len(tokens), sum(seconds) / len(seconds)
        var = sum((x - mx) ** 2 for x in tokens)
        b = sum((x - mx) * (y - my) for x, y in zip(tokens, seconds)) / var if var else 0.0
        b = max(b, 0.0)
        return cls(max(my - b * mx, 0.0), b)


@dataclass
class Profile:
    """Measured costs of one decoder layer at micro-batch size ``bs``; seconds and bytes.

    Filled by :func:`kinject.plan.profiler.measure_profile` or by hand for what-if planning.
    Transfer times left as None are derived from the byte sizes and ``bandwidth`` (host->device,
    bytes/s). All ``t_*`` are for ONE layer.
    """

    bs: int                              # micro-batch size (sequences) the compute times were measured at
    t_attn: float                        # t_cA: attention compute, one micro-batch
    t_gate: float                        # t_cG: gate (router) compute, one micro-batch (NOT the whole group)
    t_expert: ExpertCost | Callable[[float], float] | tuple[float, float]   # t_cEi(tokens)
    num_experts: int                     # E
    top_k: int                           # k of the top-k router
    num_layers: int                      # decoder layers the plan streams (each treated as an offloaded MoE layer)
    tokens_per_seq: int = 1              # tokens per sequence in the profiled step: 1 = decode, prompt length = prefill
    attn_bytes: int = 0                  # one layer's attention weights (as transferred: quantized if quant)
    gate_bytes: int = 0                  # one layer's gate weights
    expert_bytes: int = 0                # one expert's weights
    kv_bytes: int = 0                    # KV of one micro-batch, one layer, at the profiled context length
    attn_device_bytes: int = 0           # device bytes of one layer's attention while in use (stored + dequantized;
    gate_device_bytes: int = 0           #   0: the transferred bytes, weights used as moved)
    expert_device_bytes: int = 0         # device bytes of one expert while in use (FP8/HQQ: moved + dequantized)
    t_load_attn: float | None = None     # t_IO_A
    t_load_gate: float | None = None     # t_IO_G
    t_load_expert: float | None = None   # t_IO_E
    t_load_kv: float | None = None       # KV of one micro-batch, one layer, host -> device
    t_store_kv: float | None = None      # KV of one micro-batch, one layer, device -> host
    bandwidth: float | None = None       # host -> device bytes/s (b_cg)
    peak_flops: float | None = None      # device FLOP/s (p_g)
    device_bandwidth: float | None = None  # device memory bytes/s (b_g)
    flops_per_token: float | None = None   # FLOPs per token per layer (attention + top-k experts), for the roofline
    extra_bytes_per_step: int = 0        # bytes moved per step outside the layers (dense MLPs, lm_head, ...)
    extra_compute_s: float = 0.0         # compute per step outside the layers, whole batch group
    t_host_expert: ExpertCost | tuple[float, float] | None = None   # host compute of one expert (rows): experts
    #   computed where they live (compute: host / auto); None: the rules compute every expert on the device
    activation_bytes_per_row: int = 0    # one row's hidden state (in and out of a host-computed expert each)
    same_cores: bool = False             # the device is the host's cores (a CPU): host and device compute cancel
    device: str = ""                     # e.g. "NVIDIA H100 80GB HBM3"
    model: str = ""                      # model id / fingerprint
    hidden_size: int | None = None
    dtype: str = ""
    quant: str = ""                      # e.g. "hqq4g64" or ""
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.t_expert, (tuple, list)):
            if len(self.t_expert) != 2:
                raise KinjectError(f"Profile.t_expert: expected (fixed_s, per_token_s), got {self.t_expert!r}")
            self.t_expert = ExpertCost(*map(float, self.t_expert))
        elif isinstance(self.t_expert, Mapping):
            self.t_expert = ExpertCost(float(self.t_expert["fixed_s"]), float(self.t_expert["per_token_s"]))
        elif not callable(self.t_expert):
            raise KinjectError(f"Profile.t_expert: expected ExpertCost, (a, b) or a callable, got {self.t_expert!r}")
        if isinstance(self.t_host_expert, (tuple, list)):
            self.t_host_expert = ExpertCost(*map(float, self.t_host_expert))
        elif isinstance(self.t_host_expert, Mapping):
            self.t_host_expert = ExpertCost(float(self.t_host_expert["fixed_s"]), float(self.t_host_expert["per_token_s"]))
        for name in ("bs", "num_experts", "top_k", "num_layers", "tokens_per_seq"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise KinjectError(f"Profile.{name} must be a positive integer, got {value!r}")
        if self.top_k > self.num_experts:
            raise KinjectError(f"Profile: top_k={self.top_k} > num_experts={self.num_experts}")
        for name in ("t_attn", "t_gate"):
            if getattr(self, name) < 0:
                raise KinjectError(f"Profile.{name} must be >= 0 s, got {getattr(self, name)}")
        for t_name, b_name in (("t_load_attn", "attn_bytes"), ("t_load_gate", "gate_bytes"),
                               ("t_load_expert", "expert_bytes"), ("t_load_kv", "kv_bytes"),
                               ("t_store_kv", "kv_bytes")):
            if getattr(self, t_name) is None:
                nbytes = getattr(self, b_name)
                if nbytes and not self.bandwidth:
                    raise KinjectError(f"Profile.{t_name} not given and no bandwidth to derive it from "
                                       f"{b_name}={nbytes}")
                setattr(self, t_name, nbytes / self.bandwidth if nbytes else 0.0)
            elif getattr(self, t_name) < 0:
                raise KinjectError(f"Profile.{t_name} must be >= 0 s, got {getattr(self, t_name)}")

    def expert_time(self, tokens: float) -> float:
        return float(self.t_expert(tokens))  # type: ignore[operator]

    # ------------------------------------------------------------------ persistence
    def to_dict(self) -> dict:
        if not isinstance(self.t_expert, ExpertCost):
            raise KinjectError("Profile.to_json: t_expert is a callable; only ExpertCost(fixed_s, per_token_s) "
                               "can be saved")
        d = dataclasses.asdict(self)
        d["t_expert"] = dataclasses.asdict(self.t_expert)
        if self.t_host_expert is not None:
            d["t_host_expert"] = dataclasses.asdict(self.t_host_expert)
        return d

    def host_wins(self, rows: float) -> bool:
        """Fiddler's rule in the plan (as :meth:`kinject.engine.costs.PlacementCosts.host_wins` decides
        at run time): an expert with ``rows`` routed rows computes on the host when that, with its rows'
        activations over the link both ways, is cheaper than moving its bytes and computing it on the
        device. Never without a measured host cost. On :attr:`same_cores` the compute terms are one
        cost and cancel: the rows' activations vs. the expert's bytes on the link decide."""
        if self.t_host_expert is None or rows <= 0:
            return False
        link = (2 * rows * self.activation_bytes_per_row / self.bandwidth) if self.bandwidth else 0.0
        if self.same_cores:
            return link < (self.t_load_expert or 0.0)
        return self.t_host_expert(rows) + link < (self.t_load_expert or 0.0) + self.expert_time(rows)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Profile:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise KinjectError(f"Profile: unknown key(s) {unknown}")
        try:
            return cls(**dict(d))
        except TypeError as exc:
            raise KinjectError(f"Profile: {exc}") from None

    @classmethod
    def from_json(cls, text: str) -> Profile:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise KinjectError(f"Profile: not valid JSON ({exc})") from None
        return cls.from_dict(d)

    def save(self, path: str | os.PathLike) -> None:
        path = Path(path).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> Profile:
        return cls.from_json(Path(path).expanduser().read_text())

    def cache_key(self) -> str:
        """Hash of hardware + model shape + dtype/quant + bs: the key of the on-disk profile cache."""
        ident = {"device": self.device, "model": self.model, "num_layers": self.num_layers,
                 "num_experts": self.num_experts, "top_k": self.top_k, "hidden_size": self.hidden_size,
                 "dtype": self.dtype, "quant": self.quant, "bs": self.bs, "tokens_per_seq": self.tokens_per_seq}
        return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
