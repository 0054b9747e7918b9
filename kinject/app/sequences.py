"""One ``model.generate`` for a batch group whose sequences each have their own settings.

``kinject run`` gives every prompt of a group the same settings; requests arriving over the
OpenAI interface (``kinject serve``, ``kinject run-batch``) do not: each has its own
``max_tokens``, ``temperature``, ``top_p``, ``seed`` and ``stop`` strings. They still share one
``generate`` per group (Klotski's batch group, docs/architecture.md, "Serving"), through two hooks
transformers' ``generate`` calls once per step:

* :class:`PerSequenceSampler` (a logits processor): for a sequence that samples, draws its token
  from its own temperature / top-p distribution with its own ``torch.Generator`` (seeded: the same
  request gives the same tokens whatever group it lands in) and leaves only that token's score, so
  ``generate`` itself runs greedy and greedy sequences are untouched;
* :class:`PerSequenceStop` (a stopping criterion): collects each sequence's new token, ends it at
  EOS, at its own ``max_tokens``, at a stop string (the text is cut before it) or when its client
  went away (:attr:`Sequence.cancelled`); hands ``on_step``, in one call per step, the text of each
  streaming sequence that became final (holding back a tail that may still grow into a stop string
  or is an incomplete UTF-8 character) and every sequence that finished (a server answers it then,
  not at the group's end).

A finished sequence's slot is given back when the group ends (``generate`` pads it meanwhile); the
group ends as soon as every sequence has finished.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 0.0            # 0: greedy
    top_p: float = 1.0
    seed: int | None = None             # None: a fresh random seed
    stop: tuple[str, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(eq=False)
class Sequence:
    """One sequence of a group: prompt ids in, completion out. ``stream``: its text is handed to
    ``on_step`` as it becomes final. ``cancelled`` may be set from another thread (a client left)."""

    prompt_ids: list[int]
    params: SamplingParams
    stream: bool = False
    tag: object = None                  # the caller's (which request, which choice)
    cancelled: bool = False
    ids: list[int] = field(default_factory=list)
    text: str = ""
    emitted: int = 0                    # characters of ``text`` handed to on_step
    searched: int = 0                   # characters of ``text`` known to hold no stop string
    finish_reason: str | None = None    # "stop", "length" or "cancelled"

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


#: one sequence's news of a step: (sequence, new final text (streaming only), finish reason or None)
StepEvent = tuple["Sequence", str, "str | None"]
StepCallback = Callable[[list[StepEvent]], None]


def eos_ids(model, tok) -> set[int]:
    """The ids that end a sequence: the generation config's ``eos_token_id`` (one or several), else the tokenizer's."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = tok.eos_token_id
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


