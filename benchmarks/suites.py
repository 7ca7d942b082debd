"""The benchmark suites (quick, full, sequence, context, gpu) and the model fields they set."""

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
  document_len: int  # mean document length of the packed batches that time document resets
  document_forms: tuple[tuple[str, str], ...]  # the (mode, dtype) train steps timed with and without resets
  gated_forms: tuple[tuple[str, str], ...]  # the (mode, dtype) train steps of gated retention, beside RetNet's
  gated_decode_batches: tuple[int, ...]  # gated retention's decoding after `prompt_len` tokens, at these batches
  matmul_size: int


SUITES = {
    "quick": Suite(size=dict(d_model=64, num_layers=1, num_heads=2, value_dim=128, ffn_dim=128, vocab_size=256,
                             chunk_size=16),
                   seq_len=64, batch_size=4, rounds=2, sweep_rounds=2, decode_rounds=2, lengths=(32, 64),
                   train_lengths=(32,), quadratic_max_len=64, prompt_len=16, decode_batch=32, new_tokens=8,
                   contexts=(16, 32), long_train_len=256, segment_len=64, document_len=16,
                   document_forms=(("chunkwise", "float32"),), gated_forms=(("chunkwise", "float32"),),
                   gated_decode_batches=(1,), matmul_size=256),
    "full": Suite(size=dict(d_model=512, num_layers=6, num_heads=4, value_dim=1024, ffn_dim=1024, vocab_size=256,
                            chunk_size=128),
                  seq_len=512, batch_size=8, rounds=3, sweep_rounds=2, decode_rounds=4,
                  lengths=(512, 1024, 2048, 4096, 8192, 16384), train_lengths=(512, 1024, 2048, 4096),
                  quadratic_max_len=4096, prompt_len=2048, decode_batch=32, new_tokens=64,
                  contexts=(128, 512, 2048, 8192), long_train_len=16384, segment_len=2048, document_len=128,
                  document_forms=tuple((mode, dtype) for dtype in ("float32", "bfloat16")
                                       for mode in ("parallel", "chunkwise")),
                  gated_forms=tuple((mode, dtype) for dtype in ("float32", "bfloat16")
                                    for mode in ("parallel", "chunkwise")),
                  gated_decode_batches=(1, 32),
                  matmul_size=2048),
}


@dataclasses.dataclass(frozen=True)
class SequenceSweep:
  """What the sequence suite measures (`benchmarks.sequence`): the model, the splits and the lengths."""
  suite: Suite  # its size is the model; the rest is unused
  splits: tuple[int, ...]  # devices of the `sequence` mesh axis; the first is the reference (1)
  lengths: tuple[int, ...]  # compiled, run and timed at every split
  compile_only_lengths: tuple[int, ...]
  rounds: int


SEQUENCE_SUITE = SequenceSweep(suite=SUITES["full"], splits=(1, 2, 4, 8), lengths=(2048, 4096, 8192, 16384),
                               compile_only_lengths=(65536,), rounds=1)


@dataclasses.dataclass(frozen=True)
class ContextSweep:
  """What the context suite (`benchmarks.context`) measures: prefill and decoding of four models of one size
  (RetNet, gated retention, the hybrid, the Transformer) at batch 1 against the context length."""
  preset: str  # the models' size: a preset of `presets.PRESETS`
  lengths: tuple[int, ...]  # context tokens: each prompt is prefilled, then decoded after
  new_tokens: int  # greedy tokens per decoding call
  attention_window: int  # the hybrid's last layer attends over this many tokens (the others retain)
  point_budget_s: float  # a prefill or decoding estimated from the model's previous length to take longer is skipped


# Powers of 4 from 1k tokens: to 1M for `small`, to 4M and then 10M for `tiny` (6 and 8 minutes on 2 cores,
# docs/benchmarks.md). The budget keeps the Transformer's prefill, quadratic in the length, to 16k tokens at `small`.
CONTEXT_SUITES = {
    "small": ContextSweep(preset="small", lengths=tuple(1024 * 4**i for i in range(6)), new_tokens=32,
                          attention_window=512, point_budget_s=120.0),
    "tiny": ContextSweep(preset="tiny", lengths=tuple(1024 * 4**i for i in range(7)) + (10 * 2**20,), new_tokens=32,
                         attention_window=512, point_budget_s=120.0),
}


