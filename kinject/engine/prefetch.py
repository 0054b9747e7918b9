"""Expert correlation table and prefetch accuracy — Klotski §6.2 ("Correlation-aware Expert Prefetcher").

What the paper says (Klotski §6.2, quoted):

    "we record the correlations (i.e., frequency relationships) between experts activated by
    tokens at different layers through pre-run, resulting in a table. During inference, we use
    this table to determine each token's expert tendency in the current layer based on its
    selections in the previous l layers. [...] For the expert activation path of each token in
    the multi-batch, we look up the table to determine their expert tendencies in the current
    layer. We then aggregate the tendencies of all tokens across multiple batches and select the
    top-K experts for prefetching. K is by default equal to k in top-k"

    "the expert correlation table is updated during the inference so that expert prefetching can
    become more and more accurate [...] To prevent the prefetching tendencies of other tasks from
    influencing current tasks, we refrain from saving the updates to the file."

and §8: the table is built by a warm-up run (wikitext-2, batch 8, length 512), stored as JSON,
with path length ``l = 1``.

How kinject implements it
-------------------------
* **Layer ids.** ``layer`` everywhere in this module is the *decoder-layer index* — the ``N`` in
  ``model.layers.N.mlp`` — because that is what an operator knows from its module name. MoE
  layers may be non-contiguous (DeepSeek's first layer is dense): the table keeps the sorted
  sequence of MoE layer ids (given up front as ``layer_ids``, or learnt from the ids passed to
  :meth:`CorrelationTable.observe`) and the *previous* layer of ``L`` at path length ``l`` is the
  ``l``-th MoE layer id below ``L`` in that sequence (:meth:`CorrelationTable.prev_layer`).
* **Counting** (:meth:`CorrelationTable.observe`). For every token ``t`` of the batch group, every
  expert ``i`` it chose at ``prev_layer(L)`` and every expert ``j`` it chose at ``L``::

      counts[L][i, j] += 1          # co-occurrence, the paper's "frequency relationship"
      freq[L][j]      += 1          # marginal "frequency so far" (fallback, and layers with no predecessor)

* **Prediction** (:meth:`CorrelationTable.predict`), default ``mode="prob"``::

      P(j | i)  = counts[L][i, j] / sum_j' counts[L][i, j']          # row-normalised
      score[j]  = sum_t sum_{i in prev_choices[t]} P(j | i)
      hot       = top-K of score, ties -> lower expert id

  ``score[j]`` is the expected number of the batch group's tokens that route to ``j`` under the
  table, which is what "hot" means in the paper (the experts "engaged in most of the
  computations"). Row-normalising matters: raw counts (``mode="counts"``) weigh each previous
  expert ``i`` by how often ``i`` itself was chosen during warm-up, counting popularity twice.
  ``mode="vote"`` reproduces the Klotski authors' released code (MindSpore port) and the slides'
  example: each (token, previous expert ``i``) casts one vote for each of the top-``k`` experts
  of row ``i``. A row with no observations falls back to ``freq[L]`` (the paper's "frequency so
  far"); with no previous choices, or no data at all for ``L``, ``predict`` ranks by ``freq[L]``;
  with nothing at all it returns experts ``0..K-1``.

Ambiguity resolved: the paper's path length ``l`` means "the selections in the previous ``l``
layers" and notes that a larger ``l`` "would add dimension to path recording" — i.e. a table
keyed by the whole path (``E**(l+1)`` entries per layer). kinject keeps a 2-D table per layer and
reads ``l`` as the *distance* to the conditioning layer (``L - l`` in MoE-layer order). For the
paper's setting, ``l = 1`` (the only one evaluated), the two readings coincide.

Whether :meth:`observe` is applied during inference is the runtime's decision
(:attr:`CorrelationTable.online`); the paper updates online but never writes the updates back to
the file — use :meth:`CorrelationTable.copy` to keep the loaded table pristine.
"""

from __future__ import annotations

import copy as _copy
import json
from array import array
import math
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from kinject.errors import KinjectError

log = logging.getLogger(__name__)

FORMAT = "kinject.correlation/1"
MODES = ("prob", "vote", "counts")


def _as_choices(choices: Any, num_experts: int, what: str) -> torch.Tensor:
    """Router top-k indices -> LongTensor [T, k] on CPU; [T] is read as top-1."""
    if not isinstance(choices, torch.Tensor):
        try:
            choices = torch.as_tensor(choices, dtype=torch.long)
        except (TypeError, ValueError) as exc:
            raise KinjectError(f"{what}: expected a LongTensor [T, k] of expert indices, "
                               f"got {type(choices).__name__}") from exc
    if choices.is_floating_point() or choices.is_complex() or choices.dtype == torch.bool:
        raise KinjectError(f"{what}: expert indices must be an integer tensor, got dtype {choices.dtype}")
    if choices.dim() == 1:
        choices = choices[:, None]
    if choices.dim() != 2:
        raise KinjectError(f"{what}: expected shape [T, k] (tokens x top-k), got {tuple(choices.shape)}")
    if choices.requires_grad:
        choices = choices.detach()
    choices = choices.to("cpu", torch.long)        # the same tensor when it already is (callers keep it)
    if choices.numel():
        lo, hi = (int(v) for v in torch.aminmax(choices))
        if lo < 0 or hi >= num_experts:
            raise KinjectError(f"{what}: expert index out of range [0, {num_experts}): min {lo}, max {hi}")
    return choices