class PerSequenceSampler:
    """Logits processor: each sampling sequence draws its token with its own temperature, top-p and
    generator; its scores become -inf but for that token, so ``generate``'s greedy argmax takes it."""

    def __init__(self, seqs: list[Sequence]):
        self.rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        self.seqs = seqs
        self.generators: dict[int, torch.Generator] = {}

    def _generator(self, i: int, device) -> torch.Generator:
        gen = self.generators.get(i)
        if gen is None:
            seed = self.seqs[i].params.seed
            gen = torch.Generator(device=device)
            gen.manual_seed(seed if seed is not None else secrets.randbits(63))
            self.generators[i] = gen
        return gen

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        rows = [i for i in self.rows if not self.seqs[i].finished]
        if not rows:
            return scores
        idx = torch.tensor(rows, device=scores.device)
        temps = torch.tensor([self.seqs[i].params.temperature for i in rows], device=scores.device, dtype=scores.dtype)
        probs = torch.softmax(scores[idx] / temps[:, None], dim=-1)
        top_p = [self.seqs[i].params.top_p for i in rows]
        if any(p < 1.0 for p in top_p):
            # nucleus: keep the most likely tokens until their mass reaches top_p (the first always kept)
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            before = sorted_probs.cumsum(dim=-1) - sorted_probs
            cut = before >= torch.tensor(top_p, device=scores.device, dtype=probs.dtype)[:, None]
            sorted_probs = sorted_probs.masked_fill(cut, 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        chosen = torch.stack([torch.multinomial(probs[j], 1, generator=self._generator(i, scores.device))
                              for j, i in enumerate(rows)]).squeeze(1)
        scores[idx] = float("-inf")
        scores[idx, chosen] = 0.0
        return scores


class PerSequenceStop:
    """Stopping criterion: per-sequence EOS, ``max_tokens``, stop strings and cancellation; the text
    each streaming sequence finalised this step goes to ``on_step`` in one call per step."""

    def __init__(self, seqs: list[Sequence], tok, eos: set[int], on_step: StepCallback | None = None):
        self.seqs, self.tok, self.eos, self.on_step = seqs, tok, eos, on_step
        self.done = [False] * len(seqs)

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        last = input_ids[:, -1].tolist()
        events: list[StepEvent] = []
        for i, seq in enumerate(self.seqs):
            if self.done[i]:
                continue
            if seq.cancelled:
                seq.finish_reason = "cancelled"
            else:
                token = last[i]
                seq.ids.append(token)
                if token in self.eos:
                    seq.finish_reason = "stop"
                if seq.stream or seq.params.stop:
                    self._decode(seq)
                if not seq.finished and len(seq.ids) >= seq.params.max_tokens:
                    seq.finish_reason = "length"
                if seq.finished and not (seq.stream or seq.params.stop):
                    seq.text = self.tok.decode(seq.ids, skip_special_tokens=True)
                delta = _final_text(seq) if seq.stream else ""
                if delta or seq.finished:
                    events.append((seq, delta, seq.finish_reason))
            self.done[i] = seq.finished
        if events and self.on_step is not None:
            self.on_step(events)
        return torch.tensor(self.done, device=input_ids.device)

    def _decode(self, seq: Sequence) -> None:
        seq.text = self.tok.decode(seq.ids, skip_special_tokens=True)
        if seq.params.stop and not seq.finish_reason:
            # a new stop string can only end in what this step added: search from the text
            # already known to be free of one, less the longest stop string
            start = max(0, seq.searched - max(len(s) for s in seq.params.stop))
            hits = [p for p in (seq.text.find(s, start) for s in seq.params.stop) if p >= 0]
            if hits:
                seq.text = seq.text[:min(hits)]
                seq.finish_reason = "stop"
            seq.searched = len(seq.text)


def _final_text(seq: Sequence) -> str:
    """The text of ``seq`` that can no longer change and was not handed out yet: all of it once
    finished, else all but an incomplete UTF-8 character and a tail that may grow into a stop string."""
    end = len(seq.text)
    if not seq.finished:
        if seq.text.endswith("\ufffd"):
            end -= 1
        hold = 0
        for s in seq.params.stop:
            for k in range(min(len(s) - 1, end), hold, -1):
                if seq.text.endswith(s[:k], 0, end):
                    hold = k
                    break
        end -= hold
    if end <= seq.emitted:
        return ""
    delta, seq.emitted = seq.text[seq.emitted:end], end
    return delta


def generate_sequences(model, tok, seqs: list[Sequence], device, *, on_step: StepCallback | None = None,
                       eos: set[int] | None = None) -> list[Sequence]:
    """Generate every sequence of ``seqs`` in one ``model.generate`` (left-padded, as ``kinject run``'s
    groups); fills each one's ``ids``, ``text`` and ``finish_reason`` and returns ``seqs``."""
    from transformers import LogitsProcessorList, StoppingCriteriaList

    if not seqs:
        return seqs
    pad = tok.pad_token_id
    width = max(len(s.prompt_ids) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        input_ids[i, width - len(s.prompt_ids):] = torch.tensor(s.prompt_ids, dtype=torch.long)
        mask[i, width - len(s.prompt_ids):] = 1
    eos = eos_ids(model, tok) if eos is None else eos
    stop = PerSequenceStop(seqs, tok, eos, on_step)
    processors = LogitsProcessorList([PerSequenceSampler(seqs)] if any(not s.params.greedy for s in seqs) else [])
    with torch.inference_mode():
        model.generate(input_ids=input_ids.to(device), attention_mask=mask.to(device),
                       max_new_tokens=max(s.params.max_tokens for s in seqs), do_sample=False,
                       temperature=None, top_p=None, top_k=None, pad_token_id=pad,
                       logits_processor=processors, stopping_criteria=StoppingCriteriaList([stop]))
    tail: list[StepEvent] = []
    for s in seqs:
        if s.finish_reason is None:                       # generate stopped on its own (its max_new_tokens)
            s.finish_reason = "length"
            if not (s.stream or s.params.stop):
                s.text = tok.decode(s.ids, skip_special_tokens=True)
            tail.append((s, _final_text(s) if s.stream else "", s.finish_reason))
    if tail and on_step is not None:
        on_step(tail)
    return seqs
