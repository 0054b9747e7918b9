"""Makes ``model.generate`` build kinject's :class:`~kinject.kv.cache.KVCache` where it would build a
default one, and hands each step's padding mask to it; :class:`MicroBatchPrefill` runs a prefill one
micro-batch at a time through the model."""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from typing import Any, Callable

import torch

from kinject.errors import KinjectError
from transformers.cache_utils import EncoderDecoderCache

from kinject.kv.cache import KVCache

logger = logging.getLogger(__name__)


def _cache_kwarg() -> str:
    """The ``model_kwargs`` key under which this transformers' ``generate`` keeps the cache:
    ``past_key_values`` up to 5.22, ``cache`` from 5.23 (``past_key_values`` is then a deprecated
    alias, and passing both makes every step format the cache into a FutureWarning)."""
    try:
        from transformers.generation.utils import ALL_CACHE_NAMES
        return ALL_CACHE_NAMES[0]
    except (ImportError, IndexError):
        return "past_key_values"


CACHE_KWARG = _cache_kwarg()
_CACHE_KWARGS = tuple(dict.fromkeys((CACHE_KWARG, "past_key_values")))   # canonical first, then the alias

# ---------------------------------------------------------------------------------------- generate


class GenerateCache:
    """Makes ``model.generate`` use a :class:`KVCache` when it would build a default one.

    How: an instance attribute ``model._prepare_cache_for_generation`` shadows transformers' method
    (both in 5.17 .. 5.23: ``generate`` calls it once to put a cache in ``model_kwargs``). When the
    caller passed no cache (``cache`` or ``past_key_values``: :data:`CACHE_KWARG`), ``use_cache`` is on and no other
    ``cache_implementation``
    is asked for, it puts ``make_cache(model, capacity)`` there instead of a ``DynamicCache`` (an
    encoder-decoder model: ``EncoderDecoderCache(make_cache(...), make_cross_cache(model))`` when
    ``make_cross_cache`` gives one, see :mod:`kinject.kv.encdec`); a family whose own ``generate``
    calls it without ``model_kwargs`` and takes the cache it returns (DiffusionGemma's block
    diffusion) gets the :class:`KVCache` returned, of ``max_length`` tokens;
    otherwise it calls the original. A forward pre-hook hands each step's 2-D padding mask to the
    cache (StreamingKV needs it). :meth:`detach` removes both exactly (a previous instance attribute,
    if any, is put back).
    """

    NAME = "_prepare_cache_for_generation"

    def __init__(self, make_cache: Callable[[Any, int | None], KVCache],
                 make_cross_cache: Callable[[Any], KVCache] | None = None):
        self.make_cache = make_cache
        self.make_cross_cache = make_cross_cache
        self._saved: dict[int, tuple] = {}

    def attach(self, model) -> None:
        original = getattr(model, self.NAME, None)
        if original is None:
            logger.warning("kinject: this transformers version has no %s; generate keeps its own cache "
                           "(OffloadedAttention then runs whole batches)", self.NAME)
            return
        sig = inspect.signature(original)

        def prepare(*args, **kwargs):
            try:
                bound = sig.bind(*args, **kwargs)
            except TypeError:              # a transformers version calling it differently: leave it be
                return original(*args, **kwargs)
            gen = bound.arguments.get("generation_config")
            if "model_kwargs" not in sig.parameters:
                # a family's own generate that takes the cache it returns (DiffusionGemma: generation_config,
                # batch_size, max_length); the caller's cache, if any, never reaches it
                if self._wanted(model, gen, {}):
                    return self.make_cache(model, bound.arguments.get("max_length"))
                return original(*args, **kwargs)
            model_kwargs = bound.arguments.get("model_kwargs")
            if self._wanted(model, gen, model_kwargs):
                capacity = bound.arguments.get("max_cache_length")
                cross = None
                if getattr(model.config, "is_encoder_decoder", False):
                    cross = self.make_cross_cache(model)
                    if cross is None:             # not every cross-attention is kinject's: transformers' caches
                        return original(*args, **kwargs)
                cache = self.make_cache(model, capacity)
                model_kwargs[CACHE_KWARG] = cache if cross is None else EncoderDecoderCache(cache, cross)
                return None
            return original(*args, **kwargs)

        had = self.NAME in model.__dict__
        self._saved[id(model)] = (had, model.__dict__.get(self.NAME))
        model.__dict__[self.NAME] = prepare
        hook = model.register_forward_pre_hook(_begin_step, with_kwargs=True)
        self._saved[id(model)] += (hook,)

    def detach(self, model) -> None:
        saved = self._saved.pop(id(model), None)
        if saved is None:
            return
        had, previous, hook = saved
        hook.remove()
        if had:
            model.__dict__[self.NAME] = previous
        else:
            model.__dict__.pop(self.NAME, None)

    def _wanted(self, model, gen, model_kwargs) -> bool:
        if gen is None or not isinstance(model_kwargs, dict):
            return False
        if any(model_kwargs.get(k) is not None for k in _CACHE_KWARGS) or getattr(gen, "use_cache", True) is False:
            return False
        if getattr(gen, "cache_implementation", None) not in (None, "dynamic"):
            return False
        if getattr(model.config, "is_encoder_decoder", False) and self.make_cross_cache is None:
            return False
        supports = getattr(model, "_supports_default_dynamic_cache", None)
        return supports() if callable(supports) else True


