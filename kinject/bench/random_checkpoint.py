"""A checkpoint index of seeded random weights: a GPU benchmark of a model too big to download.

:class:`RandomIndex` has the interface ``kinject.io.loading`` uses from a
:class:`~kinject.io.checkpoint.CheckpointIndex` (``names``, ``source``, ``expert_source``,
``is_fused_expert``); its sources fill tensors with seeded random values, straight into pinned host
memory, in parallel chunks. Every contender of ``kinject bench gpu`` is made from one index, so
their host tiers hold the same pinned tensors (one copy of the weights in host memory).
"""

from __future__ import annotations

import hashlib
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn

from kinject.io.checkpoint import fused_expert_names

# Random init: std = gain / sqrt(fan_in). INIT_GAIN is HF's initializer_range (0.02) at Mixtral's
# hidden size 4096, so smaller dims behave alike; routers get a decisive spread (as in
# kinject.testing) so bf16 rounding differences rarely flip top-k choices.
INIT_GAIN = 0.02 * math.sqrt(4096)
ROUTER_GAIN = 4.0
CHUNK = 1 << 22                      # elements per independently seeded chunk

def _chunk_seed(seed: int, name: str, expert: int | None, chunk: int) -> int:
    digest = hashlib.blake2b(f"{seed}|{name}|{expert}|{chunk}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def init_std(name: str, shape: tuple[int, ...]) -> float | None:
    """Std of the normal a tensor is drawn from; None: ones (norm weights, 1-D tensors)."""
    if len(shape) < 2:
        return None
    gain = ROUTER_GAIN if name.endswith("mlp.gate.weight") else INIT_GAIN
    return gain / math.sqrt(shape[-1])


@dataclass(frozen=True, eq=False)
class RandomSource:
    """One tensor (or one expert's slice of a fused ``[E, ...]`` tensor) of a :class:`RandomIndex`;
    the same interface as :class:`kinject.engine.disk_sources.Source` (no file: ``pieces`` is empty)."""

    index: "RandomIndex"
    name: str
    expert: int | None
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    pieces: tuple = ()

    def in_memory(self, dtype: torch.dtype | None = None) -> torch.Tensor | None:
        """The index's cached tensor when it caches one of ``dtype`` (a reader may use it in place:
        every contender then holds the same pinned bytes); None where a read would make a new one."""
        if not self.index.cache or (dtype is not None and dtype != self.dtype):
            return None
        return self.index.tensor(self.name, self.expert)

    def read(self, dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor's values as ``dtype`` (default: the index's). Without ``out``: the index's
        cached (pinned, shared) tensor when it caches and the dtype matches; else a new one.
        With ``out`` (shape ``self.shape``): written into it, ``out`` returned."""
        if out is None:
            t = self.index.tensor(self.name, self.expert)
            return t if dtype is None or dtype == t.dtype else t.to(dtype)
        if tuple(out.shape) != tuple(self.shape):
            raise ValueError(f"read('{self.name}'): out has shape {tuple(out.shape)}, expected {self.shape}")
        if dtype is not None and dtype != out.dtype:
            raise ValueError(f"read('{self.name}'): dtype={dtype} but out is {out.dtype}")
        with torch.no_grad():
            self.index.fill_into(self.name, self.expert, out.detach())
        return out


class RandomIndex:
    """Seeded random weights for a meta-device model, with ``CheckpointIndex``'s interface.

    Every tensor is drawn in chunks of ``CHUNK`` elements, each from its own generator seeded by
    ``(seed, name, expert, chunk)``: the values depend on the seed only (not on threads or read
    order), and a fused expert tensor is exactly the stack of its experts' sources. ``pin``:
    allocate in pinned host memory (CUDA). ``cache``: keep every tensor once made and hand the
    same one to every reader (all contenders share one copy; readers must not write to it).
    """

    def __init__(self, model: nn.Module, *, seed: int = 0, dtype: torch.dtype | None = None, pin: bool = False,
                 cache: bool = True, threads: int | None = None):
        targets = dict(model.state_dict(keep_vars=True))
        self.seed, self.pin, self.cache = seed, pin, cache
        self.threads = threads or min(32, os.cpu_count() or 1)
        self.names: list[str] = list(targets)
        first: dict[int, str] = {}
        self._alias = {n: first.setdefault(id(t), n) for n, t in targets.items()}   # tied -> one name
        self._shape = {n: tuple(int(d) for d in t.shape) for n, t in targets.items()}
        self._dtype = {n: dtype if dtype is not None and t.dtype.is_floating_point else t.dtype
                       for n, t in targets.items()}
        self._fused = fused_expert_names(model, targets, {})
        self._tensors: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"RandomIndex(seed={self.seed}, {len(self.names)} tensors, pin={self.pin})"

    def __contains__(self, name: str) -> bool:
        return name in self._shape

    def __len__(self) -> int:
        return len(self.names)

    @property
    def nbytes(self) -> int:
        return sum(math.prod(self._shape[n]) * self._dtype[n].itemsize for n in self.names if self._alias[n] == n)

    # ---- the CheckpointIndex interface
    def _check(self, name: str) -> None:
        if name not in self._shape:
            raise KeyError(f"'{name}' is not a tensor of the indexed model")

    def is_fused_expert(self, name: str) -> bool:
        self._check(name)
        return name in self._fused

    def num_experts(self, name: str) -> int:
        if not self.is_fused_expert(name):
            raise ValueError(f"'{name}' is not a fused expert parameter")
        return self._shape[name][0]

    def source(self, name: str) -> RandomSource:
        self._check(name)
        shape, dtype = self._shape[name], self._dtype[name]
        return RandomSource(self, name, None, shape, dtype, math.prod(shape) * dtype.itemsize)

    def expert_source(self, name: str, expert: int) -> RandomSource:
        n = self.num_experts(name)
        if not 0 <= expert < n:
            raise IndexError(f"expert {expert} out of range for '{name}' ({n} experts)")
        shape, dtype = self._shape[name][1:], self._dtype[name]
        return RandomSource(self, name, expert, shape, dtype, math.prod(shape) * dtype.itemsize)

    def rows_source(self, name: str, start: int, stop: int, *, squeeze: bool = False):
        """Rows ``start .. stop`` of dim 0 (``CheckpointIndex.rows_source``): one expert of a fused
        tensor is its own source; any other range is cut from the whole tensor (no disk here)."""
        if squeeze and self.is_fused_expert(name):
            return self.expert_source(name, start)
        whole = self.source(name).read()
        return whole[start] if squeeze else whole[start:stop]

    # ---- values
    def _jobs(self, name: str, expert: int | None, out: torch.Tensor) -> list:
        """(flat view, std, seed) per chunk of ``out`` (the whole tensor, or expert ``expert``'s slice)."""
        key = self._alias[name]
        std = init_std(key, self._shape[key])
        if name in self._fused and expert is None:
            return [j for e in range(out.shape[0]) for j in self._jobs(name, e, out[e])]
        flat = out.view(-1)
        return [(flat[a:a + CHUNK], std, _chunk_seed(self.seed, key, expert, a // CHUNK))
                for a in range(0, flat.numel(), CHUNK)]

    @staticmethod
    def _run(job) -> None:
        view, std, seed = job
        if std is None:
            view.fill_(1.0)
        else:
            view.normal_(0.0, std, generator=torch.Generator().manual_seed(seed))

    def _run_all(self, jobs: list) -> None:
        if len(jobs) <= 1 or self.threads <= 1:
            for j in jobs:
                self._run(j)
            return
        with ThreadPoolExecutor(self.threads) as pool:      # torch ops release the GIL
            list(pool.map(self._run, jobs))

    def _empty(self, name: str) -> torch.Tensor:
        return torch.empty(self._shape[name], dtype=self._dtype[name], pin_memory=self.pin)

    def fill_into(self, name: str, expert: int | None, out: torch.Tensor) -> None:
        """Write the values of ``name`` (expert ``expert`` of it) into ``out`` (any dtype/device)."""
        self._check(name)
        cached = self._tensors.get(self._alias[name])
        if cached is not None:
            out.copy_(cached if expert is None else cached[expert])
            return
        direct = out.device.type == "cpu" and out.dtype == self._dtype[name] and out.is_contiguous()
        buf = out if direct else torch.empty(out.shape, dtype=self._dtype[name])
        self._run_all(self._jobs(name, expert, buf))
        if not direct:
            out.copy_(buf)

    def tensor(self, name: str, expert: int | None = None) -> torch.Tensor:
        """The values of ``name`` (expert ``expert``'s slice of it): cached and shared when ``cache``."""
        self._check(name)
        key = self._alias[name]
        if not self.cache:
            shape = self._shape[name] if expert is None else self._shape[name][1:]
            t = torch.empty(shape, dtype=self._dtype[name], pin_memory=self.pin)
            self._run_all(self._jobs(name, expert, t))
            return t
        with self._lock:
            t = self._tensors.get(key)
            if t is None:
                t = self._empty(name)
                self._run_all(self._jobs(name, None, t))
                self._tensors[key] = t
        return t if expert is None else t[expert]

    def materialize(self) -> float:
        """Make (and cache) every tensor, all chunks of all tensors in one parallel sweep; seconds."""
        t0 = time.perf_counter()
        jobs = []
        with self._lock:
            for name in self.names:
                if self._alias[name] != name or name in self._tensors:
                    continue
                t = self._tensors[name] = self._empty(name)
                jobs += self._jobs(name, None, t)
            self._run_all(jobs)
        return time.perf_counter() - t0
