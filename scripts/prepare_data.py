"""Tokenizes a corpus once into token shards that training reads through Grain (`--config.data.prepared=DIR`).

    python scripts/prepare_data.py --config=configs/retnet.py:small --config.data.files='corpus/*.jsonl' \\
      --config.data.tokenizer=tokenizer.json --out=prepared/corpus --workers=8

Reads `config.data.files` or `config.data.hub_dataset` (streamed) as documents and writes OUT as
`retnet_jax.input_pipeline.prepared` describes. Validation is `config.data.validation_files`, else every document that
falls in the held-out `config.data.validation_fraction` (documents spread evenly through the corpus, never a window of
training text). OUT must be new or empty (never inside a source or a run's checkpoints/ or params/; --take_folder:
one holding other files, left untouched): preparing replaces or deletes no file it did not write. An interrupted
prepare resumes at the shard it stopped at when run again with the same command; a directory is trainable only once
its metadata.json is written, at the end. Prints progress, and as the last line of stdout one JSON object:
documents, tokens, seconds, out.
"""

from retnet_jax.runs import cli

if __name__ == "__main__":
  cli.prepare()  # first, before numpy and jax start threads

import json
import os
import time
from pathlib import Path

from absl import flags

from retnet_jax.input_pipeline import prepared, sources
from retnet_jax.runs import workdir
from retnet_jax.training import metrics

_CONFIG = cli.config_flag("Config file and preset whose data section names the sources and the tokenizer.")
_OUT = flags.DEFINE_string("out", None, "Directory to write the prepared corpus into.", required=True)
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", None, "Stop after the document that brings the training split to "
                                   "this many tokens.", lower_bound=1)
_WORKERS = flags.DEFINE_integer("workers", os.cpu_count() or 1, "Processes tokenizing in parallel (a tokenizer.json; "
                                "the byte tokenizer is cheaper than sending texts to a worker).", lower_bound=1)
_TAKE_FOLDER = cli.take_folder_flag()
_SHARD_TOKENS = flags.DEFINE_integer("shard_tokens", 1 << 27, "Tokens per shard (a resumed prepare restarts the "
                                     "shard it was writing).", lower_bound=1)


def main():
  config = _CONFIG.value
  if not _OUT.value:
    raise ValueError("--out is empty; give the directory to write the prepared corpus into.")
  workdir.check_outside_runs(Path(_OUT.value), "--out", "a new or empty one")
  if config.data.synthetic or config.data.prepared:
    raise ValueError("data.synthetic / data.prepared are set: prepare_data.py tokenizes data.files or "
                     "data.hub_dataset; unset them.")
  train, validation = sources.of_config(config.data)
  total, started, last = train.total_characters, time.perf_counter(), [0.0]

  def progress(documents: int, tokens: int) -> None:
    now = time.perf_counter()
    if now - last[0] < 1.0:
      return
    last[0], seconds = now, now - started
    done = (tokens / _MAX_TOKENS.value if _MAX_TOKENS.value else
            train.characters / total if total else None)
    eta = (f" | ETA {metrics.format_duration(seconds * (1 - done) / done)}" if done and done < 1 else "")
    metrics.log(f"prepare: {documents:,} documents | {tokens:,} tokens | {tokens / seconds:,.0f} tokens/s{eta}")

  metadata = prepared.write(
      _OUT.value, train, validation, config.data.tokenizer, train.names() + (validation.names() if validation else []),
      config.data.validation_fraction, shard_tokens=_SHARD_TOKENS.value, max_tokens=_MAX_TOKENS.value,
      workers=_WORKERS.value, progress=progress, take=_TAKE_FOLDER.value)
  seconds = time.perf_counter() - started
  metrics.log(f"prepared {metadata['documents']['train']:,} training and {metadata['documents']['validation']:,} "
              f"validation documents ({metadata['tokens']['train']:,} + {metadata['tokens']['validation']:,} tokens) "
              f"in {metrics.format_duration(seconds)} into {_OUT.value}")
  print(json.dumps({"documents": metadata["documents"], "tokens": metadata["tokens"], "seconds": round(seconds, 2),
                    "out": _OUT.value}), flush=True)


if __name__ == "__main__":
  cli.run(main)