_SMALL = 256                               # up to this many experts a ranking is cheaper in Python


def _ranked(score: torch.Tensor, k: int, values: list | None = None) -> list[int]:
    """Indices of the k largest entries; ties -> lower index (stable sort on -score). ``values``:
    ``score.tolist()`` when the caller has it."""
    if values is not None or score.numel() <= _SMALL:   # small: in Python (one tolist instead of four tensor ops)
        s = values if values is not None else score.tolist()
        return sorted(range(len(s)), key=s.__getitem__, reverse=True)[:k]    # (reverse keeps ties in index order)
    order = torch.sort(-score.to(torch.float64), stable=True).indices
    return order[:k].tolist()


class CorrelationTable:
    """Frequency of layer-L expert choices given the choices at layer L-l (path length l, default 1).

    ``num_layers`` is the number of MoE layers; ``layer`` arguments are decoder-layer indices
    (see the module docstring). ``layer_ids`` fixes the sequence of MoE layer ids up front
    (recommended when the model is known, e.g. ``[1, 2, ..., 26]`` for a DeepSeek with a dense
    first layer); without it the ids are learnt from :meth:`observe`, at most ``num_layers`` of them.

    ``counts[L]`` is a LongTensor ``[E, E]`` (rows: expert at ``prev_layer(L)``, columns: expert at
    ``L``), present for every layer that has a predecessor and has been observed; ``freq[L]`` is a
    LongTensor ``[E]``. To change a table by hand, assign new tensors (``t.counts[L] = ...``): the
    row sums a prediction reads are kept per tensor object, up to date with :meth:`observe` and
    :meth:`merge`, not with in-place edits from outside.
    """

    online: bool = True

    def __init__(self, num_layers: int, num_experts: int, path_length: int = 1, top_k: int | None = None, *,
                 layer_ids: Sequence[int] | None = None, mode: str = "prob", meta: Mapping[str, Any] | None = None):
        for name, value, low in (("num_layers", num_layers, 1), ("num_experts", num_experts, 1),
                                 ("path_length", path_length, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise KinjectError(f"CorrelationTable: {name} must be an integer >= {low}, got {value!r}")
        if top_k is not None and (not isinstance(top_k, int) or not 1 <= top_k <= num_experts):
            raise KinjectError(f"CorrelationTable: top_k must be in [1, {num_experts}], got {top_k!r}")
        if mode not in MODES:
            raise KinjectError(f"CorrelationTable: mode must be one of {MODES}, got {mode!r}")
        self.num_layers, self.num_experts, self.path_length = num_layers, num_experts, path_length
        self.top_k = top_k
        self.mode = mode
        self.meta: dict[str, Any] = dict(meta or {})
        self.online = True
        self.fixed_layer_ids = layer_ids is not None
        self.layer_ids: list[int] = []
        if layer_ids is not None:
            ids = list(layer_ids)
            if any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in ids):
                raise KinjectError(f"CorrelationTable: layer_ids must be non-negative integers, got {ids}")
            if len(set(ids)) != len(ids) or len(ids) != num_layers:
                raise KinjectError(
                    f"CorrelationTable: layer_ids must be {num_layers} distinct ids (num_layers), got {ids}")
            self.layer_ids = sorted(ids)
        self._counts: dict[int, torch.Tensor] = {}  # L -> [E, E] int64 (see ``counts``)
        self._freq: dict[int, torch.Tensor] = {}    # L -> [E] int64 (see ``freq``)
        # Observations are counted in one batch per step (:meth:`_apply_pending`): a step's layers
        # add into rows of two stacked buffers with one index_add_ each, instead of ~5 tensor ops
        # per layer. ``counts[L]`` / ``freq[L]`` are views of row ``_rows[L]`` once L is observed.
        self._pending: list[tuple] = []             # (layer, choices, its counts, prev choices, prev counts)
        self._pending_layers: set[int] = set()
        self._rows: dict[int, int] = {}             # L -> its row of _cells / _freqs
        self._cells: torch.Tensor | None = None     # [num_layers, E, E] int64
        self._freqs: torch.Tensor | None = None     # [num_layers, E] int64
        self._views: dict[tuple[str, int], torch.Tensor] = {}   # ("freq" | "counts", L) -> the row view handed out
        self._step: dict[int, torch.Tensor] = {}    # L -> [T, k] choices of the current forward step
        self._step_counts: dict[int, torch.Tensor] = {}   # L -> [E] tokens per expert of those choices
        self._row_totals: dict[int, tuple[torch.Tensor, list[int]]] = {}   # L -> (counts[L], its row sums)
        self._last_layer: int | None = None
        self._prev_memo: tuple | None = None         # (layer_ids, path_length, {layer: prev_layer})
        self._ones: dict[int, torch.Tensor] = {}       # observe's increments by their number (reused)

    @property
    def counts(self) -> dict[int, torch.Tensor]:
        """L -> ``[E, E]`` co-occurrence counts (every observation so far counted in)."""
        self._apply_pending()
        return self._counts

    @property
    def freq(self) -> dict[int, torch.Tensor]:
        """L -> ``[E]`` choices per expert (every observation so far counted in)."""
        self._apply_pending()
        return self._freq

    # ------------------------------------------------------------------ layer ids
    def prev_layer(self, layer: int) -> int | None:
        """The MoE layer id at distance ``path_length`` below ``layer``, or None (first MoE layers).
        Kept per layer until ``layer_ids`` or ``path_length`` change (asked several times per layer-step)."""
        memo = self._prev_memo
        if memo is None or memo[0] is not self.layer_ids or memo[1] != self.path_length:
            memo = self._prev_memo = (self.layer_ids, self.path_length, {})
        got = memo[2].get(layer, memo)
        if got is memo:
            below = [i for i in self.layer_ids if i < layer]
            got = memo[2][layer] = below[-self.path_length] if len(below) >= self.path_length else None
        return got

    def _register(self, layer: int) -> None:
        if not isinstance(layer, int) or isinstance(layer, bool) or layer < 0:
            raise KinjectError(f"CorrelationTable: layer must be a non-negative decoder-layer index, got {layer!r}")
        if layer in self.layer_ids:
            return
        if self.fixed_layer_ids:
            raise KinjectError(f"CorrelationTable: layer {layer} is not one of the MoE layer ids {self.layer_ids}")
        if len(self.layer_ids) >= self.num_layers:
            raise KinjectError(
                f"CorrelationTable: layer {layer} would be MoE layer number {len(self.layer_ids) + 1}, but the table "
                f"was made for num_layers={self.num_layers} (known ids {self.layer_ids}); pass layer_ids=")
        self.layer_ids = sorted([*self.layer_ids, layer])

    # ------------------------------------------------------------------ counting
    def reset_step(self) -> None:
        """Forget the remembered choices (a new forward step / a new batch group starts)."""
        self._apply_pending()
        self._step.clear()
        self._step_counts.clear()
        self._last_layer = None

    def observe(self, layer: int, choices: torch.Tensor, *, counts: torch.Tensor | None = None) -> None:
        """Count one layer's routing for all tokens of the batch group.

        ``choices``: LongTensor ``[T, k]`` (router top-k indices; ``[T]`` = top-1), tokens in the
        same order at every layer of one forward step. Call it once per MoE layer per step, with
        all tokens of the batch group. Observing a layer id not above the last observed one
        starts a new step (as :meth:`reset_step`), so a forgotten ``reset_step`` cannot pair
        layer L with a stale step's choices. ``counts``: the caller's own ``bincount`` of these
        choices over the experts (``[E]``, every choice in range), saving the check and the count.
        """
        self._register(layer)
        E = self.num_experts
        if counts is not None and counts.shape == (E,) and isinstance(choices, torch.Tensor) \
                and choices.dim() == 2 and choices.is_cpu and choices.dtype is torch.long:
            c = choices                                                              # [T, k], counted in range
        else:
            c = _as_choices(choices, E, f"CorrelationTable.observe(layer={layer})")   # [T, k]
            counts = None
        if self.top_k is None:
            self.top_k = c.shape[1]
        elif c.shape[1] != self.top_k:
            raise KinjectError(f"CorrelationTable.observe(layer={layer}): {c.shape[1]} choices per token, "
                               f"the table counts top_k={self.top_k}")
        if self._last_layer is not None and layer <= self._last_layer:
            self.reset_step()
        if counts is None:
            counts = torch.bincount(c.flatten(), minlength=E)
        prev = self.prev_layer(layer)
        p = p_counts = None
        if prev is not None and prev in self._step:
            p, p_counts = self._step[prev], self._step_counts[prev]                  # [T, k'], [E]
            if p.shape[0] != c.shape[0]:
                raise KinjectError(
                    f"CorrelationTable.observe(layer={layer}): {c.shape[0]} tokens, but layer {prev} of this step "
                    f"had {p.shape[0]}; tokens must be the same (same order) at every layer of a step")
        self._pending.append((layer, c, counts, p, p_counts))     # counted in at the step's end (or a read)
        self._pending_layers.add(layer)
        self._step[layer] = c
        self._step_counts[layer] = counts         # the next layer's prediction weighs its rows by these
        self._last_layer = layer

    def _apply_pending(self) -> None:
        """Count the pending observations in: per step, one ``index_add_`` of every layer's token
        counts into the stacked ``freq`` rows and one of every (previous expert, expert) pair into
        the stacked ``counts`` rows, whatever the number of layers. Called when a new step starts
        and before anything reads the counts of a pending layer."""
        pending = self._pending
        if not pending:
            return
        self._pending, self._pending_layers = [], set()
        E = self.num_experts
        rows = [self._row(layer, cells=p is not None) for layer, _, _, p, _ in pending]
        counts = torch.stack([e[2] for e in pending])                                    # [n, E]
        self._freqs.index_add_(0, torch.frombuffer(array("q", rows), dtype=torch.long), counts)
        paired = [(r, e) for r, e in zip(rows, pending) if e[3] is not None]
        if not paired:
            return
        cs, ps = [e[1] for _, e in paired], [e[3] for _, e in paired]
        if len({c.shape for c in cs}) == 1 and len({p.shape for p in ps}) == 1:         # a step's layers: one batch
            at = torch.frombuffer(array("q", [r * E * E for r, _ in paired]), dtype=torch.long).view(-1, 1, 1, 1)
            cells = (torch.add(torch.stack(cs).unsqueeze(2), torch.stack(ps).unsqueeze(3), alpha=E) + at).view(-1)
        else:                                                                            # (shapes differ: one each)
            cells = torch.cat([(torch.add(c.unsqueeze(1), p.unsqueeze(2), alpha=E) + r * E * E).view(-1)
                               for (r, _), c, p in zip(paired, cs, ps)])
        n = cells.numel()
        ones = self._ones.get(n)             # one per batch size seen (prefill, decode): not made per step
        if ones is None:
            if len(self._ones) >= 4:         # (prompts of many lengths: keep it small)
                self._ones.clear()
            ones = self._ones[n] = torch.ones(n, dtype=torch.long)
        self._cells.view(-1).index_add_(0, cells, ones)
        for _, (layer, c, _, _, prev_counts) in paired:
            totals = self._row_totals.get(layer)      # (row sums kept only once a prediction asked for them)
            if totals is not None and totals[0] is self._counts[layer]:   # row i gained k cells per (token, prev i)
                sums, per = totals[1], c.shape[1]
                for i, t in enumerate(prev_counts.tolist()):
                    if t:
                        sums[i] += t * per

    def _row(self, layer: int, *, cells: bool) -> int:
        """``layer``'s row of the stacked buffers, made on first use: ``freq[layer]`` (and with
        ``cells``, ``counts[layer]``) is then a view of it; a tensor set from outside, or loaded
        from a file, is copied in once."""
        E = self.num_experts
        if self._cells is None:
            self._cells = torch.zeros(self.num_layers, E, E, dtype=torch.long)
            self._freqs = torch.zeros(self.num_layers, E, dtype=torch.long)
        row = self._rows.get(layer)
        if row is None:
            row = self._rows[layer] = len(self._rows)
        for own, stacked, kind in [(self._freq, self._freqs, "freq")] + ([(self._counts, self._cells, "counts")]
                                                                          if cells else []):
            got, view = own.get(layer), self._views.get((kind, layer))
            if got is None or got is not view:        # first use, or a tensor set from outside: into its row
                view = self._views[kind, layer] = stacked[row]
                if got is not None:
                    view.copy_(got)
                own[layer] = view
        return row

    def step_choices(self, layer: int) -> torch.Tensor | None:
        """The choices remembered for ``layer`` in the current step (None when not observed yet)."""
        return self._step.get(layer)

    # ------------------------------------------------------------------ prediction
    def predict(self, layer: int, prev_choices: torch.Tensor | None, k: int, *, mode: str | None = None,
                min_use: float | None = None, tokens: int | None = None) -> list[int]:
        """The ``k`` hottest experts of ``layer`` predicted from the tokens' choices at ``prev_layer(layer)``.

        ``prev_choices``: LongTensor ``[T, k']`` of the current batch group's choices at the previous
        MoE layer, or None. Scoring per ``mode`` (default: the table's, ``"prob"``) is described in
        the module docstring. Falls back to ``freq[layer]`` when ``prev_choices`` is None or the
        table has no correlation data for ``layer``; with no data at all returns ``[0, ..., k-1]``.
        Ties are broken by lower expert id. Returns ``min(k, num_experts)`` distinct ids, hottest first.

        ``min_use`` (a probability): also every further expert the batch group uses with at least
        this chance, i.e. whose expected tokens ``lam`` (:meth:`expected_tokens`) satisfy
        ``1 - exp(-lam) >= min_use`` (the chance that a Poisson count with that mean is non-zero:
        a lower bound of the chance that at least one token picks it). So a batch group that spreads
        over most experts prefetches most of them, one that concentrates on a few prefetches ``k``.
        Needs ``mode="prob"`` and the number of tokens (``prev_choices``' rows, else ``tokens``).
        """
        mode = mode or self.mode
        if mode not in MODES:
            raise KinjectError(f"CorrelationTable.predict: mode must be one of {MODES}, got {mode!r}")
        if not isinstance(k, int) or k < 0:
            raise KinjectError(f"CorrelationTable.predict: k must be a non-negative integer, got {k!r}")
        if min_use is not None and not 0.0 < min_use < 1.0:
            raise KinjectError(f"CorrelationTable.predict: min_use must be a probability in (0, 1), got {min_use!r}")
        k = min(k, self.num_experts)
        score, lam_per_score = self._score(layer, prev_choices, mode, tokens, k)
        if score is None:
            return list(range(k))
        values = score.tolist() if score.numel() <= _SMALL else None    # (one tolist for the count and the rank)
        if min_use is not None and lam_per_score:
            least = -math.log1p(-min_use) / lam_per_score             # score of an expert used with chance min_use
            used = len([v for v in values if v >= least]) if values is not None else int((score >= least).sum())
            k = max(k, used)
        return _ranked(score, k, values)

    def expected_tokens(self, layer: int, prev_choices: torch.Tensor | None, *,
                        tokens: int | None = None) -> torch.Tensor | None:
        """``[E]`` float64: how many of the batch group's tokens the table expects at each expert of
        ``layer`` (``mode="prob"`` scoring, scaled from the ``k'`` previous choices to the ``k``
        current ones; the ``freq`` fallback scaled to ``tokens x k``). None when it cannot tell
        (no data, or no token count for the fallback)."""
        score, lam_per_score = self._score(layer, prev_choices, "prob", tokens, 1)
        return score * lam_per_score if score is not None and lam_per_score else None

    def _score(self, layer: int, prev_choices: torch.Tensor | None, mode: str, tokens: int | None,
               want: int) -> tuple[torch.Tensor | None, float]:
        """(score ``[E]`` per ``mode``, expected tokens per unit of score or 0 when the score is not
        one), or (None, 0) with no data at all. ``want``: the k asked for (``vote`` without a top_k)."""
        E = self.num_experts
        if layer in self._pending_layers:
            self._apply_pending()
        freq = self._freq.get(layer)                                                        # [E] long
        table = self._counts.get(layer)                                                     # [E, E] long
        k = self.top_k
        n = None                                                                            # [E] tokens per prev expert
        if prev_choices is not None and table is not None:
            prev = self.prev_layer(layer)
            observed = prev is not None and prev_choices is self._step.get(prev)
            p = prev_choices if observed else \
                _as_choices(prev_choices, E, f"CorrelationTable.predict(layer={layer})")    # [T, k'] (observed: checked)
            n = self._step_counts.get(prev) if observed else None                           # counted when observed
            tokens = p.shape[0]
        if prev_choices is None or table is None or p.numel() == 0:
            return self._freq_score(freq, tokens)
        n_i = (n if n is not None else torch.bincount(p.flatten(), minlength=E)).tolist()  # [E] tokens per prev expert
        if mode in ("counts", "prob"):
            # prob: sum_i n_i P(.|i) = sum_i (n_i / rowsum_i) counts[i, .]; a token on an unobserved row
            # scores by freq instead (the row's fallback); counts: raw co-occurrences. The row sums are
            # kept by observe, so a prediction is a weight vector built in Python and one product.
            rowsum = self._row_sums(layer, table)                                           # observations per row
            if not any(rowsum):
                return self._freq_score(freq, tokens)                                       # an empty table
            if mode == "counts":
                w, unseen = n_i, 0
            else:
                w, unseen = [0.0] * E, 0
                for i, c in enumerate(n_i):
                    if c:
                        r = rowsum[i]
                        if r:
                            w[i] = c / r
                        else:
                            unseen += c
            # (a tensor over a Python array: a third of the cost of torch.tensor(list) here)
            score = torch.frombuffer(array("d", w), dtype=torch.float64) @ table.to(torch.float64)   # [E]
            if unseen and freq is not None:
                total = int(freq.sum())
                if total:
                    score += freq.to(torch.float64) * (unseen / total)
            # each (token, previous expert) pair spreads one unit over the experts; a token makes k pairs here
            return score, (k / p.shape[1] if mode == "prob" and k else 0.0)
        rowsum = table.sum(1).tolist()                                                      # [E] observations per row
        if not any(rowsum):
            return self._freq_score(freq, tokens)
        empty = [i for i in range(E) if not rowsum[i]]                                      # rows never observed
        kk = k or want                         # "vote": each (token, prev expert i) votes for the top-k of row i
        score = torch.zeros(E, dtype=torch.float64)
        zero = torch.zeros(E, dtype=torch.long)
        unobserved = set(empty)
        for i in (i for i, n in enumerate(n_i) if n):
            row = (freq if freq is not None else zero) if i in unobserved else table[i]
            if row.sum() == 0:
                continue
            for j in _ranked(row, kk):
                score[j] += n_i[i]
        if not bool(score.any()):                      # (prob / counts: a counted pair always scores)
            return self._freq_score(freq, tokens)
        return score, 0.0

    def _row_sums(self, layer: int, table: torch.Tensor) -> list[int]:
        """Observations per row of ``counts[layer]`` (Python ints): summed once, then kept up to date by
        :meth:`observe`; a counts tensor set from outside (another object) is summed again."""
        got = self._row_totals.get(layer)
        if got is None or got[0] is not table:
            got = self._row_totals[layer] = (table, table.sum(1).tolist())
        return got[1]

    def _freq_score(self, freq: torch.Tensor | None, tokens: int | None) -> tuple[torch.Tensor | None, float]:
        """The fallback: experts ranked by how often they were chosen so far; expected tokens are the
        frequencies scaled to ``tokens x k`` choices."""
        if freq is None:
            return None, 0.0
        total = sum(freq.tolist())                    # (a tolist is a fraction of a sum and an item)
        scale = tokens * self.top_k / total if tokens and self.top_k and total else 0.0
        return freq.to(torch.float64), scale

    def predict_from_step(self, layer: int, k: int, *, mode: str | None = None) -> list[int]:
        """:meth:`predict` with the choices remembered this step at ``prev_layer(layer)`` (None if not seen)."""
        prev = self.prev_layer(layer)
        return self.predict(layer, self._step.get(prev) if prev is not None else None, k, mode=mode)

    def marginal_coverage(self, k: int, layers: Iterable[int] | None = None) -> float | None:
        """Mean over layers of the share of token->expert assignments on each layer's ``k`` most
        frequent experts (``freq``). A table-only estimate of the planner's ``hot_coverage``; the
        measured one is :meth:`PrefetchStats.coverage`. None when the table is empty."""
        shares = []
        for layer in (self.layer_ids if layers is None else layers):
            f = self.freq.get(layer)
            if f is None or int(f.sum()) == 0:
                continue
            top = torch.sort(f, descending=True, stable=True).values[:k]
            shares.append(float(top.sum()) / float(f.sum()))
        return sum(shares) / len(shares) if shares else None

    # ------------------------------------------------------------------ combining
    def copy(self) -> CorrelationTable:
        """A deep copy (e.g. to update online without touching the table loaded from file)."""
        self._apply_pending()
        return _copy.deepcopy(self)

    def merge(self, other: CorrelationTable) -> None:
        """Add ``other``'s counts into this table (same num_experts and path_length)."""
        if not isinstance(other, CorrelationTable):
            raise KinjectError(f"CorrelationTable.merge: expected a CorrelationTable, got {type(other).__name__}")
        for name in ("num_experts", "path_length"):
            if getattr(self, name) != getattr(other, name):
                raise KinjectError(f"CorrelationTable.merge: {name} differs ({getattr(self, name)} vs "
                                   f"{getattr(other, name)})")
        if self.top_k is not None and other.top_k is not None and self.top_k != other.top_k:
            raise KinjectError(f"CorrelationTable.merge: top_k differs ({self.top_k} vs {other.top_k})")
        if set(self.layer_ids) != set(other.layer_ids) and self.fixed_layer_ids and other.fixed_layer_ids:
            raise KinjectError(f"CorrelationTable.merge: layer ids differ ({self.layer_ids} vs {other.layer_ids})")
        for layer in other.layer_ids:
            self._register(layer)
        self.top_k = self.top_k or other.top_k
        E = self.num_experts
        for layer, f in other.freq.items():
            self.freq.setdefault(layer, torch.zeros(E, dtype=torch.long)).add_(f)
        for layer, m in other.counts.items():
            self.counts.setdefault(layer, torch.zeros(E, E, dtype=torch.long)).add_(m)
            self._row_totals.pop(layer, None)       # summed again when next asked

    # ------------------------------------------------------------------ persistence
    def to_dict(self) -> dict:
        """JSON-able dict: shapes, layer ids, ``meta`` (model fingerprint) and per-layer freq/counts."""
        layers = {}
        for layer in self.layer_ids:
            entry: dict[str, Any] = {}
            if layer in self.freq:
                entry["freq"] = self.freq[layer].tolist()
            if layer in self.counts:
                entry["counts"] = self.counts[layer].tolist()
            if entry:
                layers[str(layer)] = entry
        return {"format": FORMAT, "num_layers": self.num_layers, "num_experts": self.num_experts,
                "path_length": self.path_length, "top_k": self.top_k, "mode": self.mode,
                "layer_ids": list(self.layer_ids), "fixed_layer_ids": self.fixed_layer_ids,
                "meta": dict(self.meta), "layers": layers}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, source: str = "correlation table") -> CorrelationTable:
        """Inverse of :meth:`to_dict`; every shape is checked and errors name ``source``, the layer and the key."""
        if not isinstance(d, Mapping):
            raise KinjectError(f"{source}: expected a JSON object, got {type(d).__name__}")
        if d.get("format", FORMAT) != FORMAT:
            raise KinjectError(f"{source}: format {d.get('format')!r} is not {FORMAT!r}")
        missing = [key for key in ("num_layers", "num_experts") if key not in d]
        if missing:
            raise KinjectError(f"{source}: missing key(s) {missing}")
        E = d["num_experts"]
        ids = d.get("layer_ids") or []
        fixed = bool(d.get("fixed_layer_ids", False))
        try:
            table = cls(d["num_layers"], E, d.get("path_length", 1), d.get("top_k"),
                        layer_ids=ids if fixed else None, mode=d.get("mode", "prob"), meta=d.get("meta") or {})
        except KinjectError as exc:
            raise KinjectError(f"{source}: {exc}") from None
        if not fixed:
            for layer in sorted(ids):
                try:
                    table._register(layer)
                except KinjectError as exc:
                    raise KinjectError(f"{source}: {exc}") from None
        layers = d.get("layers") or {}
        if not isinstance(layers, Mapping):
            raise KinjectError(f"{source}: 'layers' must be an object keyed by layer id")
        for key, entry in layers.items():
            try:
                layer = int(key)
            except ValueError:
                raise KinjectError(f"{source}: layer key {key!r} is not an integer") from None
            if layer not in table.layer_ids:
                raise KinjectError(f"{source}: layer {layer} has data but is not in layer_ids {table.layer_ids}")
            if not isinstance(entry, Mapping):
                raise KinjectError(f"{source}: layer {layer} must be an object with 'freq'/'counts'")
            if "freq" in entry:
                table.freq[layer] = cls._tensor(entry["freq"], (E,), source, layer, "freq")
            if "counts" in entry:
                table.counts[layer] = cls._tensor(entry["counts"], (E, E), source, layer, "counts")
        return table

    @staticmethod
    def _tensor(value: Any, shape: tuple[int, ...], source: str, layer: int, key: str) -> torch.Tensor:
        want = "x".join(map(str, shape))
        try:
            t = torch.tensor(value, dtype=torch.long)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise KinjectError(f"{source}: layer {layer} '{key}' is not a {want} array of integers ({exc})") from None
        if tuple(t.shape) != shape:
            got = "x".join(map(str, t.shape)) or "scalar"
            raise KinjectError(f"{source}: layer {layer} '{key}' has shape {got}, expected {want} "
                               f"(num_experts={shape[0]})")
        if t.numel() and int(t.min()) < 0:
            raise KinjectError(f"{source}: layer {layer} '{key}' has negative counts")
        return t

    def save(self, path: str | os.PathLike) -> None:
        """Write the table as JSON (atomically: temp file + rename)."""
        path = Path(path).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict()))
        os.replace(tmp, path)
        log.info("saved expert correlation table (%d layers) to %s", len(self.layer_ids), path)

    @classmethod
    def load(cls, path: str | os.PathLike, *, num_layers: int | None = None, num_experts: int | None = None,
             path_length: int | None = None, meta: Mapping[str, Any] | None = None) -> CorrelationTable:
        """Read a table saved by :meth:`save`; the keyword arguments, when given, must match the file
        (``meta``: every given key must equal the file's, e.g. a model fingerprint)."""
        path = Path(path).expanduser()
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise KinjectError(f"correlation table {path}: no such file") from None
        except json.JSONDecodeError as exc:
            raise KinjectError(f"correlation table {path}: not valid JSON ({exc})") from None
        table = cls.from_dict(d, source=f"correlation table {path}")
        for name, want in (("num_layers", num_layers), ("num_experts", num_experts), ("path_length", path_length)):
            if want is not None and getattr(table, name) != want:
                raise KinjectError(f"correlation table {path}: built for {name}={getattr(table, name)}, "
                                   f"the model needs {name}={want}; rebuild it with a warm-up run")
        for key, want in (meta or {}).items():
            if table.meta.get(key) != want:
                raise KinjectError(f"correlation table {path}: meta[{key!r}] is {table.meta.get(key)!r}, "
                                   f"expected {want!r}; the table was built for another model")
        return table

    def __repr__(self) -> str:
        return (f"CorrelationTable(num_layers={self.num_layers}, num_experts={self.num_experts}, "
                f"path_length={self.path_length}, top_k={self.top_k}, layers_seen={len(self.freq)})")


