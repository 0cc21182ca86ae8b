"""Turning a user's prompt into validated token ids, with or without a chat template.

Many GGUF files carry no chat template. Such a model completes plain text by default
(:func:`default_chat` says so once, in a logged warning); asking it to chat is an error that
says how to give it a template (``chat_template=`` in the library: a file or the template text).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from specdec.errors import ConfigError, InvalidRequestError, PromptTooLongError

log = logging.getLogger(__name__)

Message = Mapping[str, Any]
Prompt = str | Sequence[Message]

NO_TEMPLATE_HINT = (
    "pass a Jinja chat template with chat_template= (a file path or the template text; "
    "on the command line --chat-template FILE), or send a plain prompt"
)
_warned: set[int] = set()  # tokenizers already warned about (by id), so the warning shows once


def has_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


@dataclass(frozen=True)
class ChatMode:
    """Whether prompts get the chat template, and why not when they do not (for the CLI to
    print next to the result)."""

    chat: bool
    note: str | None = None


def default_chat(tokenizer: PreTrainedTokenizerBase, chat: bool | None = None) -> ChatMode:
    """The chat mode of a request that passed ``chat`` (``None``: the default).

    By default a model with a chat template chats and one without completes plain text, which
    is logged once per tokenizer. An explicit ``chat=True`` without a template is an error.
    """
    if chat is True and not has_chat_template(tokenizer):
        raise InvalidRequestError(
            f"this model has no chat template, so it cannot chat; {NO_TEMPLATE_HINT}",
            param="chat",
        )
    if chat is not None:
        return ChatMode(chat)
    if has_chat_template(tokenizer):
        return ChatMode(True)
    note = "this model has no chat template: the prompt is completed as plain text"
    if id(tokenizer) not in _warned:
        _warned.add(id(tokenizer))
        log.warning("%s; to chat, %s", note, NO_TEMPLATE_HINT)
    return ChatMode(False, note)


def read_chat_template(template: str | os.PathLike[str]) -> str:
    """A chat template from a file (``.jinja``, or a ``tokenizer_config.json``/``chat_template
    .json`` holding a ``chat_template`` string) or given as the template text itself, checked to
    parse, so that a typo fails when the model loads rather than at the first request."""
    text = os.fspath(template)
    looks_like_template = "{{" in text or "{%" in text
    path = Path(text)
    if not looks_like_template:
        if not path.is_file():
            raise ConfigError(
                f"chat template {text!r} is neither a file nor a Jinja template "
                "(a template contains '{{' or '{%')"
            )
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".json":
            import json

            try:
                text = json.loads(text)["chat_template"]
            except (ValueError, KeyError, TypeError) as e:
                raise ConfigError(
                    f"{path} is JSON without a 'chat_template' string: {type(e).__name__}: {e}"
                ) from e
            if not isinstance(text, str):
                raise ConfigError(f"{path}: 'chat_template' must be one template string")
    try:
        import jinja2
    except ImportError:  # transformers needs jinja2 to apply templates; nothing to check with
        return text
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"the chat template does not parse: {e.message} (line {e.lineno})") from e
    return text


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase, prompt: Prompt, chat: bool | None = None
) -> list[int]:
    """Token ids for a plain prompt or chat messages.

    ``chat=None`` applies the chat template to message lists and not to strings; ``chat=True``
    wraps a string as one user message. A model without a chat template cannot take messages
    (the error says how to give it one); :func:`default_chat` picks the mode a CLI defaults to.
    """
    if isinstance(prompt, str):
        if not prompt.strip():
            raise InvalidRequestError("the prompt is empty", param="prompt")
        messages: list[Message] | None = [{"role": "user", "content": prompt}] if chat else None
    else:
        messages = list(prompt)
        if not messages:
            raise InvalidRequestError("the message list is empty", param="messages")
        for m in messages:
            if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
                raise InvalidRequestError(
                    "each chat message needs a 'role' and a 'content'", param="messages"
                )
        if chat is False:
            raise InvalidRequestError("chat=False cannot take a message list", param="messages")
    if messages is None:
        ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    else:
        if not has_chat_template(tokenizer):
            raise InvalidRequestError(
                f"this model has no chat template, so it cannot take chat messages; "
                f"{NO_TEMPLATE_HINT}",
                param="messages" if not isinstance(prompt, str) else "chat",
            )
        ids = tokenizer.apply_chat_template(
            [dict(m) for m in messages], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, Mapping):  # newer tokenizers return a BatchEncoding
            ids = ids["input_ids"]
    ids = [int(t) for t in ids]
    if not ids:
        raise InvalidRequestError("the prompt encodes to no tokens", param="prompt")
    return ids


def check_fits(prompt_len: int, max_new_tokens: int, context_length: int) -> None:
    if prompt_len >= context_length:
        raise PromptTooLongError(
            f"the prompt has {prompt_len} tokens but the model's context holds {context_length}",
            param="prompt",
        )
    if prompt_len + max_new_tokens > context_length:
        raise InvalidRequestError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
            f"model's context of {context_length}; lower max_new_tokens to at most "
            f"{context_length - prompt_len}",
            param="max_new_tokens",
        )
