"""kt-kernel (KTransformers' CPU MoE kernels, AMX / AVX-512) as a host kernel of the chain, after torch-host
(first with ``pipeline.host_kernel: kt-kernel``).

kt-kernel (PyPI ``kt-kernel``, optional extra ``kinject[kt]``) builds one C++ MoE object per layer
from per-expert weight pointers and computes ``(hidden states, expert ids, weights) -> output``
on its own worker pool. kinject uses its extension module (``kt_kernel.kt_kernel_ext``) directly,
not its ``KTMoEWrapper``: the wrapper reads weights from files and allocates pinned (CUDA) staging
buffers, while kinject already has the experts' host tensors and does its own staging
(:class:`operators.host_experts.HostExperts`). What was checked against kt-kernel 0.7.2:

- its import reads ``/proc/cpuinfo``, loads the best of its AMX / AVX-512 / AVX2 builds, and needs
  neither a CUDA driver nor its pinned torch (the extension links no libtorch; only the wheel's
  metadata pins ``torch==2.9.1``, so pip installs it beside a matching torch: the skip reasons below
  are what actually stops it, not the pin);
- ``moe.MOEConfig(E, top_k, H, I, gpu_mask_ptr)`` with ``gate_projs / up_projs / down_projs`` as
  ``[[ptr per expert]]`` (one NUMA slice) of row-major bf16 ``[I, H]``, ``[I, H]``, ``[H, I]``
  (transformers' ``gate_up_proj[e][:I]``, ``[I:]`` and ``down_proj[e]``: views, no copy on our side),
  scales ``0``, ``pool = CPUInfer.backend_``, ``max_len`` the most rows of one call;
  ``load_weights_task(physical_to_logical_ptr)`` then repacks the weights into the kernel's own
  tiles (that one copy is what its API demands; kinject keeps no other);
- ``forward_task(bsz_ptr int32[1], k, ids_ptr int64[N, k], weights_ptr f32[N, k], x_ptr bf16[N, H],
  out_ptr bf16[N, H], incremental=False)`` submitted to ``CPUInfer`` and ``sync()``: the output row
  is ``sum_j w[j] * down(silu(gate x) * up x)`` over its ids; experts set in the mask give zero.

kinject hands it its host rows grouped by expert, one id per row (``k = 1``) at weight 1: the
outputs are the experts' own rows, which the operator weights and combines exactly as the torch
backends' (:meth:`operators.expert_interception.FusedCalls._routed`).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import threading

import torch

logger = logging.getLogger(__name__)

# what kt-kernel's fast builds need: AMX (tiles + bf16) or AVX-512 (foundation + byte/word)
FAST_FLAGS = ({"amx_tile", "amx_bf16"}, {"avx512f", "avx512bw"})
MAX_ROWS = 4096                         # rows of one kernel call (its buffers are sized by max_len)
_POOLS: dict[int, object] = {}          # threads -> CPUInfer (one worker pool per thread count)
_POOLS_LOCK = threading.Lock()


def cpu_flags() -> set[str]:
    """This CPU's feature flags, from ``/proc/cpuinfo`` (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _installed() -> bool:
    return importlib.util.find_spec("kt_kernel") is not None


def _default_gate(module) -> bool:
    """The module's gate is transformers' default ``act_fn(gate) * up`` with a SiLU ``act_fn``
    (the only activation kt-kernel's kernels compute): read from the module's class, not its family."""
    from transformers.activations import ACT2CLS
    from transformers.integrations import moe

    gate = getattr(type(module), "_apply_gate", None)
    return gate is getattr(moe, "_default_apply_gate", object()) and type(getattr(module, "act_fn", None)) is ACT2CLS["silu"]


