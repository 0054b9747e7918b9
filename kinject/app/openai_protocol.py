"""The OpenAI request and response shapes, shared by ``kinject serve`` and ``kinject run-batch``.

One parser checks a ``/v1/completions`` or ``/v1/chat/completions`` body and turns it into the
sequences of a batch group (:class:`ParsedRequest`); one set of builders writes the ``completion``,
``chat.completion``, their stream chunks, the error body and the Batch file's output line, as vLLM's
OpenAI-compatible server and ``vllm run-batch`` write them. Every refusal is a :class:`ProtocolError`
with the HTTP status the server answers and a message naming the field (docs/architecture.md, "Serving").

Defaults follow the model, as vLLM's do: ``max_tokens`` is the generation config's ``max_new_tokens``
(clipped to what the context leaves), else the rest of the context; sampling is greedy when the
generation config says ``do_sample: false``, else its temperature and top-p (OpenAI's 1.0 without one).
"""

from __future__ import annotations

import json
import time
import uuid
from json.encoder import encode_basestring
from dataclasses import dataclass, field
from typing import Any

from kinject.app.chat import ChatTemplateError, MessagesError, check_messages, render_chat
from kinject.app.sequences import SamplingParams, Sequence

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
URLS = (COMPLETIONS, CHAT)
MAX_N = 128
SEED_RANGE = (-(2 ** 63), 2 ** 64 - 1)        # what torch.Generator.manual_seed takes

_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowedError",
                413: "RequestTooLargeError", 500: "InternalServerError", 503: "ServiceUnavailableError"}

# parameters that change the answer and kinject does not implement: refused unless at their no-op value
_UNSUPPORTED = {"logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False), "suffix": (None, ""),
                "logit_bias": (None, {}), "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
                "tools": (None, []), "functions": (None, []), "tool_choice": (None, "none", "auto"),
                "function_call": (None, "none", "auto")}


class ProtocolError(Exception):
    """A request kinject refuses: ``status`` (4xx, or 5xx for a server fault) and a one-line message."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param = message, status, param

    def body(self) -> dict:
        return error_body(self.message, self.status, self.param)


def error_body(message: str, status: int, param: str | None = None) -> dict:
    """OpenAI's error object as vLLM fills it: ``type`` the error class, ``code`` the HTTP status."""
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "BadRequestError" if status < 500
                                                                      else "InternalServerError"),
                      "param": param, "code": status}}


@dataclass(frozen=True)
class ModelInfo:
    """What a request is checked against: the served name, its tokenizer and context, its defaults."""

    name: str
    tok: Any
    context: int
    default_max_tokens: int | None = None
    default_temperature: float = 0.0
    default_top_p: float = 1.0
    created: int = field(default_factory=lambda: int(time.time()))

    def card(self) -> dict:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "kinject",
                "root": self.name, "parent": None, "max_model_len": self.context}

    def models(self) -> dict:
        return {"object": "list", "data": [self.card()]}


def model_defaults(generation_config) -> dict:
    """:class:`ModelInfo`'s defaults from a transformers ``GenerationConfig`` (None: OpenAI's)."""
    if generation_config is None:
        return {"default_temperature": 1.0}
    out: dict[str, Any] = {}
    n = getattr(generation_config, "max_new_tokens", None)
    if isinstance(n, int) and n > 0:
        out["default_max_tokens"] = n
    if getattr(generation_config, "do_sample", False):
        out["default_temperature"] = float(getattr(generation_config, "temperature", None) or 1.0)
        out["default_top_p"] = float(getattr(generation_config, "top_p", None) or 1.0)
    else:
        out["default_temperature"] = 0.0
    return out


@dataclass
class ParsedRequest:
    """A checked request: its prompt ids, one :class:`SamplingParams` per choice, how to answer."""

    url: str
    model: str
    prompt: str
    prompt_ids: list[int]
    params: list[SamplingParams]
    stream: bool = False
    include_usage: bool = False
    id: str = ""
    created: int = 0

    @property
    def chat(self) -> bool:
        return self.url == CHAT

    def sequences(self, stream: bool | None = None, owner: object = None) -> list[Sequence]:
        """One :class:`Sequence` per choice (``n``), tagged ``(owner or this request, choice index)``."""
        stream = self.stream if stream is None else stream
        return [Sequence(list(self.prompt_ids), p, stream=stream, tag=(owner or self, i))
                for i, p in enumerate(self.params)]


