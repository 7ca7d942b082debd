"""torchscale's RetNet (the official implementation) measured in a worker process that the benchmark drives."""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import time
import types
from typing import Any

import numpy as np

from benchmarks.harness import Case, peak_memory, random_tokens, timed
from retnet_jax.interop import convert


class _TorchscaleCases:
  """Builds and runs torchscale cases; lives in the worker process (see `Torchscale`)."""

  def __init__(self, model_cfg: dict[str, Any]):
    self.cfg = types.SimpleNamespace(**model_cfg)
    import torch
    self.torch = torch
    self._config, self._decoder = convert.torchscale_classes()
    self.torch.set_num_threads(os.cpu_count())
    self.note = (f"torch {self.torch.__version__} with {self.torch.get_num_threads()} threads, in a worker process "
                 "with the default malloc settings")

  def model(self, mode: str):
    c = self.cfg
    args = self._config(vocab_size=c.vocab_size, decoder_embed_dim=c.d_model, decoder_value_embed_dim=c.value_dim,
                        decoder_retention_heads=c.num_heads, decoder_ffn_embed_dim=c.ffn_dim,
                        decoder_layers=c.num_layers, activation_fn="gelu", dropout=0.0, drop_path_rate=0.0,
                        chunkwise_recurrent=mode == "chunkwise", recurrent_chunk_size=c.chunk_size,
                        layernorm_eps=c.norm_eps, share_decoder_input_output_embed=c.tie_embeddings)
    return self._decoder(args, self.torch.nn.Embedding(c.vocab_size, c.d_model))

  def train_case(self, mode: str, train_cfg: dict[str, Any]) -> Case:
    """A training step: loss, backward, clipping, AdamW with our hyper-parameters."""
    torch, t = self.torch, types.SimpleNamespace(**train_cfg)
    model = self.model(mode).train()
    opt = torch.optim.AdamW(model.parameters(), lr=t.learning_rate, betas=(t.b1, t.b2), weight_decay=t.weight_decay)
    tokens = torch.from_numpy(random_tokens(t.batch_size, t.seq_len + 1, self.cfg.vocab_size)).long()

    def one_step():
      logits = model(tokens[:, :-1])[0]
      loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
      opt.zero_grad(set_to_none=True)
      loss.backward()
      torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip_norm)
      opt.step()

    return Case(timed(one_step))

  def decode_case(self, new_tokens: int) -> Case:
    """Incremental (recurrent) greedy decoding at batch 1; each unit is one token's time."""
    torch = self.torch
    model = self.model("parallel").eval()

    def run():
      tokens, state, stamps = torch.zeros((1, 1), dtype=torch.long), {}, []
      with torch.no_grad():
        for _ in range(new_tokens):
          logits = model(tokens, incremental_state=state)[0]
          tokens = torch.cat([tokens, logits[:, -1:].argmax(-1)], dim=1)
          stamps.append(time.perf_counter())
      return np.diff(stamps).tolist()

    return Case(run)


def _torchscale_worker(conn, model_cfg: dict[str, Any], source: str) -> None:
  """The worker process's loop: ("train", name, mode, train_cfg) / ("decode", name, new_tokens) build a case,
  ("run", name) times it once, ("memory", name) runs it once for its peak memory; replies ("ok", value) or
  ("error", text)."""
  try:
    cases, builder = {}, _TorchscaleCases(model_cfg)
    conn.send(("ok", builder.note))
  except ImportError as error:
    conn.send(("error", f"torchscale not measured: {error}"))
    return
  while True:
    command, name, *args = conn.recv()
    try:
      if command == "train":
        cases[name], value = builder.train_case(*args), None
      elif command == "decode":
        cases[name], value = builder.decode_case(*args), None
      elif command == "run":
        value = cases[name].run()
      elif command == "memory":
        value = peak_memory(cases[name].run, source)
      else:  # "stop"
        conn.send(("ok", None))
        return
      conn.send(("ok", value))
    except Exception as error:  # reported to the caller, which raises it with the worker's message
      conn.send(("error", f"{type(error).__name__}: {error}"))


class Torchscale:
  """torchscale's RetNet (the official implementation) at our configuration, when torch and torchscale import.

  Its cases run in a worker process, started with `spawn`, that the benchmark drives step by step, so they still
  alternate with ours in one run while each library keeps its own threads and malloc settings:
  `host_memory.keep_freed_memory` changes malloc for a whole process, and torchscale is measured as shipped.
  """

  def __init__(self, model_cfg, source: str):
    self.available, self.note = False, "torchscale not measured: "
    missing = [name for name in ("torch", "torchscale") if importlib.util.find_spec(name) is None]
    if missing:
      self.note += (f"{' and '.join(missing)} not installed (pip install -e '.[torch]' && "
                    "pip install --no-deps torchscale==0.3.0)")
      return
    context = multiprocessing.get_context("spawn")
    self._conn, child = context.Pipe()
    # Peak memory in the worker is its own RSS; a device-memory source would describe this process's device.
    worker_source = source if "RSS" in source else "process RSS high-water mark (resource.getrusage ru_maxrss)"
    self._process = context.Process(target=_torchscale_worker, args=(child, model_cfg.to_dict(), worker_source),
                                    daemon=True)
    self._process.start()
    reply, value = self._conn.recv()
    self.available, self.note = reply == "ok", value
    self._names = 0

  def _call(self, *message):
    self._conn.send(message)
    reply, value = self._conn.recv()
    if reply != "ok":
      raise RuntimeError(f"torchscale worker: {value}")
    return value

  def _case(self, *build) -> Case:
    self._names += 1
    name = str(self._names)
    self._call(build[0], name, *build[1:])
    return Case(lambda: self._call("run", name), measure_memory=lambda: self._call("memory", name))

  def train_case(self, mode: str, train_cfg) -> Case:
    fields = ("learning_rate", "b1", "b2", "weight_decay", "batch_size", "seq_len", "grad_clip_norm")
    return self._case("train", mode, {k: train_cfg[k] for k in fields})

  def decode_case(self, new_tokens: int) -> Case:
    return self._case("decode", new_tokens)

  def close(self) -> None:
    if self.available:
      self._call("stop", "")
      self._process.join()