def skip(layout, cuda: bool, op=None) -> str | None:
    """Why kt-kernel cannot compute ``layout``'s experts (None: it can). Every check before the last
    reads metadata only (installed?, ``/proc/cpuinfo``, the layout, the dtype); the last imports
    kt-kernel (:func:`_load_skip`), only when it is about to be used."""
    if not _installed():
        return "not installed (pip install 'kinject[kt]', beside the torch kt-kernel pins)"
    flags = cpu_flags()
    if not any(need <= flags for need in FAST_FLAGS):
        return ("this CPU has neither AMX (amx_tile, amx_bf16) nor AVX-512 (avx512f, avx512bw) in /proc/cpuinfo: "
                "kt-kernel would run its AVX2 build, no faster than torch-grouped")
    math = getattr(layout, "math", None)
    if math is None or layout.call != "routed":
        return f"needs transformers' fused experts contract (layout {layout.name!r})"
    if math.up != "gate_up_proj" or math.transposed:
        return f"needs gated experts stored [out, in] (layout {layout.name!r}: {math.up}, transposed={math.transposed})"
    if any("bias" in p for p in layout.params):
        return f"computes unbiased experts only (layout {layout.name!r} has {[p for p in layout.params if 'bias' in p]})"
    if math.post is not None or not _default_gate(layout.module):
        own = "a post-expert norm" if math.post is not None else "its own gate or activation"
        return f"computes silu(gate) * up only ({type(layout.module).__name__} has {own})"
    dtype = _dtype(op)
    if dtype is not None and dtype != torch.bfloat16:
        return f"computes bfloat16 experts only (these compute in {dtype})"
    if op is not None and (getattr(op, "weights", None) == "disk" or any(u.tier == "disk" for u in op.units)):
        return ("keeps its own repacked copy of every expert in host memory, which the disk tier these "
                "experts are on is there to avoid")
    return _load_skip()


def _dtype(op) -> torch.dtype | None:
    """The experts' compute dtype: their units' once registered, before that their binding's."""
    if op is None:
        return None
    if op.units:
        return op.units[0].compute_dtype
    binding = getattr(op, "binding", None)          # an operator; an ExpertSet says its dtype itself
    return getattr(binding, "dtype", None) if binding is not None else getattr(op, "dtype", None)


def torch_pin() -> str | None:
    """The torch requirement in kt-kernel's wheel metadata (``torch==2.9.1`` for 0.7.2), if any."""
    from importlib import metadata
    try:
        reqs = metadata.requires("kt-kernel") or []
    except metadata.PackageNotFoundError:
        return None
    return next((r.split(";")[0].replace(" ", "") for r in reqs if r.replace(" ", "").startswith("torch=")), None)


def _load_skip() -> str | None:
    """The last check, made only when every other one passed (the backend is then used): import
    kt-kernel (its own CPU probe loads its AMX / AVX-512 / AVX2 extension) and look at what it loaded.
    A failed import names the torch its wheel pins where that is not this torch."""
    try:
        kt = importlib.import_module("kt_kernel")
    except Exception as exc:                               # noqa: BLE001 - any import failure is a skip reason
        pin, mine = torch_pin(), torch.__version__.split("+")[0]
        built = f"; its wheel pins {pin}, this is torch {mine}" if pin and not pin.endswith("=" + mine) else ""
        return f"import failed ({type(exc).__name__}: {exc}{built})"
    variant = str(getattr(kt, "__cpu_variant__", "?"))
    if not variant.startswith(("amx", "avx512")):
        return f"kt-kernel loaded its {variant} build (no AMX / AVX-512 build loads on this CPU)"
    moe = kt.kt_kernel_ext.moe
    if getattr(moe, "AMXBF16_MOE", None) is None and getattr(moe, "AVX2BF16_MOE", None) is None:
        return f"its {variant} build has no bfloat16 MoE kernel (AMXBF16_MOE, AVX2BF16_MOE)"
    return None


def _pool(ext, threads: int):
    """kt-kernel's worker pool for ``threads`` threads (one subpool, NUMA node 0), made once."""
    with _POOLS_LOCK:
        if threads not in _POOLS:
            cfg = ext.WorkerPoolConfig()
            cfg.subpool_count, cfg.subpool_numa_map, cfg.subpool_thread_count = 1, [0], [threads]
            _POOLS[threads] = ext.CPUInfer(cfg)
        return _POOLS[threads]


