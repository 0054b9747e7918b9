"""Generation modes that roll the KV cache back or re-forward positions, on the built-in model.

transformers' assisted decoding (``assistant_model=``) and prompt-lookup decoding
(``prompt_lookup_num_tokens=``) verify several drafted tokens in one forward, then ``crop`` the
cache back past the rejected ones; ``DynamicCache.crop`` may also be called directly. Under
``rules/klotski.yaml`` -- KV in the host tier crossing an (emulated) link, or weights and KV on disk
read by ``kinject.from_pretrained``, micro-batches of 2 -- each gives the untouched model's tokens,
and the cache crops were real (drafts rejected). A forward whose positions overlap what the cache
holds without a crop first is refused, naming the model (``KVCache.check_positions``).

Contrastive search is not here: transformers 5.x moved it out of core to a hub repository
(``custom_generate="transformers-community/contrastive-search"``, ``trust_remote_code=True``), which
cannot be fetched offline; its ``batch_select_indices`` is served (tests/operators/test_attention.py). DiffusionGemma's
block diffusion re-forwards a block's positions at every denoising step, reading the prefix KV without
writing it: served from the disk tier per micro-batch (the last test).
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

import kinject
from kinject.errors import KinjectError
from kinject.fixtures import tiny_moe_path
from kinject.kv import KVCache, KVLayer
from kinject.kv.generate import CACHE_KWARG        # ``cache`` from transformers 5.23, ``past_key_values`` before

RULES = "rules/klotski.yaml"
LINK = "pipeline.emulate_bandwidth=1000"          # host KV crosses a link: loaded / stored per micro-batch
NEW = 12
# repetitive code: prompt lookup finds its n-grams, a perturbed assistant drafts some wrong tokens
PROMPT = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(tiny_moe_path())


def _untouched():
    return AutoModelForCausalLM.from_pretrained(tiny_moe_path(), dtype=torch.float32)


def _assistant():
    """A draft model that disagrees with the built-in model on some tokens (its last layer perturbed)."""
    model = _untouched()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".layers.5." in name and p.dim() > 1:   # its last layer mostly noise
                p.add_(torch.randn(p.shape, generator=g) * p.std() * 3)
    return model


def _ported(tier: str, tmp_path):
    opts = ["pipeline.micro_batch_size=2", "pipeline.n_batches=2", f"pipeline.offload_dir={tmp_path}/off"]
    if tier == "host":
        return kinject.optimize(_untouched(), RULES, [*opts, LINK])
    return kinject.from_pretrained(tiny_moe_path(), RULES, [*opts, "vars.weights=disk", "vars.kv=disk"],
                                   dtype=torch.float32)


@pytest.fixture
def crops(monkeypatch):
    """The token counts every kinject cache layer was cropped by (rejected drafts)."""
    seen: list[int] = []
    original = KVLayer.crop

    def crop(self, tokens_to_remove):
        if self.idx == 0:
            seen.append(-tokens_to_remove if tokens_to_remove <= 0 else self.seen - tokens_to_remove)
        return original(self, tokens_to_remove)

    monkeypatch.setattr(KVLayer, "crop", crop)
    return seen


def _generate(model, batch, pad, **kw):
    return model.generate(**batch, max_new_tokens=NEW, do_sample=False, pad_token_id=pad, **kw)


@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("mode", ["assisted", "prompt_lookup"])
def test_drafting_modes_crop_the_kv_and_give_the_untouched_tokens(mode, tier, tokenizer, tmp_path, crops):
    batch = tokenizer([PROMPT], return_tensors="pt")       # these modes take one row: 1 of a micro-batch of 2
    kw = {"assistant_model": _assistant()} if mode == "assisted" else {"prompt_lookup_num_tokens": 3}
    pad = tokenizer.pad_token_id
    untouched = _untouched()
    ref = _generate(untouched, batch, pad)
    assert torch.equal(_generate(untouched, batch, pad, **kw), ref)     # the mode itself is exact
    model = _ported(tier, tmp_path)
    crops.clear()
    out = _generate(model, batch, pad, **kw)
    assert torch.equal(out, ref)
    assert any(n > 0 for n in crops), crops     # kinject's cache served it, drafts were rejected and cropped
    kinject.restore(model)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_crop_then_new_tokens_match_dynamic_cache_across_micro_batches(tier, tokenizer, tmp_path):
    """``crop`` called directly on 3 rows in micro-batches of 2 (a partial one): the next forward over
    other tokens gives transformers' logits; re-forwarding cached positions without a crop is refused."""
    untouched = _untouched()
    model = _ported(tier, tmp_path)
    prompts = ["def main(args):\n    return", "import os\nimport sys\n", "class Reader:\n    def"]
    first = tokenizer(prompts, return_tensors="pt", padding=True)
    ids, mask = first["input_ids"], first["attention_mask"]
    more = torch.tensor([[11, 12, 13, 14]] * 3)
    other = torch.tensor([[21, 22]] * 3)
    cache = model.kinject.peek("attention").make_cache(model)
    ref_cache = DynamicCache(config=untouched.config)
    steps = [(ids, mask, None), (more, torch.ones_like(more), None), (other, torch.ones_like(other), 3)]
    full_mask = mask
    for step, (x, m, crop) in enumerate(steps):
        if crop:
            cache.crop(-crop)
            ref_cache.crop(-crop)
            full_mask = full_mask[:, :-crop]
        full_mask = torch.cat([full_mask, m], 1) if step else m
        with torch.no_grad():
            got = model(input_ids=x, attention_mask=full_mask, **{CACHE_KWARG: cache}).logits
            want = untouched(input_ids=x, attention_mask=full_mask, **{CACHE_KWARG: ref_cache}).logits
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)         # stale KV: off by units
        assert cache.get_seq_length() == ref_cache.get_seq_length()
    # the same two tokens again, with no crop: positions the cache holds, refused before any layer runs
    again = torch.cat([full_mask[:, :-2], torch.ones_like(other)], 1)
    with pytest.raises(KinjectError, match="MixtralForCausalLM: a forward of 2 tokens .* re-forwards 2 of the"), \
            torch.no_grad():
        model(input_ids=other, attention_mask=again, **{CACHE_KWARG: cache})
    assert cache.get_seq_length() == ref_cache.get_seq_length()
    kinject.restore(model)


