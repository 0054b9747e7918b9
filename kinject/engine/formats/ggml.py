"""GGML block types in torch: the dequantizers of the tensor types GGUF files store (docs/architecture.md
"Stored formats").

A GGUF tensor of a quantized type is rows of fixed-size *blocks*: ``block_size`` values stored in
``type_size`` bytes (a float16 scale and packed codes; the K-quants pack 256 values with 6-bit
sub-block scales). kinject keeps those bytes as they are, one ``uint8 [..., rows, row_bytes]``
tensor, in the host and disk tiers and rebuilds the float rows on the compute device with
:func:`dequantize`. Each dequantizer repeats gguf-py's numpy reference (``gguf.quants``:
the same float32 products in the same order, no fused multiply-add), so its values are
bit-identical to what transformers' GGUF load (which calls that reference) puts in the model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

QK_K = 256            # values per K-quant super-block

# ggml type name -> (values per block, bytes per block); the GGUF type ids are gguf's own
# (GGMLQuantizationType), looked up by name where needed.
BLOCKS: dict[str, tuple[int, int]] = {
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2),
    "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
    "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
    "IQ4_NL": (32, 18), "IQ4_XS": (256, 136), "MXFP4": (32, 17),
}
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)   # e2m1 doubled (ggml's kvalues)


def row_bytes(qtype: str, cols: int) -> int:
    """Bytes of one row of ``cols`` values of type ``qtype`` (``cols`` a multiple of its block)."""
    block, size = BLOCKS[qtype]
    return cols // block * size


def row_values(qtype: str, nbytes: int) -> int:
    """Values in one row of ``nbytes`` bytes of type ``qtype``."""
    block, size = BLOCKS[qtype]
    return nbytes // size * block


def dequantize(data: torch.Tensor, qtype: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``uint8 [..., rows, row_bytes]`` of ggml type ``qtype`` -> ``[..., rows, cols]`` in ``dtype``.

    Computed in float32 on ``data``'s device, then cast (as transformers casts gguf-py's float32)."""
    if qtype in ("F32", "F16", "BF16"):
        values = _FLOATS[qtype](data)
    else:
        block, size = BLOCKS[qtype]
        *lead, rows, nbytes = data.shape
        blocks = data.reshape(-1, size)                                     # [n, type_size]
        values = _DEQUANTIZERS[qtype](blocks).reshape(*lead, rows, nbytes // size * block)
    return values if values.dtype == dtype else values.to(dtype)


# ---- helpers ---------------------------------------------------------------------------------

def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte ``at`` of every block, as float32 ``[n, 1]``."""
    return blocks[:, at:at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, half: int) -> torch.Tensor:
    """``[n, ..., half]`` bytes -> ``[n, ..., 2 * half]`` 4-bit codes: the low nibbles, then the high."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _table(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: 12 bytes -> eight 6-bit scales and eight 6-bit mins (``Q4_K.get_scale_min``)."""
    d, m, m_d = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _bits(qh: torch.Tensor, count: int) -> torch.Tensor:
    """``[n, count // 8]`` bytes read as one little-endian bit field -> ``[n, count]`` bits (0/1, uint8)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=qh.device)
    return ((qh.unsqueeze(-1) >> shifts) & 1).reshape(qh.shape[0], count)


# ---- the block types ---------------------------------------------------------------------------

def _q4_0(b):
    d = _f16(b, 0)
    q = _nibbles(b[:, 2:], 16).to(torch.int8) - 8
    return d * q.float()


def _q4_1(b):
    d, m = _f16(b, 0), _f16(b, 2)
    q = _nibbles(b[:, 4:], 16).float()
    return (d * q) + m


def _q5(b, at):
    qh = _bits(b[:, at:at + 4], 32)
    ql = _nibbles(b[:, at + 4:], 16)
    return ql | (qh << 4)


def _q5_0(b):
    d = _f16(b, 0)
    q = _q5(b, 2).to(torch.int8) - 16
    return d * q.float()


def _q5_1(b):
    d, m = _f16(b, 0), _f16(b, 2)
    q = _q5(b, 4).float()
    return (d * q) + m


def _q8_0(b):
    d = _f16(b, 0)
    x = b[:, 2:].contiguous().view(torch.int8).float()
    return x * d


def _q2_k(b):
    n = b.shape[0]
    scales, qs = b[:, :16], b[:, 16:80]
    d, dmin = _f16(b, 80), _f16(b, 82)
    dl = (d * (scales & 0xF).float()).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).float()).reshape(n, 16, 1)
    shift = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).reshape(1, 1, 4, 1)
    q = ((qs.reshape(n, -1, 1, 32) >> shift) & 3).reshape(n, 16, 16).float()
    return (dl * q - ml).reshape(n, QK_K)


def _q3_k(b):
    n = b.shape[0]
    hmask, qs, scales = b[:, :32], b[:, 32:96], b[:, 96:108]
    d = _f16(b, 108)
    lscales = (scales[:, :8].reshape(n, 1, 8) >> torch.tensor([0, 4], dtype=torch.uint8, device=b.device)
               .reshape(1, 2, 1)).reshape(n, 16)
    hscales = (scales[:, 8:12].reshape(n, 1, 4) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device)
               .reshape(1, 4, 1)).reshape(n, 16)
    sc = ((lscales & 0x0F) | ((hscales & 0x03) << 4)).to(torch.int8) - 32
    dl = (d * sc.float()).reshape(n, 16, 1)
    ql = (qs.reshape(n, -1, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device)
          .reshape(1, 1, 4, 1)).reshape(n, 16, 16) & 3
    qh = (hmask.reshape(n, -1, 1, 32) >> torch.arange(8, dtype=torch.uint8, device=b.device)
          .reshape(1, 1, 8, 1)).reshape(n, 16, 16) & 1
    qh = qh ^ 1                          # the offset is 4 where the mask bit is 0
    q = (ql.to(torch.int8) - (qh << 2).to(torch.int8)).float()
    return (dl * q).reshape(n, QK_K)


def _k4_scales(b, n: int):
    """Q4_K / Q5_K super-block header: per sub-block scale ``d`` and offset ``dm``, ``[n, 8, 1]``."""
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _scale_min_k4(b[:, 4:16])
    return (d * sc.float()).reshape(n, -1, 1), (dmin * mn.float()).reshape(n, -1, 1)


def _q4_k(b):
    n = b.shape[0]
    d, dm = _k4_scales(b, n)
    q = _nibbles(b[:, 16:].reshape(n, 4, 32), 32).reshape(n, 8, 32).float()
    return (d * q - dm).reshape(n, QK_K)


def _q5_k(b):
    n = b.shape[0]
    d, dm = _k4_scales(b, n)
    qh, qs = b[:, 16:48], b[:, 48:]
    ql = _nibbles(qs.reshape(n, 4, 32), 32).reshape(n, 8, 32)
    hi = ((qh.reshape(n, 1, 32) >> torch.arange(8, dtype=torch.uint8, device=b.device).reshape(1, 8, 1)) & 1)
    q = (ql | (hi << 4)).float()
    return (d * q - dm).reshape(n, QK_K)


def _q6_k(b):
    n = b.shape[0]
    ql, qh, scales = b[:, :128], b[:, 128:192], b[:, 192:208]
    d = _f16(b, 208)
    d = (d * scales.contiguous().view(torch.int8).float()).reshape(n, 16, 1)
    lo = _nibbles(ql.reshape(n, 2, 64), 64).reshape(n, 8, 32)             # per 128 values: low nibbles, then high
    hi = ((qh.reshape(n, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device)
           .reshape(1, 1, 4, 1)) & 3).reshape(n, 8, 32)
    q = (lo | (hi << 4)).to(torch.int8) - 32
    return (d * q.reshape(n, 16, 16).float()).reshape(n, QK_K)


def _iq4_nl(b):
    d = _f16(b, 0)
    q = _nibbles(b[:, 2:], 16).long()
    return d * _table(IQ4_VALUES, b.device)[q]


def _iq4_xs(b):
    n = b.shape[0]
    d = _f16(b, 0)
    scales_h = b[:, 2].long() | (b[:, 3].long() << 8)                     # uint16, little-endian
    scales_l = b[:, 4:8]
    lo = torch.stack([scales_l & 0x0F, scales_l >> 4], dim=-1).reshape(n, 8)
    hi = (scales_h.unsqueeze(-1) >> torch.arange(0, 16, 2, device=b.device)) & 0x03
    sc = (lo.long() | (hi << 4)).to(torch.int8) - 32
    dl = (d * sc.float()).reshape(n, 8, 1)
    q = _nibbles(b[:, 8:].reshape(n, 8, 16), 16).long()                  # [n, 8, 32]
    return (dl * _table(IQ4_VALUES, b.device)[q]).reshape(n, QK_K)


def _mxfp4(b):
    e = b[:, :1].to(torch.int32)
    bits = torch.where(e < 2, torch.tensor(0x00200000, dtype=torch.int32, device=b.device) << e, (e - 1) << 23)
    d = bits.view(torch.float32)                                          # 2^(e-128): half the E8M0 scale
    q = _nibbles(b[:, 1:], 16).long()
    return d * _table(MXFP4_VALUES, b.device)[q]


_DEQUANTIZERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
    "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
    "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs, "MXFP4": _mxfp4,
}


def _bf16(data):
    return (data.contiguous().view(torch.int16).to(torch.int32) << 16).view(torch.float32)


_FLOATS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "F32": lambda data: data.contiguous().view(torch.float32),
    "F16": lambda data: data.contiguous().view(torch.float16).float(),
    "BF16": _bf16,
}
