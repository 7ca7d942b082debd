"""Tokenizers: text <-> int32 token ids, and the end-of-document token that separates documents.

    tok = tokenizer.load(config.data.tokenizer, vocab_size=config.model.vocab_size)  # refused if it outgrows V
    ids_N = tok.encode("To be, or not to be")  # int32 [num_tokens]
    text = tok.decode(ids_N)

`"byte"` is the built-in byte tokenizer (vocab 256, no separator); any other spec is the path of a `tokenizers`
tokenizer.json, whose separator is the first of EOS_TOKENS in its vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers

# Special tokens recognised as a tokenizer's end-of-document separator, in order of preference.
EOS_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")


class ByteTokenizer:
  """UTF-8 bytes as tokens: vocab 256, no training, no unknown tokens, and no separator (`eos_id` None)."""

  vocab_size = 256
  eos_id = None

  def encode(self, text: str) -> np.ndarray:
    """int32 `[num_bytes]` of the UTF-8 encoding."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

  def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
    return [self.encode(text) for text in texts]

  def decode(self, ids: Any) -> str:
    """Text of a byte sequence; a multi-byte character cut by a sequence boundary, or an id outside the byte
    range (a model with a larger vocabulary), becomes U+FFFD."""
    ids = np.asarray(ids).reshape(-1)
    pieces = np.split(ids, np.flatnonzero((ids < 0) | (ids > 255)))  # every piece after the first starts bad
    return "\ufffd".join(np.asarray(piece[i > 0:], dtype=np.uint8).tobytes().decode("utf-8", errors="replace")
                         for i, piece in enumerate(pieces))


def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's printable stand-in of each byte, the alphabet of `tokenizers`' ByteLevel pre-tokenizer: printable
  Latin-1 bytes stand for themselves, the others for the code points from 256 on, in byte order."""
  printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
  others = [b for b in range(256) if b not in printable]
  return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def byte_tokenizer_json() -> str:
  """ByteTokenizer as a `tokenizers` tokenizer.json (byte-level pieces, one token per byte, id = the byte, no
  merges): what an fla export of a byte-tokenizer model writes, so that transformers' AutoTokenizer encodes text
  as this project does."""
  tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(
      vocab={char: byte for byte, char in _bytes_to_unicode().items()}, merges=[]))
  tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  tokenizer.decoder = tokenizers.decoders.ByteLevel()
  return tokenizer.to_str()


class HFTokenizer:
  """A `tokenizers.Tokenizer` from a local tokenizer.json, with ByteTokenizer's interface.

  Special tokens are not added when encoding: documents are separated by `eos_id` (the first of EOS_TOKENS in
  the vocabulary, or None) when the stream is built.
  """

  def __init__(self, tokenizer: tokenizers.Tokenizer):
    self.tokenizer = tokenizer
    self.vocab_size = tokenizer.get_vocab_size()
    self.eos_id = next((tokenizer.token_to_id(token) for token in EOS_TOKENS
                        if tokenizer.token_to_id(token) is not None), None)

  def encode(self, text: str) -> np.ndarray:
    """int32 `[num_tokens]`."""
    return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int32)

  def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
    """As `encode` per text, tokenized in parallel by the Rust library."""
    return [np.asarray(encoding.ids, dtype=np.int32)
            for encoding in self.tokenizer.encode_batch(list(texts), add_special_tokens=False)]

  def decode(self, ids: Any) -> str:
    return self.tokenizer.decode([int(i) for i in np.asarray(ids).reshape(-1)], skip_special_tokens=False)


Tokenizer = ByteTokenizer | HFTokenizer


def load(spec: str, vocab_size: int | None = None) -> Tokenizer:
  """The tokenizer of `config.data.tokenizer`.

  Args:
    spec: `"byte"` (ByteTokenizer) or the path of a tokenizer.json (HFTokenizer).
    vocab_size: the model's `model.vocab_size`, to refuse a tokenizer whose ids would not fit its embedding
      (`check_vocab_size`); None: unchecked.
  Returns:
    The tokenizer.
  """
  if spec == "byte":
    tokenizer = ByteTokenizer()
  elif spec and Path(spec).is_file():
    try:
      tokenizer = HFTokenizer(tokenizers.Tokenizer.from_file(str(spec)))
    except Exception as e:  # the Rust library raises a bare Exception for a malformed file
      raise ValueError(f"data.tokenizer={spec!r} could not be read as a tokenizers tokenizer.json ({e}); "
                       "use 'byte' or the path of a tokenizer.json.") from e
  else:
    raise ValueError(f"data.tokenizer={spec!r} is neither 'byte' nor an existing file; "
                     "use 'byte' or the path of a tokenizer.json.")
  if vocab_size is not None:
    check_vocab_size(tokenizer, vocab_size)
  return tokenizer


def check_vocab_size(tokenizer: Tokenizer, vocab_size: int) -> None:
  """Refuses a tokenizer whose ids would not fit the model's embedding (`model.vocab_size`)."""
  if tokenizer.vocab_size > vocab_size:
    raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size={vocab_size}; "
                     f"set --config.model.vocab_size={tokenizer.vocab_size} or more, or use the model's tokenizer.")
