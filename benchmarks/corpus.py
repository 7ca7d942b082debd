"""The data path's throughput and memory: preparing a corpus, Grain's loader, and the train step beside them.

    python scripts/benchmark.py --suite=data --out=runs/data [--data_mb=16 --memory_mb=4,400]

On a JSON-lines corpus of `data_mb` MB of random Shakespeare windows (documents of 20-400 words): prepare throughput
(tokens/s) with the byte tokenizer (always in one process) and a 4096-token BPE trained on it, with 1 and 2
tokenizing processes; the
loader's tokens/s per process at batch 64 x 2048 (`loader_tokens_per_sec`: rows read from the memory-mapped
shards, shuffled, stacked and placed as a jax.Array); and the config's own train step, tokens/s, at its batch and
length. With `memory_mb`, the peak RSS of training the `tiny` preset for a few steps from prepared corpora of each
size (a subprocess each). Writes OUT/data.json and OUT/data.md.
"""

from __future__ import annotations

import datetime
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jax
import tokenizers

from benchmarks.harness import random_tokens
from benchmarks.sections import cpu_name
from retnet_jax.core import markdown, sharding
from retnet_jax.input_pipeline import data, loader, prepared, sources, tokenizer as tokenizer_lib
from retnet_jax.training import run_config, train_step

LOADER_BATCH, LOADER_SEQ_LEN = 64, 2048
REPO = Path(__file__).resolve().parents[1]


def write_corpus(path: Path, megabytes: float, seed: int = 0) -> Path:
  """A JSON-lines corpus of about `megabytes` MB: documents of 20-400 consecutive words of the shipped corpus."""
  words = data.DEFAULT_CORPUS.read_text().split()
  rng, size = random.Random(seed), 0
  with path.open("w") as f:
    while size < megabytes * 1e6:
      n = rng.randint(20, 400)
      start = rng.randint(0, len(words) - n)
      line = json.dumps({"text": " ".join(words[start:start + n])}) + "\n"
      f.write(line)
      size += len(line)
  return path


def train_bpe(texts: Iterable[str], out: Path, vocab_size: int = 4096) -> Path:
  """A byte-level BPE tokenizer.json with <|endoftext|> (its separator), trained on `texts`."""
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                           initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(texts, trainer)
  tok.save(str(out))
  return out


def prepare_rate(corpus: Path, spec: str, workers: int, out: Path) -> dict[str, float]:
  """Seconds and tokens/s of preparing `corpus` with `spec` in `workers` processes."""
  stream = sources.Stream(data.TextSource("files", (str(corpus),), None, None, "text", "data.files"))
  started = time.perf_counter()
  metadata = prepared.write(out, stream, None, spec, stream.names(), 0.01, workers=workers)
  seconds = time.perf_counter() - started
  tokens = metadata["tokens"]["train"] + metadata["tokens"]["validation"]
  return {"tokens": tokens, "seconds": seconds, "tokens_per_sec": tokens / seconds}


def loader_rate(corpus_dir: Path, seconds: float = 3.0) -> dict[str, float]:
  """Tokens/s of `loader.PreparedBatches` at LOADER_BATCH x LOADER_SEQ_LEN, each batch made a jax.Array."""
  tok = tokenizer_lib.load("byte")
  corpora = [prepared.open_corpus(corpus_dir, tok)]
  batches = loader.PreparedBatches(corpora, LOADER_SEQ_LEN, LOADER_BATCH, 0)
  jax.block_until_ready(next(batches))
  started, count = time.perf_counter(), 0
  while time.perf_counter() - started < seconds:
    jax.block_until_ready(next(batches))
    count += 1
  elapsed = time.perf_counter() - started
  return {"batches": count, "loader_tokens_per_sec": count * LOADER_BATCH * (LOADER_SEQ_LEN + 1) / elapsed}


def train_rate(config, steps: int = 5) -> dict[str, float]:
  """Tokens/s of the config's own train step at its batch and length (compiled first, then `steps` timed)."""
  run = train_step.setup(run_config.build(config), sharding.make_mesh(config.mesh))
  batch_size, seq_len = config.train.batch_size, config.train.seq_len
  with run.placement.active():
    state = run.init()
    batch = jax.device_put(random_tokens(batch_size, seq_len + 1, config.model.vocab_size),
                           run.placement.batch_sharding)
    state, _ = run.train_step(state, batch)
    jax.block_until_ready(state)
    started = time.perf_counter()
    for _ in range(steps):
      state, _ = run.train_step(state, batch)
    jax.block_until_ready(state)
  seconds = (time.perf_counter() - started) / steps
  return {"batch_size": batch_size, "seq_len": seq_len, "step_seconds": seconds,
          "tokens_per_sec": batch_size * seq_len / seconds}


