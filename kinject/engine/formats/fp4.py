"""FP4 (e2m1) weights with block scales: NVFP4 and MXFP4 as compressed-tensors and NVIDIA ModelOpt
ship them (docs/architecture.md "Stored formats").

Two e2m1 codes per byte, the even column in the low nibble, in every layout:

* compressed-tensors ``format: nvfp4-pack-quantized`` (``weight_packed`` uint8 ``[out, in/2]``,
  ``weight_scale`` float8_e4m3fn ``[out, in/16]``, ``weight_global_scale`` float32 ``[1]``, a
  *divisor*) and ``mxfp4-pack-quantized`` (``weight_scale`` uint8 E8M0 exponents ``[out, in/32]``,
  no global scale). :class:`CompressedFP4Format` dequantizes in the arithmetic of compressed-tensors'
  ``NVFP4PackedCompressor.decompress`` / ``MXFP4PackedCompressor``: codes and scales in bfloat16,
  ``scale / global_scale`` promoted to float32, the product rounded to bfloat16.
* ModelOpt ``quant_method: modelopt``, ``quant_algo: NVFP4`` (config.json or hf_quant_config.json):
  ``weight`` uint8 ``[out, in/2]``, ``weight_scale`` float8_e4m3fn ``[out, in/16]``,
  ``weight_scale_2`` float32 scalar, a *multiplier*; one set per expert. :class:`ModelOptNVFP4Format`
  dequantizes by NVIDIA's formula ``e2m1 * (float(weight_scale) * weight_scale_2)`` in float32.

Each layout's encoder (``quantize_*``: float weight -> its storage tensors) is here too, for writers
and for quantizing a float checkpoint by rule.
"""

from __future__ import annotations

import fnmatch
from typing import ClassVar

import torch

from kinject.engine.formats.base import FormatError, Layout, StoredFormat
from kinject.formatting import format_shape
from kinject.engine.formats.compressed_tensors import CompressedTensorsFormat

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)              # magnitude index -> value (bit 3: sign)
NVFP4_GROUP, MXFP4_GROUP = 16, 32
FP8_MAX, FP4_MAX = 448.0, 6.0
FP4_FORMATS = {"nvfp4-pack-quantized": NVFP4_GROUP, "mxfp4-pack-quantized": MXFP4_GROUP}


def unpack_e2m1(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``uint8 [..., n]`` -> ``[..., 2n]`` e2m1 values in ``dtype`` (low nibble first, as
    compressed-tensors' ``unpack_fp4_from_uint8`` and ModelOpt store them)."""
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)
    table = torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=torch.float32, device=packed.device)
    return table[codes.long()].to(dtype)


