"""Makes ``model.generate`` build kinject's :class:`~kinject.kv.cache.KVCache` where it would build a
default one, and hands each step's padding mask to it."""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable

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
    caller passed no cache (``cache`` or ``past_key_values``: :data:`CACHE_KWARG`), ``use_cache`` is on and no other ``cache_implementation``
    is asked for, it puts ``make_cache(model, capacity)`` there instead of a ``DynamicCache`` (an
    encoder-decoder model: ``EncoderDecoderCache(make_cache(...), make_cross_cache(model))`` when
    ``make_cross_cache`` gives one, see :mod:`kinject.kv.encdec`);
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
            cache.begin_step(kwargs.get("attention_mask"))
            break
        if isinstance(cache, EncoderDecoderCache) and isinstance(cache.self_attention_cache, KVCache):
            cache.self_attention_cache.begin_step(kwargs.get("decoder_attention_mask"))   # the decoder's padding
            break
    return None