PEAK_RSS = """
import atexit, resource, runpy, sys
atexit.register(lambda: print("peak_rss_kib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def training_peak_rss(corpus_dir: Path, workdir: Path) -> int:
  """Peak RSS in bytes of 20 steps of the `tiny` preset trained from the prepared corpus (a subprocess)."""
  result = subprocess.run(
      [sys.executable, "-c", PEAK_RSS, str(REPO / "scripts" / "train.py"), "--config=configs/retnet.py:tiny",
       f"--config.data.prepared={corpus_dir}", f"--workdir={workdir}", "--config.train.steps=20",
       "--config.train.eval_every_steps=20", "--config.checkpoint.every_steps=20"],
      cwd=REPO, capture_output=True, text=True, check=False)
  if result.returncode:
    raise RuntimeError(f"training from {corpus_dir} failed: {result.stderr[-2000:]}")
  line = next(line for line in result.stderr.splitlines() if line.startswith("peak_rss_kib"))
  return int(line.split()[1]) * 1024


def run(config, out: Path, command: str, data_mb: float, memory_mb: tuple[float, ...]) -> dict[str, Any]:
  """Every measurement above; writes OUT/data.json and OUT/data.md and returns the results."""
  out.mkdir(parents=True, exist_ok=True)
  results: dict[str, Any] = {"command": command, "cpu": cpu_name(), "date": datetime.date.today().isoformat(),
                             "corpus_mb": data_mb, "prepare": {}, "memory": {}}
  with tempfile.TemporaryDirectory(prefix="benchmarks_data_") as scratch:
    scratch = Path(scratch)
    corpus = write_corpus(scratch / "corpus.jsonl", data_mb)
    results["prepare"]["byte_workers1"] = prepare_rate(corpus, "byte", 1, scratch / "byte_1")  # never in workers
    bpe = str(train_bpe((json.loads(line)["text"] for line in corpus.open()), scratch / "tokenizer.json"))
    for workers in (1, 2):
      results["prepare"][f"bpe4096_workers{workers}"] = prepare_rate(corpus, bpe, workers, scratch / f"bpe_{workers}")
    results["loader"] = loader_rate(scratch / "byte_1")
    results["train_step"] = train_rate(config)
    for megabytes in memory_mb:
      corpus_dir = scratch / f"memory_{megabytes}"
      prepare_rate(write_corpus(scratch / f"memory_{megabytes}.jsonl", megabytes, seed=1), "byte", 2, corpus_dir)
      results["memory"][f"{megabytes:g}MB"] = {"peak_rss_bytes": training_peak_rss(corpus_dir, scratch / "run"),
                                               "corpus_bytes": sum(f.stat().st_size for f in corpus_dir.iterdir())}
      shutil.rmtree(scratch / "run")
  (out / "data.json").write_text(json.dumps(results, indent=1) + "\n")
  (out / "data.md").write_text(format_table(results))
  print(format_table(results))
  return results


def format_table(results: dict[str, Any]) -> str:
  step = results["train_step"]
  lines = [f"Data path on {results['cpu']} ({results['date']}): `{results['command']}`", ""]
  lines += markdown.table(["measurement", "tokens/s"], [
      [f"prepare, {name.replace('_workers', ', ')} worker(s)", f"{r['tokens_per_sec']:,.0f}"]
      for name, r in results["prepare"].items()] + [
      [f"loader, batch {LOADER_BATCH} x {LOADER_SEQ_LEN}, one process",
       f"{results['loader']['loader_tokens_per_sec']:,.0f}"],
      [f"train step, batch {step['batch_size']} x {step['seq_len']}", f"{step['tokens_per_sec']:,.0f}"]], right=(1,))
  if results["memory"]:
    lines += [""] + markdown.table(["prepared corpus", "shard bytes", "training peak RSS"], [
        [name, f"{m['corpus_bytes'] / 2**20:,.1f} MiB", f"{m['peak_rss_bytes'] / 2**20:,.1f} MiB"]
        for name, m in results["memory"].items()], right=(1, 2))
  return "\n".join(lines) + "\n"