def pack_e2m1(values: torch.Tensor) -> torch.Tensor:
    """``[..., 2n]`` values already on the e2m1 grid -> ``uint8 [..., n]``, even column low."""
    grid = torch.tensor(E2M1, dtype=torch.float32, device=values.device)
    v = values.to(torch.float32)
    index = (v.abs().unsqueeze(-1) - grid).abs().argmin(-1).to(torch.uint8)
    codes = index | (torch.signbit(v).to(torch.uint8) << 3)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 value of each element (ties to the lower magnitude), clamped to +-6."""
    grid = torch.tensor(E2M1, dtype=torch.float32, device=x.device)
    index = (x.abs().clamp(max=FP4_MAX).unsqueeze(-1) - grid).abs().argmin(-1)
    return grid[index] * torch.where(x < 0, -1.0, 1.0)


# ---- encoders ---------------------------------------------------------------------------------

def quantize_nvfp4(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """``[out, in]`` -> compressed-tensors NVFP4 parts: global scale ``448 * 6 / amax`` (a divisor),
    per-16 e4m3 scales ``amax / 6 * global``, codes against the stored scales."""
    w = weight.detach().to(torch.float32)
    global_scale = (FP8_MAX * FP4_MAX / w.abs().amax().clamp(min=1e-12)).reshape(1)
    groups = w.unflatten(-1, (-1, NVFP4_GROUP))
    scale = (groups.abs().amax(-1) / FP4_MAX * global_scale).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
    effective = (scale.to(torch.float32) / global_scale).clamp(min=1e-30).unsqueeze(-1)
    codes = round_e2m1(groups / effective).flatten(-2)
    return {"weight_packed": pack_e2m1(codes), "weight_scale": scale, "weight_global_scale": global_scale}


def quantize_mxfp4_pack(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """``[out, in]`` -> compressed-tensors MXFP4 parts: per-32 E8M0 exponents (bias 127) of
    ``amax / 6`` rounded up to a power of two, codes against them."""
    w = weight.detach().to(torch.float32)
    groups = w.unflatten(-1, (-1, MXFP4_GROUP))
    exponent = torch.ceil(torch.log2((groups.abs().amax(-1) / FP4_MAX).clamp(min=2.0 ** -126)))
    scale = (exponent + 127).clamp(0, 254).to(torch.uint8)
    codes = round_e2m1(groups / torch.exp2(exponent).unsqueeze(-1)).flatten(-2)
    return {"weight_packed": pack_e2m1(codes), "weight_scale": scale}


def quantize_modelopt_nvfp4(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """``[out, in]`` -> ModelOpt NVFP4 parts: ``weight_scale_2 = amax / (6 * 448)`` (a multiplier),
    per-16 e4m3 scales ``amax / 6 / weight_scale_2``, codes against the stored scales."""
    w = weight.detach().to(torch.float32)
    scale_2 = (w.abs().amax().clamp(min=1e-12) / (FP4_MAX * FP8_MAX)).reshape(())
    groups = w.unflatten(-1, (-1, NVFP4_GROUP))
    scale = (groups.abs().amax(-1) / FP4_MAX / scale_2).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
    effective = (scale.to(torch.float32) * scale_2).clamp(min=1e-30).unsqueeze(-1)
    codes = round_e2m1(groups / effective).flatten(-2)
    return {"weight": pack_e2m1(codes), "weight_scale": scale, "weight_scale_2": scale_2}


ENCODERS = {"nvfp4-pack-quantized": quantize_nvfp4, "mxfp4-pack-quantized": quantize_mxfp4_pack,
            "modelopt-nvfp4": quantize_modelopt_nvfp4}


def quantize(weight: torch.Tensor, fmt: str = "nvfp4-pack-quantized") -> dict[str, torch.Tensor]:
    """``[out, in]`` float weight -> the storage tensors of ``fmt`` (a key of :data:`ENCODERS`), by role."""
    if fmt not in ENCODERS:
        raise FormatError(f"FP4 format {fmt!r} has no encoder (supported: {', '.join(ENCODERS)})")
    if weight.dim() != 2 or weight.shape[-1] % (MXFP4_GROUP if fmt.startswith("mxfp4") else NVFP4_GROUP):
        raise FormatError(f"{fmt}: weight of shape {format_shape(weight.shape)} is not 2-D with in-features a multiple "
                          f"of its group")
    return ENCODERS[fmt](weight)


# ---- compressed-tensors nvfp4-pack-quantized / mxfp4-pack-quantized -----------------------------

class CompressedFP4Format(CompressedTensorsFormat):
    """compressed-tensors FP4 (``nvfp4-pack-quantized``, ``mxfp4-pack-quantized``): the weights of
    weight-only (NVFP4A16) and W4A4 (NVFP4) releases; activations are not quantized (the model dtype),
    as weight-only FP4 kernels (vLLM's Marlin path on GPUs without FP4 units) run W4A4 releases."""

    storage_suffixes: ClassVar[tuple[str, ...]] = ("weight_packed", "weight_scale", "weight_global_scale",
                                                   "input_global_scale")

    def __init__(self, fmt: str, groups: list[dict], ignore: tuple[str, ...], where: str, module_class=None):
        super().__init__(groups, ignore, where, module_class)
        self.fmt = fmt
        self.group_size = FP4_FORMATS[fmt]

    @classmethod
    def accepts(cls, qconfig: dict) -> bool:
        return qconfig.get("format") in FP4_FORMATS

    @classmethod
    def from_config(cls, qconfig: dict, *, where: str) -> CompressedFP4Format:
        fmt = qconfig.get("format")
        if fmt not in FP4_FORMATS:
            raise FormatError(f"{where}: key 'format' = {fmt!r} is not an FP4 format ({', '.join(FP4_FORMATS)})")
        if qconfig.get("quantization_status", "compressed") != "compressed":
            raise FormatError(f"{where}: key 'quantization_status' = {qconfig['quantization_status']!r} is not "
                              "supported (supported: 'compressed')")
        groups = qconfig.get("config_groups") or {}
        if not groups:
            raise FormatError(f"{where}: key 'config_groups' is empty; nothing says how weights are stored")
        parsed = []
        for name, group in groups.items():
            at = f"{where}: config_groups.{name}"
            if group.get("format") not in (None, fmt):
                raise FormatError(f"{at}: key 'format' = {group['format']!r}; mixed formats are not supported")
            if group.get("output_activations"):
                raise FormatError(f"{at}: key 'output_activations' is set; output quantization is not supported")
            acts = group.get("input_activations")
            if acts and (acts.get("num_bits") != 4 or acts.get("type") != "float"):
                raise FormatError(f"{at}: key 'input_activations' = {acts!r}: only FP4 activation schemes (NVFP4, "
                                  "MXFP4: weights read, activations kept in the model dtype) are supported")
            w = group.get("weights") or {}
            want = {"num_bits": 4, "type": "float", "group_size": FP4_FORMATS[fmt], "symmetric": True,
                    "strategy": "tensor_group" if fmt.startswith("nvfp4") else "group"}
            for key, value in want.items():
                if w.get(key, value) != value:
                    raise FormatError(f"{at}: key 'weights.{key}' = {w.get(key)!r} is not {fmt} "
                                      f"(expected {value!r})")
            if not group.get("targets"):
                raise FormatError(f"{at}: key 'targets' is empty")
            parsed.append({"name": name, "targets": tuple(group["targets"]), "num_bits": 4,
                           "strategy": want["strategy"], "group_size": want["group_size"], "symmetric": True,
                           "activations": bool(acts)})
        ignore = qconfig.get("ignore") or []
        return cls(fmt, parsed, tuple(ignore), where)

    def storage_keys(self, name: str) -> dict[str, str] | None:
        """Packed values, scales, NVFP4's global scale; a W4A4 group's ``input_global_scale`` too (kept,
        never read: activations stay in the model dtype, as weight-only FP4 kernels run such releases)."""
        group = self.group_of(name)
        if group is None:
            return None
        module = name.rpartition(".")[0]
        nvfp4 = self.fmt.startswith("nvfp4")
        parts = ["weight_packed", "weight_scale"] + (["weight_global_scale"] if nvfp4 else [])
        parts += ["input_global_scale"] if nvfp4 and group["activations"] else []
        return {part: f"{module}.{part}" for part in parts}

    def logical_shape(self, name: str, parts: Layout) -> tuple[int, int]:
        out, half = (int(d) for d in parts["weight_packed"][0][-2:])
        return out, half * 2

    def check(self, name: str, parts: Layout, shape: tuple[int, ...]) -> None:
        keys = self.storage_keys(name)
        if keys is None:
            raise FormatError(f"{self.where}: tensor '{name}' is not quantized by any config group")
        missing = sorted(set(keys) - set(parts))
        if missing:
            raise FormatError(f"{self.where}: tensor '{keys[missing[0]]}' is missing ({name} is stored {self.fmt})")
        if len(shape) != 2 or shape[1] % self.group_size:
            raise FormatError(f"tensor '{name}': shape {format_shape(shape)} cannot be stored {self.fmt} "
                              f"(2-D, in-features a multiple of {self.group_size})")
        out, cols = shape
        scale_dtype = torch.float8_e4m3fn if self.fmt.startswith("nvfp4") else torch.uint8
        expected = {"weight_packed": ((out, cols // 2), torch.uint8),
                    "weight_scale": ((out, cols // self.group_size), scale_dtype),
                    "weight_global_scale": ((1,), torch.float32), "input_global_scale": ((1,), torch.float32)}
        _check_parts(name, keys, parts, expected, scalar=("input_global_scale",))

    def dequantize(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """compressed-tensors' decompression: e2m1 and scale in bfloat16, ``scale / global_scale``
        (float32), products rounded to bfloat16, then ``dtype``."""
        packed, scale = parts["weight_packed"], parts["weight_scale"]            # [..., out, in/2], [..., out, G]
        values = unpack_e2m1(packed, torch.bfloat16)                           # [..., out, in]
        if self.fmt.startswith("nvfp4"):
            scale = scale.to(torch.bfloat16)
            glob = parts["weight_global_scale"]
            scale = scale / glob.reshape(*scale.shape[:-2], 1, 1)              # float32, as the [1] divisor promotes
        else:
            scale = 2.0 ** (scale.to(torch.int32) - 127).to(torch.bfloat16)     # decompress_mx_scale
        groups = scale.shape[-1]
        w = values.unflatten(-1, (groups, -1)).to(scale.dtype) * scale.unsqueeze(-1)
        return w.to(torch.bfloat16).flatten(-2).to(dtype)

    def describe(self) -> str:
        return f"compressed-tensors {self.fmt}"


# ---- NVIDIA ModelOpt NVFP4 --------------------------------------------------------------------

class ModelOptNVFP4Format(StoredFormat):
    """ModelOpt NVFP4 (``quant_method: modelopt``, ``quant_algo: NVFP4``): packed ``weight``,
    e4m3 ``weight_scale`` per 16, float32 ``weight_scale_2`` multiplier, per (expert) Linear."""

    method: ClassVar[str] = "modelopt"
    packs_values: ClassVar[bool] = True           # ``weight`` holds packed bytes, not the weight's shape
    storage_suffixes: ClassVar[tuple[str, ...]] = ("weight_scale", "weight_scale_2", "input_scale")

    def __init__(self, exclude: tuple[str, ...], group_size: int, where: str, activations: bool):
        self.exclude, self.group_size, self.where, self.activations = exclude, group_size, where, activations

    @classmethod
    def from_config(cls, qconfig: dict, *, where: str) -> ModelOptNVFP4Format:
        algo = qconfig.get("quant_algo")
        if algo != "NVFP4":
            raise FormatError(f"{where}: quantization_config.quant_algo = {algo!r} is not supported for quant_method "
                              "'modelopt' (supported: 'NVFP4')")
        group = qconfig.get("group_size", NVFP4_GROUP)
        if group != NVFP4_GROUP:
            raise FormatError(f"{where}: quantization_config.group_size = {group!r}; NVFP4 groups are 16")
        exclude = qconfig.get("exclude_modules") or qconfig.get("ignore") or []
        kv = qconfig.get("kv_cache_quant_algo")
        if kv not in (None, "none", "NONE"):
            raise FormatError(f"{where}: quantization_config.kv_cache_quant_algo = {kv!r} is not supported")
        return cls(tuple(exclude), group, where, activations=True)

    def _quantized(self, module: str) -> bool:
        return not any(fnmatch.fnmatchcase(module, p) or module == p for p in self.exclude)

    def storage_keys(self, name: str) -> dict[str, str] | None:
        if not name.endswith(".weight"):
            return None
        module = name[: -len(".weight")]
        if not self._quantized(module):
            return None
        keys = {"weight": name, "weight_scale": f"{module}.weight_scale", "weight_scale_2": f"{module}.weight_scale_2"}
        if self.activations:        # NVFP4 (W4A4) exports scale activations too; weight dequantization never reads it
            keys["input_scale"] = f"{module}.input_scale"
        return keys

    def weight_name(self, key: str) -> str | None:
        for suffix in ("weight_scale_2", "weight_scale", "input_scale"):
            if key.endswith("." + suffix):
                name = key[: -len(suffix)] + "weight"
                return name if self.storage_keys(name) else None
        return None

    def logical_shape(self, name: str, parts: Layout) -> tuple[int, int]:
        out, half = (int(d) for d in parts["weight"][0][-2:])
        return out, half * 2

    def check(self, name: str, parts: Layout, shape: tuple[int, ...]) -> None:
        keys = self.storage_keys(name) or {}
        missing = sorted(set(keys) - set(parts))
        if missing:
            what = "global scale" if missing[0] == "weight_scale_2" else missing[0]
            raise FormatError(f"{self.where}: tensor '{keys[missing[0]]}' ({what} of {name}) is missing")
        shape = tuple(shape)
        if len(shape) != 2 or shape[1] % self.group_size:
            raise FormatError(f"tensor '{name}': shape {format_shape(shape)} cannot be stored NVFP4 "
                              f"(2-D, in-features a multiple of {self.group_size})")
        out, cols = shape
        expected = {"weight": ((out, cols // 2), torch.uint8),
                    "weight_scale": ((out, cols // self.group_size), torch.float8_e4m3fn),
                    "weight_scale_2": ((), torch.float32), "input_scale": ((), torch.float32)}
        _check_parts(name, keys, parts, expected, scalar=("weight_scale_2", "input_scale"))

    def dequantize(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """``e2m1 * (float32(weight_scale) * weight_scale_2)`` in float32, then ``dtype``."""
        packed, scale = parts["weight"], parts["weight_scale"]
        values = unpack_e2m1(packed, torch.float32)                            # [..., out, in]
        scale_2 = parts["weight_scale_2"].to(torch.float32).reshape(*scale.shape[:-2], 1, 1)
        block = scale.to(torch.float32) * scale_2                               # [..., out, G]
        w = values.unflatten(-1, (block.shape[-1], -1)) * block.unsqueeze(-1)
        return w.flatten(-2).to(dtype)

    def describe(self) -> str:
        return "modelopt NVFP4"


def _check_parts(name: str, keys: dict[str, str], parts: Layout, expected: dict, scalar: tuple[str, ...] = ()) -> None:
    """Refuse a storage tensor of the wrong dtype or a shape that does not fit ``name``, naming it."""
    for role, key in keys.items():
        got_shape, got_dtype = tuple(int(d) for d in parts[role][0]), parts[role][1]
        want_shape, want_dtype = expected[role]
        if got_dtype != want_dtype:
            raise FormatError(f"tensor '{key}': dtype {str(got_dtype).removeprefix('torch.')}, expected "
                              f"{str(want_dtype).removeprefix('torch.')}")
        fits = got_shape == want_shape or (role in scalar or role == "weight_global_scale") and got_shape in ((), (1,))
        if not fits:
            raise FormatError(f"tensor '{key}': shape {format_shape(got_shape)} does not fit {name} "
                              f"(expected {format_shape(want_shape)})")
