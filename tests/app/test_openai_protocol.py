"""The OpenAI request parser and response builders shared by `kinject serve` and `kinject run-batch`,
and chat rendering: on the built-in model's tokenizer, no weights loaded."""

import json

import pytest
from transformers import AutoTokenizer

from kinject.app.chat import ChatTemplateError, MessagesError, check_messages, render_chat
from kinject.app.openai_protocol import (CHAT, COMPLETIONS, ChunkEncoder, ModelInfo, ProtocolError, batch_line, chunk,
                                         model_defaults, parse_json, parse_request, response_body, sse, usage_chunk)
from kinject.app.sequences import SamplingParams, Sequence
from kinject.fixtures import tiny_moe_path

MESSAGES = [{"role": "system", "content": "short answers"}, {"role": "user", "content": "def add(a, b):"}]


@pytest.fixture(scope="module")
def tok():
    t = AutoTokenizer.from_pretrained(tiny_moe_path())
    t.padding_side = "left"
    return t


@pytest.fixture(scope="module")
def info(tok):
    return ModelInfo("kinject-builtin", tok, 64, default_max_tokens=16)


# ------------------------------------------------------------------ chat


@pytest.mark.parametrize("messages", [MESSAGES, [{"role": "user", "content": [{"type": "text", "text": "import "},
                                                                              {"type": "text", "text": "os"}]}]])
def test_render_chat_encodes_to_the_templates_own_ids(tok, messages):
    text = render_chat(tok, check_messages(messages), "m")
    want = tok.apply_chat_template(check_messages(messages), tokenize=True, add_generation_prompt=True)["input_ids"]
    assert tok(text)["input_ids"] == want                       # one BOS, not two
    assert text.endswith("# assistant:\n")


def test_model_without_template_is_an_error_naming_it():
    plain = AutoTokenizer.from_pretrained(tiny_moe_path())
    plain.chat_template = None
    with pytest.raises(ChatTemplateError, match="model my-model has no chat template"):
        render_chat(plain, MESSAGES, "my-model")


@pytest.mark.parametrize("bad, match", [([], "non-empty list"), ("hi", "non-empty list"), ([{"content": "x"}], "role"),
                                        ([{"role": "user", "content": 3}], "content must be"),
                                        ([{"role": "user", "content": [{"type": "image_url"}]}], "only")])
def test_bad_messages(bad, match):
    with pytest.raises(MessagesError, match=match):
        check_messages(bad)


# ------------------------------------------------------------------ requests


def test_completion_request_defaults_and_fields(info, tok):
    req = parse_request(COMPLETIONS, {"model": "kinject-builtin", "prompt": "def f(x):"}, info)
    assert req.prompt_ids == tok("def f(x):")["input_ids"]
    assert req.params == [SamplingParams(max_tokens=16)]       # generation config: max_new_tokens, greedy
    req = parse_request(COMPLETIONS, {"model": "default", "prompt": "x", "max_tokens": 3, "temperature": 0.5,
                                      "top_p": 0.9, "seed": 7, "stop": "\n", "n": 3}, info)
    assert [p.seed for p in req.params] == [7, 8, 9] and {p.stop for p in req.params} == {("\n",)}
    assert {(p.max_tokens, p.temperature, p.top_p) for p in req.params} == {(3, 0.5, 0.9)}
    assert [s.tag[1] for s in req.sequences()] == [0, 1, 2]
    # no model field: the served one; token ids and a one-string list are prompts too
    ids = tok("import os")["input_ids"]
    assert parse_request(COMPLETIONS, {"prompt": ids}, info).prompt_ids == ids
    assert parse_request(COMPLETIONS, {"prompt": ["import os"]}, info).prompt_ids == ids
    # near the end of the context the default shrinks to what is left
    long = parse_request(COMPLETIONS, {"prompt": ids * 18}, info)
    assert long.params[0].max_tokens == 64 - len(ids) * 18 < 16


def test_chat_request_renders_with_the_template(info, tok):
    req = parse_request(CHAT, {"model": "kinject-builtin", "messages": MESSAGES, "max_completion_tokens": 5,
                               "max_tokens": 9}, info)
    assert req.prompt_ids == tok.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert req.params[0].max_tokens == 5 and req.chat and req.id.startswith("chatcmpl-")