def parse_json(raw: bytes | str) -> dict:
    """The request body as a JSON object, or a 400 saying what is wrong with it."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"malformed JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise ProtocolError(f"the body must be a JSON object, got {type(body).__name__}")
    return body


def parse_request(url: str, body: Any, info: ModelInfo) -> ParsedRequest:
    """Check ``body`` of a request to ``url`` against the served model; raises :class:`ProtocolError`."""
    if url not in URLS:
        raise ProtocolError(f"URL {url} is not served; kinject serves {', '.join(URLS)}", 404)
    if not isinstance(body, dict):
        raise ProtocolError(f"the body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ProtocolError(f"'model' must be a string, got {_short(model)}", param="model")
    if model not in (None, "default", info.name):
        raise ProtocolError(f"The model `{model}` does not exist; this server serves `{info.name}` "
                            "(or say \"default\")", 404, "model")
    for key, noops in _UNSUPPORTED.items():
        value = body.get(key)
        if not any(value == a and isinstance(value, bool) == isinstance(a, bool) for a in noops):
            raise ProtocolError(f"'{key}' is not supported by kinject (got {_short(body[key])})", param=key)
    best_of = body.get("best_of")
    if best_of is not None and best_of != body.get("n", 1):
        raise ProtocolError(f"'best_of' is not supported by kinject (got {_short(best_of)})", param="best_of")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise ProtocolError(f"'response_format' other than text is not supported (got {_short(fmt)})",
                            param="response_format")

    if url == CHAT:
        if "messages" not in body:
            raise ProtocolError("'messages' is required for /v1/chat/completions", param="messages")
        try:
            prompt = render_chat(info.tok, check_messages(body["messages"]), info.name)
        except MessagesError as exc:
            raise ProtocolError(str(exc), param="messages") from None
        except ChatTemplateError as exc:
            raise ProtocolError(str(exc), param="messages") from None
        prompt_ids = info.tok(prompt)["input_ids"]
    else:
        if "messages" in body:
            raise ProtocolError("/v1/completions takes 'prompt'; 'messages' goes to /v1/chat/completions",
                                param="messages")
        prompt, prompt_ids = _completion_prompt(body.get("prompt"), info)

    if not prompt_ids:
        raise ProtocolError("the prompt is empty (no tokens)", param="prompt")
    room = info.context - len(prompt_ids)
    if room < 1:
        raise ProtocolError(f"This model's maximum context length is {info.context} tokens. However, your "
                            f"prompt is {len(prompt_ids)} tokens, which leaves no room for a completion",
                            param="messages" if url == CHAT else "prompt")
    key = "max_completion_tokens" if url == CHAT and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, key, low=1)
    if max_tokens is None:
        max_tokens = min(info.default_max_tokens or room, room)
    elif max_tokens > room:
        raise ProtocolError(f"This model's maximum context length is {info.context} tokens. However, you "
                            f"requested {len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the prompt, "
                            f"{max_tokens} for the completion). Please reduce the prompt or {key}.", param=key)
    temperature = _number(body, "temperature", 0.0, 2.0)
    top_p = _number(body, "top_p", 0.0, 1.0, open_low=True)
    seed = _int(body, "seed", *SEED_RANGE)
    n = _int(body, "n", 1, MAX_N) or 1
    stop = _stop(body.get("stop"))
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ProtocolError(f"'stream' must be true or false, got {_short(stream)}", param="stream")
    options = body.get("stream_options")
    if options is not None and not stream:
        raise ProtocolError("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
            raise ProtocolError(f"'stream_options' must be {{\"include_usage\": true|false}}, got {_short(options)}",
                                param="stream_options")
        include_usage = options.get("include_usage", False)

    temperature = info.default_temperature if temperature is None else temperature
    top_p = (info.default_top_p if temperature > 0 else 1.0) if top_p is None else top_p
    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                             seed=None if seed is None else _choice_seed(seed, i), stop=stop) for i in range(n)]
    return ParsedRequest(url, info.name, prompt, list(prompt_ids), params, stream, include_usage,
                         id=("chatcmpl-" if url == CHAT else "cmpl-") + uuid.uuid4().hex, created=int(time.time()))


def _completion_prompt(prompt: Any, info: ModelInfo) -> tuple[str, list[int]]:
    """``prompt`` of a completions request: a string, a list of one string, or token ids."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt, list(info.tok(prompt)["input_ids"])
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        vocab = len(info.tok)
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise ProtocolError(f"token id {bad} in 'prompt' is outside the vocabulary (0..{vocab - 1})", param="prompt")
        return info.tok.decode(prompt), list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise ProtocolError(f"one prompt per request (got a list of {len(prompt)}): send one request each",
                            param="prompt")
    if prompt is None:
        raise ProtocolError("'prompt' is required for /v1/completions", param="prompt")
    raise ProtocolError(f"'prompt' must be a string or a list of token ids, got {_short(prompt)}", param="prompt")


def _choice_seed(seed: int, i: int) -> int:
    """Choice ``i``'s seed: ``seed + i``, wrapped into the range a torch generator takes."""
    lo, hi = SEED_RANGE
    return (seed + i - lo) % (hi - lo + 1) + lo