def _begin_step(module, args, kwargs):
    for key in _CACHE_KWARGS:
        cache = kwargs.get(key)
        if isinstance(cache, KVCache):
            first = kwargs.get("input_ids")
            first = first if first is not None else kwargs.get("inputs_embeds")
            q = first.shape[1] if isinstance(first, torch.Tensor) and first.dim() >= 2 else None
            cache.begin_step(kwargs.get("attention_mask"), q)
            break
        if isinstance(cache, EncoderDecoderCache) and isinstance(cache.self_attention_cache, KVCache):
            cache.self_attention_cache.begin_step(kwargs.get("decoder_attention_mask"))   # the decoder's padding
            break
    return None


# ---------------------------------------------------------------------------------------- prefill by micro-batch

ROW_KWARGS = ("input_ids", "attention_mask", "position_ids", "inputs_embeds", "token_type_ids")
"""``generate``'s per-row inputs of a model forward that a prefill by micro-batch cuts into chunks."""


class MicroBatchPrefill:
    """Makes a model's prefill run one micro-batch at a time through the whole model.

    Why: a batch group's prefill runs every layer on all its prompts' tokens at once, so its
    activations (hidden states, the experts' gathered rows, attention scores) grow with the group,
    and under a device budget they, more than the KV, cap how many sequences fit. Run chunk by chunk
    (the :class:`KVCache`'s micro-batches), the device holds one micro-batch's activations; each
    chunk's KV goes to its tier as it is made (its attention's commit), and the decode steps then
    run the whole group with KV streamed per micro-batch. The price: every offloaded weight moves
    once per chunk in the prefill instead of once.

    How: an instance attribute ``model.forward`` shadows the class's. When a call is a prefill
    (``q > 1`` tokens, an empty :class:`KVCache` with more than one chunk, every layer one that
    :meth:`KVCache.windowable` allows, per-row inputs only among :data:`ROW_KWARGS`, no router
    logits asked for: their auxiliary loss is one number over every row), it runs the
    original forward once per chunk with those inputs cut to the chunk's rows and ``cache.window``
    set to the chunk (a one-chunk range), calls ``between()`` between two chunks (the runtime ends one pipeline step and
    begins the next: each chunk's forward is a step of its own), advances the cache once
    (:meth:`KVCache.end_windows`) and joins the outputs along the batch. Any other call runs the
    original unchanged. :meth:`detach` puts back what was there.
    """

    def __init__(self, between: Callable[[], None] | None = None,
                 layers: Callable[[Any], list] | None = None, hold: Callable[[], Any] | None = None,
                 stage: "HiddenStaging | None" = None, chunk: int = 1):
        self.between = between
        self.layers = layers
        self.chunk = chunk                 # layer-wise: micro-batches per layer call (``pipeline.prefill_chunk``)
        self.hold = hold or contextlib.nullcontext
        self.stage = stage
        self._saved: dict[int, tuple[bool, Any]] = {}
        self._layers: dict[int, list] = {}

    def attach(self, model) -> None:
        original = model.forward
        config = getattr(model, "config", None)

        @functools.wraps(original)
        def forward(*args, **kwargs):
            cache = _kv_cache(kwargs)
            aux = kwargs.get("output_router_logits", getattr(config, "output_router_logits", False))
            rows = None if args or cache is None or aux else self._chunks(cache, kwargs)
            if rows is None:
                return original(*args, **kwargs)
            return self._prefill(original, cache, rows, kwargs)

        self._saved[id(model)] = ("forward" in model.__dict__, model.__dict__.get("forward"))
        model.__dict__["forward"] = forward
        if self.layers is not None:
            layers = self.layers(model)
            stage = self.stage if self.stage is not None and _one_chain(model, layers) else None
            self._layers[id(model)] = [(layer, _wrap_layer(layer, self.hold, stage, first=i == 0,
                                                           last=i == len(layers) - 1, chunk=self.chunk))
                                       for i, layer in enumerate(layers)]

    def detach(self, model) -> None:
        for layer, saved in self._layers.pop(id(model), []):
            _put_back(layer, saved)
        saved = self._saved.pop(id(model), None)
        if saved is not None:
            _put_back(model, saved)

    @staticmethod
    def _chunks(cache: KVCache, kwargs: dict) -> list[slice] | None:
        """The chunks' rows when this call is a prefill to run chunk by chunk, else None."""
        first = kwargs.get("input_ids")
        first = first if first is not None else kwargs.get("inputs_embeds")
        if not isinstance(first, torch.Tensor) or first.dim() < 2 or first.shape[1] < 2:
            return None                                 # a decode step (or no per-row input)
        if cache.get_seq_length() != 0 or not cache.windowable():
            return None
        batch = first.shape[0]
        for k, v in kwargs.items():
            if not isinstance(v, torch.Tensor) or v.dim() == 0:
                continue
            if k in ROW_KWARGS:
                if v.shape[0] != batch or k == "position_ids" and v.dim() != 2:
                    return None                         # e.g. multimodal rope's [3, B, T] positions
            elif v.shape[0] == batch and k != "cache_position":
                logger.debug("kinject: prefill of the whole batch group: %s is a per-row input it does not cut", k)
                return None
        rows = cache.chunk_rows(batch)
        return rows if len(rows) > 1 else None

    def _prefill(self, original, cache: KVCache, rows: list[slice], kwargs: dict):
        q = (kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs["inputs_embeds"]).shape[1]
        if self.layers is not None:                     # layer-wise: one forward, each layer split by chunk
            cache.layer_rows = rows
            try:
                out = original(**kwargs)
            finally:
                cache.layer_rows = None
            cache.end_windows(q)
            return out
        outs = []
        try:
            for j, r in enumerate(rows):
                if j and self.between is not None:
                    self.between()
                cache.window = range(j, j + 1)
                outs.append(original(**{k: (v[r] if k in ROW_KWARGS and isinstance(v, torch.Tensor) and v.dim() else v)
                                        for k, v in kwargs.items()}))
        finally:
            cache.window = None
        cache.end_windows(q)
        return _join(outs)


