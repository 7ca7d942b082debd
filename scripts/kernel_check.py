"""Compiles the Pallas retention kernels on a GPU, checks them against the XLA chunkwise form, and times both.

    python scripts/kernel_check.py --out=runs/kernel_check.json
    python scripts/kernel_check.py --head_dims=256x512 --lengths=16384 --forward_tilings=64:8:2,32:8:3  # tuning
    python scripts/kernel_check.py --interpret  # a tiny CPU smoke run in Pallas interpret mode

For each per-head size d_k x d_v and length T (batch 4, 8 heads, bfloat16, chunk 64 by default): up to
`--check_max_len`, both kernel layouts' (split and fused) out, final state, normaliser by-products and gradients
(q, k, v, state) against the XLA form in float32 at `precision=highest` from the same bfloat16 values, beside the XLA
form's own bfloat16 error; then forward and forward+backward times of both layouts (each tiling given, applied to
each layout) and of the XLA form in bfloat16, all interleaved; and each layout's launch grids (programs per launch,
chunks walked serially per program). FLOPs per head: forward 2 T (C (d_k + d_v) + 2 d_k d_v) for chunk C,
forward+backward 3 times that. Times are named `pallas_<layout>_<tiling>/forward` (that forward tiling) and
`pallas_<layout>_<tiling>/forward_backward` (that backward tiling, after the layout's first forward one). The JSON
(device, versions, one entry per case) is rewritten after every case, so a run cut short keeps its results. The
check itself is `benchmarks.kernel_check`; the GPU suite's op part shares its inputs, error measure, FLOP
counts and timed cases (`benchmarks.op`).
"""

from __future__ import annotations

from retnet_jax.runs import cli

if __name__ == "__main__":
  cli.prepare()  # first, before numpy and jax start threads

import sys
from pathlib import Path

from absl import app, flags
import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's root: benchmarks/ is not installed
from benchmarks import kernel_check
from benchmarks.op import TOLERANCE
from retnet_jax.runs import workdir

_OUT = flags.DEFINE_string("out", "runs/kernel_check.json", "JSON results file.")
_BATCH = flags.DEFINE_integer("batch", 4, "Batch size.", lower_bound=1)
_HEADS = flags.DEFINE_integer("heads", 8, "Heads.", lower_bound=1)
_CHUNK = flags.DEFINE_integer("chunk", 64, "Chunk size; 0: kernels.default_chunk per head dims (the split "
                              "kernels' chunk; a layout that does not take it is not timed).", lower_bound=0)
_HEAD_DIMS = flags.DEFINE_list("head_dims", ["256x256", "128x128", "256x512"], "Per-head sizes d_k x d_v.")
_LENGTHS = flags.DEFINE_list("lengths", ["2048", "4096", "8192", "16384", "32768"], "Sequence lengths T.")
_CHECK_MAX_LEN = flags.DEFINE_integer("check_max_len", 8192, "Check numerics at lengths up to this one.")
_FORWARD_TILINGS = flags.DEFINE_list("forward_tilings", [], "Forward kernel tilings block_v:num_warps:num_stages "
                                     "to time, e.g. 64:8:2,32:8:3 (default: kernels.default_config's).")
_BACKWARD_TILINGS = flags.DEFINE_list("backward_tilings", [], "Backward kernel tilings to time forward+backward "
                                      "with, beside the first forward tiling (default: kernels.default_config's).")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Interleaved timing rounds.", lower_bound=1)
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed calls per case and round.", lower_bound=1)
_INTERPRET = flags.DEFINE_boolean("interpret", False, "Pallas interpret mode at a tiny size (no GPU needed): "
                                  "batch 1, 2 heads, 16x32, T 64 and 100, chunk 16 (its times are the interpreter's).")


def _settings() -> kernel_check.Settings:
  """The flags' settings (the tiny ones with --interpret); UsageError naming a bad --head_dims or --lengths."""
  if _INTERPRET.value:
    return kernel_check.Settings(batch=1, heads=2, chunk=16, head_dims=((16, 32),), lengths=(64, 100),
                                 check_max_len=100, rounds=_ROUNDS.value, repeats=_REPEATS.value)
  usage = (f"--head_dims={','.join(_HEAD_DIMS.value)} --lengths={','.join(_LENGTHS.value)}: give positive sizes, "
           "e.g. --head_dims=256x256,128x128 --lengths=2048,4096.")
  try:
    head_dims = tuple(tuple(int(x) for x in dims.split("x")) for dims in _HEAD_DIMS.value)
    lengths = tuple(int(x) for x in _LENGTHS.value)
  except ValueError:
    raise app.UsageError(usage) from None
  if not head_dims or not lengths or any(len(d) != 2 or min(d) < 1 for d in head_dims) or min(lengths) < 1:
    raise app.UsageError(usage)
  return kernel_check.Settings(batch=_BATCH.value, heads=_HEADS.value, chunk=_CHUNK.value, head_dims=head_dims,
                               lengths=lengths, check_max_len=_CHECK_MAX_LEN.value, rounds=_ROUNDS.value,
                               repeats=_REPEATS.value)


def main():
  settings = _settings()
  if not _INTERPRET.value and jax.default_backend() != "gpu":
    raise ValueError(f"no GPU: JAX's default backend is {jax.default_backend()!r}. Run this on a GPU machine, or "
                     "with --interpret for a tiny smoke run of the kernels in Pallas interpret mode.")
  out = Path(_OUT.value)
  workdir.check_results_path(out, "--out")  # a user's file, or a run's, is never replaced
  report = kernel_check.run(settings, _FORWARD_TILINGS.value, _BACKWARD_TILINGS.value, _INTERPRET.value, out,
                            cli.given_flags())
  failed = [c for c in report["cases"] if not c.get("errors", {"ok": True})["ok"]]
  print(f"{len(report['cases'])} cases, {len(failed)} beyond tolerance {TOLERANCE}; results in {out}")
  if failed:
    sys.exit(1)


if __name__ == "__main__":
  cli.run(main)