def test_a_read_only_forward_leaves_the_cache_as_it_was(tokenizer):
    """A module that reads ``cache.layers[i].keys`` and never calls ``update`` (DiffusionGemma's
    decoder, every denoising step) sees its micro-batch's past, and the layer neither stores nor
    advances: the next forward continues from the same positions."""
    untouched = _untouched()
    model = kinject.optimize(copy.deepcopy(untouched), RULES, ["pipeline.micro_batch_size=2", LINK])
    batch = tokenizer(["def main(args):\n    return", "import os\n", "class Reader:"], return_tensors="pt",
                      padding=True)
    cache = model.kinject.peek("attention").make_cache(model)
    with torch.no_grad():
        model(**batch, **{CACHE_KWARG: cache})
    layer = cache.layers[0]
    seen, keys = layer.get_seq_length(), layer.keys.clone()
    ref = DynamicCache(config=untouched.config)
    with torch.no_grad():
        untouched(**batch, **{CACHE_KWARG: ref})
    torch.testing.assert_close(keys, ref.layers[0].keys, atol=1e-5, rtol=0)

    read: list[torch.Tensor] = []
    attns = [layer.self_attn.base for layer in model.model.layers]

    def reads_only(attn):
        forward = attn.forward
        # the attention's cache argument: ``cache`` from transformers 5.23, ``past_key_values`` before
        name = next(n for n in ("cache", "past_key_values") if n in inspect.signature(forward).parameters)

        def run(hidden_states, position_embeddings, attention_mask, **kwargs):
            past = kwargs.pop(name).layers[attn.layer_idx]      # the micro-batch's past, read; no update
            if attn is attns[0]:
                read.append(past.keys.clone())
            own = DynamicCache()                        # its new entries kept to itself, as DiffusionGemma's decoder
            own.update(past.keys, past.values, attn.layer_idx)
            return forward(hidden_states, position_embeddings, attention_mask, **{name: own}, **kwargs)
        return run

    for attn in attns:
        attn.forward = reads_only(attn)
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([[5, 6, 7, 8]] * 3), **{CACHE_KWARG: cache})
    finally:
        for attn in attns:
            del attn.forward
    assert torch.equal(torch.cat(read), keys)                       # each micro-batch its own rows' past
    assert layer.get_seq_length() == seen and torch.equal(layer.keys, keys)
    kinject.restore(model)


