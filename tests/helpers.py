"""What the tests share: tiny models, random tokens, a compiled forward call, the tiny run's config on a slice of the
shipped corpus, its metrics, damaged checkpoint bytes, the scripts run in a subprocess as a user runs them, and
whether the tests run on a GPU.

A finished tiny run is the `trained` fixture of tests/conftest.py (a `TrainedRun`); `trained_copy` is a private copy
for a test that writes into the workdir.
"""

import itertools
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import jax
import ml_collections
import numpy as np
from flax import nnx

from configs import retnet as retnet_config
from retnet_jax.hardware import accelerators
from retnet_jax.mixers.kernels import support
from retnet_jax.models import presets
from retnet_jax.models.model import Model

# What XLA's C++ logging writes to stderr by itself when jax is imported (the aot extra's CUDA plugin on a machine
# without a GPU: "Could not find cuda drivers"), before a script can say anything: not the script's own lines.
XLA_LOG_LINE = re.compile(r"^(WARNING: All log messages before absl::InitializeLog\(\)"
                          r"|[IWE]\d{4} [\d:.]+ +\d+ [\w.]+:\d+\] )")
REPO = Path(__file__).resolve().parent.parent
CORPUS = REPO / "data" / "tinyshakespeare.txt"
# The tiny run's training: 8 steps of 8 x 32 tokens, logging every step, evaluating (2 batches) every 4 steps.
TINY_TRAIN = dict(steps=8, batch_size=8, seq_len=32, log_every_steps=1, eval_every_steps=4, eval_batches=2,
                  warmup_steps=2)


def on_gpu() -> bool:
  """Whether the tests run on a GPU (`RETNET_TEST_BACKEND=gpu`): the Pallas kernels compile there, at the sizes
  `kernels.check_supported` accepts, instead of running interpreted at any size, and some results round otherwise
  than on the CPU (each test that allows for it says why)."""
  return jax.default_backend() == "gpu"


def aot_extra_missing(platform: str) -> str | None:
  """None if the aot extra's packages for compiling for `platform` (gpu, tpu) are installed, else why not (a skip
  reason)."""
  try:
    accelerators.check_installed(platform)
  except ValueError as e:
    return str(e)
  return None


def kernel_chunk(interpreted: int) -> int:
  """A chunk size for a model running the Pallas kernels: `interpreted` off a GPU (any size runs interpreted, and a
  small one runs fast), on a GPU the smallest chunk tile the compiled kernels take."""
  return support.CHUNK_SIZES["fused"][0] if on_gpu() else interpreted


def tiny_model(**overrides) -> Model:
  """The `tiny` preset's RetNet with the model fields `overrides`, initialised from seed 0."""
  cfg = retnet_config.get_config("tiny").model
  cfg.unlock()
  cfg.update(overrides)
  return Model(cfg, rngs=nnx.Rngs(0))


def tiny_transformer(max_len: int = 32, **overrides) -> Model:
  """The Transformer of the `tiny` RetNet's size (`presets.transformer_config`) with a KV cache of `max_len` tokens
  and the model fields `overrides`, initialised from seed 0."""
  cfg = presets.transformer_config(retnet_config.get_config("tiny").model, max_len)
  cfg.update(overrides)
  return Model(cfg, rngs=nnx.Rngs(0))


def random_tokens(batch: int, length: int, vocab_size: int = 256, seed: int = 0) -> np.ndarray:
  """Token ids `[batch, length]` (int32) drawn uniformly from `[0, vocab_size)` by numpy's generator `seed`."""
  return np.random.default_rng(seed).integers(0, vocab_size, (batch, length)).astype(np.int32)


@nnx.jit(static_argnames="mode")
def forward(model, tokens, state, mode, segment_ids=None):
  """`model(tokens, mode=mode, state=state, segment_ids=segment_ids)` compiled: logits `[B, L, V]` and the state
  after the tokens."""
  return model(tokens, mode=mode, state=state, segment_ids=segment_ids)


