"""One generate per batch group with per-sequence settings (kinject/app/sequences.py), and `kinject run`
with chat lines, on the built-in model under rules/klotski.yaml: greedy tokens equal untouched
transformers on the same left-padded group; max_tokens, stop strings, seeds and streaming per sequence."""

import json
import shutil
from pathlib import Path

import pytest
import torch

import kinject
from kinject.app.chat import render_chat
from kinject.app.run import RunConfig, load_tokenizer, default_rules, run_job
from kinject.app.sequences import SamplingParams, Sequence, generate_sequences
from kinject.errors import KinjectError
from kinject.fixtures import tiny_moe_path
from kinject.rules import load_rules

PROMPTS = ["def fibonacci(n):", "import torch\nimport torch.nn as nn\n\nclass", "for i in range(10):\n    print(",
           "# Mixture of experts models route every token to", "if __name__ == \"__main__\":"]


@pytest.fixture(scope="module")
def model_and_tok():
    path = Path(tiny_moe_path())
    tok = load_tokenizer(path)
    model = kinject.from_pretrained(path, load_rules(default_rules(path)), dtype="float32", attn_implementation="eager")
    yield model, tok
    model.kinject.transfer.close()


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_moe_path(), dtype=torch.float32, attn_implementation="eager").eval()


def hf_group(hf, tok, prompts, new):
    enc = tok(prompts, return_tensors="pt", padding=True)
    out = hf.generate(**enc, max_new_tokens=new, do_sample=False, pad_token_id=tok.pad_token_id)
    return out[:, enc["input_ids"].shape[1]:].tolist()


def trimmed(ids, n, eos=2):
    ids = ids[:n]
    return ids[: ids.index(eos) + 1] if eos in ids else ids


def seqs_of(tok, prompts, **params):
    return [Sequence(tok(p)["input_ids"], SamplingParams(**params)) for p in prompts]


def test_greedy_group_equals_transformers_with_own_max_tokens(model_and_tok, hf):
    model, tok = model_and_tok
    limits = [3, 9, 1, 12, 6]                                   # each its own; the group runs to the longest
    seqs = [Sequence(tok(p)["input_ids"], SamplingParams(max_tokens=m)) for p, m in zip(PROMPTS, limits)]
    generate_sequences(model, tok, seqs, model.kinject.device)
    ref = hf_group(hf, tok, PROMPTS, max(limits))
    for s, r, m in zip(seqs, ref, limits):
        assert s.ids == trimmed(r, m)
        assert s.text == tok.decode(s.ids, skip_special_tokens=True)
        assert s.finish_reason == ("stop" if s.ids[-1] == 2 else "length") and len(s.ids) <= m