def _int(body: dict, key: str, low: int | None = None, high: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"'{key}' must be an integer, got {_short(value)}", param=key)
    if (low is not None and value < low) or (high is not None and value > high):
        rng = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ProtocolError(f"'{key}' must be {rng}, got {value}", param=key)
    return value


def _number(body: dict, key: str, low: float, high: float, open_low: bool = False) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ProtocolError(f"'{key}' must be a number, got {_short(value)}", param=key)
    if value > high or value < low or (open_low and value == low):
        raise ProtocolError(f"'{key}' must be in {'(' if open_low else '['}{low:g}, {high:g}], got {value}", param=key)
    return float(value)


def _stop(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ProtocolError(f"'stop' must be a non-empty string or a list of them, got {_short(stop)}", param="stop")
    return tuple(stop)


def _short(value: Any, limit: int = 60) -> str:
    text = json.dumps(value) if isinstance(value, (dict, list, str, int, float, bool, type(None))) else repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


# ------------------------------------------------------------------------------------- responses


def usage(req: ParsedRequest, seqs: list[Sequence]) -> dict:
    completion = sum(len(s.ids) for s in seqs)
    return {"prompt_tokens": len(req.prompt_ids), "completion_tokens": completion,
            "total_tokens": len(req.prompt_ids) + completion}


def response_body(req: ParsedRequest, seqs: list[Sequence]) -> dict:
    """The whole answer: a ``text_completion`` or a ``chat.completion``, with ``usage``."""
    if req.chat:
        choices = [{"index": i, "message": {"role": "assistant", "content": s.text}, "logprobs": None,
                    "finish_reason": s.finish_reason} for i, s in enumerate(seqs)]
        obj = "chat.completion"
    else:
        choices = [{"index": i, "text": s.text, "logprobs": None, "finish_reason": s.finish_reason}
                   for i, s in enumerate(seqs)]
        obj = "text_completion"
    return {"id": req.id, "object": obj, "created": req.created, "model": req.model, "choices": choices,
            "usage": usage(req, seqs)}


def chunk(req: ParsedRequest, index: int, text: str, finish_reason: str | None, first: bool = False) -> dict:
    """One stream chunk of choice ``index``: its new text, and its finish reason on the last one."""
    if req.chat:
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    out = {"id": req.id, "object": obj, "created": req.created, "model": req.model, "choices": [choice]}
    if req.include_usage:
        out["usage"] = None
    return out


def usage_chunk(req: ParsedRequest, seqs: list[Sequence]) -> dict:
    """The last chunk of a stream with ``stream_options.include_usage``: no choices, the usage."""
    return {"id": req.id, "object": "chat.completion.chunk" if req.chat else "text_completion",
            "created": req.created, "model": req.model, "choices": [], "usage": usage(req, seqs)}


class ChunkEncoder:
    """A request's stream chunks as SSE bytes, the same bytes as ``sse(chunk(...))`` writes, built from
    bytes prepared once per request: per chunk only the text is JSON-encoded (per-token Python work
    stays small, docs/architecture.md, "Serving")."""

    def __init__(self, req: ParsedRequest):
        head = json.dumps({"id": req.id, "object": "chat.completion.chunk" if req.chat else "text_completion",
                           "created": req.created, "model": req.model}, ensure_ascii=False)
        self.chat = req.chat
        self._head = b"data: " + head[:-1].encode() + b', "choices": [{"index": '
        self._tail = b"}]" + (b', "usage": null' if req.include_usage else b"") + b"}\n\n"

    def encode(self, index: int, text: str, finish_reason: str | None, first: bool = False) -> bytes:
        """What ``sse(chunk(req, index, text, finish_reason, first))`` gives."""
        quoted = encode_basestring(text).encode()             # json.dumps(text, ensure_ascii=False), less its call layers
        if not self.chat:
            choice = b', "text": ' + quoted
        elif first:
            choice = b', "delta": {"role": "assistant", "content": ' + quoted + b"}"
        else:
            choice = b', "delta": {"content": ' + quoted + b"}" if text else b', "delta": {}'
        reason = b"null" if finish_reason is None else json.dumps(finish_reason).encode()
        return b"".join((self._head, str(index).encode(), choice, b', "logprobs": null, "finish_reason": ', reason,
                         self._tail))


def sse(data: dict | str) -> bytes:
    """One Server-Sent Events message."""
    return b"data: " + (data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)).encode() + b"\n\n"


SSE_DONE = sse("[DONE]")


def batch_line(custom_id: str | None, *, body: dict | None = None, error: dict | None = None,
               status: int = 200) -> dict:
    """One line of the Batch output file, as ``vllm run-batch`` writes it: the response (status,
    request id, body) and, for a refused request, ``error`` (the error body the server would send)
    with no response body."""
    return {"id": "kinject-" + uuid.uuid4().hex, "custom_id": custom_id,
            "response": {"status_code": status, "request_id": "kinject-batch-" + uuid.uuid4().hex,
                         "body": body if error is None else None},
            "error": error}
