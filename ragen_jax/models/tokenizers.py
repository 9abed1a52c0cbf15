"""Tokenizers: the built-in character tokenizer and the shared tokenizer interface.

Every tokenizer exposes the same small surface, which is all the rest of ragen_jax uses:

- ``encode(text) -> list[int]``: special-token strings (``<|im_start|>``, ``<think>``, ...) map to their
  single ids; everything else is ordinary text.
- ``decode(ids) -> str``: the UTF-8 text of the concatenated token bytes (pad ids are skipped).
- ``token_bytes() -> list[bytes]``: for every id, the exact bytes it stands for. This table is what lets
  environments read model output *on device* (see ``token_byte_table``).
- ``vocab_size``, ``pad_id``, ``eos_ids`` (generation stops on any of them) and ``special_id(text)``.

The character tokenizer needs no files: ids 0..7 are the chat/format special tokens, ids 8..263 are the
256 bytes, so every ASCII character is one token and any Unicode text still encodes (as its UTF-8 bytes).
"""

from __future__ import annotations

import re
from typing import Protocol, Sequence, runtime_checkable

import numpy as np

# Order fixes the character tokenizer's ids: "<|pad|>" is 0, "<|endoftext|>" is 1, and so on.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|pad|>",
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<answer>",
    "</answer>",
)


@runtime_checkable
class Tokenizer(Protocol):
    """What ragen_jax needs from a tokenizer (character or Hugging Face)."""

    vocab_size: int
    pad_id: int
    eos_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def token_bytes(self) -> list[bytes]: ...

    def special_id(self, text: str) -> int | None: ...


class CharTokenizer:
    """Byte-level "character" tokenizer with the chat and format special tokens; needs no files.

    Ids: ``SPECIAL_TOKENS[i] -> i`` for i < 8, then byte ``b -> 8 + b``. ``vocab_size`` is 264.
    ``eos_ids`` are ``<|im_end|>`` (end of a chat turn) and ``<|endoftext|>``.
    """

    num_special = len(SPECIAL_TOKENS)

    def __init__(self) -> None:
        self.vocab_size = self.num_special + 256
        self._special_to_id = {s: i for i, s in enumerate(SPECIAL_TOKENS)}
        self.pad_id = self._special_to_id["<|pad|>"]
        self.eos_ids = (self._special_to_id["<|im_end|>"], self._special_to_id["<|endoftext|>"])
        # Longest first so that no special token is split by a shorter one that prefixes it.
        alternatives = sorted(SPECIAL_TOKENS, key=len, reverse=True)
        self._special_re = re.compile("(" + "|".join(re.escape(s) for s in alternatives) + ")")

    def special_id(self, text: str) -> int | None:
        return self._special_to_id.get(text)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in self._special_re.split(text):
            if not piece:
                continue
            special = self._special_to_id.get(piece)
            if special is not None:
                ids.append(special)
            else:
                ids.extend(self.num_special + b for b in piece.encode("utf-8"))
        return ids

    def token_bytes(self) -> list[bytes]:
        table = [s.encode("utf-8") for s in SPECIAL_TOKENS]
        table += [bytes([b]) for b in range(256)]
        return table

    def decode(self, ids: Sequence[int]) -> str:
        table = self.token_bytes()
        out = bytearray()
        for i in ids:
            i = int(i)
            if i == self.pad_id:
                continue
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")
            out += table[i]
        return out.decode("utf-8", errors="replace")


def token_byte_table(tokenizer: Tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """The token -> bytes table as dense arrays, for device-side detokenization.

    Returns:
      table: uint8[V, W], row i holds the bytes of token i, zero-padded; W = the longest token.
      lengths: int32[V], the number of bytes of each token (0 for the pad token).
    """
    pieces = tokenizer.token_bytes()
    if len(pieces) != tokenizer.vocab_size:
        raise ValueError(
            f"token_bytes() has {len(pieces)} entries but vocab_size is {tokenizer.vocab_size}"
        )
    pieces = [b"" if i == tokenizer.pad_id else p for i, p in enumerate(pieces)]
    width = max(1, max(len(p) for p in pieces))
    table = np.zeros((len(pieces), width), np.uint8)
    lengths = np.zeros((len(pieces),), np.int32)
    for i, p in enumerate(pieces):
        table[i, : len(p)] = np.frombuffer(p, np.uint8)
        lengths[i] = len(p)
    return table, lengths
