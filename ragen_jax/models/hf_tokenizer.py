"""The Hugging Face tokenizer (``tokenizer.json`` through the ``tokenizers`` library) behind the
ragen_jax Tokenizer protocol (see ``tokenizers.py``).

    tok = HFTokenizer("/ckpt/Qwen2.5-0.5B", vocab_size=151936)   # directory, tokenizer.json, or JSON text
    ids = tok.encode("<|im_start|>user\\nHi<|im_end|>\\n")       # added tokens -> their single ids
    table, lengths = token_byte_table(tok)                       # device-side detokenization

Token bytes (``token_bytes()``):
- byte-level BPE (GPT-2 / Qwen / Llama-3: the decoder is ``ByteLevel``): every vocabulary string is
  made of the GPT-2 byte-to-unicode characters; mapping them back gives the exact bytes, so the
  concatenated bytes of any encoding are the UTF-8 of the text.
- added tokens (``<|im_start|>``, ``<|eot_id|>``, ...): the UTF-8 of their content.
- SentencePiece-style vocabularies (``Metaspace`` / ``Replace("▁", " ")`` and ``ByteFallback``
  decoders, e.g. Llama-2, Mistral): "▁" becomes a space and ``<0xNN>`` the byte NN. This is exact
  except that the tokenizer's own decode drops the leading space of the first word, which the table
  keeps.
- any other model (WordPiece, Unigram without those decoders): the UTF-8 of the token string, which
  may differ from what the tokenizer's decoder produces (e.g. WordPiece's "##" prefixes). ``decode``
  then uses the tokenizer's own decoder, and device-side detokenization is approximate.
Ids no token uses (gaps, or rows past the tokenizer's vocabulary up to ``vocab_size``) map to b"".

``pad_id`` and ``eos_ids`` come from ``tokenizer_config.json`` and ``generation_config.json`` next to
``tokenizer.json`` when present, plus the end-of-turn / end-of-text added tokens the vocabulary has
(``<|im_end|>``, ``<|endoftext|>``, ``<|eot_id|>``, ``<|end_of_text|>``, ``</s>``), because a chat
rollout must stop at the end of the assistant turn even for a base model whose config names only the
end-of-text token.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Sequence

import tokenizers

# End-of-turn and end-of-text tokens of the supported families: generation stops on any present.
END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "</s>")
# Pad-token candidates, in order, when no config names one.
PAD_CANDIDATES = ("<|pad|>", "<pad>", "<|endoftext|>", "<|finetune_right_pad_id|>", "<|end_of_text|>")
_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


@functools.cache
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies.

    Printable Latin-1 bytes ('!'..'~', '¡'..'¬', '®'..'ÿ') stand for themselves; the other 68 bytes,
    in increasing order, get the characters chr(256), chr(257), ...
    """
    printable = [
        *range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)
    ]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@functools.cache
def unicode_to_byte() -> dict[str, int]:
    return {c: b for b, c in byte_to_unicode().items()}


