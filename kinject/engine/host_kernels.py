"""Host expert kernels that run at memory speed at batch 1 (docs/architecture.md, "Host compute").

A decode step's host experts are matrix-vector products over weights read once: the bound is the
experts' bytes over the memory bandwidth, and the kernel's job is to read each byte once, at that
speed, with no conversion, copy or transpose of the weights per call. What torch offers on a CPU,
measured at the Qwen3-MoE shape of ``kinject bench host-experts`` (hidden 1024, 8 routed experts of
width 768 per layer, their weights rotated through more layers than the caches hold, BENCHMARKS.md
has the rows; 2 threads, a loaded machine, so shares not absolute times matter):

* ``torch.mv`` on the expert's own bfloat16 ``[out, in]`` slice (one row per expert): about 6x
  faster than ``x @ W.T`` through ``F.linear`` / ``torch.mm`` with one row, whose bfloat16 path
  does not reach a GEMV kernel, and than the grouped GEMM over the ``[E, ...]`` view
  (``torch._grouped_mm``, the torch-grouped backend), and bit-identical to both (accumulation in
  float32, one rounding; checked in tests/test_host_kernels.py). With a few rows per expert
  ``W @ x.T`` (the GEMV orientation, ``[out, in] @ [in, n]``) beats ``x @ W.T``; from
  :data:`MM_ROWS` rows on, ``x @ W.T`` (a real GEMM) does;
* gathering the routed experts' weights into one tensor (``W[ids]``, then ``bmm``) copies the
  bytes the kernel should read once: slower than per-expert ``mv`` at every row count;
* float32 (an upcast per call, or float32 weights kept) doubles the bytes read: slower;
* ``torch.compile`` (inductor, C++) of the SwiGLU as a float32 reduction over the bfloat16 weights:
  slower than ``mv``; of the SwiGLU as ``F.linear``: it keeps the slow one-row ``mm``;
* INT8 weight-only, ``torch.ops.aten._weight_int8pack_mm`` (per-channel scales in the activation
  dtype): half the bytes of bfloat16, computed on the stored int8 values in place;
* INT4 weight-only, ``torch.ops.aten._weight_int4pack_mm_for_cpu`` (gpt-fast / torchao's CPU path:
  groups along ``in``, the weight repacked once by ``_convert_weight_to_int4pack_for_cpu``): one
  projection a call, 9.5 GB/s; where kinject's grouped GEMV takes the widths (multiples of 128, a
  vector build) :class:`Int4GemvLinear` holds the codes in kinject's layout instead (:func:`pack_int4`)
  and a layer step's experts are one call, 1.7x faster.

:class:`ExpertKernels` is one experts operator's host kernel (the ``torch-host`` backend of
:mod:`operators.host_experts`): per expert, per projection, one :class:`DenseLinear`,
:class:`Int8Linear`, :class:`Int4GemvLinear` or :class:`Int4Linear`, made on the expert's first host compute and kept (the
dense and stored-int8 ones are views of the store's host tensors: no byte is copied). ``host_format``
(a rule's ``host_format: int8 | int4``) makes the host compute in that format from the expert's
weights quantized once (the store keeps its own bytes for moves); otherwise the expert's stored
form decides: its own tensors, INT8 stored bytes natively, any other stored format dequantized by
its codec per call, as the store hands it (:meth:`kinject.engine.store.TensorStore.host_weights`).

A group of experts with fewer than :data:`MM_ROWS` rows each goes through kinject's compiled grouped
GEMV instead (:mod:`kinject.engine.host_gemv`, ``gemv``): one call per projection for all of them,
where it computes that format (INT8; bfloat16 where its bits are torch's, or with ``gemv_bf16``).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from kinject.engine.formats import int8 as int8_format

HOST_FORMATS = ("int8", "int4")          # host_format: computed on the host in this format
INT4_GROUP = 32                          # int4 group along ``in`` (llama.cpp's Q4_0 / Q4_K sub-block)
MM_ROWS = 16                             # rows of one expert from which ``x @ W.T`` beats ``W @ x.T``
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class HostKernelError(ValueError):
    """A host format or weight the host kernels cannot compute (the message names which and why)."""


# ---------------------------------------------------------------- one projection


_KIND_DTYPES = {"bf16": torch.bfloat16, "int8": torch.int8}    # the weight dtype each kernel computes


def gemv_key(kind: str, w: torch.Tensor, scale: torch.Tensor | None = None):
    """What the compiled grouped GEMV (:mod:`kinject.engine.host_gemv`) needs of one projection:
    ``((kind, out, in), weight, scale, weight address, scale address)``, or None where it cannot compute
    it (not a contiguous CPU ``[out, in]`` weight of the kind's dtype, or scales not contiguous bfloat16).
    The addresses are read once here: a decode step's ``data_ptr`` calls on tensors whose headers the
    weights streamed out of the caches cost microseconds each (the tensors are held, so they stay valid)."""
    if w.dtype is not _KIND_DTYPES[kind] or w.dim() != 2 or w.device.type != "cpu" or not w.is_contiguous():
        return None
    if scale is not None and (scale.dtype != torch.bfloat16 or not scale.is_contiguous()):
        return None
    return (kind, w.shape[0], w.shape[1]), w, scale, w.data_ptr(), scale.data_ptr() if scale is not None else 0


class DenseLinear:
    """``x [n, in] -> x @ W.T`` on the weight ``W [out, in]`` as it is (a view, never copied)."""

    __slots__ = ("w", "gemv")

    def __init__(self, w: torch.Tensor):
        self.w = w
        self.gemv = gemv_key("bf16", w)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w, n = self.w, x.shape[0]
        if x.dtype != w.dtype:
            x = x.to(w.dtype)
        if n == 1:
            return torch.mv(w, x[0]).unsqueeze(0)
        if n < MM_ROWS:
            return torch.mm(w, x.t()).t()
        return torch.mm(x, w.t())

    @property
    def nbytes(self) -> int:
        return self.w.numel() * self.w.element_size()


class Int8Linear:
    """``x [n, in] -> (x @ q.T) * s`` on int8 ``q [out, in]`` and per-row scales ``s [out]``
    (``_weight_int8pack_mm``: float32 accumulation, the scale in the activation dtype)."""

    __slots__ = ("q", "scale", "gemv")

    def __init__(self, q: torch.Tensor, scale: torch.Tensor):
        if q.dtype != torch.int8 or q.dim() != 2 or scale.shape != q.shape[:1]:
            raise HostKernelError(f"int8 kernel needs int8 [out, in] values and [out] scales, got "
                                  f"{q.dtype} {list(q.shape)} and {list(scale.shape)}")
        self.q, self.scale = q, scale
        self.gemv = gemv_key("int8", q, scale)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.scale.dtype:
            x = x.to(self.scale.dtype)
        return torch.ops.aten._weight_int8pack_mm(x, self.q, self.scale)

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * self.scale.element_size()


class Int4Linear:
    """``x [n, in] -> x @ W.T`` with ``W = (u - 8) * scale + zero`` per group of :attr:`group` along
    ``in`` (``u`` the unsigned 4-bit codes): torch's ``_weight_int4pack_mm_for_cpu`` on the codes
    packed once by ``_convert_weight_to_int4pack_for_cpu``; ``scales_zeros [in / group, out, 2]``."""

    __slots__ = ("packed", "group", "scales_zeros", "out_features")
    gemv = None                         # not computed by the compiled grouped GEMV

    def __init__(self, codes: torch.Tensor, scales_zeros: torch.Tensor, group: int):
        out, cols = codes.shape
        if cols % group or scales_zeros.shape != (cols // group, out, 2):
            raise HostKernelError(f"int4 kernel: codes {list(codes.shape)} with group {group} need scales_zeros "
                                  f"[{cols // group}, {out}, 2], got {list(scales_zeros.shape)}")
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
        self.group, self.scales_zeros, self.out_features = group, scales_zeros.contiguous(), out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.scales_zeros.dtype:
            x = x.to(self.scales_zeros.dtype)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group, self.scales_zeros)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scales_zeros.numel() * self.scales_zeros.element_size()


class Int4GemvLinear:
    """:class:`Int4Linear`'s weight ``q * s`` computed by kinject's grouped GEMV (:meth:`HostGemv.int4
    <kinject.engine.host_gemv.HostGemv.int4>`) on the codes in kinject's int4 layout (:func:`pack_int4`),
    held instead of torch's packing: half the bytes of INT8 read at memory speed, the experts of a layer
    step in one call (torch's kernel takes one projection a call). Its arithmetic: the documented weight
    ``q * s`` times the rows, summed in float32 in the kernel's order (:meth:`HostGemv.int4
    <kinject.engine.host_gemv.HostGemv.int4>`), the same bits whatever the call's other rows."""

    __slots__ = ("packed", "scales", "gemv_kernel", "gemv")

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, gemv):
        out, cols = q.shape
        if scale.dtype != torch.bfloat16 or scale.shape != (out, cols // INT4_GROUP) or not gemv.int4_takes(cols):
            raise HostKernelError(f"int4 kernel: codes {list(q.shape)} need bfloat16 scales [{out}, {cols // INT4_GROUP}] "
                                  f"and an inner dimension the kernel takes, got {scale.dtype} {list(scale.shape)}")
        layout = gemv.int4_layout
        self.packed, self.scales, self.gemv_kernel = pack_int4(q, layout), pack_int4_scales(scale, layout), gemv
        self.gemv = (("int4", out, cols), self.packed, self.scales, self.packed.data_ptr(), self.scales.data_ptr())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        (_, out, cols), shape = self.gemv[0], x.shape
        x = x.reshape(-1, cols)
        x = (x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)).contiguous()
        y = self.gemv_kernel.int4([self.gemv[3]], [self.gemv[4]], [x.shape[0]], x, out, cols)
        return y.view(*shape[:-1], out)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scales.numel() * self.scales.element_size()


INT4_PANEL = 16                          # weight rows a panel of int4 layout 3 (rows padded to a multiple)


def _panel_rows(out: int) -> int:
    """``out`` weight rows rounded up to whole panels (int4 layout 3)."""
    return -(-out // INT4_PANEL) * INT4_PANEL


def pack_int4(q: torch.Tensor, layout: int) -> torch.Tensor:
    """Signed int4 codes ``q [out, in]`` (int8 in [-8, 7], ``in`` a multiple of 128) in kinject's int4
    host layout ``layout`` (the one the compiled kernel reads: ``HostGemv.int4_layout``; ``host_gemv.c``,
    int4 weights), nibbles two's complement:

    * 1: ``[out, in / 2]`` bytes, per block of 128 codes of a row 16 little-endian 32-bit words, nibble
      ``k`` of word ``j`` holding code ``16 k + j`` (a shift pair then sign-extends 16 consecutive codes at
      once: AVX2, AVX-512);
    * 3: panels of 16 rows, lanes as rows (AVX512-BF16): ``[out rounded up to 16, in / 2]`` bytes, the
      padded rows' codes 0; a panel is its groups of 32 columns in order, each 4 vectors of 32 little-endian
      16-bit words, word ``2 i + t`` of vector ``c`` holding in nibble ``m`` the code of the panel's row
      ``i`` at column ``2 (4 c + m) + t`` of the group (one shift and one VPERMW give one column pair of
      16 rows as bfloat16); the scales in :func:`pack_int4_scales`' layout 3."""
    out, cols = q.shape
    if q.dtype != torch.int8 or cols % 128 or int(q.min()) < -8 or int(q.max()) > 7:
        raise HostKernelError(f"int4 layout: needs int8 codes in [-8, 7] with a multiple of 128 inputs, "
                              f"got {q.dtype} {list(q.shape)}")
    if layout == 3:
        rows = _panel_rows(out)
        nib = torch.zeros(rows, cols, dtype=torch.uint8)
        nib[:out] = q.view(torch.uint8) & 0xF
        # [panel, row i, group, vector c, nibble m, t] -> [panel, group, c, i, t, m]: word (i, t), nibble m
        nib = nib.reshape(rows // INT4_PANEL, INT4_PANEL, cols // 32, 4, 4, 2).permute(0, 2, 3, 1, 5, 4)
        low, high = nib[..., 0] | (nib[..., 1] << 4), nib[..., 2] | (nib[..., 3] << 4)   # a word's two bytes
        return torch.stack([low, high], -1).reshape(rows, cols // 2)
    if layout != 1:
        raise HostKernelError(f"int4 layout: no layout {layout} (1: 32-bit words, 3: panels of 16 rows)")
    nib = (q.view(torch.uint8) & 0xF).reshape(out, cols // 128, 4, 2, 16)     # [out, block, byte m, k - 2m, j]
    byte = nib[:, :, :, 0] | (nib[:, :, :, 1] << 4)                             # byte m of word j: nibbles 2m, 2m + 1
    return byte.transpose(2, 3).contiguous().reshape(out, cols // 2)            # words little-endian: [j][m]


def pack_int4_scales(scale: torch.Tensor, layout: int) -> torch.Tensor:
    """An int4 weight's bfloat16 group scales ``[out, in / 32]`` as :func:`pack_int4`'s ``layout`` reads them:
    as they are for layout 1; for layout 3 ``[out rounded up to 16, in / 32]`` values holding, per panel of
    16 rows, each group's 16 scales together (row order; the padded rows' 0)."""
    if layout != 3:
        return scale.contiguous()
    out, groups = scale.shape
    rows = _panel_rows(out)
    padded = scale.new_zeros(rows, groups)
    padded[:out] = scale
    return padded.reshape(rows // INT4_PANEL, INT4_PANEL, groups).transpose(1, 2).contiguous().reshape(rows, groups)


def quantize_int4(weight: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [out, in]`` -> (signed codes ``q`` int8 in [-8, 7], scales ``[out, in / group]`` in the
    weight's dtype): symmetric per group, ``s = amax / 7.5`` (compressed-tensors' symmetric INT4
    arithmetic; ``1 / 7.5`` for an all-zero group), ``q = clamp(round(W / s), -8, 7)``, ``W ~ q * s``."""
    out, cols = weight.shape
    if cols % group:
        raise HostKernelError(f"int4: the input dimension {cols} of a {list(weight.shape)} weight is not a multiple "
                              f"of the group size {group}")
    w = weight.detach().to(torch.float32).reshape(out, cols // group, group)
    amax = w.abs().amax(-1)
    scale = (torch.where(amax > 0, amax, torch.ones_like(amax)) / 7.5).to(weight.dtype)
    q = torch.round(w / scale.to(torch.float32).unsqueeze(-1)).clamp_(-8, 7).to(torch.int8)
    return q.reshape(out, cols), scale


def int4_linear(q: torch.Tensor, scale: torch.Tensor, group: int) -> Int4Linear:
    """The kernel of symmetric signed codes ``q [out, in]`` and scales ``[out, in / group]``: unsigned
    codes ``q + 8``, zero point 0, so ``(u - 8) * s + 0 = q * s`` exactly."""
    scales_zeros = torch.stack([scale, torch.zeros_like(scale)], -1).transpose(0, 1)     # [in/g, out, 2]
    return Int4Linear((q.to(torch.int32) + 8), scales_zeros, group)


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """``q * s`` in float32 cast to ``dtype``: the int4 host format's documented weight."""
    return (q.to(torch.float32) * scale.to(torch.float32).repeat_interleave(group, -1)).to(dtype)


def linear_for(w: torch.Tensor, host_format: str | None, *, compute_dtype: torch.dtype, gemv=None) -> Callable:
    """The projection kernel of a float weight ``w [out, in]``: as it is (``host_format`` None), or
    quantized once to ``int8`` / ``int4`` (computed in ``compute_dtype``). int4 with bfloat16 activations
    where ``gemv`` (the compiled grouped GEMV) takes its shape: :class:`Int4GemvLinear`, else torch's."""
    if host_format is None:
        return DenseLinear(w)
    if host_format == "int8":
        parts = int8_format.quantize(w)
        return Int8Linear(parts["weight"], parts["weight_scale"].to(compute_dtype))
    if host_format == "int4":
        q, s = quantize_int4(w)
        if gemv is not None and compute_dtype == torch.bfloat16 and gemv.int4_takes(w.shape[1], INT4_GROUP):
            return Int4GemvLinear(q, s.to(torch.bfloat16), gemv)
        return int4_linear(q, s.to(compute_dtype), INT4_GROUP)
    raise HostKernelError(f"host_format {host_format!r} is not one of {', '.join(HOST_FORMATS)}")


# ---------------------------------------------------------------- one operator's experts


class ExpertKernels:
    """The host kernel of one experts operator: ``(group, tensors, counts, x) -> [N, H]``, unweighted.

    ``weights(e)``: expert ``e``'s host weights by role (the store's host tensors; a stored low-bit
    expert: dequantized by its codec); ``stored(e)``: role -> (storage tensors by part, codec) of
    the roles the store holds encoded (empty: none); ``cacheable(e)``: whether the expert's host
    weights stay where they are (host tier) so its kernels may be kept; ``up`` / ``down``: the
    roles of the two projections; ``activation`` / ``post``: the layout's math between and after.
    """

    def __init__(self, *, weights: Callable[[int], dict], stored: Callable[[int], dict], cacheable: Callable[[int], bool],
                 up: str, down: str, activation: Callable, post: Callable | None, host_format: str | None,
                 compute_dtype: torch.dtype, gemv=None, gemv_bf16: bool = False):
        if host_format is not None and host_format not in HOST_FORMATS:
            raise HostKernelError(f"host_format {host_format!r} is not one of {', '.join(HOST_FORMATS)}")
        self._weights, self._stored, self._cacheable = weights, stored, cacheable
        self.up, self.down, self.activation, self.post = up, down, activation, post
        self.host_format, self.compute_dtype = host_format, compute_dtype
        self.gemv = gemv                         # the compiled grouped GEMV (host_gemv.HostGemv) or None
        self.gemv_bf16 = gemv_bf16 and gemv is not None and gemv.vectorized    # bfloat16 too (host_gemv: fast)
        self.grouped_calls = 0                   # layer steps it computed (report)
        self._kernels: dict[int, tuple[Callable, Callable]] = {}
        self.kinds: dict[str, int] = {}          # kernel class name -> projections built (report)
        self._one_token_table = False            # one_token's table of every expert (None: not one it takes)

    def needs_tensors(self, e: int) -> bool:
        """Whether the caller should hand expert ``e``'s host weights with each call: an expert whose
        weights do not stay put (disk tier) is read by the caller, not inside the timed kernel."""
        return not self._cacheable(e)

    def prepare(self, experts: Sequence[int]) -> None:
        """Build the kernels of ``experts`` whose weights stay put now (a ``host_format`` quantizes
        each once here): the first compute pays for all of them at once, and no later prefill pays
        for the experts it happens to route to first."""
        for e in experts:
            if self._cacheable(e):
                self.kernels(e)

    def kernels(self, e: int, given: dict | None = None) -> tuple[Callable, Callable]:
        """Expert ``e``'s (up, down) projection kernels, made once where its weights stay put
        (``given``: its host weights as the caller read them, else they are asked for)."""
        k = self._kernels.get(e)
        if k is None:
            if self._cacheable(e):                 # built from the store's own tensors (stored bytes in place)
                k = self._kernels[e] = self._make(e)
            else:
                k = self._make(e, given or None)
        return k

    def _make(self, e: int, given: dict | None = None) -> tuple[Callable, Callable]:
        stored = self._stored(e) if self.host_format is None and given is None else {}
        native = {role: self._native(parts, codec) for role, (parts, codec) in stored.items()}
        dense = given
        out = []
        for role in (self.up, self.down):
            k = native.get(role)
            if k is None:
                if dense is None:
                    dense = self._weights(e)
                w = dense[role]
                if w.dim() != 2:
                    raise HostKernelError(f"expert {e}: {role} is {list(w.shape)}, not a 2-D [out, in] weight")
                k = linear_for(w, self.host_format, compute_dtype=self.compute_dtype, gemv=self.gemv)
            self.kinds[type(k).__name__] = self.kinds.get(type(k).__name__, 0) + 1
            out.append(k)
        return out[0], out[1]

    def _native(self, parts: dict[str, torch.Tensor], codec) -> Callable | None:
        """A kernel on a role's stored bytes as they are (INT8: :class:`Int8Linear` on the values, the
        scale converted to the compute dtype where stored in another); None: no native kernel, the
        store's dequantized weight is used."""
        if isinstance(codec, int8_format.Int8Format) and parts["weight"].dim() == 2:
            s = parts["weight_scale"]
            return Int8Linear(parts["weight"], s if s.dtype == self.compute_dtype else s.to(self.compute_dtype))
        return None

    takes_broadcast_rows = True     # x may be one row for every row (the fused kernels read it so; else copied)

    def __call__(self, group: Sequence[int], tensors, counts: Sequence[int], x: torch.Tensor) -> torch.Tensor:
        """Every expert's up projection on its rows, the activation once over all of them (it is
        row-wise: the same values as per expert, one call instead of one per expert), then every
        expert's down projection on its rows of it. With the compiled grouped GEMV and fewer than
        :data:`MM_ROWS` rows per expert, each projection of all the experts is one call. ``x`` may be one
        row broadcast to every row (:attr:`takes_broadcast_rows`): the fused call reads it as it is,
        anything else gets real rows."""
        pairs, rows = [], []
        built = self._kernels
        for i, (e, n) in enumerate(zip(group, counts)):
            if n:
                pairs.append(built.get(e) or self.kernels(e, tensors[i] if tensors else None))
                rows.append(n)
        if not pairs:
            return x.new_empty((0, x.shape[-1]), dtype=self.compute_dtype)
        if self.gemv is not None and x.dtype == torch.bfloat16:
            if max(rows) < MM_ROWS:
                y = self._grouped(pairs, rows, x)
            else:                    # (a prompt's few busy experts: torch's GEMM for them, the rest grouped)
                y = self._grouped_but_busy(pairs, rows, x)
            if y is not None:
                return self.post(y) if self.post is not None else y
        if x.dim() == 2 and x.stride(0) == 0:
            x = x.contiguous()
        y = self._one_by_one(pairs, rows, x)
        return self.post(y) if self.post is not None else y

    def _one_by_one(self, pairs: list, rows: list[int], x: torch.Tensor) -> torch.Tensor:
        """Each expert's kernels on its rows of ``x`` (``rows[i]`` each, in order), the activation once
        over every expert's up projection: the unweighted outputs ``[sum(rows), H]``."""
        ups, start = [], 0
        for (up, _), n in zip(pairs, rows):
            ups.append(up(x[start:start + n]))
            start += n
        h = self.activation(ups[0] if len(ups) == 1 else torch.cat(ups))
        if len(pairs) == 1:
            return pairs[0][1](h)
        outs, start = [], 0
        for (_, down), n in zip(pairs, rows):
            outs.append(down(h[start:start + n]))
            start += n
        return torch.cat(outs)

    def _grouped_but_busy(self, pairs: list, rows: list[int], x: torch.Tensor) -> torch.Tensor | None:
        """A group where some experts have :data:`MM_ROWS` rows or more (a prompt's busiest): those through
        their own kernels (torch's GEMM, :meth:`_one_by_one`), every other one in one grouped call on its rows,
        each expert's rows the values either path gives it alone (a row's output depends on its expert's
        kernel and row count only, the activation is row-wise). Before, one busy expert sent the whole
        layer one expert at a time: 63 experts' cold weights through torch's GEMV, 28 ms a layer of a
        32-token prompt against 11 grouped. None where the grouped call does not take the others."""
        small = [i for i, n in enumerate(rows) if n < MM_ROWS]
        if len(small) < 2:
            return None
        starts = [0]
        for n in rows:
            starts.append(starts[-1] + n)
        pieces: list[torch.Tensor | None] = [None] * len(rows)
        xs = torch.cat([x[starts[i]:starts[i + 1]] for i in small])
        grouped = self._grouped([pairs[i] for i in small], [rows[i] for i in small], xs)
        if grouped is None:
            return None
        at = 0
        for i in small:
            pieces[i], at = grouped[at:at + rows[i]], at + rows[i]
        for i, n in enumerate(rows):
            if pieces[i] is None:
                pieces[i] = self._one_by_one([pairs[i]], [n], x[starts[i]:starts[i + 1]])
        return torch.cat(pieces)

    def one_token(self, experts: int, ids: torch.Tensor, weights: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """A decode step's one token ``x`` through its routed experts ``ids`` (``[.., k]``, slot order) and
        their weighted sum with ``weights``, in one compiled call (:meth:`HostGemv.one_token_experts`): what
        :meth:`__call__` on the experts sorted ascending and the interception's weighted sum compute, bit
        for bit. ``experts``: how many the operator stores (0 .. experts - 1). None (nothing computed)
        where that call does not take them: gradients recorded, an expert whose weights do not stay put,
        another layout or format than the fused SwiGLU's, an id out of range or repeated."""
        table = self._one_token_table
        if table is False:
            table = self._one_token_table = self._table(experts)
        if table is None or torch.is_grad_enabled():
            return None
        out = self.gemv.one_token_experts(table, ids, weights, x)
        if out is not None:
            self.grouped_calls += 1
        return out

    def _table(self, experts: int):
        """:meth:`one_token`'s table of all ``experts`` (built once, after :meth:`prepare`), or None."""
        if self.gemv is None or self.post is not None or getattr(self.activation, "fused", None) != "silu" \
                or not experts or not all(self._cacheable(e) for e in range(experts)):
            return None
        pairs = [self.kernels(e) for e in range(experts)]
        ups, downs = [getattr(p[0], "gemv", None) for p in pairs], [getattr(p[1], "gemv", None) for p in pairs]
        if not gemv_takes(self.gemv, self.gemv_bf16, ups[0], downs[0]):
            return None
        kup, kdown = ups[0][0], downs[0][0]
        if any(u is None or u[0] != kup for u in ups) or any(d is None or d[0] != kdown for d in downs) \
                or kup[0] != kdown[0] or kup[1] != 2 * kdown[2] or kdown[1] != kup[2]:
            return None
        return self.gemv.one_token_table(kup[0], ups, downs, kdown[2], kdown[1])

    def _grouped(self, pairs: list, rows: list[int], x: torch.Tensor) -> torch.Tensor | None:
        """Both projections of every expert through the compiled grouped GEMV, one call each; None where
        a projection is not one it computes (another format, or a weight not laid out for it)."""
        y = gemv_experts(self.gemv, self.gemv_bf16, [getattr(p[0], "gemv", None) for p in pairs],
                         [getattr(p[1], "gemv", None) for p in pairs], rows, x, self.activation)
        if y is not None:
            self.grouped_calls += 1
        return y


def gemv_experts(gemv, fast: bool, ups: list, downs: list, rows: list[int], x: torch.Tensor,
                 activation: Callable) -> torch.Tensor | None:
    """A group of experts' two projections through the compiled grouped GEMV (``gemv``, a
    :class:`~kinject.engine.host_gemv.HostGemv`), one call each with ``activation`` between: ``ups`` /
    ``downs`` are each expert's projection descriptors (:func:`gemv_key`), ``rows`` its number of rows
    of ``x`` (sorted by expert). None where a projection is not one it computes (another format, a
    weight not laid out for it, bfloat16 without torch's bits here unless ``fast``: :func:`gemv_takes`,
    or a call that records gradients: the compiled kernel has no backward)."""
    if not ups or not gemv_takes(gemv, fast, ups[0], downs[0]):
        return None
    return gemv_experts_taken(gemv, ups, downs, rows, x, activation)


def gemv_experts_taken(gemv, ups: list, downs: list, rows: list[int], x: torch.Tensor,
                       activation: Callable) -> torch.Tensor | None:
    """:func:`gemv_experts` once the caller asked :func:`gemv_takes` of the first expert."""
    if torch.is_grad_enabled() and (x.requires_grad or any(d is not None and d[1].requires_grad for d in ups + downs)):
        return None
    kup, kdown = ups[0][0], downs[0][0]
    if any(u is None or u[0] != kup for u in ups) or any(d is None or d[0] != kdown for d in downs):
        return None
    if (getattr(activation, "fused", None) == "silu" and kup[0] == kdown[0] and kup[1] == 2 * kdown[2]
            and kdown[1] == kup[2] and gemv.swiglu_takes(kup[0], kdown[2], kdown[1])):
        # both projections and the gate in one call: no torch operation between them to pay for the
        # caches the up projection's weights flushed (docs/architecture.md, "Host compute")
        if kup[0] == "bf16":
            return gemv.swiglu_bf16([d[3] for d in ups], [d[3] for d in downs], rows, x, kdown[2], kdown[1])
        fused = gemv.swiglu_int4 if kup[0] == "int4" else gemv.swiglu_int8
        return fused([d[3] for d in ups], [d[4] for d in ups], [d[3] for d in downs], [d[4] for d in downs],
                     rows, x, kdown[2], kdown[1])
    h = activation(_gemv_run(gemv, kup, ups, rows, x, kup[0] == "bf16" and gemv.bf16_exact_for(kup[2])))
    return _gemv_run(gemv, kdown, downs, rows, h, kdown[0] == "bf16" and gemv.bf16_exact_for(kdown[2]))


def gemv_takes(gemv, fast: bool, up, down) -> bool:
    """Whether the compiled grouped GEMV computes an expert whose projections have the descriptors
    ``up`` and ``down`` (:func:`gemv_key`; None: not one it computes): bfloat16 only with torch's bits
    (an inner dimension it has them for), unless ``fast``. The shapes decide, so asking of one expert
    answers for a group of the same layer before a descriptor is built for each of them."""
    if up is None or down is None:
        return False
    if fast:
        return True
    ku, kd = up[0], down[0]
    return (ku[0] != "bf16" or gemv.bf16_exact_for(ku[2])) and (kd[0] != "bf16" or gemv.bf16_exact_for(kd[2]))


def _gemv_run(gemv, key: tuple, descs: list, rows: list[int], x: torch.Tensor, exact: bool) -> torch.Tensor:
    kind, out, cols = key
    if kind == "bf16":
        return gemv.bf16([d[1] for d in descs], rows, x, out, cols, exact=exact)
    run = gemv.int4 if kind == "int4" else gemv.int8
    return run([d[3] for d in descs], [d[4] for d in descs], rows, x, out, cols)
