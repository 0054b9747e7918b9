"""StreamingLLM's KV policy for kinject's cache: attention sinks + a recent window, with the
original RoPE positions kept (what is evicted is never seen again)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kinject.errors import KinjectError

_FAR = 1 << 62          # "no such position" for sink slots not (yet) filled

# ---------------------------------------------------------------------------------------- policy


@dataclass(frozen=True)
class StreamingKV:
    """StreamingLLM's KV policy: keep ``sink`` attention sinks and a recent ``window``.

    Rule (every token, prefill included): the query at slot ``t`` attends to the key at slot ``s``
    iff ``s`` is a real (non-padding) token, ``s <= t``, and ``s`` is one of the first ``sink`` real
    tokens of its row or ``s > t - window`` (the window counts the query itself). Sinks are per
    row -- with left padding the first real token, not slot 0. A layer therefore stores the row's
    sinks plus the last ``window - 1`` slots (a ring), never more.

    Positions: kinject keeps the *original* positions. StreamingLLM re-indexes positions inside the
    cache (RoPE applied after retrieval, distances capped at the cache size); transformers'
    attention modules apply RoPE to keys *before* ``cache.update``, and kinject runs those modules
    unchanged (docs/architecture.md, "StreamingKV"), so cached keys carry the rotation of their original position and
    queries use their true position (from ``generate``'s ``position_ids``). Relative distances to
    the sinks therefore keep growing: fine within the model's trained context, and the difference
    from re-indexing beyond it. Works on full-attention layers; sliding layers (GPT-OSS) are already
    bounded and keep their own policy.

    The operator builds the attention mask for these layers itself (``attention_mask``): the kept
    slots are not a contiguous range, which transformers' mask code cannot express. Usable on any
    KV tier (``device``: no offload).
    """

    sink: int = 4
    window: int = 1024

    def __post_init__(self) -> None:
        if not (isinstance(self.sink, int) and self.sink >= 0):
            raise ValueError(f"StreamingKV sink must be an integer >= 0, got {self.sink!r}")
        if not (isinstance(self.window, int) and self.window >= 1):
            raise ValueError(f"StreamingKV window must be an integer >= 1, got {self.window!r}")

    @property
    def recent(self) -> int:
        """Entries kept in the recent ring between steps (the next query is the window's last)."""
        return self.window - 1

    def meta(self, mask2d: torch.Tensor | None, batch: int, total: int, device) -> "StreamingMeta":
        """Per-step facts about every slot ``< total`` of every row, from the 2-D padding mask."""
        if mask2d is None:
            real = torch.ones(batch, total, dtype=torch.bool, device=device)
        else:
            if tuple(mask2d.shape) != (batch, total):
                raise KinjectError(f"StreamingKV: the 2-D attention mask has shape {tuple(mask2d.shape)}, expected "
                                   f"({batch}, {total}) (rows, cached + new tokens)")
            real = mask2d.to(device=device, dtype=torch.bool)
        sinkflag = real & (real.long().cumsum(-1) <= self.sink)                      # [B, T+q]
        pos = torch.arange(total, device=device)
        cand = torch.where(sinkflag, pos, torch.full_like(pos, _FAR)).sort(-1).values  # [B, T+q]
        sink_abs = torch.full((batch, self.sink), _FAR, dtype=torch.long, device=device)
        n = min(self.sink, total)
        sink_abs[:, :n] = cand[:, :n]                                                   # [B, sink]
        return StreamingMeta(real, sinkflag, sink_abs)

    def attention_mask(self, meta: "StreamingMeta", rows: slice, seen: int, count: int, q: int, *,
                       sliding_window: int | None = None) -> torch.Tensor:
        """Boolean ``[b, 1, q, sink + count + q]`` mask for one micro-batch whose keys are laid out as
        ``[sinks | recent ring (slots seen-count .. seen-1) | new (slots seen .. seen+q-1)]``."""
        dev = meta.real.device
        real, sf = meta.real[rows], meta.sinkflag[rows]                                 # [b, T+q]
        b = real.shape[0]
        sink_abs = meta.sink_abs[rows]                                                  # [b, S]
        rec = torch.arange(seen - count, seen, device=dev)                              # [count]
        new = torch.arange(seen, seen + q, device=dev)                                  # [q]
        key_abs = torch.cat([sink_abs, rec.expand(b, -1), new.expand(b, -1)], 1)        # [b, K]
        ok = torch.cat([sink_abs < seen,                          # sinks stored before this step
                        real[:, rec] & ~sf[:, rec],               # ring copies of sinks are duplicates
                        real[:, new]], 1)                                               # [b, K]
        is_sink = torch.cat([torch.ones_like(sink_abs, dtype=torch.bool),
                             torch.zeros(b, count, dtype=torch.bool, device=dev), sf[:, new]], 1)
        t = new[None, :, None]                                                          # [1, q, 1]
        k = key_abs[:, None, :]                                                         # [b, 1, K]
        allowed = ok[:, None, :] & (k <= t) & (is_sink[:, None, :] | (k > t - self.window))
        if sliding_window is not None:
            allowed &= k > t - sliding_window
        return allowed[:, None]                                                         # [b, 1, q, K]

    def absorb_sinks(self, meta: "StreamingMeta", rows: slice, seen: int, q: int,
                     sinks: torch.Tensor, new: torch.Tensor) -> None:
        """Copy this step's new entries that are sinks into ``sinks`` (``[S, b, ...]``), in place.
        ``new``: ``[q, b, ...]``, the entries of slots ``seen .. seen+q-1``."""
        sink_abs = meta.sink_abs[rows]                                                  # [b, S]
        b, s = sink_abs.shape
        if s == 0:
            return
        take = (sink_abs >= seen) & (sink_abs < seen + q)                               # [b, S]
        idx = (sink_abs - seen).clamp(0, q - 1)                                         # [b, S]
        picked = new[idx, torch.arange(b, device=idx.device)[:, None]].transpose(0, 1)  # [S, b, ...]
        keep = take.t().reshape(s, b, *([1] * (new.dim() - 2)))
        sinks.copy_(torch.where(keep, picked, sinks))


@dataclass
class StreamingMeta:
    real: torch.Tensor       # [B, T+q] bool: slot holds a real token
    sinkflag: torch.Tensor   # [B, T+q] bool: slot is one of the row's first `sink` real tokens
    sink_abs: torch.Tensor   # [B, sink] long: slots of the sinks, _FAR where none (yet)

    def to(self, device) -> "StreamingMeta":
        """The same facts on ``device`` (host compute absorbs sinks where the KV is stored)."""
        return StreamingMeta(self.real.to(device), self.sinkflag.to(device), self.sink_abs.to(device))