@dataclasses.dataclass(frozen=True)
class GpuSuite:
  """What the GPU suite (`benchmarks.gpu`) measures. Every size is a field, so that a CPU test runs it tiny.

  Models are named sizes: `(preset, model fields that replace the preset's)`, with bfloat16 compute and float32
  parameters. The RetNet chunk size depends on the retention implementation: the XLA form's preset chunk, the
  Pallas kernels' 64 (the chunk of fla's kernels too).
  """
  models: dict[str, tuple[str, dict[str, int]]]
  chunk_sizes: dict[str, int]  # per model.retention_impl (xla, pallas): the RetNet chunk length
  op_batch: int
  op_heads: int
  op_head_dims: tuple[tuple[int, int], ...]  # (d_k, d_v) per head
  op_lengths: tuple[int, ...]
  op_check_len: int  # the implementations are compared with the XLA form at this length before timing
  op_repeats: int  # runs per timed round of one op case
  train_models: tuple[str, ...]
  train_impls: tuple[str, ...]  # the RetNet train steps' implementations (`gpu_train.IMPLS`: xla, pallas, ...)
  train_seq_len: int
  train_batch: dict[str, int]  # per model: sequences per step
  train_remat: dict[str, str]  # per model: train.remat
  decode_model: str
  decode_prompt_len: int  # batch 1: a real prompt, prefilled
  decode_batch: int
  decode_contexts: tuple[int, ...]  # the large batch decodes after this many tokens of context
  decode_new_tokens: int
  compile_models: tuple[str, ...]  # train steps compiled (not run) for their compile time
  matmul_size: int  # of the bfloat16 GEMM that measures the MFU denominator
  rounds: int
  op_decays: tuple[str, ...] = ("constant",)  # gpu_op.DECAYS: per-head decays; per_token: also per-token ones
  op_layouts: tuple[str, ...] = ("split",)  # the Pallas kernels' layouts (`kernels.LAYOUTS`) the op times
  decode_param_dtype: str = "float32"  # the decoded model's parameters (model.param_dtype): the bytes read per token
  # the context suite's curve at batch 1 (`gpu_decode`): XLA's memory analysis of RetNet's and the Transformer's
  # prefill (compiled, not run) and their decoding tokens/s from a state this many tokens in
  curve_contexts: tuple[int, ...] = ()


# The paper has no 350M size: d_model 1024 and 24 layers with its ratios (key head dim 256, value width 2 d_model,
# GLU FFN 4/3 d_model, rounded to a multiple of 64), 50304 tokens, tied embeddings: 353M parameters.
SIZE_350M = dict(d_model=1024, num_layers=24, num_heads=4, value_dim=2048, ffn_dim=1344)

# scripts/gpu_check.py's train, op and decode parts: every GPU target within 9 minutes on one H100
# (benchmarks/gpu_check.py says how). The 1.3b train step with scanned layers (compiled in seconds, not
# half a minute) at the lightest remat policy that `planning.aot.search` fits on h100:1 at seq 2048 and the
# largest batch there: dots_with_no_batch_dims_saveable at 16 (full remat fits 128, save_mixer_out 32; a step of
# 128 x 2048 tokens, ~12 s at the 22k tokens/s measured on an H100 at batch 4, would leave the train part's budget
# one or two of its four cases); one head dim, two lengths, both decays and layouts for the op; one context for
# decoding, from bfloat16 weights, and the context suite's curve at 4k, 64k and 1M tokens.
_CHECK = GpuSuite(
    models={"1.3b": ("1.3b", dict(scan_layers=True))}, chunk_sizes={"xla": 256, "pallas": 64}, op_batch=4,
    op_heads=8, op_head_dims=((256, 256),), op_lengths=(4096, 16384), op_check_len=1024, op_repeats=3,
    train_models=("1.3b",), train_impls=("xla", "pallas", "pallas_fused"), train_seq_len=2048,
    train_batch={"1.3b": 16}, train_remat={"1.3b": "dots_with_no_batch_dims_saveable"}, decode_model="1.3b",
    decode_prompt_len=128, decode_batch=64, decode_contexts=(8192,), decode_new_tokens=32, compile_models=(),
    matmul_size=8192, rounds=3, op_decays=("constant", "per_token"), op_layouts=("split", "fused"),
    decode_param_dtype="bfloat16", curve_contexts=(4096, 65536, 1048576))