@pytest.mark.parametrize("url, body, status, match", [
    (COMPLETIONS, {"model": "gpt-4", "prompt": "x"}, 404, "`gpt-4` does not exist"),
    (COMPLETIONS, {"prompt": "x", "temperature": 2.5}, 400, "'temperature' must be in"),
    (COMPLETIONS, {"prompt": "x", "temperature": "hot"}, 400, "'temperature' must be a number"),
    (COMPLETIONS, {"prompt": "x", "top_p": 0}, 400, "'top_p' must be in"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 0}, 400, "'max_tokens' must be >= 1"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": True}, 400, "'max_tokens' must be an integer"),
    (COMPLETIONS, {"prompt": "x", "n": 0}, 400, "'n' must be in"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 64}, 400, "maximum context length is 64"),
    (COMPLETIONS, {"prompt": "x " * 80}, 400, "leaves no room"),
    (COMPLETIONS, {"prompt": "x", "stop": [""]}, 400, "'stop' must be"),
    (COMPLETIONS, {"prompt": "x", "logprobs": 2}, 400, "'logprobs' is not supported"),
    (COMPLETIONS, {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "only allowed when 'stream'"),
    (COMPLETIONS, {"prompt": ["a", "b"]}, 400, "one prompt per request"),
    (COMPLETIONS, {"prompt": [1, 99999]}, 400, "outside the vocabulary"),
    (COMPLETIONS, {}, 400, "'prompt' is required"),
    (COMPLETIONS, {"messages": MESSAGES}, 400, "goes to /v1/chat/completions"),
    (CHAT, {"prompt": "x"}, 400, "'messages' is required"),
    (CHAT, {"messages": [{"role": "user"}]}, 400, "content must be"),
    ("/v1/embeddings", {"input": "x"}, 404, "is not served"),
])
def test_refusals_name_the_field(info, url, body, status, match):
    with pytest.raises(ProtocolError, match=match) as exc:
        parse_request(url, body, info)
    assert exc.value.status == status
    err = exc.value.body()["error"]
    assert err["code"] == status and err["type"] in ("BadRequestError", "NotFoundError") and match in err["message"]


def test_malformed_json_bodies():
    with pytest.raises(ProtocolError, match="malformed JSON"):
        parse_json(b"{nope")
    with pytest.raises(ProtocolError, match="JSON object"):
        parse_json(b"[1, 2]")


def test_defaults_follow_the_generation_config():
    from transformers import GenerationConfig

    assert model_defaults(GenerationConfig(do_sample=False, max_new_tokens=20)) == {"default_max_tokens": 20,
                                                                                   "default_temperature": 0.0}
    assert model_defaults(GenerationConfig(do_sample=True, temperature=0.6, top_p=0.95))["default_top_p"] == 0.95
    assert model_defaults(None) == {"default_temperature": 1.0}


def test_response_shapes(info):
    req = parse_request(CHAT, {"messages": MESSAGES, "n": 2, "stream": True,
                               "stream_options": {"include_usage": True}}, info)
    seqs = req.sequences()
    for s, (ids, text, why) in zip(seqs, [([5, 6, 2], "ab", "stop"), ([7], "c", "length")]):
        s.ids, s.text, s.finish_reason = ids, text, why
    body = response_body(req, seqs)
    assert body["object"] == "chat.completion" and body["usage"] == {
        "prompt_tokens": len(req.prompt_ids), "completion_tokens": 4, "total_tokens": len(req.prompt_ids) + 4}
    assert [c["message"]["content"] for c in body["choices"]] == ["ab", "c"]
    first = chunk(req, 1, "c", None, first=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "c"} and first["usage"] is None
    assert chunk(req, 0, "", "stop")["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert usage_chunk(req, seqs)["choices"] == []
    line = batch_line("x", body=body)
    assert line["response"]["status_code"] == 200 and line["error"] is None and line["response"]["body"] is body
    err = batch_line("y", error=ProtocolError("no", 404).body(), status=404)
    assert err["response"] == {**err["response"], "status_code": 404, "body": None} and err["error"]["error"]["code"] == 404
    json.dumps(line)


@pytest.mark.parametrize("url,body", [(COMPLETIONS, {"prompt": "x", "stream": True}),
                                      (COMPLETIONS, {"prompt": "x", "stream": True, "stream_options": {"include_usage": True}}),
                                      (CHAT, {"messages": MESSAGES, "stream": True}),
                                      (CHAT, {"messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True}})])
def test_chunk_encoder_writes_the_bytes_of_chunk(info, url, body):
    req = parse_request(url, body, info)
    req = type(req)(**{**req.__dict__, "model": 'a "quoted" módel\\'})     # names JSON must escape
    enc = ChunkEncoder(req)
    for index, text, reason, first in [(0, "", None, True), (0, "ab", None, True), (1, 'say "hi"\n\tü €😀', None, False),
                                       (0, "", "stop", False), (12, "x", "length", False), (0, "\x00\x7f\u2028", None, False)]:
        got = enc.encode(index, text, reason, first)
        assert got == sse(chunk(req, index, text, reason, first=first)), (index, text, reason, first)
        assert json.loads(got[len(b"data: "):]) == chunk(req, index, text, reason, first=first)


def test_sequences_are_fresh_per_call(info):
    req = parse_request(COMPLETIONS, {"prompt": "x", "n": 2}, info)
    a, b = req.sequences(), req.sequences()
    assert all(isinstance(s, Sequence) for s in a) and a[0] is not b[0] and a[0].prompt_ids is not req.prompt_ids


def test_fixture_ships_the_template():
    from pathlib import Path

    assert (Path(tiny_moe_path()) / "chat_template.jinja").is_file()
    assert AutoTokenizer.from_pretrained(tiny_moe_path()).chat_template


def test_serve_without_its_extra_names_the_extra(monkeypatch, capsys):
    import importlib.util

    from kinject.app.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "fastapi" else real(name, *a))
    assert main(["serve"]) == 2
    err = capsys.readouterr().err
    assert "kinject serve needs fastapi: pip install 'kinject[serve]'" in err and "Traceback" not in err
    assert main(["serve", "--port", "70000"]) == 2
    assert "--port must be in [0, 65535]" in capsys.readouterr().err
