"""A chat request's ``chat_template_kwargs`` may set template variables, not the template call's own parameters."""

from __future__ import annotations

from typing import Any

from sgl_importance.request_check.fields import InvalidFieldError

# The tokenizer's apply_chat_template parameters: SGLang passes chat_template_kwargs
# as **kwargs beside its own, so a key among them is a TypeError (a 500), and
# `chat_template` would render a caller's Jinja template in the server.
CHAT_TEMPLATE_PARAMETERS = frozenset(
    {
        "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
        "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
        "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    }
)  # fmt: skip


def check_chat_template_kwargs(kwargs: Any) -> None:
    """A chat request's ``chat_template_kwargs`` must not set the template call's own
    parameters (the template itself included)."""
    if not isinstance(kwargs, dict):
        return  # pydantic refuses it first
    taken = sorted(key for key in kwargs if key in CHAT_TEMPLATE_PARAMETERS)
    if taken:
        raise InvalidFieldError(
            f"chat_template_kwargs.{taken[0]}",
            kwargs[taken[0]],
            "variables for the chat template other than " + ", ".join(sorted(CHAT_TEMPLATE_PARAMETERS)),
            why="is a parameter of the template call, not a template variable",
        )
