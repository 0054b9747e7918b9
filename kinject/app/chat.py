"""Chat messages to the prompt text a model was trained on: the tokenizer's own chat template.

An instruct model fed raw text instead of its template answers text it never saw, so there is no
fallback: a tokenizer without a template is a :class:`ChatTemplateError` naming the model.
``kinject run`` (``{"messages": [...]}`` lines), ``kinject run-batch`` and ``kinject serve``
(``/v1/chat/completions``) all render through :func:`render_chat` (docs/architecture.md, "Serving").
"""

from __future__ import annotations

from typing import Any

from kinject.errors import KinjectError


class ChatTemplateError(KinjectError):
    """The model has no chat template, or its template refused the messages."""


class MessagesError(KinjectError):
    """``messages`` is not a list of ``{"role", "content"}`` objects."""


def check_messages(messages: Any) -> list[dict]:
    """``messages`` as OpenAI sends them, checked: a non-empty list of objects with a string ``role`` and a
    ``content`` that is a string or a list of ``{"type": "text", "text": ...}`` parts (joined: the text is
    all a text-only model reads; any other part type is refused, never dropped)."""
    if not isinstance(messages, list) or not messages:
        raise MessagesError(f"'messages' must be a non-empty list, got {_short(messages)}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise MessagesError(f"messages[{i}] must be an object with 'role' and 'content', got {_short(m)}")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise MessagesError(f"messages[{i}].role must be a non-empty string, got {_short(role)}")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise MessagesError(f"messages[{i}].content[{j}]: only {{'type': 'text', 'text': ...}} parts are "
                                        f"supported (a text-only model), got {_short(part)}")
                texts.append(part["text"])
            content = "".join(texts)
        elif not isinstance(content, str):
            raise MessagesError(f"messages[{i}].content must be a string or a list of text parts, got {_short(content)}")
        out.append({**{k: v for k, v in m.items() if k not in ("role", "content")}, "role": role, "content": content})
    return out


def has_chat_template(tok) -> bool:
    return bool(getattr(tok, "chat_template", None))


def render_chat(tok, messages: list[dict], model_name: str) -> str:
    """The prompt text of ``messages`` under ``tok``'s chat template with ``add_generation_prompt=True``.

    The text is meant to be encoded the ordinary way (``tok(text)``, special tokens added), as every
    prompt of a batch group is: a leading BOS the template writes and the tokenizer adds again is
    taken off the text, so the ids are exactly ``apply_chat_template(..., tokenize=True)``'s."""
    if not has_chat_template(tok):
        raise ChatTemplateError(f"model {model_name} has no chat template (tokenizer_config.json 'chat_template' "
                                "or chat_template.jinja): send a plain 'prompt' instead of 'messages'")
    try:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - a template's own raise_exception() is a user error
        raise ChatTemplateError(f"model {model_name}: its chat template refused the messages "
                                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
    bos = getattr(tok, "bos_token", None)
    if bos and text.startswith(bos) and _adds_bos(tok):
        text = text[len(bos):]
    return text


def _adds_bos(tok) -> bool:
    bos_id = getattr(tok, "bos_token_id", None)
    return bos_id is not None and tok("", add_special_tokens=True)["input_ids"][:1] == [bos_id]


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