class PrefetchStats:
    """Accuracy of prefetched hot experts, per layer and overall (Klotski §9, Figure 13).

    :meth:`record` takes, for one layer and one step, the predicted (prefetched) set and the
    experts truly used with their token counts. Aggregates are micro-averages over all records:

    * ``precision``    = sum |predicted ∩ used| / sum |predicted|  — Figure 13's green line
      ("prefetched hot experts [...] actually involved in the computations").
    * ``hot_accuracy`` = sum |predicted ∩ hottest_K| / sum K, K = |predicted| — the blue line
      ("accuracy of the selected hot experts"). ``hottest_K`` is tie-inclusive: an expert counts
      as hot when its token count is >= the K-th largest count (a prediction is not penalised for
      picking one of two equally hot experts), and K is capped by the number of used experts.
    * ``coverage``     = sum tokens on predicted / sum tokens — the share of token->expert
      assignments served by prefetched experts; this is the planner's ``hot_coverage``.

    Each accessor returns None when nothing has been recorded for it.
    """

    _KEYS = ("records", "pred", "pred_hits", "hot_hits", "hot_denom", "tok_hit", "tok_all")

    def __init__(self, num_experts: int | None = None):
        self.num_experts = num_experts
        self._layers: dict[int, dict[str, int]] = {}

    def reset(self) -> None:
        self._layers.clear()

    def record(self, layer: int, predicted: Iterable[int], used: torch.Tensor | Mapping[int, int] | list[int]) -> None:
        """``used``: the step's router choices (LongTensor ``[T, k]``), a mapping expert -> token count,
        or a list of token counts per expert (Python ints). ``predicted``: expert ids (a set of ints is
        used as it is)."""
        pred = predicted if isinstance(predicted, (set, frozenset)) else {int(e) for e in predicted}
        if isinstance(used, list):                              # tokens per expert, ints (the caller's own)
            counts = {e: n for e, n in enumerate(used) if n > 0}
        elif isinstance(used, Mapping):
            counts = {int(e): int(c) for e, c in used.items() if int(c) > 0}
        else:
            E = self.num_experts
            if E is None:
                t = used if isinstance(used, torch.Tensor) else torch.as_tensor(used)
                E = int(t.max()) + 1 if t.numel() else 1
            c = _as_choices(used, E, f"PrefetchStats.record(layer={layer})")
            bc = torch.bincount(c.flatten(), minlength=E)
            counts = {e: int(n) for e, n in enumerate(bc.tolist()) if n > 0}
        s = self._layers.setdefault(int(layer), dict.fromkeys(self._KEYS, 0))
        s["records"] += 1
        s["pred"] += len(pred)
        s["pred_hits"] += len(pred & counts.keys())
        s["tok_all"] += sum(counts.values())
        s["tok_hit"] += sum([counts[e] for e in pred if e in counts])
        denom = min(len(pred), len(counts))
        if denom:
            kth = sorted(counts.values(), reverse=True)[denom - 1]
            hot = {e for e, n in counts.items() if n >= kth}
            s["hot_hits"] += min(len(pred & hot), denom)
            s["hot_denom"] += denom

    def _agg(self, layer: int | None) -> dict[str, int]:
        if layer is not None:
            return self._layers.get(int(layer), dict.fromkeys(self._KEYS, 0))
        total = dict.fromkeys(self._KEYS, 0)
        for s in self._layers.values():
            for key in self._KEYS:
                total[key] += s[key]
        return total

    @staticmethod
    def _ratio(a: int, b: int) -> float | None:
        return a / b if b else None

    def precision(self, layer: int | None = None) -> float | None:
        s = self._agg(layer)
        return self._ratio(s["pred_hits"], s["pred"])

    def hot_accuracy(self, layer: int | None = None) -> float | None:
        s = self._agg(layer)
        return self._ratio(s["hot_hits"], s["hot_denom"])

    def coverage(self, layer: int | None = None) -> float | None:
        s = self._agg(layer)
        return self._ratio(s["tok_hit"], s["tok_all"])

    def report(self) -> dict:
        """``{"layers": {L: {...}}, "overall": {...}}`` with precision, hot_accuracy, coverage, records."""
        def one(layer: int | None) -> dict:
            return {"precision": self.precision(layer), "hot_accuracy": self.hot_accuracy(layer),
                    "coverage": self.coverage(layer), "records": self._agg(layer)["records"]}
        return {"layers": {layer: one(layer) for layer in sorted(self._layers)}, "overall": one(None)}

    def summary(self) -> str:
        def pct(x: float | None) -> str:
            return "n/a" if x is None else f"{100 * x:.1f}%"
        return (f"prefetch precision {pct(self.precision())}, hot-expert accuracy {pct(self.hot_accuracy())}, "
                f"token coverage {pct(self.coverage())} over {self._agg(None)['records']} layer-steps")