class HiddenStaging:
    """Where a layer-wise prefill keeps the batch group's hidden states between layers: in the host
    tier (Klotski's Algorithm 1), each micro-batch's rows copied to the device before its layer call
    and its output copied back, over the transfer engine (so the link carries, and an emulated link
    charges, those bytes; ``kv_load`` / ``kv_store``, tier ``activations``). The device then holds one
    micro-batch's hidden states, not the group's, except the first layer's input (the embeddings the
    model computed) and the last layer's output (the model's final norm reads it there)."""

    def __init__(self, transfer):
        self.transfer = transfer

    def to_device(self, x: torch.Tensor, label: str):
        return self.transfer.copy_to_device(x, channel="kv_load", label=label, tier="activations")

    def to_host(self, x: torch.Tensor, label: str):
        return self.transfer.copy_to_host(x, channel="kv_store", label=label)

    def join(self, handles: list) -> torch.Tensor:
        """The micro-batches' outputs, landed on the host, as one (pinned on CUDA) host tensor."""
        return self.transfer.pin(torch.cat([h.wait(host=True) for h in handles], 0))


def _one_chain(model, layers: list) -> bool:
    """Whether ``layers`` are, in order, every module of one ModuleList of ``model`` (each layer's
    output is the next one's input): only then can hidden states stay in the host tier between them."""
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == len(layers) and \
                all(a is b for a, b in zip(module, layers)):
            return True
    return False