class KTKernelExperts:
    """One layer's kt-kernel MoE object over the experts that live on the host, built once.

    ``host``: the :class:`~operators.host_experts.HostExperts` of the layer. Experts on the device
    tier are masked (kt-kernel computes zeros for them; the chain never sends it their rows). The
    weights are passed by pointer to the experts' host tensors (views of transformers' ``[E, ...]``
    parameters; a low-bit stored expert: its weights dequantized on the host now, held only until
    kt-kernel has repacked them). kt-kernel's ``load_weights_task`` copies them into its own tiles
    (checked: zeroing our tensors afterwards leaves its outputs unchanged), so a layer's host
    experts take their bytes twice in host memory while the store keeps its own for moves: the one
    copy its API demands, and the reason disk-tier experts are not handed to it (:func:`skip`).
    """

    def __init__(self, host):
        ext = importlib.import_module("kt_kernel").kt_kernel_ext
        op, self.host = host.experts, host
        threads = getattr(host.runtime.pipeline, "host_threads", None) or torch.get_num_threads()
        self.cpu = _pool(ext, int(threads))
        units = op.units[: op.stored]
        live = [u.tier != "device" for u in units]
        first = live.index(True)
        weights = [host.weights(e if live[e] else first) for e in range(len(units))]   # masked: any valid pointer
        math = op.layout.math
        gu = weights[first][math.up]                                                      # [2I, H]
        inter, hidden = gu.shape[0] // 2, gu.shape[1]
        self.hidden = hidden
        self.mask = torch.tensor([not x for x in live], dtype=torch.bool)                 # True: not ours
        cfg = ext.moe.MOEConfig(len(units), 1, hidden, inter, self.mask.data_ptr())
        cfg.layer_idx, cfg.pool, cfg.max_len = int(op.layer or 0), self.cpu.backend_, MAX_ROWS
        parts = [(w[math.up].contiguous(), w[math.down].contiguous()) for w in weights]   # no-ops for host views
        cfg.gate_projs = [[g[:inter].data_ptr() for g, _ in parts]]
        cfg.up_projs = [[g[inter:].data_ptr() for g, _ in parts]]
        cfg.down_projs = [[d.data_ptr() for _, d in parts]]
        cfg.gate_scales = cfg.up_scales = cfg.down_scales = [[0] * len(units)]
        cls = getattr(ext.moe, "AMXBF16_MOE", None) or ext.moe.AVX2BF16_MOE
        self.moe = cls(cfg)
        order = torch.arange(len(units), dtype=torch.int64)                               # physical = logical
        self.cpu.submit(self.moe.load_weights_task(order.data_ptr()))
        self.cpu.sync()
        logger.info("%s: kt-kernel %s over %d host experts (%d threads)", op.key, cls.__name__, sum(live), threads)

    def __call__(self, group: list[int], tensors: list[dict], counts: list[int], x: torch.Tensor) -> torch.Tensor:
        """Experts ``group``'s rows ``x`` ``[N, H]`` (grouped by expert, ``counts`` each) -> their
        outputs ``[N, H]`` bf16, unweighted; ``tensors`` are not read (the kernel holds its repacked copy)."""
        ids = torch.repeat_interleave(torch.tensor(group, dtype=torch.int64),
                                      torch.tensor(counts, dtype=torch.int64)).unsqueeze(1)     # [N, 1]
        x = x.to(torch.bfloat16).contiguous()
        out = torch.empty_like(x)
        ones = torch.ones(ids.shape, dtype=torch.float32)
        for s in range(0, x.shape[0], MAX_ROWS):
            e = min(s + MAX_ROWS, x.shape[0])
            bsz = torch.tensor([e - s], dtype=torch.int32)
            self.cpu.submit(self.moe.forward_task(bsz.data_ptr(), 1, ids[s:e].data_ptr(), ones[s:e].data_ptr(),
                                                  x[s:e].data_ptr(), out[s:e].data_ptr(), False))
            self.cpu.sync()
        return out