def max_abs_diff(a, b) -> float:
  """The largest absolute difference between two trees of arrays, compared in float32."""
  return max(float(np.max(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def forms_agree(model, tokens, modes, rtol: float = 1e-5, state_atol: float = 1e-5) -> dict:
  """`{mode: (logits, state)}` of `model` over `tokens` in each of `modes`, after asserting that every pair's logits
  agree to `rtol` of the largest logit and their states to `state_atol`."""
  results = {mode: forward(model, tokens, None, mode) for mode in modes}
  scale = float(np.max(np.abs(results[modes[0]][0])))
  for a, b in itertools.combinations(modes, 2):
    assert max_abs_diff(results[a][0], results[b][0]) < rtol * scale, (a, b)
    assert max_abs_diff(results[a][1], results[b][1]) < state_atol, (a, b)
  return results


def corpus_slice(directory: Path, text_bytes: int = 60_000) -> Path:
  """`directory/corpus.txt`, written with the shipped corpus's first `text_bytes` bytes; its path."""
  corpus = Path(directory) / "corpus.txt"
  corpus.write_bytes(CORPUS.read_bytes()[:text_bytes])
  return corpus


def tiny_config(directory: Path, text_bytes: int = 60_000, **train_overrides) -> ml_collections.ConfigDict:
  """The `tiny` preset on `corpus_slice(directory, text_bytes)` with TINY_TRAIN's training and `train_overrides`,
  checkpointing synchronously every 4 steps."""
  config = retnet_config.get_config("tiny")
  config.data.files = (str(corpus_slice(directory, text_bytes)),)
  config.train.update({**TINY_TRAIN, **train_overrides})
  config.checkpoint.update(every_steps=4, async_save=False)
  return config


def metrics_rows(workdir: Path) -> list[dict]:
  """Every row of `workdir/metrics.jsonl`, in file order."""
  return [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]


def read_metrics(workdir: Path, key: str = "loss") -> dict[int, float]:
  """`key` of each step that logged it in `workdir/metrics.jsonl`, by step: the last row of a step that several runs
  logged (a rerun appends), so these values alone cannot tell a resumed run from one trained again from step 0
  (`assert_resumed_from` can)."""
  return {m["step"]: m[key] for m in metrics_rows(workdir) if key in m}


def logged_steps(workdir: Path, key: str = "loss") -> list[int]:
  """The step of every row of `workdir/metrics.jsonl` that logged `key`, in file order: each run's rows after the
  earlier runs' (the file is appended to), a step that several runs trained once per run."""
  return [m["step"] for m in metrics_rows(workdir) if key in m]


def step_runs(steps: list[int]) -> str:
  """`steps` as runs of consecutive steps, for a message: [1, 2, 3, 1, 2, 5] as '1-3, 1-2, 5'."""
  runs = []
  for s in steps:
    if runs and s == runs[-1][1] + 1:
      runs[-1][1] = s
    else:
      runs.append([s, s])
  return ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in runs)


def assert_resumed_from(workdir: Path, step: int, output: str | None = None) -> None:
  """Asserts that the last training in `workdir` (logging every step) resumed from checkpoint `step`, not from an
  earlier one or step 0: steps 1 to `step` were each logged once (a run trained again from step 0 logs step 1 twice),
  and the last run's rows go on from `step` + 1. The last run's rows begin at the last row whose step does not exceed
  the one before (none where the rerun began right after the earlier run's last row). With `output` (what the run
  printed), also that it said it resumed from that checkpoint."""
  steps = logged_steps(workdir)
  assert [s for s in steps if s <= step] == list(range(1, step + 1)), (
      f"steps 1 to {step} should each be logged once (the last run resumed from checkpoint {step}); the runs logged "
      f"steps {step_runs(steps)}")
  begins = [n for n in range(1, len(steps)) if steps[n] <= steps[n - 1]]
  if begins:
    last = steps[begins[-1]:]
    assert last == list(range(step + 1, step + 1 + len(last))), (
        f"the last run should log steps from {step + 1} (resumed from checkpoint {step}); the runs logged steps "
        f"{step_runs(steps)}")
  if output is not None:
    assert f"resumed from {Path(workdir) / 'checkpoints' / str(step)} (data position" in output, output[-3000:]


def flip_bytes(step_dir: Path, every_data_file: bool = False):
  """XORs 4,000 bytes in the middle of the largest array file (or of every array data file) of a checkpoint
  step, sizes unchanged. Which bytes a restore reads depends on the storage layout, so tests that must damage
  what is read whatever the mesh flip every data file."""
  files = [f for f in (step_dir / "state").rglob("*") if f.is_file()]
  if every_data_file:
    files = [f for f in files if f.parent.name == "d"]
  else:
    files = [max(files, key=lambda f: f.stat().st_size)]
  for file in files:
    data = bytearray(file.read_bytes())
    middle = max(len(data) // 2 - 2000, 0)
    data[middle:middle + 4000] = bytes(b ^ 0x5A for b in data[middle:middle + 4000])
    file.write_bytes(bytes(data))


def script_flags(config: ml_collections.ConfigDict, workdir: Path) -> list[str]:
  """The flags that give a script `tiny_config`'s run `config` in `workdir`."""
  return ([f"--config={REPO / 'configs' / 'retnet.py'}:tiny", f"--workdir={workdir}",
           f"--config.data.files=('{config.data.files[0]}',)"]
          + [f"--config.train.{k}={config.train[k]}" for k in TINY_TRAIN])


class TrainedRun(NamedTuple):
  """A finished training: its config, its workdir and the script flags that load it (`script_flags`)."""
  config: ml_collections.ConfigDict
  workdir: Path
  flags: list[str]


def free_port() -> int:
  """A TCP port free on this host now (for a coordinator of several local processes)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_python(*args: str, timeout: int = 300, **env_vars: str) -> subprocess.CompletedProcess:
  """`python *args` from the repository root on one CPU device, as a user runs it (without the 8 devices the suite
  forces through XLA_FLAGS), with `env_vars` added to the environment; stdout and stderr captured as text."""
  env = {**os.environ, "XLA_FLAGS": "", **env_vars}
  return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=REPO,
                        timeout=timeout)


def run_script(name: str, *flags: str, timeout: int = 300, **env_vars: str) -> subprocess.CompletedProcess:
  """`scripts/name` with `flags`, run as `run_python` runs it."""
  return run_python(str(REPO / "scripts" / name), *flags, timeout=timeout, **env_vars)


def script_stdout(name: str, *flags: str, **env_vars: str) -> str:
  """The stdout of `run_script(name, *flags, **env_vars)`, after checking that it succeeded."""
  result = run_script(name, *flags, **env_vars)
  assert result.returncode == 0, result.stderr[-3000:]
  return result.stdout


def script_lines(output: str) -> list[str]:
  """The non-empty lines a script printed, without XLA's own log lines (XLA_LOG_LINE)."""
  return [line for line in output.splitlines() if line.strip() and not XLA_LOG_LINE.match(line)]