def _wrap_layer(layer, hold: Callable[[], Any], stage: HiddenStaging | None = None, *, first: bool = True,
                last: bool = True, chunk: int = 1) -> tuple[bool, Any]:
    """Shadow ``layer.forward`` so that, during a layer-wise prefill (``cache.layer_rows`` set), the
    layer runs once per window of ``chunk`` micro-batches (``cache.window`` = their range) on those
    rows, and the windows' outputs join along the batch: every micro-batch of the group passes this
    layer before the next layer runs, and ``hold()`` (the store's) keeps the weights a window
    released until the last window is done, so each layer's weights are loaded once for the group
    while its activations are one window's. Within a window the attention runs per micro-batch
    (:class:`~operators.attention.OffloadedAttention` serves ``cache.window`` chunk by chunk) and
    the layer's experts once over all its tokens (Klotski: each expert's weights used once for the
    window's tokens, not once per micro-batch). With ``stage``, the group's hidden states wait in
    the host tier between layers (:class:`HiddenStaging`; ``first``: the input is the device's,
    ``last``: the output goes back there). Returns what :func:`_put_back` restores."""
    original = layer.forward
    saved = ("forward" in layer.__dict__, layer.__dict__.get("forward"))

    @functools.wraps(original)
    def forward(*args, **kwargs):
        cache = _kv_cache(kwargs)
        chunks = getattr(cache, "layer_rows", None) if cache is not None else None
        if chunks is None or cache.window is not None:
            return original(*args, **kwargs)
        batch = chunks[-1].stop
        windows = [range(j, min(j + chunk, len(chunks))) for j in range(0, len(chunks), chunk)]
        rows = [slice(chunks[w[0]].start, chunks[w[-1]].stop) for w in windows]
        outs = []
        staged_in, staged_out = stage is not None and not first, stage is not None and not last

        def cut(j: int):                  # window j's arguments; staged: its hidden rows on their way
            a, kw = _cut(args, rows[j], batch), _cut(kwargs, rows[j], batch)
            return _staged_hidden(stage, a, kw, f"hidden rows {rows[j].start}:{rows[j].stop} in") if staged_in \
                else (a, kw, None)

        try:
            with hold():
                nxt = cut(0)
                for j, r in enumerate(rows):
                    cache.window = windows[j]
                    a, kw, landing = nxt
                    if j + 1 < len(rows):
                        nxt = cut(j + 1)  # the next window's hidden rows cross while this one computes
                    out = original(*_landed(a, landing), **_landed(kw, landing))
                    outs.append(stage.to_host(out, f"hidden rows {r.start}:{r.stop} out") if staged_out else out)
        finally:
            cache.window = None
        return stage.join(outs) if staged_out else _join(outs)

    layer.__dict__["forward"] = forward
    return saved


def _staged_hidden(stage: HiddenStaging, args: tuple, kwargs: dict, label: str) -> tuple[tuple, dict, Any]:
    """A layer call's arguments with its hidden states (the first argument, or ``hidden_states``)
    on their way from the host tier to the device: the arguments with that slot held by the copy's
    handle (:func:`_landed` puts the copy there), and the handle."""
    if args:
        handle = stage.to_device(args[0], label)
        return (handle, *args[1:]), kwargs, handle
    if "hidden_states" not in kwargs:
        raise KinjectError("pipeline.prefill: layer: a decoder layer was called without its hidden states "
                           "(first argument or hidden_states=); use prefill: micro_batch")
    handle = stage.to_device(kwargs["hidden_states"], label)
    return args, {**kwargs, "hidden_states": handle}, handle


def _landed(x, handle):
    """``x`` (a call's positional tuple or keyword dict) with the slot holding ``handle`` replaced by
    the copy it made (waited for); as it is with no handle."""
    if handle is None:
        return x
    if isinstance(x, tuple):
        return tuple(handle.wait() if v is handle else v for v in x)
    return {k: handle.wait() if v is handle else v for k, v in x.items()}


def _put_back(module, saved: tuple[bool, Any]) -> None:
    had, previous = saved
    if had:
        module.__dict__["forward"] = previous
    else:
        module.__dict__.pop("forward", None)


def _cut(x, rows: slice, batch: int):
    """``x`` with every tensor whose first dimension is the batch cut to ``rows`` (tuples, lists and
    mappings element-wise; a cache, and tensors shared by every row, as they are)."""
    if isinstance(x, torch.Tensor):
        return x[rows] if x.dim() > 1 and x.shape[0] == batch else x      # 1-D: cache_position, never per row
    if isinstance(x, (tuple, list)):
        return type(x)(_cut(v, rows, batch) for v in x)
    if isinstance(x, dict):
        return {k: _cut(v, rows, batch) for k, v in x.items()}
    return x


def _kv_cache(kwargs: dict) -> KVCache | None:
    for key in _CACHE_KWARGS:
        cache = kwargs.get(key)
        if isinstance(cache, KVCache):
            return cache
    return None


def _join(outs: list):
    """The chunks' outputs joined along the batch: tensors concatenated (router logits, flattened
    row-major, too), tuples and mappings element-wise, the cache (one object) and None as they are."""
    first = outs[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            raise KinjectError("prefill by micro-batch: the model returned a scalar (an auxiliary loss?) that "
                               "chunks cannot be joined into; set pipeline.prefill: group")
        return torch.cat(outs, 0)
    if isinstance(first, (tuple, list)):
        return type(first)(_join([o[i] for o in outs]) for i in range(len(first)))
    if isinstance(first, dict):                        # ModelOutput keeps only its non-None fields
        joined = {k: _join([o[k] for o in outs]) for k in first}
        return type(first)(**joined)
    return first
