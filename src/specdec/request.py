"""Turning a user's prompt into validated token ids."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from specdec.errors import InvalidRequestError, PromptTooLongError

Message = Mapping[str, Any]
Prompt = str | Sequence[Message]


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase, prompt: Prompt, chat: bool | None = None
) -> list[int]:
    """Token ids for a plain prompt or chat messages.

    ``chat=None`` applies the chat template to message lists and not to strings; ``chat=True``
    wraps a string as one user message. A model without a chat template cannot take messages.
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
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidRequestError(
                "this model's tokenizer has no chat template; pass a plain prompt instead",
                param="messages",
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
