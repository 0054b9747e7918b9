"""A unit: tensors the store moves together, and the state the store keeps about them.

One module's weights, or one expert of a fused ``[E, ...]`` expert parameter. The store
(:class:`~kinject.engine.store.TensorStore`) creates units, and only the store writes the
fields below "state, guarded by the store's lock"; the disk runs, the host cache and the
landing slabs read the fields they are handed units for (docs/architecture.md, "Where each
concept lives").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kinject.engine.slabs import Slab
    from kinject.engine.transfer_handles import TransferHandle


@dataclass(eq=False)
class Unit:
    """Tensors that move together. ``tensors``: role -> host tensor (device/host tier) or
    :class:`~kinject.engine.disk_sources.DiskTensor` (disk tier). ``dtype``: compute dtype of the materialised copy."""

    name: str
    tier: str
    tensors: dict[str, Any]
    layer: int | None = None
    dtype: torch.dtype | None = None
    nbytes: int = 0                                   # bytes when materialised on the device
    # --- state, guarded by the store's lock
    device: dict[str, torch.Tensor] | None = None     # materialised copy (resident units: always)
    handle: TransferHandle | None = None              # in-flight transfer producing ``device``
    refs: int = 0
    reserved: bool = False                            # bytes counted against the budget
    last_use: int = 0
    loads: int = 0                                    # times fetched from its tier
    wire_nbytes: int = 0                              # bytes moved from its tier per load (packed, if quantized)
    compute_nbytes: int = 0                           # bytes of the tensors acquire hands out (dequantized)
    quant: dict[str, tuple] | None = None             # role -> (shape, dtype, QuantSpec or StoredFormat) of stored roles
    stored: dict[str, Any] | None = None              # role -> how it is rebuilt from its parts (StoredSource, HQQFormat)
    dequantized: dict[str, torch.Tensor] | None = None  # device tensors after dequantization (while materialised)
    host_cache: dict[str, torch.Tensor] | None = None  # disk units: their tensors in host memory (cache or read-ahead)
    cached: bool = False                              # host_cache is (or will be, once read) a host cache entry
    reading_ahead: bool = False
    owner: str | None = None                          # who registered it (loads counted per owner)
    in_place: bool | None = None                      # host tensors usable on the device as they are (cached)
    host_as_is: bool | None = None                    # host tensors already in the compute dtype (cached)
    extent: tuple | None = None                       # disk units: ((file, start, end), ...) of its bytes (cached)
    stack: tuple[str, int] | None = None              # (stack, index): units moved together share a slab
    slab: Slab | None = None                          # the landing slab its device tensors are views of
    workspace: Slab | None = None                     # the slab its dequantized tensors are views of
    holders: int = 1                                  # operators bound to it (weights tied across modules)
    tie_key: tuple | None = None                      # the tied tensor set it is registered for (TensorStore.tie)
    every_step: bool = False                          # its module runs every forward (not a routed expert)
    host_compute: bool = False                        # its operator can compute it where it lives (only
                                                      # activations cross the link when it is not kept)
    kept: bool = False                                # kept on the device by the residency plan (TensorStore.keep)
    offloaded: bool = field(init=False)               # not on the device tier (an attribute: asked per use)

    def __post_init__(self) -> None:
        self.offloaded = self.tier != "device"

    def __repr__(self) -> str:
        return f"Unit({self.name!r}, tier={self.tier}, {self.nbytes} B, refs={self.refs})"

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of the tensors :meth:`TensorStore.acquire` hands out (stored roles dequantized)."""
        if self.dtype is not None:
            return self.dtype
        if self.quant:
            return next(iter(self.quant.values()))[1]
        return next(iter(self.tensors.values())).dtype
