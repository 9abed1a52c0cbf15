"""Chat formatting: hand-written expected strings for both styles, turn boundaries, RAGEN's turn index."""

from __future__ import annotations

import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from ragen_jax.models.chat import (
    QWEN25_DEFAULT_SYSTEM,
    format_chat,
    format_turn,
    generation_prompt,
    rollout_prompt,
    style_for_architecture,
    turn_boundary_ids,
    turn_index,
)
from ragen_jax.models.hf_tokenizer import HFTokenizer, byte_to_unicode
from ragen_jax.models.tokenizers import CharTokenizer

CHAT = [
    {"role": "system", "content": "You're a helpful assistant."},
    {"role": "user", "content": "\nTurn 1:\nState:\n#P_#\n"},
    {"role": "assistant", "content": "<think>go</think><answer>Right</answer>"},
    {"role": "user", "content": "Reward:\n1.0\n"},
]

QWEN_EXPECTED = (
    "<|im_start|>system\nYou're a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\n\nTurn 1:\nState:\n#P_#\n<|im_end|>\n"
    "<|im_start|>assistant\n<think>go</think><answer>Right</answer><|im_end|>\n"
    "<|im_start|>user\nReward:\n1.0\n<|im_end|>\n"
)
LLAMA3_EXPECTED = (
    "<|begin_of_text|>"
    "<|start_header_id|>system<|end_header_id|>\n\nYou're a helpful assistant.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nTurn 1:\nState:\n#P_#<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n<think>go</think><answer>Right</answer><|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nReward:\n1.0<|eot_id|>"
)


def test_qwen_chatml():
    assert format_chat(CHAT, "qwen") == QWEN_EXPECTED
    assert format_chat(CHAT, "qwen", add_generation_prompt=True) == QWEN_EXPECTED + "<|im_start|>assistant\n"


def test_llama3():
    assert format_chat(CHAT, "llama3") == LLAMA3_EXPECTED
    assert format_chat(CHAT, "llama3", add_generation_prompt=True) == (
        LLAMA3_EXPECTED + "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_rollout_prompt_ends_with_assistant_header_and_think():
    assert rollout_prompt(CHAT, "qwen").endswith("<|im_end|>\n<|im_start|>assistant\n<think>")
    assert rollout_prompt(CHAT, "llama3").endswith(
        "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n<think>")


def test_turns_compose_into_the_chat():
    """Appending turns one by one (as multi-turn rollouts do) gives the same text as one call."""
    for style in ("qwen", "llama3"):
        later = "".join(format_turn(m["role"], m["content"], style) for m in CHAT[2:])
        assert format_chat(CHAT[:2], style) + later == format_chat(CHAT, style)
        with_prompt = format_chat(CHAT, style, add_generation_prompt=True)
        assert with_prompt == format_chat(CHAT, style) + generation_prompt(style)


def test_default_system():
    user_only = [{"role": "user", "content": "hi"}]
    assert format_chat(user_only, "qwen", default_system=QWEN25_DEFAULT_SYSTEM) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n")
    assert format_chat(CHAT, "qwen", default_system="ignored") == QWEN_EXPECTED
    assert format_chat(user_only, "qwen") == "<|im_start|>user\nhi<|im_end|>\n"


def test_errors():
    with pytest.raises(ValueError, match="Did you mean 'llama3'"):
        format_chat(CHAT, "llama")
    with pytest.raises(ValueError, match="unknown chat role 'robot'"):
        format_chat([{"role": "robot", "content": "x"}], "qwen")
    with pytest.raises(ValueError, match="needs 'role' and 'content'"):
        format_chat([{"role": "user"}], "qwen")
    with pytest.raises(TypeError, match="must be a string"):
        format_turn("user", 3, "qwen")
    assert style_for_architecture("qwen2") == "qwen" and style_for_architecture("llama") == "llama3"
    with pytest.raises(ValueError, match="no chat style"):
        style_for_architecture("gpt2")


def test_char_tokenizer_turn_boundaries_and_ragen_turn_index():
    tok = CharTokenizer()
    marks = turn_boundary_ids(tok, "qwen")
    assert (marks.turn_start, marks.turn_end, marks.header_end) == (2, 3, None)  # <|im_start|>, <|im_end|>
    assert list(marks.generation_prompt) == tok.encode("<|im_start|>assistant\n")
    ids = np.array(tok.encode(format_chat(CHAT, "qwen")))
    index = turn_index(ids, marks.turn_start)
    # RAGEN's loss mask: odd turn index > 1 marks the assistant turn, header to "<|im_end|>\n".
    assistant = (index % 2 == 1) & (index > 1)
    assert tok.decode(ids[assistant]) == (
        "<|im_start|>assistant\n<think>go</think><answer>Right</answer><|im_end|>\n")
    assert index[0] == 1 and index[-1] == 4
    with pytest.raises(ValueError, match="<\\|start_header_id\\|>"):
        turn_boundary_ids(tok, "llama3")


def test_llama3_turn_boundaries_with_hf_tokenizer():
    """A byte-level tokenizer (no merges) with the Llama-3 special tokens at Llama-3's ids."""
    alphabet = byte_to_unicode()
    vocab = {alphabet[b]: b for b in range(256)}
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [
        "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tok.add_special_tokens(specials)
    hf = HFTokenizer(tok)
    marks = turn_boundary_ids(hf, "llama3")
    assert (marks.turn_start, marks.header_end, marks.turn_end) == (258, 259, 260)
    ids = hf.encode(format_chat(CHAT, "llama3", add_generation_prompt=True))
    assert ids[0] == 256 and ids.count(258) == 5 and ids.count(260) == 4
    assert tuple(ids[-len(marks.generation_prompt):]) == marks.generation_prompt
    assert hf.decode(ids) == format_chat(CHAT, "llama3", add_generation_prompt=True)
    assert set(hf.eos_ids) == {257, 260}
