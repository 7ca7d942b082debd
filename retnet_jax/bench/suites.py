"""The benchmark suites (quick, full, sequence) and the model fields they set."""

from __future__ import annotations

import dataclasses

# Model fields a suite sets (each also a flag of scripts/benchmark.py).
SIZE_FIELDS = ("d_model", "num_layers", "num_heads", "value_dim", "ffn_dim", "vocab_size", "chunk_size")


@dataclasses.dataclass(frozen=True)
class Suite:
  """What a suite measures: the model size, the training shape, the sweeps and the repetitions."""
  size: dict[str, int]  # model fields set on configs/retnet.py:small
  seq_len: int
  batch_size: int
  rounds: int  # timed rounds after the warm-up: ceilings and training
  sweep_rounds: int  # for the sequence-length sweeps
  decode_rounds: int  # for decoding (each run times two decode calls)
  lengths: tuple[int, ...]  # sequence lengths of the forward sweep (batch 1)
  train_lengths: tuple[int, ...]  # sequence lengths of the training-step sweep (batch 1)
  quadratic_max_len: int  # the sweeps of the quadratic forms (parallel retention, attention) stop here
  prompt_len: int  # prompt before decoding at batch 1 and at `decode_batch`
  decode_batch: int
  new_tokens: int
  contexts: tuple[int, ...]  # prompt lengths of the latency-vs-context sweep (batch 1)
  long_train_len: int  # chunkwise training of one sequence this long, whole and in segments (batch 1)
  segment_len: int  # train.segment_len of the segmented long training step
  matmul_size: int


SUITES = {
    "quick": Suite(size=dict(d_model=64, num_layers=1, num_heads=2, value_dim=128, ffn_dim=128, vocab_size=256,
                             chunk_size=16),
                   seq_len=64, batch_size=4, rounds=2, sweep_rounds=2, decode_rounds=2, lengths=(32, 64),
                   train_lengths=(32,), quadratic_max_len=64, prompt_len=16, decode_batch=32, new_tokens=8,
                   contexts=(16, 32), long_train_len=256, segment_len=64, matmul_size=256),
    "full": Suite(size=dict(d_model=512, num_layers=6, num_heads=4, value_dim=1024, ffn_dim=1024, vocab_size=256,
                            chunk_size=128),
                  seq_len=512, batch_size=8, rounds=3, sweep_rounds=2, decode_rounds=4,
                  lengths=(512, 1024, 2048, 4096, 8192, 16384), train_lengths=(512, 1024, 2048, 4096),
                  quadratic_max_len=4096, prompt_len=2048, decode_batch=32, new_tokens=64,
                  contexts=(128, 512, 2048, 8192), long_train_len=16384, segment_len=2048, matmul_size=2048),
}


@dataclasses.dataclass(frozen=True)
class SequenceSweep:
  """What the sequence suite measures (`retnet_jax.bench.sequence`): the model, the splits and the lengths."""
  suite: Suite  # its size is the model; the rest is unused
  splits: tuple[int, ...]  # devices of the `sequence` mesh axis; the first is the reference (1)
  lengths: tuple[int, ...]  # compiled, run and timed at every split
  compile_only_lengths: tuple[int, ...]
  rounds: int


SEQUENCE_SUITE = SequenceSweep(suite=SUITES["full"], splits=(1, 2, 4, 8), lengths=(2048, 4096, 8192, 16384),
                               compile_only_lengths=(65536,), rounds=1)