def test_a_crop_past_evicted_entries_and_misplaced_positions_are_refused_naming_the_model():
    """A sliding layer that already dropped its oldest entries cannot roll back (transformers'
    ``DynamicSlidingWindowLayer`` refuses too, unless it recorded its past); a forward whose mask
    skips positions after the cached ones is refused like one that overlaps them."""
    from kinject.engine.transfer import TransferEngine
    from kinject.kv import KVSpec
    from kinject.testing import tiny_config

    config = tiny_config("gpt_oss")                      # layer 0 sliding (16), layer 1 full
    with TransferEngine("cpu") as engine:
        cache = KVCache(config, specs=lambda i: KVSpec("host"), transfer=engine, micro_batch_size=2,
                        owner="GptOssForCausalLM")
        for i in (0, 1):
            cache.update(torch.randn(3, 2, 20, 16), torch.randn(3, 2, 20, 16), i)
        cache.layers[1].crop(-2)                         # the full layer keeps everything: served
        assert cache.layers[1].get_seq_length() == 18
        with pytest.raises(KinjectError, match="GptOssForCausalLM: cache layer 0 cannot crop 2 tokens: its older "
                                               "entries were already evicted \\(sliding window\\)"):
            cache.layers[0].crop(-2)
        cache.check_positions(20 + 3, 3)                 # 20 cached + 3 new: in place
        with pytest.raises(KinjectError, match="a forward of 3 tokens with a 25-token attention mask skips 2 "
                                               "positions after the 20 the cache holds"):
            cache.check_positions(25, 3)
        with pytest.raises(KinjectError, match="re-forwards 3 of the 20 positions"):
            cache.check_positions(20, 3)


def test_speculative_bench_writes_plain_and_prompt_lookup_rows(tmp_path, capsys):
    """``kinject bench speculative``: a row per decoding mode, prompt lookup in fewer forwards than
    tokens, the untouched model's tokens in both."""
    from kinject.app.cli import build_parser

    out = tmp_path / "spec.md"
    args = build_parser().parse_args(["bench", "speculative", "--rules", "hybrid", "--new-tokens", "8", "--repeats", "1",
                                      "--workdir", str(tmp_path / "w"), "--out", str(out)])
    assert args.func(args) == 0
    rows = [line.split("|")[1:-1] for line in out.read_text().splitlines() if line.startswith("| hybrid")]
    assert [r[1].strip() for r in rows] == ["plain greedy", "prompt lookup (k=4)"]
    assert float(rows[0][5]) == 1.0 and float(rows[1][5]) < 1.0          # forwards per token
    assert all(r[7].strip() == "✓" for r in rows)


def test_block_diffusion_streams_its_prefix_kv_per_micro_batch_from_disk(tmp_path):
    """DiffusionGemma's generate takes kinject's cache (its own ``_prepare_cache_for_generation``):
    the encoder writes each block's prefix KV to the disk tier, the decoder re-forwards the block at
    every denoising step reading it per micro-batch; 4 prompts in micro-batches of 2, 8 new tokens
    (two blocks of 4), the untouched model's tokens, and the cache holds the prompt and the first block
    only (the decoder's re-forwards added nothing)."""
    import warnings

    from kinject import modal_families

    model = modal_families.build_tiny_modal_model("diffusion_gemma")
    assert model.config.canvas_length == 4
    batch = modal_families.text_batch(4, seed=1, length=10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = modal_families.generate_tokens(model, batch, 8)
        model.save_pretrained(tmp_path / "ckpt")
        ported = kinject.from_pretrained(tmp_path / "ckpt", RULES, ["pipeline.micro_batch_size=2", "pipeline.n_batches=2",
                                                                  LINK, "vars.weights=disk", "vars.kv=disk",
                                                                  f"pipeline.offload_dir={tmp_path}/off"],
                                         attn_implementation="sdpa")
        torch.manual_seed(0)
        out = ported.generate(**batch, max_new_tokens=8, do_sample=False)
    assert torch.equal(out.sequences, ref)
    cache = getattr(out, CACHE_KWARG)                   # the output field is named like the argument
    assert isinstance(cache, KVCache) and [layer.spec.tier for layer in cache.layers] == ["disk", "disk"]
    assert cache.micro_batch_size == 2 and cache.get_seq_length() == 10 + 4
    kinject.restore(ported)
