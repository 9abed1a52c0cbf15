"""Chat formatting for the two model families, as text, plus the token ids that mark turn boundaries.

Styles (what the families' Hugging Face chat templates produce for plain text messages):

    "qwen"   (ChatML, Qwen2 / Qwen2.5; also the character tokenizer's format):
             <|im_start|>{role}\\n{content}<|im_end|>\\n ...   generation prompt: <|im_start|>assistant\\n
    "llama3" (Llama 3.x, SmolLM2-style Llama checkpoints using the Llama-3 tokens):
             <|begin_of_text|><|start_header_id|>{role}<|end_header_id|>\\n\\n{content.strip()}<|eot_id|> ...
             generation prompt: <|start_header_id|>assistant<|end_header_id|>\\n\\n

Differences from the hub templates, on purpose: no default system message is injected (Qwen2.5's
template adds "You are Qwen, ..." when the first message is not a system one; pass
``default_system=QWEN25_DEFAULT_SYSTEM`` to get it), and no "Cutting Knowledge Date" preamble
(Llama 3.1+). Llama-3 content is stripped as Meta's template does; ChatML content is kept verbatim.

The RAGEN rollout prompt is the chat with the generation prompt, followed by the literal ``<think>``
(``rollout_prompt``). Multi-turn rollouts append turns with ``format_turn`` so tokens already in the
KV cache are never re-tokenized.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Mapping, Sequence

from ragen_jax.models.tokenizers import Tokenizer

CHAT_STYLES = ("qwen", "llama3")
QWEN25_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
LLAMA3_BOS = "<|begin_of_text|>"
THINK_OPEN = "<think>"
_ROLES = ("system", "user", "assistant", "tool")


def _check_style(style: str) -> None:
    if style not in CHAT_STYLES:
        close = difflib.get_close_matches(style, CHAT_STYLES, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown chat style {style!r}; known: {list(CHAT_STYLES)}.{hint}")


def style_for_architecture(architecture: str) -> str:
    """The chat style of a ModelConfig.architecture ("qwen2" -> "qwen", "llama" -> "llama3")."""
    styles = {"qwen2": "qwen", "llama": "llama3"}
    if architecture not in styles:
        raise ValueError(f"no chat style for architecture {architecture!r}; known: {sorted(styles)}")
    return styles[architecture]


def format_turn(role: str, content: str, style: str) -> str:
    """One complete message: header, content, end-of-turn marker."""
    _check_style(style)
    if role not in _ROLES:
        raise ValueError(f"unknown chat role {role!r}; expected one of {list(_ROLES)}")
    if not isinstance(content, str):
        raise TypeError(f"message content must be a string, got {type(content).__name__}")
    if style == "qwen":
        return f"<|im_start|>{role}\n{content}<|im_end|>\n"
    return f"<|start_header_id|>{role}<|end_header_id|>\n\n{content.strip()}<|eot_id|>"


def generation_prompt(style: str) -> str:
    """The assistant header that asks the model to write the next turn."""
    _check_style(style)
    if style == "qwen":
        return "<|im_start|>assistant\n"
    return "<|start_header_id|>assistant<|end_header_id|>\n\n"


def format_chat(
    messages: Sequence[Mapping[str, str]],
    style: str,
    add_generation_prompt: bool = False,
    *,
    default_system: str | None = None,
) -> str:
    """The chat ``messages`` ([{"role": ..., "content": ...}, ...]) as one string in ``style``.

    llama3 starts with ``<|begin_of_text|>`` (the template writes the BOS; tokenizers here never add
    one). ``default_system`` is prepended as a system message when the first message is not one.
    """
    _check_style(style)
    for i, m in enumerate(messages):
        if "role" not in m or "content" not in m:
            raise ValueError(f"message {i} needs 'role' and 'content' keys, got {sorted(m)}")
    if default_system is not None and (not messages or messages[0]["role"] != "system"):
        messages = [{"role": "system", "content": default_system}, *messages]
    text = LLAMA3_BOS if style == "llama3" else ""
    text += "".join(format_turn(m["role"], m["content"], style) for m in messages)
    if add_generation_prompt:
        text += generation_prompt(style)
    return text


def rollout_prompt(messages: Sequence[Mapping[str, str]], style: str, **kwargs) -> str:
    """RAGEN's rollout prompt: the chat, the assistant header, then the literal ``<think>``."""
    return format_chat(messages, style, add_generation_prompt=True, **kwargs) + THINK_OPEN


@dataclasses.dataclass(frozen=True)
class TurnBoundaryIds:
    """Token ids that delimit turns.

    turn_start: opens every message (``<|im_start|>`` / ``<|start_header_id|>``); RAGEN's turn index
      is the running count of it. turn_end: closes every message (``<|im_end|>`` / ``<|eot_id|>``).
    header_end: ends the role header (llama3 ``<|end_header_id|>``; None for qwen, whose header ends
      at the newline). generation_prompt: the ids of ``generation_prompt(style)``.
    """

    turn_start: int
    turn_end: int
    header_end: int | None
    generation_prompt: tuple[int, ...]


def turn_boundary_ids(tokenizer: Tokenizer, style: str) -> TurnBoundaryIds:
    """The turn-boundary ids of ``tokenizer`` for ``style``; a clear error when its vocabulary lacks
    the style's special tokens (e.g. a Llama tokenizer asked for the qwen style)."""
    _check_style(style)
    names = (
        ("<|im_start|>", "<|im_end|>", None)
        if style == "qwen"
        else ("<|start_header_id|>", "<|eot_id|>", "<|end_header_id|>")
    )
    ids = []
    for name in names:
        if name is None:
            ids.append(None)
            continue
        i = tokenizer.special_id(name)
        if i is None:
            raise ValueError(
                f"the tokenizer has no special token {name!r} needed by the {style!r} chat style; "
                f"use the style of its model family (styles: {list(CHAT_STYLES)})"
            )
        ids.append(i)
    return TurnBoundaryIds(ids[0], ids[1], ids[2], tuple(tokenizer.encode(generation_prompt(style))))


def turn_index(tokens, turn_start: int):
    """Running count of ``turn_start`` tokens: 0 before the first message, k inside the k-th (from 1).

    tokens: int[..., L] (numpy or jax) -> int[..., L]. With system, user, assistant, user, ... the
    assistant turns are the odd indices > 1 (RAGEN's loss-mask rule: index % 2 == 1 and index > 1).
    """
    return (tokens == turn_start).cumsum(axis=-1)