def test_stop_strings_cut_the_text_and_streaming_adds_up(model_and_tok):
    model, tok = model_and_tok
    plain = seqs_of(tok, PROMPTS, max_tokens=14)
    generate_sequences(model, tok, plain, model.kinject.device)
    stops = []
    for s in plain:                        # a stop string each that the greedy text really contains
        words = [w for w in s.text.split(" ") if len(w) >= 2]
        stops.append(words[len(words) // 2] if words else "\n")
    events = []
    streamed = [Sequence(tok(p)["input_ids"], SamplingParams(max_tokens=14, stop=(st, "zzzz-never")), stream=True)
                for p, st in zip(PROMPTS, stops)]
    generate_sequences(model, tok, streamed, model.kinject.device, on_step=events.append)
    for p, s, st in zip(plain, streamed, stops):
        if st in p.text:
            assert s.text == p.text[:p.text.index(st)] and s.finish_reason == "stop"
            assert s.ids == p.ids[:len(s.ids)] and len(s.ids) <= len(p.ids)
        else:
            assert s.text == p.text
        got = "".join(text for step in events for q, text, _ in step if q is s)
        assert got == s.text                                   # every streamed piece, nothing held back at the end
        reasons = [why for step in events for q, _, why in step if q is s and why]
        assert reasons == [s.finish_reason]                    # finished exactly once


def test_seeded_sampling_is_the_same_in_any_group(model_and_tok):
    model, tok = model_and_tok
    params = dict(max_tokens=10, temperature=0.9, top_p=0.8, seed=1234)
    alone = seqs_of(tok, PROMPTS[:1], **params)
    generate_sequences(model, tok, alone, model.kinject.device)
    mixed = [Sequence(tok(PROMPTS[2])["input_ids"], SamplingParams(max_tokens=4)),
             Sequence(tok(PROMPTS[0])["input_ids"], SamplingParams(**params)),
             Sequence(tok(PROMPTS[3])["input_ids"], SamplingParams(max_tokens=10, temperature=1.0, seed=5))]
    generate_sequences(model, tok, mixed, model.kinject.device)
    assert mixed[1].ids == alone[0].ids
    other = seqs_of(tok, PROMPTS[:1], **{**params, "seed": 99})
    generate_sequences(model, tok, other, model.kinject.device)
    greedy = seqs_of(tok, PROMPTS[:1], max_tokens=10)
    generate_sequences(model, tok, greedy, model.kinject.device)
    assert len({tuple(alone[0].ids), tuple(other[0].ids), tuple(greedy[0].ids)}) > 1


def test_cancelled_sequence_stops_the_group_early(model_and_tok):
    model, tok = model_and_tok
    seqs = [Sequence(tok(p)["input_ids"], SamplingParams(max_tokens=40), stream=True) for p in PROMPTS[:2]]

    def on_step(events):
        for s in seqs:
            if len(s.ids) >= 3:
                s.cancelled = True

    generate_sequences(model, tok, seqs, model.kinject.device, on_step=on_step)
    assert all(s.finish_reason in ("cancelled", "stop") for s in seqs)
    assert max(len(s.ids) for s in seqs) <= 4


# ------------------------------------------------------------------ kinject run with chat lines


def test_run_renders_messages_with_the_template(model_and_tok, hf, tmp_path):
    _, tok = model_and_tok
    chats = [[{"role": "user", "content": "def add(a, b):"}],
             [{"role": "system", "content": "python"}, {"role": "user", "content": "import os"}]]
    src = tmp_path / "p.jsonl"
    src.write_text("\n".join([json.dumps({"id": "c1", "messages": chats[0]}), json.dumps({"prompt": PROMPTS[0]}),
                              json.dumps({"id": "c2", "messages": chats[1]})]) + "\n")
    out = tmp_path / "out.jsonl"
    run_job(RunConfig(prompts=str(src), out=str(out), max_new_tokens=6, dtype="float32", progress=False,
                      overrides=["pipeline.n_batches=1", "pipeline.micro_batch_size=3"]))
    recs = [json.loads(ln) for ln in out.read_text().splitlines()]
    texts = [render_chat(tok, chats[0], "m"), PROMPTS[0], render_chat(tok, chats[1], "m")]
    assert [r["prompt"] for r in recs] == texts and recs[0]["messages"] == chats[0] and "messages" not in recs[1]
    ref = hf_group(hf, tok, texts, 6)
    assert [r["completion_ids"] for r in recs] == [trimmed(r, 6) for r in ref]


def test_run_chat_on_a_model_without_template_names_it(tmp_path):
    bare = tmp_path / "no-template-model"
    bare.mkdir()
    for f in Path(tiny_moe_path()).iterdir():
        if f.name != "chat_template.jinja":
            (bare / f.name).symlink_to(f)
    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(KinjectError, match=r"line 1 \(id 1\): model .*no-template-model has no chat template"):
        run_job(RunConfig(model=str(bare), prompts=str(src), out=str(tmp_path / "o.jsonl"), progress=False))
    assert not (tmp_path / "o.jsonl").exists()
    shutil.rmtree(bare)