def _token_content(value) -> str | None:
    """A token named in tokenizer_config.json: a string or an AddedToken dict {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_optional_json(file: Path) -> dict:
    if not file.exists():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON ({e}); fix or delete it") from None
    return data if isinstance(data, dict) else {}


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` with the ragen_jax Tokenizer surface.

    source: a directory holding tokenizer.json, the path of a tokenizer.json, its JSON text, or a
      ``tokenizers.Tokenizer``. Side files (tokenizer_config.json, generation_config.json) are read
      from the same directory.
    vocab_size: the model's embedding rows when larger than the tokenizer's vocabulary (Qwen2.5:
      151936 rows for 151665 tokens); the extra ids decode to nothing.
    pad_token / eos_tokens: override what the side files say.
    """

    def __init__(
        self,
        source: str | os.PathLike | tokenizers.Tokenizer,
        vocab_size: int | None = None,
        *,
        pad_token: str | None = None,
        eos_tokens: Sequence[str] | None = None,
    ) -> None:
        self._source_dir: Path | None = None
        self._source_json: bytes | None = None
        if isinstance(source, tokenizers.Tokenizer):
            self._tok = source
        elif isinstance(source, str) and source.lstrip().startswith("{"):
            self._tok = tokenizers.Tokenizer.from_str(source)
        else:
            path = Path(source)
            file = path / "tokenizer.json" if path.is_dir() else path
            if not file.exists():
                raise FileNotFoundError(
                    f"no tokenizer.json at {file}; pass a checkpoint directory holding tokenizer.json "
                    "(convert a tiktoken vocabulary with ragen_jax.models.tiktoken_convert)"
                )
            self._source_json = file.read_bytes()
            try:
                self._tok = tokenizers.Tokenizer.from_str(self._source_json.decode("utf-8"))
            except Exception as e:
                raise ValueError(f"cannot read {file} as a Hugging Face tokenizer: {e}") from None
            self._source_dir = file.parent
        side = {n: _read_optional_json(self._source_dir / n) if self._source_dir else {} for n in _SIDE_FILES}
        self._tokenizer_config = side["tokenizer_config.json"]
        self._generation_config = side["generation_config.json"]

        self._added = {int(i): t.content for i, t in self._tok.get_added_tokens_decoder().items()}
        self._added_ids = {content: i for i, content in self._added.items()}
        spec = json.loads(self._tok.to_str())
        self.kind = _vocabulary_kind(spec)
        needed = max(self._tok.get_vocab_size(with_added_tokens=True), max(self._added, default=-1) + 1)
        if vocab_size is not None and vocab_size < needed:
            raise ValueError(
                f"vocab_size={vocab_size} is smaller than the tokenizer's {needed} ids; pass the model's "
                "embedding rows (config.json vocab_size) or None"
            )
        self.vocab_size = vocab_size or needed
        self.eos_ids = self._find_eos_ids(eos_tokens)
        self.pad_id = self._find_pad_id(pad_token)
        self._table: list[bytes] | None = None

    # -- special tokens -------------------------------------------------------------------------------

    def _id_of(self, text: str, what: str) -> int:
        i = self._added_ids.get(text, self._tok.token_to_id(text))
        if i is None:
            raise ValueError(f"{what} {text!r} is not a token of this tokenizer")
        return int(i)

    def _find_eos_ids(self, eos_tokens: Sequence[str] | None) -> tuple[int, ...]:
        if eos_tokens is not None:
            return tuple(dict.fromkeys(self._id_of(t, "eos token") for t in eos_tokens))
        ids: list[int] = []
        declared = self._generation_config.get("eos_token_id")
        ids += declared if isinstance(declared, list) else [] if declared is None else [declared]
        content = _token_content(self._tokenizer_config.get("eos_token"))
        if content is not None:
            ids.append(self._id_of(content, "tokenizer_config.json eos_token"))
        ids += [self._added_ids[t] for t in END_TOKENS if t in self._added_ids]
        if not ids:
            raise ValueError(
                "this tokenizer names no end-of-sequence token (no generation_config.json / "
                "tokenizer_config.json eos, no known end token); pass eos_tokens=[...]"
            )
        return tuple(dict.fromkeys(int(i) for i in ids))

    def _find_pad_id(self, pad_token: str | None) -> int:
        if pad_token is not None:
            return self._id_of(pad_token, "pad token")
        content = _token_content(self._tokenizer_config.get("pad_token"))
        if content is not None:
            return self._id_of(content, "tokenizer_config.json pad_token")
        if self._generation_config.get("pad_token_id") is not None:
            return int(self._generation_config["pad_token_id"])
        for t in PAD_CANDIDATES:
            if t in self._added_ids:
                return self._added_ids[t]
        return self.eos_ids[0]

    def special_id(self, text: str) -> int | None:
        """The id of an added (special or control) token with exactly this content, else None."""
        return self._added_ids.get(text)

    # -- encode / decode ------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; added tokens in the text become their single ids. No BOS/EOS is added
        (chat formatting writes them explicitly, see chat.py)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, pad ids skipped: the UTF-8 of the concatenated token bytes for byte-level
        vocabularies (what device-side detokenization sees), the tokenizer's decoder otherwise."""
        ids = [int(i) for i in ids if int(i) != self.pad_id]
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")
        if self.kind == "byte_level":
            table = self.token_bytes()
            return b"".join(table[i] for i in ids).decode("utf-8", errors="replace")
        return self._tok.decode(ids, skip_special_tokens=False)

    def token_bytes(self) -> list[bytes]:
        """For every id in [0, vocab_size), the bytes it stands for (see the module docstring)."""
        if self._table is None:
            self._table = [self._bytes_of(i) for i in range(self.vocab_size)]
        return self._table

    def _bytes_of(self, i: int) -> bytes:
        if i in self._added:
            return self._added[i].encode("utf-8")
        token = self._tok.id_to_token(i)
        if token is None:
            return b""
        if self.kind == "byte_level":
            inverse = unicode_to_byte()
            try:
                return bytes(inverse[c] for c in token)
            except KeyError:
                raise ValueError(
                    f"token {i} ({token!r}) holds a character outside the byte-level alphabet; "
                    "the tokenizer.json is not a consistent byte-level BPE"
                ) from None
        if self.kind == "sentencepiece":
            if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
                return bytes([int(token[3:5], 16)])
            return token.replace("\u2581", " ").encode("utf-8")
        return token.encode("utf-8")

    # -- files ----------------------------------------------------------------------------------------

    def save(self, directory: str | os.PathLike) -> None:
        """Write tokenizer.json (the original bytes when loaded from a file) and the side files; when
        the source had no tokenizer_config.json / generation_config.json, minimal ones naming the pad
        and end tokens, so that loading the directory again gives the same pad_id and eos_ids."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        if self._source_dir is not None and self._source_dir.resolve() == out.resolve():
            return
        if self._source_json is not None:
            (out / "tokenizer.json").write_bytes(self._source_json)
        else:
            self._tok.save(str(out / "tokenizer.json"))
        copied = set()
        for name in _SIDE_FILES:
            if self._source_dir is not None and (self._source_dir / name).exists():
                (out / name).write_bytes((self._source_dir / name).read_bytes())
                copied.add(name)
        if "tokenizer_config.json" not in copied:
            config = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": self._content(self.pad_id)}
            config["eos_token"] = self._content(self.eos_ids[0])
            (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        if "generation_config.json" not in copied:
            gen = {"eos_token_id": list(self.eos_ids), "pad_token_id": self.pad_id}
            (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n", encoding="utf-8")

    def _content(self, i: int) -> str:
        return self._added.get(i) or self._tok.id_to_token(i)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tok


def _vocabulary_kind(spec: dict) -> str:
    """"byte_level", "sentencepiece" or "other", from the tokenizer.json's decoder (and pre-tokenizer)."""

    def types(node) -> list[str]:
        if not isinstance(node, dict):
            return []
        found = [node.get("type", "")]
        for key in ("decoders", "pretokenizers"):
            for child in node.get(key) or []:
                found += types(child)
        return found

    decoder = types(spec.get("decoder"))
    if "ByteLevel" in decoder or (not decoder and "ByteLevel" in types(spec.get("pre_tokenizer"))):
        return "byte_level"
    replaces_metaspace = any(
        isinstance(d, dict)
        and d.get("type") == "Replace"
        and (d.get("pattern") or {}).get("String") == "\u2581"
        for d in (spec.get("decoder") or {}).get("decoders") or []
    )
    if "Metaspace" in decoder or "ByteFallback" in decoder or replaces_metaspace:
        return "sentencepiece"
    return "other"