GPU_SUITES = {
    # One 80 GB GPU (H100). Batches and remat policies are estimates (the saved projections of 16k tokens x 24
    # layers, ~17 GB at 1.3b, beside 16 bytes per parameter of state): a step whose XLA buffers exceed the device's
    # memory is recorded as skipped, not run, and one the runtime cannot allocate as skipped with the allocation.
    "h100": GpuSuite(
        models={"350m": ("1.3b", SIZE_350M), "1.3b": ("1.3b", {}), "2.7b": ("2.7b", {})},
        chunk_sizes={"xla": 256, "pallas": 64}, op_batch=4, op_heads=8,
        op_head_dims=((256, 256), (128, 128), (256, 512)), op_lengths=(2048, 4096, 8192, 16384, 32768),
        op_check_len=1024, op_repeats=5, train_models=("350m", "1.3b"), train_impls=("xla", "pallas"),
        train_seq_len=2048, train_batch={"350m": 16, "1.3b": 8, "2.7b": 4},
        train_remat={name: "dots_with_no_batch_dims_saveable" for name in ("350m", "1.3b", "2.7b")},
        decode_model="1.3b", decode_prompt_len=128, decode_batch=64, decode_contexts=(2048, 8192, 32768),
        decode_new_tokens=32, compile_models=("1.3b", "2.7b"), matmul_size=8192, rounds=5),
    "check": _CHECK,  # scripts/gpu_check.py on one H100 (80 GB)
    # The check on one H200 (141 GB), by the same rule on h200:1: dots_with_no_batch_dims_saveable at 32 (98 GB
    # planned; full remat fits 256, save_mixer_out 64); the other parts as on the H100.
    "check_h200": dataclasses.replace(_CHECK, train_batch={"1.3b": 32}),
    # The check's parts at the tiny sizes: its smoke run on a CPU.
    "check_tiny": GpuSuite(
        models={"tiny": ("tiny", dict(num_layers=1))}, chunk_sizes={"xla": 16, "pallas": 16},
        op_batch=1, op_heads=2, op_head_dims=((16, 32),), op_lengths=(32,), op_check_len=32, op_repeats=1,
        train_models=("tiny",), train_impls=("xla", "pallas", "pallas_fused"), train_seq_len=32,
        train_batch={"tiny": 2}, train_remat={"tiny": "none"}, decode_model="tiny", decode_prompt_len=8,
        decode_batch=2, decode_contexts=(32,), decode_new_tokens=4, compile_models=(), matmul_size=64, rounds=1,
        op_decays=("constant", "per_token"), op_layouts=("split", "fused"), decode_param_dtype="bfloat16",
        curve_contexts=(64, 1024)),
    # Seconds on a CPU: the tests, and a smoke run of every part on a GPU before the real one.
    "tiny": GpuSuite(
        models={"tiny": ("tiny", dict(num_layers=1))}, chunk_sizes={"xla": 16, "pallas": 16},
        op_batch=1, op_heads=2, op_head_dims=((16, 32),), op_lengths=(32,), op_check_len=32, op_repeats=1,
        train_models=("tiny",), train_impls=("xla", "pallas"), train_seq_len=32, train_batch={"tiny": 2},
        train_remat={"tiny": "none"}, decode_model="tiny", decode_prompt_len=8, decode_batch=1,
        decode_contexts=(32,), decode_new_tokens=4, compile_models=("tiny",), matmul_size=64, rounds=1),
}
