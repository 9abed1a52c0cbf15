import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

from ragen_jax.models.tokenizers import SPECIAL_TOKENS, CharTokenizer, Tokenizer, token_byte_table


def test_specials_are_single_tokens_and_ascii_is_one_token_per_char():
    tok = CharTokenizer()
    assert isinstance(tok, Tokenizer)
    ids = tok.encode("<|im_start|>user\nHi<|im_end|>\n<think>a</think><answer>Up</answer>")
    assert ids[0] == tok.special_id("<|im_start|>") == 2
    assert ids[1:5] == [8 + ord(c) for c in "user"]
    assert tok.special_id("</answer>") == ids[-1] == 7
    assert tok.vocab_size == 264 and tok.pad_id == 0
    assert set(tok.eos_ids) == {tok.special_id("<|im_end|>"), tok.special_id("<|endoftext|>")}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.text(max_size=12), st.sampled_from(SPECIAL_TOKENS[1:])), max_size=8))
def test_round_trip_and_byte_table(parts):
    tok = CharTokenizer()
    text = "".join(parts)
    assume("<|pad|>" not in text)  # pad is dropped by decode by design
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    table, lengths = token_byte_table(tok)
    joined = b"".join(bytes(table[i, : lengths[i]]) for i in ids)
    assert joined == text.encode("utf-8")


def test_decode_skips_pad_and_rejects_out_of_range():
    tok = CharTokenizer()
    assert tok.decode([0, 8 + ord("a"), 0]) == "a"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([999])
    table, lengths = token_byte_table(tok)
    assert lengths[tok.pad_id] == 0 and table.dtype == np.uint8 and lengths[tok.special_id("<think>")] == 7
