"""Text in, text out: prompts encoded, completed by a `sampling.Sampler`, decoded up to their stop token.

    texts = generate_text(sampling.Sampler(), model, tokenizer, ["ROMEO:"], max_new_tokens=64, key=jax.random.key(0),
                          print_row=0)

`TextPrinter` is the `stream` callback that prints one row's text as it is produced (`print_row` above).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, TextIO

import numpy as np

from retnet_jax.evaluation import sampling
from retnet_jax.models import model as model_lib


class TextPrinter:
  """A `stream` callback that prints one batch row's text as it is produced, up to a stop token; text ending in an
  incomplete character (U+FFFD) waits for the next token, and `finish` prints what is left."""

  def __init__(self, tokenizer: Any, row: int = 0, stop_tokens: Sequence[int] = (), file: TextIO | None = None):
    self.tokenizer = tokenizer
    self.row = row
    self.stop_tokens = frozenset(int(t) for t in stop_tokens)
    self.file = file
    self.ids: list[int] = []
    self.printed = ""
    self.stopped = False

  def __call__(self, step_tokens_B: np.ndarray, step: int) -> None:
    token = int(step_tokens_B[self.row])
    if self.stopped or token in self.stop_tokens:
      self.stopped = True
      return
    self.ids.append(token)
    text = self.tokenizer.decode(self.ids)
    if not text.endswith("\ufffd"):
      self._print(text)

  def finish(self) -> None:
    self._print(self.tokenizer.decode(self.ids))
    print(file=self.file or sys.stdout, flush=True)

  def _print(self, text: str) -> None:
    print(text[len(self.printed):], end="", file=self.file or sys.stdout, flush=True)
    self.printed = text


def check_prompts(prompts: Sequence[str], name: str = "prompt") -> None:
  """Refuses a prompt that is not text: a string holding bytes that are not UTF-8 (Python keeps them as lone
  surrogates, e.g. from a command line in another encoding), which no tokenizer encodes.

  Args:
    prompts: the prompts. name: what the error calls each of them (a script's flag, e.g. "--prompt").
  """
  for i, prompt in enumerate(prompts):
    try:
      prompt.encode("utf-8")
    except UnicodeEncodeError as e:
      byte = prompt[e.start].encode("utf-8", "surrogateescape")
      raise ValueError(f"{name} {i} holds the byte {byte.hex() if len(byte) == 1 else repr(prompt[e.start])}, "
                       f"which is not UTF-8 (at character {e.start}: {prompt[max(e.start - 10, 0):e.start]!r}...); "
                       "give the prompt as UTF-8 text (check the shell's locale or the encoding of what it "
                       "comes from).") from None


def generate_text(sampler: sampling.Sampler, model: model_lib.Model, tokenizer: Any, prompts: Sequence[str], *,
                  print_row: int | None = None, **kwargs) -> list[str]:
  """Encodes `prompts`, generates with `sampler` (keyword arguments as `Sampler.generate`; stop tokens default to the
  tokenizer's `eos_id`) and decodes each row up to its stop token; with `print_row`, that row's text is printed as it
  is produced."""
  if isinstance(prompts, str):
    raise ValueError(f"prompts must be a list of strings; got one string {prompts[:40]!r}: pass [prompt].")
  if print_row is not None and kwargs.get("stream") is not None:
    raise ValueError("give either print_row or stream, not both.")
  if print_row is not None and not 0 <= print_row < len(prompts):
    raise ValueError(f"print_row={print_row} is not a row of the {len(prompts)} prompts.")
  check_prompts(prompts)
  if "stop_tokens" not in kwargs:
    kwargs["stop_tokens"] = () if tokenizer.eos_id is None else (tokenizer.eos_id,)
  stop = set(int(t) for t in kwargs["stop_tokens"])
  printer = None if print_row is None else TextPrinter(tokenizer, print_row, stop)
  if printer is not None:
    kwargs["stream"] = printer
  tokens_BxP, lengths_B = sampling.pad_prompts(tokenizer.encode_batch(prompts))
  out = sampler.generate(model, tokens_BxP, lengths_B, **kwargs)
  if printer is not None:
    printer.finish()
  texts = []
  for row, length in zip(out.tokens, out.lengths):
    ids = row[:length]
    if length and int(ids[-1]) in stop:
      ids = ids[:-1]
    texts.append(tokenizer.decode(ids))
  return texts
